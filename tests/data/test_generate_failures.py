"""01b failures: 401/403 stop the run at once; every request failing (5xx, non-JSON, empty choices,
timeouts) or too many failing is an error; prompts 01 would drop are counted skips."""

from __future__ import annotations

import json

import pytest

from common.core.run_folder import Layout, read_manifest
from tests.fault_server import Faults, FaultServer
from tests.helpers import error_line, run_stage, stage_env


# ============================================================================ 01b: failures
@pytest.fixture
def gen(run_dir, write_config, chat_tokenizer_dir):
    """(make a config for a server, run 01b on it) with the test API key."""
    from tests.data.test_generate import SECRET, config

    def make(server, **generate):
        return config(write_config, server, chat_tokenizer_dir, **generate)

    def run(cfg):
        return run_stage("01b_generate_synthetic.py", cfg, env=stage_env(EAGLE3_TEST_API_KEY=SECRET), timeout=300)

    return make, run


@pytest.mark.parametrize("status", [401, 403])
def test_01b_auth_error_stops_the_run_at_once(run_dir, gen, status):
    """A 401/403 on chat stops the run after the requests already in flight: one error line naming the
    key's variable, nothing recorded as failed (not one row per prompt), no train.jsonl, the error in the report."""
    from tests.data.test_generate import make_prompts

    make, run = gen
    make_prompts(run_dir, 40)
    with FaultServer(Faults(chat_status=status)) as server:
        res = run(make(server, concurrency=4))
        assert server.stats.chat_requests <= 4  # the requests already in flight, no more
    error_line(res, f"refused a chat request with {status}", "EAGLE3_TEST_API_KEY", "recorded no prompt as failed")
    assert not (run_dir / "data" / "failed.jsonl").read_text().strip()
    assert not (run_dir / "data" / "train.jsonl").exists()
    report = json.loads((run_dir / "data" / "generate_report.json").read_text())
    assert report["complete"] is False and str(status) in report["error"]


@pytest.mark.parametrize("status, advice", [(401, "EAGLE3_TEST_API_KEY"), (400, "chat template")])
def test_01b_overwrite_checks_chat_before_it_deletes_the_previous_outputs(run_dir, gen, status, advice):
    """A server that lists models but refuses every chat request (a proxy that lets GET /models through without a
    key: 401; a served model without a chat template: 400): 01b --overwrite finds out with one 1-token request
    before it deletes anything, says why in one line, and the previous outputs stay byte for byte."""
    from tests.data.test_generate import SECRET, make_prompts

    make, run = gen
    make_prompts(run_dir, 6)
    with FaultServer(Faults()) as server:
        assert run(make(server)).returncode == 0
    data = run_dir / "data"
    before = {p.name: p.read_bytes() for p in data.iterdir() if p.is_file()}
    assert {"raw_responses.jsonl", "train.jsonl"} <= set(before)
    with FaultServer(Faults(chat_status=status)) as server:
        res = run_stage("01b_generate_synthetic.py", make(server), "--overwrite",
                        env=stage_env(EAGLE3_TEST_API_KEY=SECRET), timeout=300)
        assert server.stats.chat_requests == 1
    error_line(res, f"refused a 1-token chat request with {status}", advice, "nothing was generated or deleted")
    assert {p.name: p.read_bytes() for p in data.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("faults, cause", [
    (Faults(p_503=1.0), "503 x12"),
    (Faults(p_non_json=1.0), "MalformedResponse x12"),
    (Faults(p_empty_choices=1.0), "MalformedResponse x12"),
    (Faults(p_hang=1.0, hang_s=5.0), "TimeoutError x12"),
], ids=["5xx", "non-json", "empty-choices", "timeouts"])
def test_01b_every_request_failing_is_an_error(run_dir, gen, faults, cause):
    """Every request failing (5xx, non-JSON, empty choices, timeouts) is one error line with the cause
    counted, no train.jsonl, and the same error in generate_report.json (not exit 0 with an empty train.jsonl)."""
    from tests.data.test_generate import make_prompts

    make, run = gen
    make_prompts(run_dir, 12)
    with FaultServer(faults) as server:
        res = run(make(server, max_retries=1, timeout_s=0.5, concurrency=12))
    line = error_line(res, "no prompt got an answer: all 12 of 12 failed every retry", "failed.jsonl")
    assert cause in line
    assert not (run_dir / "data" / "train.jsonl").exists()
    assert json.loads((run_dir / "data" / "generate_report.json").read_text())["error"] == line[len("error: "):]


@pytest.mark.slow  # ~40 s: two 01b subprocesses with retries
def test_01b_failure_share_over_the_limit_is_an_error(run_dir, gen):
    from tests.data.test_generate import make_prompts

    make, run = gen
    make_prompts(run_dir, 20, always_fail=(3, 7, 11))  # 15% fail every retry
    with FaultServer(Faults()) as server:
        error_line(run(make(server, max_retries=0, max_failure_fraction=0.1)),
                   "3 of 20 prompts (15%) failed every retry, more than generate.max_failure_fraction=0.1 (503 x3)")
        assert not (run_dir / "data" / "train.jsonl").exists()
        res = run(make(server, max_retries=0, max_failure_fraction=0.2))  # within the limit: samples, a partial stage
        assert res.returncode == 0, res.stderr[-2000:]
    assert len((run_dir / "data" / "failed.jsonl").read_text().splitlines()) == 3
    assert read_manifest(Layout(run_dir), "01b_generate_synthetic")["state"] == "running"


@pytest.mark.slow  # ~40 s: five 01b subprocesses
def test_01b_never_mixes_two_generations(run_dir, gen):
    """Changed sampling settings with finished rows: an error, not a data set of two generations;
    changed tokenization: retokenized; new prompts: generated."""
    from tests.data.test_generate import make_prompts

    make, run = gen
    make_prompts(run_dir, 6)
    with FaultServer(Faults()) as server:
        assert run(make(server)).returncode == 0
        error_line(run(make(server, temperature=0.2)), '"temperature": 0.6', '"temperature": 0.2', "--overwrite")
        make_prompts(run_dir, 8)
        res = run(make(server))
        assert res.returncode == 0 and "2 generated" in res.stdout, res.stdout
    assert "already complete" in run(make(server)).stdout  # the server is gone: nothing left to ask it


def test_01b_skips_prompts_stage_01_would_drop(run_dir, gen):
    """Prompt rows stage 01 would drop (a message without "role", an unknown role, only empty or no user
    turns) are never sent and are counted in the report by 01's reason; no traceback."""
    make, run = gen
    rows = [
        {"id": "ok", "messages": [{"role": "user", "content": "What is 2 plus 2?"}]},
        {"id": "no-role", "messages": [{"content": "hello"}]},
        {"id": "empty", "messages": [{"role": "user", "content": "   "}]},
        {"id": "system-only", "messages": [{"role": "system", "content": "be brief"}]},
        {"id": "bad-role", "messages": [{"role": "wizard", "content": "hi"}]},
    ]
    (run_dir / "data").mkdir(parents=True)
    (run_dir / "data" / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with FaultServer(Faults()) as server:
        res = run(make(server))
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert server.stats.chat_requests == 1 and list(server.stats.requests_by_prompt) == ["What is 2 plus 2?"]
    report = json.loads((run_dir / "data" / "generate_report.json").read_text())
    assert report["skipped_prompts"] == {"bad_fields": 2, "empty": 1, "no_user_turn": 1} and report["num_done"] == 1
