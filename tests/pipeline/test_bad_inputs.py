"""The bad-input matrix: every case through a stage's command line, one test per case.

Each case must end in one of two ways, and never in a corrupted or silently shortened output:
  - a clear error: exit code 2, exactly one stderr line starting "error:" (the last line, no
    traceback) that names the file and line, the sample, or the config key at fault;
  - a counted skip: exit code 0 and the dropped row counted (by reason) in the stage's report,
    with everything else written.

| case                                   | stage(s)            | expected                                      |
|----------------------------------------|---------------------|-----------------------------------------------|
| malformed JSONL line                   | 01 / 01b / 02 / 03  | counted skip (01); error naming file:line     |
| wrong field types                      | 01 / 01b / 02 / 03  | counted skip (01); error naming sample + line |
| empty or system-only conversation      | 01 / 01b / 02       | counted skip (01), failed.jsonl (01b); error  |
| over-long sample                       | 01b / 02 / 04       | truncated or dropped and counted; error       |
| non-UTF-8 bytes                        | 01 / 01b / 02 / cfg | counted skip (01); error naming file:line     |
| unknown / typo'd config key            | YAML and --set      | error naming the key and the closest one      |
| wrong value type, invalid YAML         | config              | error naming the key / file                   |
| tokenizer / model mismatch             | 01b / 02 / 03       | error                                         |
| aux layer id out of range, duplicated  | config / 02         | error with a valid suggestion                 |
| draft vocab larger than target vocab   | 03 / 04             | capped with a warning in 03; 04 uses the capped map, errors on any other mismatch|
| missing / truncated safetensors        | 02 / 04 (hidden, target weights, vocab map) | error naming the file |
| missing input file                     | 01b / 04            | error naming the stage to run first           |
| server answers non-JSON / no choices   | 01b                 | retried; then failed.jsonl with the reason    |
| disk full during a write (tmpfs)       | 01 / 01b / 02 / 04  | error; finished work intact; rerun completes  |

Speed: the CLI runs go through a small fork server (`ForkServer` below): one helper process
imports torch / transformers / openai once, then forks a fresh child per command that runs the
stage script exactly as `python NN_stage.py ...` would (its own process, exit code, stdout and
stderr), minus the 5-15 s of imports per run.
Disk-full cases mount a small tmpfs (needs root; skipped otherwise) and fill it at a chosen
moment inside the stage process, so every writer (Python, safetensors, torch.save) meets a real
ENOSPC.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from common.core.io import iter_jsonl
from tests.fault_server import FaultServer, Faults
from tests.helpers import REPO, clone_run, error_line, stage_env, write_yaml

PYTHON = sys.executable
VOCAB = 256
API_ENV = "EAGLE3_BAD_INPUT_KEY"


# ============================================================================ the fork server

_FORK_SERVER = r'''
import json, os, runpy, signal, sys, time, traceback
import numpy, yaml, tqdm, torch, safetensors.torch, transformers, openai, httpx2
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
import common.core.cli, common.core.config, common.data.prepare, common.data.generate, common.target.tokenization, common.extract.stage
import common.vocab.vocab_map, common.target.loading, common.train.data, common.train.trainer, common.model.draft, common.train.export
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(null, 0); os.dup2(out, 1); os.dup2(err, 2)
            os.chdir(req["cwd"])
            os.environ.update(req["env"])
            sys.argv = list(req["argv"])
            try:
                if req.get("pre"):
                    exec(req["pre"], {"__name__": "__fault_injection__"})
                runpy.run_path(sys.argv[0], run_name="__main__")
                code = 0
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    code = 1
            except BaseException:
                traceback.print_exc()
                code = 1
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    deadline = time.monotonic() + req["timeout"]
    status = None
    while True:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    rc = os.waitstatus_to_exitcode(status) if status is not None else None
    print(json.dumps({"rc": rc}), flush=True)
'''


@dataclass
class Result:
    rc: int | None  # None: timed out (killed)
    stdout: str
    stderr: str


class ForkServer:
    """Runs stage scripts in forked children of one pre-imported Python process."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.proc = subprocess.Popen([PYTHON, "-c", _FORK_SERVER], cwd=REPO, env=stage_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = self.proc.stdout.readline()
        assert ready.strip() == '{"ready": true}', f"fork server did not start: {ready!r}"
        self.n = 0

    def run(self, script: str, *args: str, pre: str | None = None, env: dict | None = None, timeout: float = 300) -> Result:
        self.n += 1
        out, err = self.workdir / f"run{self.n}.out", self.workdir / f"run{self.n}.err"
        req = {"argv": [str(REPO / script), *map(str, args)], "cwd": str(REPO), "env": env or {}, "pre": pre,
               "stdout": str(out), "stderr": str(err), "timeout": timeout}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        return Result(reply["rc"], out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    server = ForkServer(tmp_path_factory.mktemp("fork-server"))
    yield server.run
    server.close()


def assert_ok(res: Result) -> None:
    assert res.rc == 0, (res.rc, res.stderr[-3000:])
    assert "Traceback" not in res.stderr


def write_lines(path: Path, lines: list) -> Path:
    """Rows (dicts -> JSON) and raw lines (bytes / str, written as is), one per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    chunks = []
    for line in lines:
        if isinstance(line, dict):
            line = json.dumps(line)
        chunks.append(line if isinstance(line, bytes) else line.encode("utf-8"))
    path.write_bytes(b"\n".join(chunks) + b"\n")
    return path


# ============================================================================ shared inputs


@pytest.fixture(scope="module")
def config_only_target(tmp_path_factory) -> Path:
    """config.json of a 4-layer Llama (vocab 256, 64 positions), no weights: stages 02 and 03
    check their inputs before loading any weight."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("config-only-target")
    LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def weights_target(tmp_path_factory) -> Path:
    """A tiny random Llama with weights (float32), saved in two safetensors shards + index."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("weights-target")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                         tie_word_embeddings=False))
    model.save_pretrained(path, max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


def sample(sid: str, n: int, start: int = 1) -> dict:
    ids = [(start + 7 * i) % VOCAB for i in range(n)]
    return {"id": sid, "input_ids": ids, "loss_mask": [0] * (n // 3) + [1] * (n - n // 3)}


GOOD_ROWS = [sample(f"s{i}", 10 + i, i) for i in range(4)]


def tokenized_run(root: Path, model: Path, train_lines: list, eval_lines: list | None = None, **sections) -> Path:
    run = root / "run"
    write_lines(run / "data" / "train.jsonl", train_lines)
    if eval_lines is not None:
        write_lines(run / "data" / "eval.jsonl", eval_lines)
    tree = {"run_dir": str(run), "target": {"model": str(model), "aux_layer_ids": [1, 2, 3], "dtype": "float32"},
            "extract": {"device": "cpu", "dtype": "float32", "backend": "hf"}, "vocab": {"draft_vocab_size": 32}}
    for key, value in sections.items():
        tree.setdefault(key, {}).update(value)
    return write_yaml(root / "run.yaml", tree)


# ============================================================================ stage 01: counted skips

GOOD_SOURCE = [{"messages": [{"role": "user", "content": f"question number {i}"}]} for i in range(5)]


def prepare(cli, tmp_path, bad_lines: list, **data) -> tuple[Result, dict, list]:
    src = write_lines(tmp_path / "source.jsonl", [GOOD_SOURCE[0], GOOD_SOURCE[1], *bad_lines, *GOOD_SOURCE[2:]])
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run"), "data": {"source": str(src), **data}})
    res = cli("01_prepare_data.py", "--config", cfg)
    data_dir = tmp_path / "run" / "data"
    report = json.loads((data_dir / "prepare_report.json").read_text()) if res.rc == 0 else {}
    prompts = list(iter_jsonl(data_dir / "prompts.jsonl")) if res.rc == 0 else []
    return res, report, prompts


def assert_counted(report: dict, prompts: list, **dropped) -> None:
    c = report["counts"]
    assert {k: v for k, v in c["dropped"].items() if v} == dropped
    assert c["kept"] == len(prompts) == len(GOOD_SOURCE)  # every good row kept, in order
    assert [p["messages"][-1]["content"] for p in prompts] == [r["messages"][0]["content"] for r in GOOD_SOURCE]
    assert c["read"] == c["kept"] + sum(c["dropped"].values())


def test_01_malformed_jsonl_lines_are_counted_skips(cli, tmp_path):
    res, report, prompts = prepare(cli, tmp_path, [b'{"messages": [{"role": "user", "content": "cut', b'[1, 2]', b"not json"])
    assert_ok(res)
    assert_counted(report, prompts, malformed_json=3)
    src = tmp_path / "source.jsonl"
    assert [e["where"] for e in report["skipped_examples"]] == [f"{src}:3", f"{src}:4", f"{src}:5"]
    assert "dropped 3 (malformed_json 3)" in res.stdout


def test_01_wrong_field_types_are_counted_skips(cli, tmp_path):
    bad = [{"messages": [{"role": "user", "content": 42}]}, {"messages": [{"role": 1, "content": "x"}]},
           {"conversations": "not a list"}, {"messages": ["a string turn"]}, {"text": "no conversation field"},
           {"messages": [{"role": "narrator", "content": "unknown role"}]}]
    res, report, prompts = prepare(cli, tmp_path, bad)
    assert_ok(res)
    assert_counted(report, prompts, bad_fields=6)


def test_01_empty_and_system_only_conversations_are_counted_skips(cli, tmp_path):
    bad = [{"messages": []}, {"conversations": []}, {"messages": [{"role": "user", "content": " \n\t"}]},
           {"messages": [{"role": "system", "content": "only a system prompt"}]},
           {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "an answer to nothing"}]}]
    res, report, prompts = prepare(cli, tmp_path, bad)
    assert_ok(res)
    assert_counted(report, prompts, empty=3, no_user_turn=2)


def test_01_non_utf8_line_is_a_counted_skip(cli, tmp_path):
    res, report, prompts = prepare(cli, tmp_path, ['{"messages": [{"role": "user", "content": "caf\u00e9"}]}'.encode("latin-1"),
                                                   b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'])
    assert_ok(res)
    assert_counted(report, prompts, invalid_utf8=2)


def test_01_source_without_usable_rows_is_an_error(cli, tmp_path):
    src = write_lines(tmp_path / "source.jsonl", [b"garbage", {"messages": [{"role": "system", "content": "s"}]}])
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run"), "data": {"source": str(src)}})
    error_line(cli("01_prepare_data.py", "--config", cfg), f"no usable prompts in {src}", "malformed_json 1",
                 "no_user_turn 1", f"{src}:1")
    assert not (tmp_path / "run" / "data" / "prompts.jsonl").exists()


# ============================================================================ stage 01b


def gen_config(tmp_path: Path, tokenizer: Path, base_url: str = "http://127.0.0.1:9/v1", **sections) -> Path:
    tree = {"run_dir": str(tmp_path / "run"), "target": {"model": str(tokenizer)},
            "generate": {"base_url": base_url, "concurrency": 4, "timeout_s": 5.0, "max_retries": 2,
                         "backoff_initial_s": 0.01, "backoff_max_s": 0.02, "max_tokens": 32, "api_key_env": API_ENV},
            "tokenize": {"max_seq_len": 512}}
    for key, value in sections.items():
        tree.setdefault(key, {}).update(value)
    return write_yaml(tmp_path / "run.yaml", tree)


def prompt(i: int, **extra) -> dict:
    return {"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}],
            "split": "eval" if i % 4 == 0 else "train", **extra}


def write_prompts(tmp_path: Path, lines: list) -> Path:
    return write_lines(tmp_path / "run" / "data" / "prompts.jsonl", lines)


def generate_outputs(tmp_path: Path) -> tuple[dict, list, list, list]:
    data = tmp_path / "run" / "data"
    report = json.loads((data / "generate_report.json").read_text())
    raw = list(iter_jsonl(data / "raw_responses.jsonl")) if (data / "raw_responses.jsonl").exists() else []
    failed = list(iter_jsonl(data / "failed.jsonl")) if (data / "failed.jsonl").exists() else []
    samples = [*iter_jsonl(data / "train.jsonl"), *iter_jsonl(data / "eval.jsonl")]
    return report, raw, failed, samples


def generate_outputs_without_samples(tmp_path: Path) -> tuple[dict, list, list, None]:
    """generate_outputs for a run that failed before tokenizing (no train.jsonl)."""
    data = tmp_path / "run" / "data"
    report = json.loads((data / "generate_report.json").read_text())
    raw = list(iter_jsonl(data / "raw_responses.jsonl")) if (data / "raw_responses.jsonl").exists() else []
    return report, raw, list(iter_jsonl(data / "failed.jsonl")), None


def assert_each_id_once(prompts: list[dict], raw: list, failed: list) -> None:
    ids = [r["id"] for r in raw] + [r["id"] for r in failed]
    assert sorted(ids) == sorted(p["id"] for p in prompts), "an id was lost or duplicated"


def test_01b_malformed_prompts_line_names_file_and_line(cli, tmp_path, chat_tokenizer_dir):
    path = write_prompts(tmp_path, [prompt(0), prompt(1), b'{"id": "p2", "messages": [{"role": "us'])
    path.write_bytes(path.read_bytes() + json.dumps(prompt(3)).encode() + b"\n")  # the torn line is not the last one
    error_line(cli("01b_generate_synthetic.py", "--config", gen_config(tmp_path, chat_tokenizer_dir)),
                 f"{path}:3: malformed JSONL line")
    assert not (path.parent / "raw_responses.jsonl").exists()


def test_01b_non_utf8_prompts_line_names_file_and_line(cli, tmp_path, chat_tokenizer_dir):
    path = write_prompts(tmp_path, [prompt(0), b'{"id": "p1", "messages": [{"role": "user", "content": "\xff"}]}', prompt(2)])
    error_line(cli("01b_generate_synthetic.py", "--config", gen_config(tmp_path, chat_tokenizer_dir)), f"{path}:2:")


def test_01b_prompt_without_a_string_id_is_an_error(cli, tmp_path, chat_tokenizer_dir):
    path = write_prompts(tmp_path, [prompt(0), {"id": 7, "messages": [{"role": "user", "content": "x"}]}])
    error_line(cli("01b_generate_synthetic.py", "--config", gen_config(tmp_path, chat_tokenizer_dir)), str(path), "7")


def test_01b_prompts_stage_01_would_drop_are_counted_skips(cli, tmp_path, chat_tokenizer_dir):
    """Rows 01 never writes (wrong field types, no user turn, a message without a role) are skipped
    by 01's rules and counted, never sent (tests/data/test_generate_failures.py covers more shapes)."""
    prompts = [prompt(0), {"id": "str", "messages": "What is 2 + 2?"}, {"id": "empty", "messages": []},
               {"id": "sys-only", "messages": [{"role": "system", "content": "You are terse."}], "split": "train"},
               {"id": "no-role", "messages": [{"content": "hi"}]}, prompt(1)]
    write_prompts(tmp_path, prompts)
    with FaultServer(Faults(seed=0)) as server:
        res = cli("01b_generate_synthetic.py", "--config", gen_config(tmp_path, chat_tokenizer_dir, server.base_url))
        assert server.stats.chat_requests == 2
    assert_ok(res)
    report, raw, failed, samples = generate_outputs(tmp_path)
    assert report["skipped_prompts"] == {"bad_fields": 2, "empty": 1, "no_user_turn": 1}
    assert failed == [] and report["num_done"] == 2 and report["complete"] is True
    assert sorted(s["id"] for s in samples) == ["p0", "p1"]


def test_01b_missing_prompts_file_names_the_stage_to_run(cli, tmp_path, chat_tokenizer_dir):
    error_line(cli("01b_generate_synthetic.py", "--config", gen_config(tmp_path, chat_tokenizer_dir)),
                 "prompts file not found", "01_prepare_data.py")


@pytest.mark.parametrize("mode", ["truncate", "drop"])
def test_01b_overlong_samples_are_truncated_or_dropped_and_counted(cli, tmp_path, chat_tokenizer_dir, mode):
    from common.target.tokenization import load_tokenizer

    prompts = [prompt(i) for i in range(8)]
    for p in prompts[::3]:  # longer prompts: their answers cross max_seq_len
        p["messages"][0]["content"] += " Please explain every step." * 8
    write_prompts(tmp_path, prompts)
    max_len = 100
    with FaultServer(Faults(seed=0)) as server:
        res = cli("01b_generate_synthetic.py", "--config", gen_config(tmp_path, chat_tokenizer_dir, server.base_url,
                                                                      tokenize={"max_seq_len": max_len, "overlong": mode}))
    assert_ok(res)
    report, raw, failed, samples = generate_outputs(tmp_path)
    assert failed == [] and len(raw) == len(prompts)
    tok = load_tokenizer(str(chat_tokenizer_dir))
    full = {r["id"]: len(tok.apply_chat_template(r["messages"], tokenize=True)["input_ids"]) for r in raw}
    long_ids = {pid for pid, n in full.items() if n > max_len}
    assert 0 < len(long_ids) < len(prompts), full  # the case is exercised, and not for every sample
    t = report["tokenize"]
    skipped = sum(t["skipped"].values())
    assert len(samples) + skipped == len(raw)  # every generated sample is written or counted
    assert all(len(s["input_ids"]) == len(s["loss_mask"]) <= max_len for s in samples)
    kept_long = [s for s in samples if s["id"] in long_ids]
    if mode == "truncate":
        # "truncated" also counts the samples that truncation left with nothing to learn (skipped, counted)
        assert len(kept_long) >= 1 and t["truncated"] == len(kept_long) + t["skipped"].get("no_loss_tokens", 0)
        assert all(len(s["input_ids"]) == max_len and sum(s["loss_mask"]) > 0 for s in kept_long)
    else:
        assert t["truncated"] == 0 and kept_long == [] and skipped == len(long_ids)
        assert sorted(s["id"] for s in samples) == sorted(set(full) - long_ids)
    assert t["train"] + t["eval"] == len(samples)


def test_01b_tokenizer_that_differs_from_the_served_model_is_an_error(cli, tmp_path, chat_tokenizer_dir):
    from common.target.tokenization import load_tokenizer

    write_prompts(tmp_path, [prompt(0), prompt(1)])
    tok = load_tokenizer(str(chat_tokenizer_dir))
    shifted = lambda text: [t + 1 for t in tok(text, add_special_tokens=False)["input_ids"]]  # noqa: E731
    with FaultServer(Faults(seed=0), tokenize_fn=shifted) as server:
        res = cli("01b_generate_synthetic.py", "--config", gen_config(tmp_path, chat_tokenizer_dir, server.base_url))
        assert server.stats.chat_requests == 0  # checked before any generation
    error_line(res, "does not match the served model", str(chat_tokenizer_dir))


@pytest.mark.parametrize("kind,reason", [("non_json", "not JSON"), ("empty_choices", "no choices")])
def test_01b_server_answers_garbage_every_time_is_a_counted_failure(cli, tmp_path, chat_tokenizer_dir, kind, reason):
    prompts = [prompt(i) for i in range(4)]
    write_prompts(tmp_path, prompts)
    with FaultServer(Faults(seed=0, **{f"p_{kind}": 1.0})) as server:
        res = cli("01b_generate_synthetic.py", "--config", gen_config(tmp_path, chat_tokenizer_dir, server.base_url))
        assert server.stats.faults[kind] == len(prompts) * 3  # 1 try + max_retries=2 retries each
    error_line(res, "no prompt got an answer: all 4 of 4 failed every retry (MalformedResponse x4)")
    report, raw, failed, _ = generate_outputs_without_samples(tmp_path)
    assert raw == [] and not (tmp_path / "run" / "data" / "train.jsonl").exists()
    assert_each_id_once(prompts, raw, failed)
    assert all(f["error_type"] == "MalformedResponse" and reason in f["reason"] and f["attempts"] == 3 for f in failed)
    assert report["num_failed"] == 4 and report["complete"] is False
    assert report["this_run"]["retry_reasons"] == {"MalformedResponse": 8}


def test_01b_server_answers_garbage_sometimes_is_retried(cli, tmp_path, chat_tokenizer_dir):
    prompts = [prompt(i) for i in range(12)]
    write_prompts(tmp_path, prompts)
    faults = Faults(seed=4, p_non_json=0.3, p_empty_choices=0.3, max_faults_per_request=2)
    with FaultServer(faults) as server:
        res = cli("01b_generate_synthetic.py", "--config", gen_config(tmp_path, chat_tokenizer_dir, server.base_url))
        injected = server.stats.faults["non_json"] + server.stats.faults["empty_choices"]
    assert_ok(res)
    report, raw, failed, samples = generate_outputs(tmp_path)
    assert injected > 0 and failed == [] and len(samples) == len(prompts)
    assert_each_id_once(prompts, raw, failed)
    assert report["this_run"]["retries"] == injected and report["complete"] is True


# ============================================================================ config


@pytest.mark.parametrize("tree,args,fragments", [
    ({"tokenize": {"max_seq_length": 5}}, [], ["unknown config key 'tokenize.max_seq_length'", "did you mean 'tokenize.max_seq_len'"]),
    ({"trian": {"lr": 1}}, [], ["unknown config key 'trian'", "did you mean 'train'"]),
    ({}, ["--set", "train.ttt_step=3"], ["unknown config key 'train.ttt_step'", "did you mean 'train.ttt_steps'"]),
    ({}, ["--set", "generate.api_key=sk-123"], ["unknown config key 'generate.api_key'", "did you mean 'generate.api_key_env'"]),
], ids=["yaml-typo", "section-typo", "set-typo", "api-key-in-config"])
def test_config_unknown_key_names_the_closest_valid_one(cli, tmp_path, tree, args, fragments):
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run"), **tree})
    error_line(cli("04_train.py", "--config", cfg, *args), *fragments)


@pytest.mark.parametrize("tree,args,fragments", [
    ({"train": {"lr": "fast"}}, [], ["config key 'train.lr' must be a number, got 'fast'"]),
    ({}, ["--set", "generate.concurrency=lots"], ["config key 'generate.concurrency' must be an integer, got 'lots'"]),
    ({"target": {"aux_layer_ids": "1,2,3"}}, [], ["config key 'target.aux_layer_ids' must be a list"]),
    ({"train": {"ttt_steps": 0}}, [], ["config key 'train.ttt_steps' must be >= 1 and <= 256, got 0"]),
    ({"tokenize": {"overlong": "chop"}}, [], ["config key 'tokenize.overlong' must be one of truncate, drop, got 'chop'"]),
], ids=["number", "integer", "list", "range", "choice"])
def test_config_wrong_value_type_names_the_key(cli, tmp_path, tree, args, fragments):
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run"), **tree})
    error_line(cli("02_extract_hidden.py", "--config", cfg, *args), *fragments)


def test_config_invalid_yaml_names_the_file(cli, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("run_dir: out\ntrain:\n  lr: [1e-4\n", encoding="utf-8")
    error_line(cli("03_build_vocab_map.py", "--config", cfg), f"config file {cfg} is not valid YAML")


def test_config_non_utf8_yaml_names_the_file(cli, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(b"run_dir: out\n# caf\xe9 au lait\ntrain:\n  lr: 0.001\n")
    error_line(cli("03_build_vocab_map.py", "--config", cfg), str(cfg))


def test_config_duplicated_aux_layer_ids(cli, tmp_path):
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run"), "target": {"aux_layer_ids": [1, 2, 2]}})
    error_line(cli("02_extract_hidden.py", "--config", cfg), "target.aux_layer_ids has duplicated ids [1, 2, 2]")


def test_aux_layer_id_out_of_range(cli, tmp_path, config_only_target):
    cfg = tokenized_run(tmp_path, config_only_target, GOOD_ROWS, target={"aux_layer_ids": [1, 2, 4]})
    error_line(cli("02_extract_hidden.py", "--config", cfg), "target.aux_layer_ids = [1, 2, 4]", "[4] are out of range",
                 "4 decoder layers", "[0, 3]")
    assert not (tmp_path / "run" / "hidden").exists()


def test_default_aux_layer_ids_that_collapse_on_a_small_target(cli, tmp_path, config_only_target):
    # 4 layers: the default (2, N//2, N-3) = (2, 2, 1) has a duplicate that vLLM would collapse.
    cfg = tokenized_run(tmp_path, config_only_target, GOOD_ROWS, target={"aux_layer_ids": None})
    error_line(cli("03_build_vocab_map.py", "--config", cfg), "[2, 2, 1] has duplicates", "--set target.aux_layer_ids=[")


# ============================================================================ stages 02 / 03: tokenized samples

BAD_SAMPLES = {
    "malformed-json": b'{"id": "bad", "input_ids": [1, 2',
    "non-utf8": b'{"id": "bad", "input_ids": [1, 2], "loss_mask": [1, 1], "note": "\xff"}',
    "ids-not-a-list": {"id": "bad", "input_ids": "1 2 3", "loss_mask": [1, 1, 1]},
    "length-mismatch": {"id": "bad", "input_ids": [1, 2, 3], "loss_mask": [1, 1]},
    "string-token": {"id": "bad", "input_ids": [1, "2", 3], "loss_mask": [1, 1, 1]},
    "float-token": {"id": "bad", "input_ids": [1, 2.5, 3], "loss_mask": [1, 1, 1]},
    "mask-not-0-1": {"id": "bad", "input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]},
    "missing-field": {"id": "bad", "input_ids": [1, 2, 3]},
}


@pytest.mark.parametrize("stage", ["02_extract_hidden.py", "03_build_vocab_map.py"])
@pytest.mark.parametrize("case", list(BAD_SAMPLES))
def test_bad_tokenized_sample_names_file_and_line(cli, tmp_path, config_only_target, stage, case):
    cfg = tokenized_run(tmp_path, config_only_target, [*GOOD_ROWS[:2], BAD_SAMPLES[case], *GOOD_ROWS[2:]])
    train = tmp_path / "run" / "data" / "train.jsonl"
    line = error_line(cli(stage, "--config", cfg), f"{train}:3")
    if case not in ("malformed-json", "non-utf8", "missing-field"):
        assert "'bad'" in line  # the sample id
    assert not (tmp_path / "run" / "hidden" / "plan.json").exists() and not (tmp_path / "run" / "vocab").exists()


def test_02_empty_sample_is_an_error(cli, tmp_path, config_only_target):
    cfg = tokenized_run(tmp_path, config_only_target, GOOD_ROWS, [{"id": "empty", "input_ids": [], "loss_mask": []}])
    error_line(cli("02_extract_hidden.py", "--config", cfg), "sample 'empty'", "eval.jsonl:1", "has no tokens")


def test_02_sample_longer_than_the_target_positions_is_an_error(cli, tmp_path, config_only_target):
    cfg = tokenized_run(tmp_path, config_only_target, [*GOOD_ROWS, sample("long", 65)])
    error_line(cli("02_extract_hidden.py", "--config", cfg), "sample 'long' has 65 tokens", "max_position_embeddings 64",
                 "tokenize.max_seq_len")


@pytest.mark.parametrize("stage", ["02_extract_hidden.py", "03_build_vocab_map.py"])
def test_token_ids_outside_the_target_vocab_mean_another_tokenizer(cli, tmp_path, config_only_target, stage):
    foreign = {"id": "foreign", "input_ids": [5, VOCAB + 100, 7], "loss_mask": [1, 1, 1]}
    cfg = tokenized_run(tmp_path, config_only_target, [*GOOD_ROWS, foreign])
    error_line(cli(stage, "--config", cfg), "sample 'foreign' has token id 356", f"outside the target vocab [0, {VOCAB})",
                 "different tokenizer")


def test_03_draft_vocab_larger_than_target_vocab_is_capped_with_a_warning(cli, tmp_path, config_only_target):
    cfg = tokenized_run(tmp_path, config_only_target, GOOD_ROWS, vocab={"draft_vocab_size": 1000})
    res = cli("03_build_vocab_map.py", "--config", cfg)
    assert_ok(res)
    assert "vocab.draft_vocab_size=1000 exceeds the target vocab 256" in res.stderr
    report = json.loads((tmp_path / "run" / "vocab" / "report.json").read_text())
    assert report["requested_draft_vocab_size"] == 1000 and report["draft_vocab_size"] == VOCAB


def test_03_no_loss_masked_tokens_is_an_error(cli, tmp_path, config_only_target):
    rows = [{**r, "loss_mask": [0] * len(r["input_ids"])} for r in GOOD_ROWS]
    cfg = tokenized_run(tmp_path, config_only_target, rows)
    error_line(cli("03_build_vocab_map.py", "--config", cfg), "has no loss-masked tokens")


# ============================================================================ safetensors: target weights


def test_02_truncated_target_weights_name_the_file(cli, tmp_path, weights_target):
    target = tmp_path / "target"
    shutil.copytree(weights_target, target)
    shard = sorted(target.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cfg = tokenized_run(tmp_path, target, GOOD_ROWS)
    error_line(cli("02_extract_hidden.py", "--config", cfg), shard.name)
    assert not list((tmp_path / "run" / "hidden").glob("shard-*"))


def test_02_missing_target_weight_shard_names_the_file(cli, tmp_path, weights_target):
    target = tmp_path / "target"
    shutil.copytree(weights_target, target)
    shard = sorted(target.glob("model-*.safetensors"))[-1]
    shard.unlink()
    cfg = tokenized_run(tmp_path, target, GOOD_ROWS)
    error_line(cli("02_extract_hidden.py", "--config", cfg), shard.name)


# ============================================================================ stage 04 (on the stage-04 test data set)


def test_04_truncated_hidden_shard_names_the_file(cli, tmp_path, hidden_run):
    cfg = clone_run(hidden_run, tmp_path)
    shard = sorted((tmp_path / "run" / "hidden").glob("shard-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:4096])
    error_line(cli("04_train.py", "--config", cfg), shard.name, "02_extract_hidden.py")
    assert not (tmp_path / "run" / "train" / "checkpoints").exists()


def test_04_missing_hidden_shard_names_the_file(cli, tmp_path, hidden_run):
    cfg = clone_run(hidden_run, tmp_path)
    shard = sorted((tmp_path / "run" / "hidden").glob("shard-*.safetensors"))[0]
    shard.unlink()
    error_line(cli("04_train.py", "--config", cfg), shard.name, "missing", "02_extract_hidden.py")


def test_04_missing_hidden_index_names_the_stage_to_run(cli, tmp_path, hidden_run):
    cfg = clone_run(hidden_run, tmp_path)
    shutil.rmtree(tmp_path / "run" / "hidden")
    error_line(cli("04_train.py", "--config", cfg), "index.json", "run 02_extract_hidden.py first")


def test_04_truncated_vocab_map_names_the_file(cli, tmp_path, hidden_run):
    cfg = clone_run(hidden_run, tmp_path)
    vocab = tmp_path / "run" / "vocab" / "vocab_map.safetensors"
    vocab.write_bytes(vocab.read_bytes()[:100])
    error_line(cli("04_train.py", "--config", cfg), str(vocab), "03_build_vocab_map.py")


def test_04_draft_vocab_size_larger_than_target_vocab(cli, tmp_path, hidden_run):
    cfg = clone_run(hidden_run, tmp_path)
    error_line(cli("04_train.py", "--config", cfg, "--set", "vocab.draft_vocab_size=100000"), "vocab.draft_vocab_size=100000")


def test_04_sample_longer_than_the_micro_batch(cli, tmp_path, hidden_run):
    cfg = clone_run(hidden_run, tmp_path)
    error_line(cli("04_train.py", "--config", cfg, "--set", "train.batch_max_tokens=32"), "train.batch_max_tokens=32",
                 "tokenize.max_seq_len")


def test_04_truncated_target_weights_name_the_file(cli, tmp_path, hidden_run):
    cfg = clone_run(hidden_run, tmp_path)
    tree = yaml.safe_load(cfg.read_text())
    target = tmp_path / "target"
    shutil.copytree(tree["target"]["model"], target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    tree["target"]["model"] = str(target)
    write_yaml(cfg, tree)
    error_line(cli("04_train.py", "--config", cfg), "model.safetensors")
    assert not (tmp_path / "run" / "train" / "checkpoints").exists()


def renamed_embedding_target(src: Path, dest: Path) -> Path:
    """A copy of the target whose embedding is stored under a name its architecture does not know."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    weights = load_file(dest / "model.safetensors")
    weights["model.tok_embeddings.weight"] = weights.pop("model.embed_tokens.weight")
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_02_a_target_missing_a_weight_is_refused_before_overwrite_deletes(cli, tmp_path, hidden_run):
    """transformers starts a weight the checkpoint lacks at random (and only warns): 02 refuses such a target in one
    line naming the missing and the unknown weight, before --overwrite deletes the hidden states already there."""
    cfg = clone_run(hidden_run, tmp_path)
    tree = yaml.safe_load(cfg.read_text())
    tree["target"]["model"] = str(renamed_embedding_target(Path(tree["target"]["model"]), tmp_path / "target"))
    write_yaml(cfg, tree)
    hidden = tmp_path / "run" / "hidden"
    before = {p.name: p.read_bytes() for p in hidden.iterdir()}
    error_line(cli("02_extract_hidden.py", "--config", cfg, "--overwrite"), "lacks 1 weight(s)",
               "(model.embed_tokens.weight)", "its safetensors hold others (model.tok_embeddings.weight)")
    assert {p.name: p.read_bytes() for p in hidden.iterdir()} == before


def test_04_overwrite_keeps_the_finished_draft_when_the_target_tensors_do_not_load(cli, tmp_path, hidden_run):
    """04 --overwrite loads the target's embedding and lm_head before it deletes train/ (which may hold a finished
    draft). Here hidden states of an older 02, which did not record the target's weights, so only the load itself
    finds the target's embedding missing: one error line, and train/ as it was."""
    cfg = clone_run(hidden_run, tmp_path, max_steps=2, eval_every=0)
    assert_ok(cli("04_train.py", "--config", cfg))
    train = tmp_path / "run" / "train"
    before = {p: p.read_bytes() for p in train.rglob("*") if p.is_file()}
    assert train / "final" / "model.safetensors" in before
    index_path = tmp_path / "run" / "hidden" / "index.json"
    index = json.loads(index_path.read_text())
    del index["target_weights"]
    index_path.write_text(json.dumps(index))
    tree = yaml.safe_load(cfg.read_text())
    tree["target"]["model"] = str(renamed_embedding_target(Path(tree["target"]["model"]), tmp_path / "target"))
    write_yaml(cfg, tree)
    error_line(cli("04_train.py", "--config", cfg, "--overwrite"), "no embedding tensor")
    assert {p: p.read_bytes() for p in train.rglob("*") if p.is_file()} == before


# ============================================================================ disk full (tmpfs)


class Tmpfs:
    """A small tmpfs mounted for one test; `fill_code()` is Python that fills it up (run inside the stage)."""

    def __init__(self, path: Path, size: str):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs to simulate a full disk (needs root): {res.stderr.strip()}")
        self.filler = path / "filler.bin"

    def fill_code(self) -> str:
        return (f"def _fill_disk():\n"
                f"    import errno\n"
                f"    with open({str(self.filler)!r}, 'ab', buffering=0) as f:\n"
                f"        try:\n"
                f"            while True:\n"
                f"                f.write(b'\\0' * 65536)\n"
                f"        except OSError as e:\n"
                f"            assert e.errno == errno.ENOSPC, e\n")

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path):
    mounts = []

    def mount(size: str = "64m") -> Tmpfs:
        fs = Tmpfs(tmp_path / f"tmpfs{len(mounts)}", size)
        mounts.append(fs)
        return fs

    yield mount
    for fs in mounts:
        fs.close()


def fill_before(fs: Tmpfs, target: str, nth: int = 1) -> str:
    """Code that wraps `module:attr[.attr]` so that the disk fills up right before its nth call."""
    module, attrs = target.split(":")
    *parents, name = attrs.split(".")
    return fs.fill_code() + (
        f"import importlib\n"
        f"_owner = importlib.import_module({module!r})\n"
        f"for _a in {parents!r}:\n"
        f"    _owner = getattr(_owner, _a)\n"
        f"_orig = getattr(_owner, {name!r})\n"
        f"_calls = [0]\n"
        f"def _wrapped(*args, **kwargs):\n"
        f"    _calls[0] += 1\n"
        f"    if _calls[0] == {nth}:\n"
        f"        _fill_disk()\n"
        f"    return _orig(*args, **kwargs)\n"
        f"setattr(_owner, {name!r}, _wrapped)\n"
    )


ONE_THREAD = "import torch\ntorch.set_num_threads(1)\n"


def no_temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".tmp-*")]


def test_disk_full_while_01_writes_prompts(cli, tmp_path, tmpfs):
    fs = tmpfs()
    src = REPO / "data" / "sample_prompts.jsonl"
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(fs.path / "run"), "data": {"source": str(src), "max_samples": 20}})
    assert_ok(cli("01_prepare_data.py", "--config", cfg))
    prompts = fs.path / "run" / "data" / "prompts.jsonl"
    before = prompts.read_bytes()
    res = cli("01_prepare_data.py", "--config", cfg, "--set", "data.max_samples=300", "--overwrite",
              pre=fill_before(fs, "common.data.prepare:write_jsonl_atomic"))
    error_line(res, "No space left on device")
    assert prompts.read_bytes() == before  # the previous complete output is untouched
    assert not no_temp_files(fs.path)
    fs.free()
    assert_ok(cli("01_prepare_data.py", "--config", cfg, "--set", "data.max_samples=300", "--overwrite"))
    assert len(list(iter_jsonl(prompts))) == 300


def test_disk_full_while_01b_appends_responses(cli, tmp_path, tmpfs, chat_tokenizer_dir):
    fs = tmpfs()
    prompts = [prompt(i) for i in range(40)]
    run = fs.path / "run"
    write_lines(run / "data" / "prompts.jsonl", prompts)
    with FaultServer(Faults(seed=0, latency_s=0.01)) as server:
        cfg = gen_config(tmp_path, chat_tokenizer_dir, server.base_url, generate={"fsync_every": 1})
        tree = yaml.safe_load(cfg.read_text())
        tree["run_dir"] = str(run)
        write_yaml(cfg, tree)
        res = cli("01b_generate_synthetic.py", "--config", cfg, pre=fill_before(fs, "common.core.io:JsonlAppender.write", nth=10))
        error_line(res, "No space left on device")
        raw_path = run / "data" / "raw_responses.jsonl"
        from common.data.generate_files import load_done

        done, dupes = load_done(raw_path)
        assert 0 < len(done) < len(prompts) and dupes == 0
        assert not (run / "data" / "train.jsonl").exists()
        fs.free()
        assert_ok(cli("01b_generate_synthetic.py", "--config", cfg))
    report, raw, failed, samples = generate_outputs(fs.path)
    assert failed == [] and len(samples) == len(prompts)
    assert_each_id_once(prompts, raw, failed)


def test_disk_full_while_02_writes_a_shard(cli, tmp_path, tmpfs, weights_target):
    fs = tmpfs()
    rows = [sample(f"s{i:02d}", 20 + i % 17, i) for i in range(40)]
    cfg = tokenized_run(tmp_path, weights_target, rows, extract={"shard_max_tokens": 200, "batch_max_tokens": 128,
                                                                  "min_free_disk_gb": 0.0})
    tree = yaml.safe_load(cfg.read_text())
    ref_tree = {**tree, "run_dir": str(tmp_path / "ref")}
    shutil.copytree(tmp_path / "run", tmp_path / "ref")
    shutil.copytree(tmp_path / "run", fs.path / "run")
    tree["run_dir"] = str(fs.path / "run")
    write_yaml(cfg, tree)
    ref_cfg = write_yaml(tmp_path / "ref.yaml", ref_tree)
    assert_ok(cli("02_extract_hidden.py", "--config", ref_cfg))
    reference = {p.name: p.read_bytes() for p in (tmp_path / "ref" / "hidden").glob("shard-*.safetensors")}
    assert len(reference) >= 4

    res = cli("02_extract_hidden.py", "--config", cfg, pre=fill_before(fs, "common.extract.shard_loop:write_shard", nth=3))
    error_line(res, "No space left on device")
    hidden = fs.path / "run" / "hidden"
    index = json.loads((hidden / "index.json").read_text())
    assert not index["complete"] and len(index["shards"]) == 2
    for entry in index["shards"]:  # what the index lists is complete and correct
        assert (hidden / entry["file"]).read_bytes() == reference[entry["file"]]
    assert sorted(p.name for p in hidden.glob("shard-*")) == sorted(e["file"] for e in index["shards"])
    fs.free()
    assert_ok(cli("02_extract_hidden.py", "--config", cfg))
    assert {p.name: p.read_bytes() for p in hidden.glob("shard-*.safetensors")} == reference
    assert not no_temp_files(hidden)


def test_disk_full_while_04_writes_a_checkpoint(cli, tmp_path, tmpfs, hidden_run):
    from safetensors.torch import load_file

    fs = tmpfs("256m")
    kw = dict(max_steps=6, checkpoint_every=2, eval_every=0, log_every=1, batch_max_tokens=256)
    ref_cfg = clone_run(hidden_run, tmp_path / "ref", **kw)
    assert_ok(cli("04_train.py", "--config", ref_cfg, pre=ONE_THREAD, timeout=600))
    cfg = clone_run(hidden_run, fs.path, **kw)
    run = fs.path / "run"
    res = cli("04_train.py", "--config", cfg, pre=ONE_THREAD + fill_before(fs, "common.train.trainer:save_checkpoint", nth=2),
              timeout=600)
    error_line(res, "No space left on device")
    ckpts = sorted(p.name for p in (run / "train" / "checkpoints").iterdir() if not p.name.startswith("."))
    assert ckpts == ["step-2"]  # the complete checkpoint survives; the failed one is not under a final name
    assert not (run / "train" / "final").exists()
    fs.free()
    res = cli("04_train.py", "--config", cfg, pre=ONE_THREAD, timeout=600)
    assert_ok(res)
    assert "resuming from" in res.stdout
    a = load_file(str(tmp_path / "ref" / "run" / "train" / "final" / "model.safetensors"))
    b = load_file(str(run / "train" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    assert not no_temp_files(run / "train")


# ============================================================================ hostile JSON


def test_01_lone_surrogates_and_deep_nesting_are_counted_skips(cli, tmp_path):
    """A lone surrogate ("\\ud800": valid JSON, not text) and a 200k-deep nested line are counted skips with their
    reason, not a UnicodeEncodeError or RecursionError traceback."""
    surrogate = b'{"messages": [{"role": "user", "content": "broken \\ud800 text"}]}'
    deep = b"[" * 200_000 + b"]" * 200_000
    res, report, prompts = prepare(cli, tmp_path, [surrogate, deep])
    assert_ok(res)
    assert_counted(report, prompts, malformed_json=2)
    reasons = [e["detail"] for e in report["skipped_examples"]]
    assert any("surrogate" in r for r in reasons) and any("nested too deeply" in r for r in reasons), reasons


def test_01b_refuses_a_lone_surrogate_with_one_line(cli, tmp_path, chat_tokenizer_dir):
    prompts = write_lines(tmp_path / "run" / "data" / "prompts.jsonl",
                          [prompt(0), b'{"id": "p\\udc80", "messages": [{"role": "user", "content": "x"}]}'])
    error_line(cli("01b_generate_synthetic.py", "--config", gen_config(tmp_path, chat_tokenizer_dir)),
               f"{prompts}:2: malformed JSONL line", "surrogate")


@pytest.mark.parametrize("layout", ["jsonl", "json_array"])
def test_01_utf8_bom_is_read_not_dropped(cli, tmp_path, layout):
    """A UTF-8 BOM is read past: the first JSONL row is kept, a pretty-printed JSON array is readable."""
    if layout == "jsonl":
        src = tmp_path / "source.jsonl"
        src.write_bytes(b"\xef\xbb\xbf" + b"\n".join(json.dumps(r).encode() for r in GOOD_SOURCE) + b"\n")
    else:
        src = tmp_path / "source.json"
        src.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD_SOURCE, indent=2).encode())
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run"), "data": {"source": str(src)}})
    assert_ok(cli("01_prepare_data.py", "--config", cfg))
    report = json.loads((tmp_path / "run" / "data" / "prepare_report.json").read_text())
    assert_counted(report, list(iter_jsonl(tmp_path / "run" / "data" / "prompts.jsonl")))


@pytest.mark.parametrize("content", [b"", b"name,text\na,b\n", b"PAR1 truncated in the middle"])
def test_01_a_parquet_name_on_other_bytes_is_one_error_line(cli, tmp_path, content):
    """A .parquet name on other bytes (empty, CSV, a cut file) is one error line naming the file, not pyarrow's
    traceback."""
    src = tmp_path / "source.parquet"
    src.write_bytes(content)
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run"), "data": {"source": str(src)}})
    error_line(cli("01_prepare_data.py", "--config", cfg), str(src), "not a parquet file")
    assert not (tmp_path / "run" / "data" / "prompts.jsonl").exists()


def test_run_pipeline_on_a_read_only_run_dir_is_one_error_line(tmp_path, tmpfs):
    """A read-only run_dir is one error line from run_pipeline, not an OSError traceback from its `finally`."""
    fs = tmpfs("4m")
    res = subprocess.run(["mount", "-o", "remount,ro", str(fs.path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {res.stderr.strip()}")
    done = subprocess.run([PYTHON, str(REPO / "run_pipeline.py"), "--config", str(REPO / "configs" / "tiny.yaml"),
                           "--set", f"run_dir={fs.path / 'run'}", "--set", f"target.model={tmp_path / 'target'}"],
                          cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=300)
    error_line(done, f"cannot write under run_dir {fs.path / 'run'}", "Read-only file system")


def test_run_pipeline_on_a_complete_run_on_a_read_only_mount_is_one_error_line(tmp_path, tmpfs):
    """A finished run on a read-only mount (its logs/ already there, so no mkdir fails): every stage writes (its
    log, lock and record) even when complete, so run_pipeline tries a write first and refuses in one line,
    changing nothing. A real read-only mount: a tmpfs holding a finished run's folder, remounted read-only
    (we run as root: chmod would not stop us)."""
    fs = tmpfs("4m")
    run = fs.path / "run"
    finished = {f"logs/{stage}.log": f"# {stage}: done\n" for stage in ("01_prepare_data", "04_train", "05_evaluate")}
    finished |= {f"stages/{stage}.json": json.dumps({"stage": stage, "state": "complete"})
                 for stage in ("01_prepare_data", "04_train", "05_evaluate")}
    finished |= {"eval/report.json": "{}", "train/final/config.json": "{}", "logs/pipeline_runs.jsonl": "{}\n"}
    for rel, text in finished.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    res = subprocess.run(["mount", "-o", "remount,ro", str(fs.path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {res.stderr.strip()}")
    (tmp_path / "target").mkdir()
    done = subprocess.run([PYTHON, str(REPO / "run_pipeline.py"), "--config", str(REPO / "configs" / "tiny.yaml"),
                           "--set", f"run_dir={run}", "--set", f"target.model={tmp_path / 'target'}"],
                          cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=300)
    error_line(done, f"cannot write under run_dir {run} (Read-only file system)",
               "copy the run folder to a writable place and point run_dir at it")
    assert {str(p.relative_to(run)): p.read_text() for p in run.rglob("*") if p.is_file()} == finished


def test_01b_a_server_that_answers_html_is_one_error_line(cli, tmp_path, chat_tokenizer_dir):
    """GET /v1/models answered 200 text/html (a web page at base_url): one error line, nothing generated."""
    import http.server
    import threading

    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html><body>It works!</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prompts = [prompt(i) for i in range(3)]
        write_prompts(tmp_path, prompts)
        base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        error_line(cli("01b_generate_synthetic.py", "--config", gen_config(tmp_path, chat_tokenizer_dir, base_url)),
                   f"the server at {base_url} answered GET /models with something that is not an OpenAI model list")
    finally:
        server.shutdown()
    assert not (tmp_path / "run" / "data" / "raw_responses.jsonl").exists()


def test_escape_sequences_in_user_data_are_printed_escaped(cli, tmp_path, config_only_target):
    """A sample id with terminal escapes (set the title, clear the screen) is printed escaped, never raw."""
    evil = "s\x1b]0;pwned\x07\x1b[2J\u202e"
    cfg = tokenized_run(tmp_path, config_only_target, [GOOD_ROWS[0], {"id": evil, "input_ids": [], "loss_mask": []}])
    res = cli("02_extract_hidden.py", "--config", cfg)
    line = error_line(res, "has no tokens")
    assert "\x1b" not in res.stderr and "\x07" not in res.stderr and "\u202e" not in res.stderr
    assert "sample 's\\x1b]0;pwned\\x07\\x1b[2J\\u202e'" in line


def test_01b_redoes_what_a_damaged_raw_responses_tail_lost(cli, tmp_path, chat_tokenizer_dir):
    """With the tail of raw_responses.jsonl cut, 01b checks the file again and asks for the lost prompt only
    (never "already complete")."""
    prompts = [prompt(i) for i in range(6)]
    write_prompts(tmp_path, prompts)
    with FaultServer() as server:
        cfg = gen_config(tmp_path, chat_tokenizer_dir, server.base_url)
        assert_ok(cli("01b_generate_synthetic.py", "--config", cfg))
        raw_path = tmp_path / "run" / "data" / "raw_responses.jsonl"
        lines = raw_path.read_bytes().splitlines(keepends=True)
        lost = json.loads(lines[-1])["id"]
        raw_path.write_bytes(b"".join(lines[:-1]) + lines[-1][:10])  # the last record cut mid-line
        before = server.stats.chat_requests
        res = cli("01b_generate_synthetic.py", "--config", cfg)
        assert_ok(res)
        assert "checking it again" in res.stdout and "already complete" not in res.stdout
        assert server.stats.chat_requests == before + 1  # only the lost prompt was asked again
    report, raw, failed, samples = generate_outputs(tmp_path)
    assert_each_id_once(prompts, raw, failed) and failed == []
    assert sorted(s["id"] for s in samples) == sorted(p["id"] for p in prompts) and lost in {r["id"] for r in raw}
    assert "already complete" in cli("01b_generate_synthetic.py", "--config", cfg).stdout


def test_01b_failures_a_rerun_cannot_fix_are_not_retried_or_called_retryable():
    """A request that cannot be encoded is not retryable: it is neither retried nor reported as "rerun to retry"."""
    from common.core.run_folder import Layout
    from common.data.generate import failed_advice
    from common.data.generate_requests import classify

    failure = classify(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"))
    assert not failure.retryable and failure.reason.startswith("the request cannot be encoded")
    layout = Layout.of("/run")
    advice = failed_advice(layout, {"a": {"retryable": False}, "b": {"retryable": True}})
    assert "1 rejected as invalid or not encodable, which a rerun repeats" in advice and "1 for transient reasons" in advice
    assert failed_advice(layout, {"b": {"retryable": True}}).startswith(" (rerun to retry them")


def test_01b_timeout_s_is_a_total_deadline_per_request(cli, tmp_path, chat_tokenizer_dir):
    """Against a server that sends its answer a byte at a time (each byte well inside httpx's per-read timeout),
    every attempt of 01b ends at generate.timeout_s: each failed as a timeout, and none waited for the server to
    finish its answer (counted by the server, not timed: the machine's load would decide a wall-clock bound)."""
    prompts = [prompt(i) for i in range(2)]
    write_prompts(tmp_path, prompts)
    with FaultServer(Faults(drip_s=0.1)) as server:  # ~60 s per answer; each byte well inside a read timeout
        cfg = gen_config(tmp_path, chat_tokenizer_dir, server.base_url, generate={"timeout_s": 1.5, "max_retries": 1})
        res = cli("01b_generate_synthetic.py", "--config", cfg)
        assert server.stats.chat_requests == 4 and server.stats.faults["drip"] == 4  # 2 prompts x 2 attempts
        assert server.stats.faults["drip_done"] == 0  # every attempt was cut at its deadline
    error_line(res, "no prompt got an answer: all 2 of 2 failed every retry (TimeoutError x2)")
    report, raw, failed, _ = generate_outputs_without_samples(tmp_path)
    assert raw == [] and all(f["attempts"] == 2 and "generate.timeout_s" in f["reason"] for f in failed)
    assert_each_id_once(prompts, raw, failed)
