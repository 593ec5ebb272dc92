"""SIGKILL at random moments, rerun, and the final artifacts equal an uninterrupted run's.

Which stage is covered where:
  01  prepare     here: kills anywhere in the run (seeded), then byte-identical prompts.jsonl
  01b generate    tests/data/test_generate.py::test_sigkill_at_random_moments_then_resume
  02  extract     tests/extract/test_extract.py::test_sigkill_at_random_points_then_resume_is_byte_identical
  03  vocab map   here: byte-identical vocab_map.safetensors and report
  04  train       tests/train/test_train.py::test_resume_after_sigkill_is_exact
  05  evaluate    here, on a fake vLLM (tests/helpers.py FakeVllm): identical report and outputs
                  (except timings), prompts answered exactly once in outputs.jsonl
plus: temp files that a kill leaves behind (`.tmp-*` next to an atomically written file) are
removed by the next run, so repeated kills cannot fill the disk.

Every run is a fresh `python NN_stage.py` subprocess, SIGKILLed (tests/helpers.py kill_while_working)
at a moment drawn uniformly (seeded) from its work: for 01 and 03, which write their outputs whole, from
the CPU seconds of an uninterrupted run; for 05, from the requests left to answer. So kills land in
start-up, in the work and in the final writes, however loaded the machine. After every kill the outputs
must be either absent or complete and correct (never half-written under a final name).
"""

from __future__ import annotations

import json
import random
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, cpu_seconds, kill_while_working, stage_env, start_in_own_group

PYTHON = sys.executable


