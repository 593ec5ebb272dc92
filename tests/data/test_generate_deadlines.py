"""Every HTTP call 01b makes has a total deadline, generate.timeout_s. Against a server
that sends its answers one byte a second (tests/fault_server.py, Faults.drip_s), each start-up call
(GET /v1/models, POST /tokenize, GET /metrics) and each chat request ends at its deadline with the outcome
its failure has: none waited for the server to finish a dripped answer (stats.faults["drip_done"] stays 0;
not a wall-clock bound, which the machine's load would decide; tests/serving/test_http_deadlines.py checks
in virtual time that a call ends exactly at its deadline). And the --overwrite audit of 01b: a refused start
deletes nothing."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from common.core.config import load_config
from common.core.errors import DataError, PipelineError
from common.core.run_folder import Layout, read_manifest
from common.data.generate import run_stage
from common.target.tokenization import load_tokenizer
from tests.data.test_generate import config, make_prompts, rows_of, run_01b
from tests.fault_server import METRICS_KV_TOKENS, Faults, FaultServer
from tests.helpers import error_line

TIMEOUT_S = 3.0
ONE_BYTE_A_SECOND = 1.0  # a dripping server: without a total deadline, any of its answers takes minutes


def tokenize_fn(tokenizer_dir: Path):
    tok = load_tokenizer(str(tokenizer_dir))
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def run_outcome(cfg_path: Path) -> object:
    """run_stage's exit code, or the PipelineError it raised."""
    try:
        return run_stage(load_config(cfg_path))
    except PipelineError as e:
        return e


@pytest.mark.parametrize("path", ["/v1/models", "/tokenize", "/metrics", "/v1/chat/completions"])
def test_01b_every_call_ends_at_its_deadline_against_a_one_byte_a_second_server(
        run_dir, write_config, chat_tokenizer_dir, capsys, path):
    prompts = make_prompts(run_dir, 2)
    faults = Faults(drip_s=ONE_BYTE_A_SECOND, drip_paths=(path,))
    with FaultServer(faults, tokenize_fn=tokenize_fn(chat_tokenizer_dir)) as server:
        cfg = config(write_config, server, chat_tokenizer_dir, timeout_s=TIMEOUT_S, max_retries=0, concurrency=2)
        outcome = run_outcome(cfg)
        assert server.stats.faults["drip"] >= 1
        assert server.stats.faults["drip_done"] == 0, path  # every call ended by its deadline, not the server's
    out = capsys.readouterr().out
    raw, failed = rows_of(run_dir / "data" / "raw_responses.jsonl"), rows_of(run_dir / "data" / "failed.jsonl")
    if path == "/v1/models":  # the first call: a one-line refusal before any chat request
        assert isinstance(outcome, PipelineError) and str(outcome).startswith(
            f"the server at {server.base_url} did not answer GET /models in full within 3s"), outcome
        assert server.stats.chat_requests == 0 and not (run_dir / "data" / "raw_responses.jsonl").exists()
        return
    if path == "/v1/chat/completions":  # each request a retryable timeout; none answered: the run fails
        assert isinstance(outcome, PipelineError) and str(outcome).startswith(
            "no prompt got an answer: all 2 of 2 failed every retry (TimeoutError x2)"), outcome
        assert raw == [] and sorted(f["id"] for f in failed) == [p["id"] for p in prompts]
        assert all(f["error_type"] == "TimeoutError" and "generate.timeout_s" in f["reason"] for f in failed)
        return
    # /tokenize and /metrics are checks 01b does without: it goes on and generates everything
    assert outcome == 0 and failed == [] and sorted(r["id"] for r in raw) == [p["id"] for p in prompts]
    report = json.loads((run_dir / "data" / "generate_report.json").read_text())
    kv_line = f"the server's KV cache holds {METRICS_KV_TOKENS:,} tokens"
    if path == "/tokenize":
        assert report["tokenizer_check"] == "unchecked (APITimeoutError on /tokenize)" and kv_line in out
    else:
        assert report["tokenizer_check"] == "match" and kv_line not in out


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_01b_overwrite_refused_at_start_deletes_nothing(run_dir, write_config, chat_tokenizer_dir):
    """Every refusal of 01b's start (an unreachable server, a model it does not serve, a server too slow
    to list its models, a tokenizer other than the served model's) comes before --overwrite deletes the
    previous outputs: they stay byte-identical, and the stage's record still says complete."""
    make_prompts(run_dir, 3)
    with FaultServer(Faults()) as server:
        assert run_stage(load_config(config(write_config, server, chat_tokenizer_dir))) == 0
    before = snapshot(run_dir / "data")
    assert {"raw_responses.jsonl", "train.jsonl", "eval.jsonl", "generate_report.json"} <= set(before)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nothing_listens = f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # once closed
    # the stage as a user runs it: exit 2, one error line
    error_line(run_01b(config(write_config, nothing_listens, chat_tokenizer_dir), "--overwrite"),
               f"cannot reach the generation server at {nothing_listens}")
    assert snapshot(run_dir / "data") == before
    # the other refusals in-process (the same run_stage, seconds faster)
    ours = tokenize_fn(chat_tokenizer_dir)
    refusals = [
        (Faults(), None, {"model": "other"}, PipelineError, "generate.model 'other' is not served"),
        (Faults(drip_s=ONE_BYTE_A_SECOND, drip_paths=("/v1/models",)), None, {"timeout_s": TIMEOUT_S}, PipelineError,
         "did not answer GET /models in full within 3s"),
        (Faults(), lambda text: [t + 1 for t in ours(text)], {}, DataError, "does not match the served model"),
    ]
    for faults, tokenize, generate, error, message in refusals:
        with FaultServer(faults, tokenize_fn=tokenize) as server:
            with pytest.raises(error, match=message):
                run_stage(load_config(config(write_config, server, chat_tokenizer_dir, **generate)), overwrite=True)
            assert server.stats.chat_requests == 0
        assert snapshot(run_dir / "data") == before, message
    assert read_manifest(Layout(run_dir), "01b_generate_synthetic")["state"] == "complete"
