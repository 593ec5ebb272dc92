"""Stage 01b against a fault-injecting fake server (tests/fault_server.py): fast, no vLLM.

What must hold whatever the server does: every prompt id ends exactly once in
raw_responses.jsonl or in failed.jsonl with a reason; 4xx are not retried, transient errors
and malformed responses are; reruns skip done ids and retry failed ones; SIGKILL at any moment
loses nothing that was written and never duplicates; SIGTERM exits 130 with no torn line;
the API key is sent but never written anywhere. With tokenize.token_ids_from=server the
samples are the server's ids (last turn's prompt masked, completion learned) and a response
without ids is a non-retryable failure; with =template a template that cannot reproduce a
generated turn (Kimi-K2.5's) fails before any request.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (DROPS_OLD_REASONING_TEMPLATE, KIMI_LIKE_SPECIAL, KIMI_LIKE_TEMPLATE, SMOLLM2_TEMPLATE, build_chat_tokenizer,
                      build_slow_chat_tokenizer)
from fault_server import (
    ALWAYS_FAIL_MARKER,
    BAD_REQUEST_MARKER,
    FAULT_KINDS,
    NO_TOKEN_IDS_MARKER,
    FaultServer,
    Faults,
    expected_reply,
    expected_token_ids,
)

from common.core.config import load_config
from common.core.errors import ConfigError, DataError, PipelineError
from common.core.io import iter_jsonl
from common.data.generate import run_stage
from common.data.generate_files import load_done
from common.data.generate_requests import MISSING_TOKEN_IDS, MissingTokenIds, backoff_delay, classify
from common.serving.chat import MalformedResponse
from common.target.tokenization import load_tokenizer
from tests.helpers import REPO, error_line, stage_env

SECRET = "sk-test-DO-NOT-LEAK-5f3a9c"
SCRIPT = str(REPO / "01b_generate_synthetic.py")


# ----------------------------------------------------------------------------- helpers


def make_prompts(run_dir: Path, n: int, *, bad: tuple[int, ...] = (), always_fail: tuple[int, ...] = (),
                 no_ids: tuple[int, ...] = ()) -> list[dict]:
    """n prompts: every 4th has a system prompt, every 5th two user turns, every 5th in eval."""
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "You are a helpful assistant."}] if i % 4 == 0 else []
        text = f"Question {i}: what is {i} plus {i + 1}?"
        if i in bad:
            text += " " + BAD_REQUEST_MARKER
        if i in always_fail:
            text += " " + ALWAYS_FAIL_MARKER
        if i in no_ids:
            text += " " + NO_TOKEN_IDS_MARKER
        messages.append({"role": "user", "content": text})
        if i % 5 == 2:
            messages.append({"role": "user", "content": f"Are you sure about {i}?"})
        rows.append({"id": f"p{i:03d}", "messages": messages, "split": "eval" if i % 5 == 0 else "train"})
    path = run_dir / "data" / "prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return rows


def expected_conversation(prompt: dict) -> list[dict]:
    """What 01b must store: the prompt with each user turn answered as the fault server answers it."""
    conv: list[dict] = []
    for m in prompt["messages"]:
        conv.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            reply = expected_reply(conv)
            answer = {"role": "assistant", "content": reply["content"]}
            if reply["reasoning"]:
                answer["reasoning"] = reply["reasoning"]
            conv.append(answer)
    return conv


def config(write_config, server: FaultServer | str, tokenizer_dir: Path, tokenize: dict | None = None,
           target: dict | None = None, **generate) -> Path:
    base_url = server if isinstance(server, str) else server.base_url
    gen = {"base_url": base_url, "concurrency": 8, "timeout_s": 2.0, "max_retries": 6, "backoff_initial_s": 0.01,
           "backoff_max_s": 0.05, "max_tokens": 64, "fsync_every": 4, "api_key_env": "EAGLE3_TEST_API_KEY",
           "max_failure_fraction": 1.0}  # these tests inject failures on purpose; the limit has its own tests
    gen.update(generate)
    return write_config({"target": {"model": str(tokenizer_dir), **(target or {})}, "generate": gen,
                         "tokenize": {"max_seq_len": 512, **(tokenize or {})}})


def rows_of(path: Path) -> list[dict]:
    return list(iter_jsonl(path)) if path.exists() else []


def run_01b(cfg_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, "--config", str(cfg_path), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=stage_env(EAGLE3_TEST_API_KEY=SECRET))


def assert_accounted(run_dir: Path, prompts: list[dict]) -> tuple[list[dict], list[dict]]:
    """Every id exactly once in raw or (exclusively) in failed, with a reason; returns (raw, failed)."""
    raw = rows_of(run_dir / "data" / "raw_responses.jsonl")
    failed = rows_of(run_dir / "data" / "failed.jsonl")
    raw_ids = [r["id"] for r in raw]
    failed_ids = [r["id"] for r in failed]
    assert len(raw_ids) == len(set(raw_ids)), "duplicate ids in raw_responses.jsonl"
    assert len(failed_ids) == len(set(failed_ids)), "duplicate ids in failed.jsonl"
    assert not set(raw_ids) & set(failed_ids)
    assert sorted(raw_ids + failed_ids) == sorted(p["id"] for p in prompts)
    assert all(r["reason"] and r["attempts"] >= 1 for r in failed)
    return raw, failed


def assert_no_secret(*places) -> None:
    for place in places:
        if isinstance(place, Path):
            for f in place.rglob("*"):
                if f.is_file():
                    assert SECRET not in f.read_text(encoding="utf-8", errors="replace"), f"API key leaked into {f}"
        else:
            assert SECRET not in place


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv("EAGLE3_TEST_API_KEY", SECRET)


# ----------------------------------------------------------------------------- unit checks


def test_classify_retryable_and_not():
    import httpx2
    import openai

    def status_error(code, headers=None):
        req = httpx2.Request("POST", "http://x/v1/chat/completions")
        resp = httpx2.Response(code, request=req, headers=headers or {})
        return openai.APIStatusError("boom", response=resp, body=None)

    for code in (429, 500, 502, 503):
        assert classify(status_error(code)).retryable, code
    for code in (400, 401, 404, 422):
        f = classify(status_error(code))
        assert not f.retryable and f.status_code == code
    assert classify(status_error(429, {"retry-after": "3"})).retry_after == 3.0
    req = httpx2.Request("POST", "http://x")
    assert classify(openai.APITimeoutError(request=req)).retryable
    assert classify(openai.APIConnectionError(request=req)).retryable
    assert classify(MalformedResponse("x")).retryable
    assert classify(json.JSONDecodeError("bad", "{", 0)).retryable


def test_backoff_full_jitter_bounds():
    rng = random.Random(0)
    for attempt in range(1, 10):
        cap = min(0.5, 0.01 * 2 ** (attempt - 1))
        delays = [backoff_delay(attempt, 0.01, 0.5, rng) for _ in range(200)]
        assert all(0.0 <= d <= cap for d in delays)
        assert max(delays) > 0.5 * cap  # full jitter spreads over the whole range


def test_load_done_dedupes_and_cuts_torn_tail(tmp_path):
    path = tmp_path / "raw.jsonl"
    path.write_bytes(b'{"id": "a", "v": 1}\n{"id": "b"}\n{"id": "a", "v": 2}\n{"id": "c", "v"')
    done, dupes = load_done(path)
    assert sorted(done) == ["a", "b"] and done["a"]["v"] == 1 and dupes == 1
    assert path.read_bytes().endswith(b'{"id": "a", "v": 2}\n')
    # A complete object without its newline is cut too (the appender would cut it next).
    path.write_bytes(b'{"id": "a"}\n{"id": "d"}')
    done, _ = load_done(path)
    assert sorted(done) == ["a"]


# ----------------------------------------------------------------------------- in-process runs


def test_faults_every_id_accounted_values_exact(run_dir, write_config, chat_tokenizer_dir, api_key):
    prompts = make_prompts(run_dir, 48, bad=(7,), always_fail=(11,))
    faults = Faults(seed=3, p_delay=0.3, max_delay_s=0.02, p_hang=0.04, hang_s=3.0, p_500=0.08, p_503=0.05, p_429=0.05,
                    p_reset=0.05, p_torn=0.05, p_non_json=0.05, p_empty_choices=0.05, max_faults_per_request=3)
    with FaultServer(faults) as server:
        cfg = load_config(config(write_config, server, chat_tokenizer_dir, timeout_s=0.75))
        assert run_stage(cfg) == 0
    stats = server.stats
    raw, failed = assert_accounted(run_dir, prompts)

    # Every fault kind happened, and each retryable failure cost exactly one retry.
    for kind in FAULT_KINDS:
        assert stats.faults[kind] > 0, kind
    by_id = {r["id"]: r for r in failed}
    assert set(by_id) == {"p007", "p011"}
    assert by_id["p007"]["status_code"] == 400 and by_id["p007"]["attempts"] == 1  # not retried
    assert "marked bad" in by_id["p007"]["reason"]
    assert by_id["p011"]["status_code"] == 503 and by_id["p011"]["attempts"] == cfg.generate.max_retries + 1
    assert stats.requests_by_prompt[prompts[7]["messages"][0]["content"]] == 1
    assert stats.faults["always_503"] == cfg.generate.max_retries + 1
    report = json.loads((run_dir / "data" / "generate_report.json").read_text())
    run = report["this_run"]
    injected = sum(stats.faults[k] for k in FAULT_KINDS)
    assert run["retries"] == injected + cfg.generate.max_retries  # p011: max_retries retries, then failed
    assert run["requests"] == stats.chat_requests
    assert run["retry_reasons"]["MalformedResponse"] == stats.faults["non_json"] + stats.faults["empty_choices"]
    assert run["retry_reasons"]["TimeoutError"] == stats.faults["hang"]
    assert run["max_in_flight"] <= cfg.generate.concurrency and stats.max_in_flight <= cfg.generate.concurrency
    assert report["num_done"] == 46 and report["num_failed"] == 2 and report["complete"] is False

    # Values: the stored conversation is the server's deterministic answer, turn by turn (the
    # second turn's answer hashes the regenerated history, so a wrong history would show).
    prompt_by_id = {p["id"]: p for p in prompts}
    for row in raw:
        want = expected_conversation(prompt_by_id[row["id"]])
        assert row["messages"] == want, row["id"]
        assert row["content"] == want[-1]["content"] and row["reasoning"] == want[-1].get("reasoning", "")
        assert len(row["turns"]) == sum(m["role"] == "user" for m in want)
        assert row["finish_reason"] == "stop" and row["usage"]["completion_tokens"] > 0
    assert {r.get("reasoning", "") != "" for r in raw} == {True, False}

    # Tokenized outputs: split as in prompts.jsonl; ids and masks match the template.
    tok = load_tokenizer(str(chat_tokenizer_dir))
    train = rows_of(run_dir / "data" / "train.jsonl")
    evals = rows_of(run_dir / "data" / "eval.jsonl")
    assert sorted(r["id"] for r in train + evals) == sorted(r["id"] for r in raw)
    assert {r["id"] for r in evals} == {r["id"] for r in raw if prompt_by_id[r["id"]]["split"] == "eval"}
    raw_by_id = {r["id"]: r for r in raw}
    for sample in train + evals:
        messages = raw_by_id[sample["id"]]["messages"]
        ids = tok.apply_chat_template(messages, tokenize=True)["input_ids"]
        assert sample["input_ids"] == list(ids)
        masked = tok.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m], skip_special_tokens=False)
        want = "".join(
            (f"<think>\n{m['reasoning']}\n</think>\n\n" if m.get("reasoning") else "") + m["content"] + "<|im_end|>"
            for m in messages if m["role"] == "assistant"
        )
        assert masked == want
    assert report["tokenize"]["train"] == len(train) and report["tokenize"]["eval"] == len(evals)

    # The key was sent, and is nowhere on disk.
    assert stats.auth_headers == {f"Bearer {SECRET}"}
    assert_no_secret(run_dir, run_dir.parent)


def test_rerun_retries_failed_then_complete(run_dir, write_config, chat_tokenizer_dir, api_key, capsys):
    prompts = make_prompts(run_dir, 24)
    with FaultServer(Faults(seed=5, p_500=0.35)) as server:
        # No retries: about a third fail.
        cfg_path = config(write_config, server, chat_tokenizer_dir, max_retries=0)
        assert run_stage(load_config(cfg_path)) == 0
        raw1, failed1 = assert_accounted(run_dir, prompts)
        assert failed1 and all(r["status_code"] == 500 and r["attempts"] == 1 for r in failed1)
        first_requests = server.stats.chat_requests
        # Rerun with retries: only the failed ids are requested again, and they all succeed.
        assert run_stage(load_config(cfg_path, ["generate.max_retries=8"])) == 0
        raw2, failed2 = assert_accounted(run_dir, prompts)
        assert failed2 == []
        assert [r["id"] for r in raw2[: len(raw1)]] == [r["id"] for r in raw1]  # append-only
        retried_prompts = {next(m["content"] for m in p["messages"] if m["role"] == "user")
                           for p in prompts if p["id"] in {r["id"] for r in failed1}}
        assert server.stats.chat_requests > first_requests
        report = json.loads((run_dir / "data" / "generate_report.json").read_text())
        assert report["done_before"] == len(raw1) and report["num_failed"] == 0 and report["complete"] is True
        assert report["this_run"]["prompts"] == len(failed1)
        assert len(retried_prompts) == len(failed1)
    capsys.readouterr()
    # Third run: nothing to do, no server needed.
    train_mtime = (run_dir / "data" / "train.jsonl").stat().st_mtime_ns
    assert run_stage(load_config(cfg_path)) == 0
    assert "already complete" in capsys.readouterr().out
    assert (run_dir / "data" / "train.jsonl").stat().st_mtime_ns == train_mtime
    # Missing train.jsonl: tokenization alone reruns, still without a server.
    (run_dir / "data" / "train.jsonl").unlink()
    assert run_stage(load_config(cfg_path)) == 0
    assert len(rows_of(run_dir / "data" / "train.jsonl")) == sum(p["split"] == "train" for p in prompts)
    # Changed tokenization settings: retokenized, not "complete".
    assert run_stage(load_config(cfg_path, ["tokenize.max_seq_len=16"])) == 0
    assert "already complete" not in capsys.readouterr().out
    assert all(len(r["input_ids"]) <= 16 for r in rows_of(run_dir / "data" / "train.jsonl"))


def test_overwrite_restarts(run_dir, write_config, chat_tokenizer_dir, api_key):
    prompts = make_prompts(run_dir, 6)
    with FaultServer(Faults(seed=1)) as server:
        cfg_path = config(write_config, server, chat_tokenizer_dir)
        assert run_stage(load_config(cfg_path)) == 0
        assert run_stage(load_config(cfg_path), overwrite=True) == 0
        # every prompt twice (p002 has two user turns), and --overwrite's 1-token chat probe before it deleted anything
        assert server.stats.chat_requests == 2 * sum(1 + (p["id"] in ("p002",)) for p in prompts) + 1
        assert server.stats.requests_by_prompt["hi"] == 1
    assert_accounted(run_dir, prompts)


def test_multi_turn_requests_carry_the_regenerated_history(run_dir, write_config, chat_tokenizer_dir, api_key):
    make_prompts(run_dir, 3)  # p002 has two user turns
    with FaultServer(Faults(seed=2), record_bodies=True) as server:
        cfg = load_config(config(write_config, server, chat_tokenizer_dir, temperature=0.25, max_tokens=77,
                                 enable_thinking=True, extra_body={"top_k": 5}))
        assert run_stage(cfg) == 0
    bodies = [b for b in server.stats.bodies if "Are you sure about 2?" in json.dumps(b)]
    assert len(bodies) == 1
    first_turn = expected_reply(bodies[0]["messages"][:1])
    assert bodies[0]["messages"][1] == {"role": "assistant", "content": first_turn["content"],
                                        **({"reasoning": first_turn["reasoning"]} if first_turn["reasoning"] else {})}
    for b in server.stats.bodies:
        assert b["model"] == "fault-model" and b["max_tokens"] == 77 and b["temperature"] == 0.25 and b["top_k"] == 5
        assert b["chat_template_kwargs"] == {"enable_thinking": True}


def test_model_checks_and_tokenizer_mismatch(run_dir, write_config, chat_tokenizer_dir, api_key):
    make_prompts(run_dir, 4)
    tok = load_tokenizer(str(chat_tokenizer_dir))
    with FaultServer(Faults(), tokenize_fn=lambda text: tok(text, add_special_tokens=False)["input_ids"]) as server:
        cfg_path = config(write_config, server, chat_tokenizer_dir)
        with pytest.raises(PipelineError, match="generate.model 'other' is not served"):
            run_stage(load_config(cfg_path, ["generate.model=other"]))
        assert run_stage(load_config(cfg_path, ["generate.model=fault-model"])) == 0
    report = json.loads((run_dir / "data" / "generate_report.json").read_text())
    assert report["tokenizer_check"] == "match" and report["model"] == "fault-model"
    with FaultServer(Faults(), tokenize_fn=lambda text: [t + 1 for t in tok(text, add_special_tokens=False)["input_ids"]]) as server:
        with pytest.raises(DataError, match="does not match the served model"):
            run_stage(load_config(config(write_config, server, chat_tokenizer_dir)), overwrite=True)


# ----------------------------------------------------------------------------- subprocess runs


def test_unreachable_server_is_a_one_line_error(run_dir, write_config, chat_tokenizer_dir):
    import socket

    make_prompts(run_dir, 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    url = f"http://127.0.0.1:{port}/v1"
    proc = run_01b(config(write_config, url, chat_tokenizer_dir))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach the generation server at " + url)
    assert "vllm.entrypoints.openai.api_server" in lines[0]
    assert "Traceback" not in proc.stderr


def test_sigkill_at_random_moments_then_resume(run_dir, write_config, chat_tokenizer_dir):
    """Kill -9 the stage several times mid-run (seeded moments); the rerun completes with every
    id exactly once or failed with a reason; nothing duplicated, nothing lost."""
    prompts = make_prompts(run_dir, 60, bad=(13,))
    rng = random.Random(1234)
    raw_path = run_dir / "data" / "raw_responses.jsonl"
    faults = Faults(seed=7, latency_s=0.08, p_500=0.1, p_reset=0.05, p_torn=0.05)
    with FaultServer(faults) as server:
        cfg_path = config(write_config, server, chat_tokenizer_dir, concurrency=4, fsync_every=3)
        kills = mid_run_kills = 0
        for _ in range(3):
            target = rng.randint(1, 6000)  # bytes in raw_responses.jsonl before the kill
            jitter = rng.uniform(0.0, 0.4)
            proc = subprocess.Popen([sys.executable, SCRIPT, "--config", str(cfg_path)], cwd=REPO, env=stage_env(
                EAGLE3_TEST_API_KEY=SECRET), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            start_size = raw_path.stat().st_size if raw_path.exists() else 0
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                size = raw_path.stat().st_size if raw_path.exists() else 0
                if size - start_size >= target:
                    break
                time.sleep(0.02)
            time.sleep(jitter)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait(30)
            # After every kill: at most a torn last line, no duplicate ids among whole lines.
            done, dupes = load_done(raw_path) if raw_path.exists() else ({}, 0)
            assert dupes == 0
            mid_run_kills += proc.returncode == -signal.SIGKILL and 0 < len(done) < len(prompts)
        assert kills >= 2 and mid_run_kills >= 1
        final = run_01b(cfg_path)
        assert final.returncode == 0, final.stderr
    raw, failed = assert_accounted(run_dir, prompts)
    assert [r["id"] for r in failed] == ["p013"]
    prompt_by_id = {p["id"]: p for p in prompts}
    assert all(r["messages"] == expected_conversation(prompt_by_id[r["id"]]) for r in raw)
    assert_no_secret(run_dir)


def test_sigterm_stops_cleanly_with_130(run_dir, write_config, chat_tokenizer_dir):
    prompts = make_prompts(run_dir, 80)
    raw_path = run_dir / "data" / "raw_responses.jsonl"
    with FaultServer(Faults(seed=9, latency_s=0.25)) as server:
        cfg_path = config(write_config, server, chat_tokenizer_dir, concurrency=4, fsync_every=1000)
        proc = subprocess.Popen([sys.executable, SCRIPT, "--config", str(cfg_path)], cwd=REPO, text=True,
                                env=stage_env(EAGLE3_TEST_API_KEY=SECRET), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while server.stats.chat_requests < 12 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "interrupted" in err and "rerun the same command to resume" in err
        data = raw_path.read_bytes()
        assert data.endswith(b"\n")  # finished samples were flushed whole, even with fsync_every=1000
        rows = [json.loads(line) for line in data.splitlines()]
        assert 4 <= len(rows) < len(prompts)
        assert len({r["id"] for r in rows}) == len(rows)
        report = json.loads((run_dir / "data" / "generate_report.json").read_text())
        assert report["interrupted"] is True and report["num_done"] == len(rows)
        assert not (run_dir / "data" / "train.jsonl").exists()
        final = run_01b(cfg_path)
        assert final.returncode == 0, final.stderr
    raw, failed = assert_accounted(run_dir, prompts)
    assert failed == [] and [r["id"] for r in raw[: len(rows)]] == [r["id"] for r in rows]
    assert_no_secret(run_dir, out, err, final.stdout, final.stderr)


# ----------------------------------------------------------------------------- token ids from the server


def test_missing_token_ids_is_not_retryable():
    f = classify(MissingTokenIds(MISSING_TOKEN_IDS))
    assert not f.retryable and "needs vLLM >= 0.10 or set tokenize.token_ids_from=template" in f.reason


def expected_turn_ids(prompt: dict) -> list[tuple[list[int], list[int]]]:
    """Per user turn: the (prompt ids, completion ids) the fault server reports for it."""
    conv, out = [], []
    for m in expected_conversation(prompt):
        if m["role"] == "assistant":
            out.append(expected_token_ids(conv))
        conv.append(m)
    return out


def test_server_token_ids_single_and_multi_turn_and_truncation(run_dir, write_config, chat_tokenizer_dir, api_key):
    prompts = make_prompts(run_dir, 15)  # p002, p007, p012: two user turns
    with FaultServer(Faults(seed=4, p_500=0.1), record_bodies=True) as server:
        cfg_path = config(write_config, server, chat_tokenizer_dir, tokenize={"token_ids_from": "server"})
        assert run_stage(load_config(cfg_path)) == 0
    raw, failed = assert_accounted(run_dir, prompts)
    assert failed == []
    assert all(b["return_token_ids"] is True for b in server.stats.bodies)
    # One 1-token preflight checked that the server returns ids before the run.
    assert [b["max_tokens"] for b in server.stats.bodies].count(1) == 1 and server.stats.bodies[0]["max_tokens"] == 1

    # Every turn stores the server's ids, as the server reported them.
    prompt_by_id = {p["id"]: p for p in prompts}
    for row in raw:
        want = expected_turn_ids(prompt_by_id[row["id"]])
        assert [(t["prompt_token_ids"], t["completion_token_ids"]) for t in row["turns"]] == want
    assert sum(len(r["turns"]) == 2 for r in raw) == 3

    # A sample is the last turn's prompt ids (loss 0) + completion ids (loss 1); in a two-turn
    # conversation the first answer is inside that prompt (as the template renders it): loss 0.
    def want_sample(pid):
        p, c = expected_turn_ids(prompt_by_id[pid])[-1]
        return p + c, [0] * len(p) + [1] * len(c)

    samples = rows_of(run_dir / "data" / "train.jsonl") + rows_of(run_dir / "data" / "eval.jsonl")
    assert sorted(s["id"] for s in samples) == sorted(p["id"] for p in prompts)
    for s in samples:
        assert (s["input_ids"], s["loss_mask"]) == want_sample(s["id"])
    two_turn = next(s for s in samples if s["id"] == "p002")
    first_completion = expected_turn_ids(prompt_by_id["p002"])[0][1]
    first_answer_words = first_completion[first_completion.index(7) + 1: -1]  # after </think>, before end of turn
    joined = two_turn["input_ids"]
    at = next(i for i in range(len(joined)) if joined[i:i + len(first_answer_words)] == first_answer_words)
    assert not any(two_turn["loss_mask"][at: at + len(first_answer_words)])
    report = json.loads((run_dir / "data" / "generate_report.json").read_text())
    assert report["tokenize"]["token_ids_from"] == "server" and report["complete"] is True

    # Retokenize with a small max_seq_len (no server needed): truncated, or nothing left to learn.
    max_len = 24
    assert run_stage(load_config(cfg_path, [f"tokenize.max_seq_len={max_len}"])) == 0
    samples = {s["id"]: s for s in rows_of(run_dir / "data" / "train.jsonl") + rows_of(run_dir / "data" / "eval.jsonl")}
    full = {p["id"]: want_sample(p["id"]) for p in prompts}
    prompt_only = {pid for pid, (ids, mask) in full.items() if not any(mask[:max_len])}
    cut = {pid for pid, (ids, _) in full.items() if len(ids) > max_len}
    assert prompt_only and cut - prompt_only  # both cases happen
    assert set(samples) == set(full) - prompt_only
    for pid, s in samples.items():
        ids, mask = full[pid]
        assert s["input_ids"] == ids[:max_len] and s["loss_mask"] == mask[:max_len]
    t = json.loads((run_dir / "data" / "generate_report.json").read_text())["tokenize"]
    assert t["truncated"] == len(cut) and t["skipped"] == {"no_loss_tokens": len(prompt_only)}
    # Drop instead: every overlong sample is gone, counted.
    assert run_stage(load_config(cfg_path, [f"tokenize.max_seq_len={max_len}", "tokenize.overlong=drop"])) == 0
    t = json.loads((run_dir / "data" / "generate_report.json").read_text())["tokenize"]
    assert t["train"] + t["eval"] == len(full) - len(cut) and t["skipped"] == {"dropped_overlong": len(cut)}


def test_server_mode_without_token_ids_fails_clearly(run_dir, write_config, chat_tokenizer_dir, api_key):
    prompts = make_prompts(run_dir, 6, no_ids=(1, 4))
    with FaultServer(Faults(seed=1)) as server:
        cfg_path = config(write_config, server, chat_tokenizer_dir, tokenize={"token_ids_from": "server"})
        assert run_stage(load_config(cfg_path)) == 0
        # A response without ids is a failure with the reason, not retried (retrying cannot help).
        raw, failed = assert_accounted(run_dir, prompts)
        assert sorted(f["id"] for f in failed) == ["p001", "p004"]
        for f in failed:
            assert f["attempts"] == 1 and f["error_type"] == "MissingTokenIds" and MISSING_TOKEN_IDS in f["reason"]
        for i in (1, 4):
            assert server.stats.requests_by_prompt[prompts[i]["messages"][-1]["content"]] == 1
        report = json.loads((run_dir / "data" / "generate_report.json").read_text())
        assert report["this_run"]["failure_reasons"] == {"MissingTokenIds": 2} and report["this_run"]["retries"] == 0

    # A server that never returns ids (vLLM < 0.10): one 1-token preflight request, then a clear error,
    # before --overwrite deletes anything: a refused start keeps the previous outputs.
    previous = (run_dir / "data" / "raw_responses.jsonl").read_bytes()
    with FaultServer(Faults(seed=1), token_ids=False) as old_server:
        with pytest.raises(PipelineError, match="server did not return token ids.*vLLM >= 0.10.*token_ids_from=template"):
            run_stage(load_config(config(write_config, old_server, chat_tokenizer_dir, tokenize={"token_ids_from": "server"})),
                      overwrite=True)
        assert old_server.stats.chat_requests == 1
    assert (run_dir / "data" / "raw_responses.jsonl").read_bytes() == previous

    # Rows generated without ids (template mode) cannot become server samples: said before any request.
    with FaultServer(Faults(seed=1)) as server:
        assert run_stage(load_config(config(write_config, server, chat_tokenizer_dir)), overwrite=True) == 0
        make_prompts(run_dir, 8)  # two new prompts to generate
        requests = server.stats.requests
        cfg_path = config(write_config, server, chat_tokenizer_dir, tokenize={"token_ids_from": "server"})
        with pytest.raises(DataError, match="6 finished row.*have no token ids.*--overwrite"):
            run_stage(load_config(cfg_path))
        assert server.stats.requests == requests
    with pytest.raises(ConfigError, match="token_ids_from' must be one of template, server"):
        run_stage(load_config(cfg_path, ["tokenize.token_ids_from=vllm"]))


def test_kimi_like_target_fails_fast_in_template_mode_and_works_from_server_ids(run_dir, write_config, tmp_path, api_key):
    """Kimi-K2.5: a slow remote-code tokenizer, a template that strips the reasoning it renders.
    Template mode fails before the first request (not after days of generation) and says what
    to do; a tokenizer that needs trust_remote_code fails before any request too; server mode
    works."""
    tok_dir = build_slow_chat_tokenizer(tmp_path / "kimi-tok", KIMI_LIKE_TEMPLATE, KIMI_LIKE_SPECIAL)
    prompts = make_prompts(run_dir, 5)
    with FaultServer(Faults(seed=6)) as server:
        trusted = {"trust_remote_code": True}
        with pytest.raises(DataError, match="does not render assistant reasoning.*set tokenize.token_ids_from=server"):
            run_stage(load_config(config(write_config, server, tok_dir, target=trusted)))
        assert server.stats.requests == 0
        with pytest.raises(DataError, match="cannot load the target tokenizer.*trust_remote_code"):
            run_stage(load_config(config(write_config, server, tok_dir)))
        assert server.stats.requests == 0
        cfg = load_config(config(write_config, server, tok_dir, target=trusted, tokenize={"token_ids_from": "server"}))
        assert run_stage(cfg) == 0
    raw, failed = assert_accounted(run_dir, prompts)
    assert failed == []
    prompt_by_id = {p["id"]: p for p in prompts}
    for s in rows_of(run_dir / "data" / "train.jsonl") + rows_of(run_dir / "data" / "eval.jsonl"):
        p, c = expected_turn_ids(prompt_by_id[s["id"]])[-1]
        assert s["input_ids"] == p + c and s["loss_mask"] == [0] * len(p) + [1] * len(c)


def test_template_that_rewrites_history_fails_fast_only_with_multi_turn_prompts(run_dir, write_config, tmp_path, api_key):
    tok_dir = build_chat_tokenizer(tmp_path / "tok", DROPS_OLD_REASONING_TEMPLATE)
    make_prompts(run_dir, 3)  # p002 has two user turns
    with FaultServer(Faults(seed=2)) as server:
        with pytest.raises(DataError, match="not prefix-stable.*set tokenize.token_ids_from=server"):
            run_stage(load_config(config(write_config, server, tok_dir)))
        assert server.stats.requests == 0
        prompts = make_prompts(run_dir, 2)  # single-turn prompts only: the template is fine
        assert run_stage(load_config(config(write_config, server, tok_dir))) == 0
    assert_accounted(run_dir, prompts)


def test_a_template_without_reasoning_is_not_refused_in_template_mode(run_dir, write_config, tmp_path, api_key):
    """SmolLM2, Llama-3.1, Mistral: no reasoning part in the template, no <think> in the tokenizer; vLLM returns content
    only. 01b probes them without reasoning and generates; with server.reasoning_parser set (the server would return
    reasoning the template cannot render) the probe still refuses, before any request."""
    tok_dir = build_chat_tokenizer(tmp_path / "smollm2-tok", SMOLLM2_TEMPLATE, added=())
    prompts = make_prompts(run_dir, 6)  # p002 has two user turns: the two-turn probe
    with FaultServer(Faults(seed=3, reasoning=False)) as server:
        cfg_path = config(write_config, server, tok_dir)
        res = run_01b(cfg_path, "--set", "server.reasoning_parser=deepseek_r1")
        error_line(res, "does not render assistant reasoning", "set tokenize.token_ids_from=server")
        assert res.returncode == 2 and server.stats.requests == 0 and not (run_dir / "data" / "raw_responses.jsonl").exists()
        assert run_stage(load_config(cfg_path)) == 0
    raw, failed = assert_accounted(run_dir, prompts)
    assert failed == [] and not any("reasoning" in m for r in raw for m in r["messages"])
    samples = rows_of(run_dir / "data" / "train.jsonl") + rows_of(run_dir / "data" / "eval.jsonl")
    assert len(samples) == len(prompts) and all(sum(s["loss_mask"]) > 0 for s in samples)


def with_long_prompts(run_dir: Path, prompts: list[dict], long_ids: set[str]) -> list[dict]:
    """The prompts with the user turns of `long_ids` grown to ~600 tokens."""
    for p in prompts:
        if p["id"] in long_ids:
            p["messages"][-1]["content"] += " and more" * 300
    (run_dir / "data" / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts), encoding="utf-8")
    return prompts


def test_prompts_longer_than_the_server_context_are_left_out_before_any_request(run_dir, write_config, chat_tokenizer_dir,
                                                                                 api_key):
    """ShareGPT has prompts longer than the served context: each would be a 400 (vLLM refuses a prompt of max_model_len
    tokens or more). 01b counts and leaves them out before any request; when nothing is left, one error line."""
    long_ids = {"p001", "p004", "p007"}
    prompts = with_long_prompts(run_dir, make_prompts(run_dir, 10), long_ids)
    with FaultServer(Faults(seed=4)) as server:
        cfg_path = config(write_config, server, chat_tokenizer_dir)
        res = run_01b(cfg_path, "--set", "server.max_model_len=256")
        assert res.returncode == 0, res.stderr[-2000:]
        assert "left out 3 of 10 prompts the server cannot take (over_max_model_len 3; server.max_model_len=256)" in res.stdout
        sent = set(server.stats.requests_by_prompt)
    assert not any("and more and more" in text for text in sent)
    raw, failed = assert_accounted(run_dir, [p for p in prompts if p["id"] not in long_ids])
    assert failed == []
    report = json.loads((run_dir / "data" / "generate_report.json").read_text())
    assert report["skipped_prompts"] == {"over_max_model_len": 3} and report["num_prompts"] == 7 and report["complete"]
    # a server with a larger context: the rerun answers the three it left out, and only them
    with FaultServer(Faults(seed=4)) as server:
        res = run_01b(config(write_config, server, chat_tokenizer_dir), "--set", "server.max_model_len=2048")
        assert res.returncode == 0, res.stderr[-2000:]
        assert server.stats.chat_requests == sum(1 + (p["id"] in ("p007",)) for p in prompts if p["id"] in long_ids)
    assert_accounted(run_dir, prompts)

    # nothing fits: one line naming the limit, no request, nothing written or deleted
    before = {f.name: f.read_bytes() for f in (run_dir / "data").iterdir()}
    with FaultServer(Faults(seed=4)) as server:
        res = run_01b(config(write_config, server, chat_tokenizer_dir, max_tokens=4), "--set", "server.max_model_len=8",
                      "--overwrite")
        assert server.stats.requests == 0
    error_line(res, "all 10 prompts of", "are too long for the server (server.max_model_len=8 tokens",
               "raise server.max_model_len")
    assert res.returncode == 2 and {f.name: f.read_bytes() for f in (run_dir / "data").iterdir()} == before


def test_a_reply_merging_with_the_generation_prompt_is_a_counted_skip(run_dir, write_config, tmp_path):
    """One sample whose first token merges with the generation prompt's last characters (the
    template is fine for others): skipped and counted, not a stop of the whole tokenization."""
    from conftest import PROMPT_ENDS_MID_WORD_TEMPLATE

    from common.core.run_folder import Layout
    from common.data.generate_tokenize import tokenize_outputs

    tok_dir = build_chat_tokenizer(tmp_path / "tok", PROMPT_ENDS_MID_WORD_TEMPLATE)
    cfg = load_config(config(write_config, "http://127.0.0.1:9/v1", tok_dir))
    user = {"role": "user", "content": "What is 12 plus 30?"}
    prompts = [{"id": "ok", "messages": [user], "split": "train"}, {"id": "merges", "messages": [user], "split": "train"}]
    done = {"ok": {"messages": [user, {"role": "assistant", "content": " 42."}]},
            "merges": {"messages": [user, {"role": "assistant", "content": "nswer to turn 1"}]}}
    (run_dir / "data").mkdir()
    counts = tokenize_outputs(cfg, Layout.of(cfg), prompts, done, load_tokenizer(str(tok_dir)))
    assert counts.train == 1 and counts.skipped == {"token_boundary_merge": 1}
    assert [r["id"] for r in rows_of(run_dir / "data" / "train.jsonl")] == ["ok"]


def test_a_moved_tokenizer_is_the_same_tokenizer(run_dir, write_config, chat_tokenizer_dir, api_key, tmp_path, capsys):
    """Issue 33, case 11: 01b recorded the tokenizer (target.model) by path, so the same files at another path
    retokenized everything and rewrote data/. Now it is complete and rewrites nothing; other files retokenize."""
    import shutil

    make_prompts(run_dir, 6)
    with FaultServer(Faults(seed=1)) as server:
        assert run_stage(load_config(config(write_config, server, chat_tokenizer_dir))) == 0
    outputs = [run_dir / "data" / name for name in ("raw_responses.jsonl", "train.jsonl", "eval.jsonl", "generate_report.json")]

    def state() -> list:
        return [(p.read_bytes(), p.stat().st_mtime_ns) for p in outputs]

    before = state()
    moved = shutil.copytree(chat_tokenizer_dir, tmp_path / "elsewhere" / "tokenizer")
    capsys.readouterr()
    assert run_stage(load_config(config(write_config, "http://127.0.0.1:9/v1", moved))) == 0  # no server needed
    assert "already complete" in capsys.readouterr().out
    assert state() == before
    with open(moved / "tokenizer_config.json", "a") as f:
        f.write("\n")  # another file: retokenized (a redo, not an error), still without a server
    assert run_stage(load_config(config(write_config, "http://127.0.0.1:9/v1", moved))) == 0
    assert "already complete" not in capsys.readouterr().out