def run(cmd: list[str], timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    """cmd to its end; its result and the CPU seconds it used (the measure of its work)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def kill_while_writing_whole(cmd: list[str], outputs: list[Path], work: float, seed: int, check) -> int:
    """SIGKILL 3 runs of a stage that writes its outputs whole, each at a moment drawn from all of `work` (the
    CPU seconds of an uninterrupted run: every run does it all again); check() after each run. A run the kill
    missed finished the job: its outputs go (after the check), so that the next run has the work to do again."""

    def start() -> subprocess.Popen:
        if all(p.exists() for p in outputs):
            for p in outputs:
                p.unlink()
        return start_in_own_group(cmd)

    rng = random.Random(seed)
    return sum(kill_while_working(start, cpu_seconds, work, rng, after_each=lambda killed: check()) for _ in range(3))


def without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(".tmp-*"))


# ============================================================================ 01 prepare


def big_source(path: Path, n: int) -> Path:
    """n rows in both shapes, with duplicates, a system-only row and a malformed line now and then."""
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            k = rng.randrange(n // 2)  # about one row in four repeats an earlier prompt
            if i % 997 == 0:
                f.write('{"messages": [{"role": "user", "content": "cut\n')
            elif i % 991 == 0:
                f.write(json.dumps({"messages": [{"role": "system", "content": "only a system prompt"}]}) + "\n")
            elif i % 2:
                f.write(json.dumps({"conversations": [{"from": "human", "value": f"Question {k}: explain item {k} in detail."},
                                                      {"from": "gpt", "value": "an answer that 01 drops"}]}) + "\n")
            else:
                f.write(json.dumps({"id": f"row-{i}", "messages": [{"role": "system", "content": "Be brief."},
                                                                  {"role": "user", "content": f"Question {k}: explain item {k} in detail."}]}) + "\n")
    return path


def test_01_prepare_sigkill_anywhere_then_rerun_is_identical(tmp_path):
    src = big_source(tmp_path / "source.jsonl", 60_000)
    cmd_for = {}
    for name in ("ref", "cut"):
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({"run_dir": str(tmp_path / name), "data": {"source": str(src), "eval_fraction": 0.1}}))
        cmd_for[name] = [PYTHON, str(REPO / "01_prepare_data.py"), "--config", str(cfg)]
    ref, work = run(cmd_for["ref"])
    assert ref.returncode == 0, ref.stderr
    ref_prompts = (tmp_path / "ref" / "data" / "prompts.jsonl").read_bytes()
    ref_report = json.loads((tmp_path / "ref" / "data" / "prepare_report.json").read_text())
    assert ref_report["counts"]["kept"] > 20_000

    data = tmp_path / "cut" / "data"

    def check():
        prompts, report = data / "prompts.jsonl", data / "prepare_report.json"
        if prompts.exists():
            assert prompts.read_bytes() == ref_prompts  # atomic: the whole file or nothing
        if report.exists():
            assert prompts.exists() and without(json.loads(report.read_text()), "seconds", "config", "source") == \
                without(ref_report, "seconds", "config", "source")

    kills = kill_while_writing_whole(cmd_for["cut"], [data / "prompts.jsonl", data / "prepare_report.json"], work, 101, check)
    assert kills == 3, "the runs finished before they could be killed; make the source larger"
    final, _ = run(cmd_for["cut"])
    assert final.returncode == 0, final.stderr
    check()
    assert (data / "prompts.jsonl").read_bytes() == ref_prompts
    again, _ = run(cmd_for["cut"])
    assert again.returncode == 0 and "already complete" in again.stdout


# ============================================================================ 03 vocab map


def test_03_vocab_map_sigkill_anywhere_then_rerun_is_identical(tmp_path):
    from transformers import LlamaConfig

    vocab = 50_000
    target = tmp_path / "target"
    LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(target)
    rng = random.Random(3)
    for name in ("ref", "cut"):
        (tmp_path / name / "data").mkdir(parents=True)
    lines = []
    for i in range(2000):  # ~0.6M tokens, Zipf-like ids
        n = rng.randint(100, 500)
        ids = [min(vocab - 1, int(rng.paretovariate(1.1) * 7)) for _ in range(n)]
        lines.append(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * (n // 4) + [1] * (n - n // 4)}) + "\n")
    text = "".join(lines)
    cmd_for = {}
    for name in ("ref", "cut"):
        (tmp_path / name / "data" / "train.jsonl").write_text(text)
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({"run_dir": str(tmp_path / name), "target": {"model": str(target), "aux_layer_ids": [1, 2, 3]},
                                       "vocab": {"draft_vocab_size": 4096}}))
        cmd_for[name] = [PYTHON, str(REPO / "03_build_vocab_map.py"), "--config", str(cfg)]
    ref, work = run(cmd_for["ref"])
    assert ref.returncode == 0, ref.stderr
    ref_map = (tmp_path / "ref" / "vocab" / "vocab_map.safetensors").read_bytes()
    ref_report = json.loads((tmp_path / "ref" / "vocab" / "report.json").read_text())
    out = tmp_path / "cut" / "vocab"

    def check():
        if (out / "vocab_map.safetensors").exists():
            assert (out / "vocab_map.safetensors").read_bytes() == ref_map
        if (out / "report.json").exists():  # written last: its presence means complete
            assert (out / "vocab_map.safetensors").exists()
            assert without(json.loads((out / "report.json").read_text()), "target_model") == without(ref_report, "target_model")

    kills = kill_while_writing_whole(cmd_for["cut"], [out / "vocab_map.safetensors", out / "report.json"], work, 303, check)
    assert kills == 3, "the runs finished before they could be killed; make train.jsonl larger"
    final, _ = run(cmd_for["cut"])
    assert final.returncode == 0, final.stderr
    check()
    assert (out / "vocab_map.safetensors").read_bytes() == ref_map
    again, _ = run(cmd_for["cut"])
    assert again.returncode == 0 and "already complete" in again.stdout


# ============================================================================ 05 evaluate (fake vLLM)

# Runs 05_evaluate.py with its vLLM servers swapped for tests/helpers.py's FakeVllm (deterministic
# answers and spec-decode counters), each request slowed down so that kills land mid-run. Each answer
# appends a line to `answered`, naming the server that gave it ("target" alone or "draft"): the run's
# progress.
FAKE_05 = r'''
import contextlib, runpy, sys, time
from tests.helpers import FakeVllm
from common.evaluate import serve

serving = ["target"]

@contextlib.contextmanager
def fake_target_server(cfg, speculative=None, log_path=None):
    serving[0] = "target" if speculative is None else "draft"
    with FakeVllm(with_draft=speculative is not None, diverge=("question 5",)) as server:
        yield server

serve.target_server = fake_target_server
_chat = serve._chat
def slow_chat(*args, **kwargs):
    time.sleep(0.1)
    answer = _chat(*args, **kwargs)
    with open({answered!r}, "a") as f:
        f.write(serving[0] + "\n")
    return answer
serve._chat = slow_chat
sys.argv = [{script!r}, "--config", {config!r}]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def eval_run(root: Path, tokenizer_dir: Path) -> Path:
    """A run_dir with prompts, a (fake) trained draft and 04's offline report; returns the config. The target is a
    config and a tokenizer (05 counts each prompt's tokens against server.max_model_len)."""
    target = root / "target"
    shutil.copytree(tokenizer_dir, target)
    (target / "config.json").write_text('{"model_type": "llama"}')
    run_dir = root / "run"
    (run_dir / "data").mkdir(parents=True)
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}], "split": "eval" if i % 2 else "train"}
               for i in range(24)]
    (run_dir / "data" / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    final = run_dir / "train" / "final"
    final.mkdir(parents=True)
    from common.model.draft import DraftModelConfig  # 05 reads the draft's config.json before vLLM does

    (final / "config.json").write_text(json.dumps(DraftModelConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
        draft_vocab_size=128, target_hidden_size=64, aux_layer_ids=[1, 2, 3]).to_vllm_config()))
    (final / "training_summary.json").write_text(json.dumps({"step": 10}))
    (final / "model.safetensors").write_bytes(b"fake weights")
    last_eval = {"type": "eval", "step": 10, "loss": 1.0, "step_acc": [0.6, 0.5, 0.4], "tau": {"3": 2.02}}
    (run_dir / "train" / "eval_report.json").write_text(json.dumps(last_eval))
    # 04's prediction for the draft, beside it (common.train.export.prediction_record): what 05 reads
    (final / "prediction.json").write_text(json.dumps({"step": 10, "k": 3, "eval": last_eval, "missing": None}))
    cfg = root / "run.yaml"
    cfg.write_text(yaml.safe_dump({"run_dir": str(run_dir), "target": {"model": str(target), "dtype": "float32"},
                                   "evaluate": {"num_prompts": 8, "num_speculative_tokens": 3, "max_tokens": 64,
                                                "temperature": 0.0, "concurrency": 1, "throughput_repeats": 1}}))
    return cfg


def comparable_eval(run_dir: Path) -> dict:
    """eval/ outputs without what depends on timing or paths."""
    out = {}
    d = run_dir / "eval"
    if (d / "report.json").exists():
        r = json.loads((d / "report.json").read_text())
        out["report"] = without(r, "created", "throughput", "key", "draft", "target", "files", "offline")
        out["report_tokens"] = {k: v["output_tokens"] for k, v in r["throughput"].items() if isinstance(v, dict)}
    if (d / "outputs.jsonl").exists():
        rows = [json.loads(line) for line in (d / "outputs.jsonl").read_text().splitlines()]
        out["outputs"] = [{**row, "with_draft": without(row["with_draft"], "latency_s"),
                           "without_draft": without(row["without_draft"], "latency_s")} for row in rows]
    if (d / "baseline.json").exists():
        b = json.loads((d / "baseline.json").read_text())
        out["baseline"] = {pid: without(o, "latency_s") for pid, o in b["outputs"].items()}
    return out


def test_05_evaluate_sigkill_anywhere_then_rerun_is_identical(tmp_path, chat_tokenizer_dir):
    cmds, runs, answered = {}, {}, {}
    for name in ("ref", "cut"):
        cfg = eval_run(tmp_path / name, chat_tokenizer_dir)
        runs[name] = tmp_path / name / "run"
        answered[name] = tmp_path / f"{name}-answered.log"
        code = FAKE_05.format(script=str(REPO / "05_evaluate.py"), config=str(cfg), answered=str(answered[name]))
        cmds[name] = [PYTHON, "-c", code]
    ref, _ = run(cmds["ref"])
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = comparable_eval(runs["ref"])
    assert set(reference) == {"report", "report_tokens", "outputs", "baseline"}
    assert reference["report"]["outputs"]["mismatched_ids"] == ["p5"]
    assert [r["id"] for r in reference["outputs"]] == ["p1", "p3", "p5", "p7", "p9", "p11", "p13", "p15"]

    def check():
        now = comparable_eval(runs["cut"])
        for key, value in now.items():
            assert value == reference[key], key  # each file is absent or complete and equal
        if "report" in now:
            assert "outputs" in now and "baseline" in now

    # The work is the answers (as many as the reference run got): the target alone's (kept in baseline.json
    # once all are in) and those with the draft; each kill is drawn from the answers still to come, the last
    # ones followed by the report's writes.
    servers = answered["ref"].read_text().splitlines()
    work, target_alone = len(servers), servers.count("target")
    eval_dir, log = runs["cut"] / "eval", answered["cut"]
    kept = {"answers": 0}  # what the run in progress started with

    def answers(victim) -> float:
        if victim is None:  # before a run: what the files keep
            return work if (eval_dir / "report.json").exists() else target_alone if (eval_dir / "baseline.json").exists() else 0
        return kept["answers"] + len(log.read_text().splitlines())

    def start() -> subprocess.Popen:
        kept["answers"] = answers(None)
        log.write_text("")
        return start_in_own_group(cmds["cut"])

    kills = kill_while_working(start, answers, work, random.Random(505), kills=3, after_each=lambda killed: check())
    assert kills == 3, "the runs finished before they could be killed; slow the fake server down"
    final, _ = run(cmds["cut"])
    assert final.returncode == 0, final.stderr[-3000:]
    assert comparable_eval(runs["cut"]) == reference
    again, _ = run(cmds["cut"])
    assert again.returncode == 0 and "already complete" in again.stdout


# ============================================================================ stale temp files


@pytest.mark.parametrize("stage,final", [
    ("01_prepare_data.py", "data/prompts.jsonl"),
    ("01b_generate_synthetic.py", "data/train.jsonl"),
    ("03_build_vocab_map.py", "vocab/vocab_map.safetensors"),
])
def test_temp_files_left_by_a_kill_are_removed_by_the_next_run(tmp_path, chat_tokenizer_dir, stage, final):
    """A SIGKILL during an atomic write leaves `.tmp-NAME.XXXX` next to NAME (for train.jsonl that can be
    GBs); the next run must remove it, or repeated kills fill the disk."""
    from transformers import LlamaConfig

    target = tmp_path / "target"
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(target)
    run_dir = tmp_path / "run"
    data = run_dir / "data"
    data.mkdir(parents=True)
    src = tmp_path / "source.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(20)))
    # 01b: every prompt already answered, so the rerun only tokenizes (no server needed).
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}], "split": "train"} for i in range(5)]
    (data / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (data / "raw_responses.jsonl").write_text("".join(json.dumps(
        {"id": p["id"], "messages": p["messages"] + [{"role": "assistant", "content": f"answer {i}"}]}) + "\n"
        for i, p in enumerate(prompts)))
    (data / "train.jsonl").write_text(
        "".join(json.dumps({"id": f"s{i}", "input_ids": [i, i + 1, 5], "loss_mask": [0, 1, 1]}) + "\n" for i in range(20)))
    if stage.startswith("01b"):
        (data / "train.jsonl").unlink()
    model = chat_tokenizer_dir if stage.startswith("01b") else target
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"run_dir": str(run_dir), "data": {"source": str(src)},
                                   "target": {"model": str(model), "aux_layer_ids": [1, 2, 3]}, "vocab": {"draft_vocab_size": 8}}))
    stale = run_dir / Path(final).parent / f".tmp-{Path(final).name}.k1ll3d"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"half of a file that a SIGKILL interrupted")
    res, _ = run([PYTHON, str(REPO / stage), "--config", str(cfg)])
    assert res.returncode == 0, res.stderr[-2000:]
    assert (run_dir / final).is_file()
    assert temp_files(run_dir) == [], "stale temp files survive the rerun"
