"""MT-bench the way it is meant to be run, on the fake vLLM server of test_evaluate.py: turn 2 is the first turn, the
target-alone run's answer to it and the second user turn, on both servers; acceptance per turn and per category,
each category in a window of its own (a fake draft that accepts less on math prompts and on turn 2 tells the windows
apart); the target-alone run, turn 2 included, cached and reused."""

from __future__ import annotations

import contextlib
import json

import pytest

from common.core.config import config_from_dict
from common.core.errors import PipelineError
from common.evaluate import serve
from common.evaluate import stage as evaluate
from tests.evaluate.test_evaluate import run_env, serve_fakes  # noqa: F401 (run_env: a fixture)
from tests.evaluate.test_prompt_sets import with_sets, write_jsonl
from tests.helpers import FakeVllm

MT_BENCH = [  # FastChat's question.jsonl shape: 2 categories x 2 rows of two turns, and a row of one turn
    {"question_id": 101, "category": "writing", "turns": ["Write a poem about rain.", "Now make it shorter."]},
    {"question_id": 102, "category": "writing", "turns": ["Write a letter to a friend.", "Add a postscript."]},
    {"question_id": 103, "category": "math", "turns": ["What is 7 times 8?", "And 9 times 9?"]},
    {"question_id": 104, "category": "math", "turns": ["Is 17 prime?", "Is 21 prime?"]},
    {"question_id": 105, "category": "math", "turns": ["What is 2 + 2?"]},
]
MATH = {row["turns"][0] for row in MT_BENCH if row["category"] == "math"}


class ByTurnAndCategoryVllm(FakeVllm):
    """FakeVllm whose draft gets one token less accepted at position 1 on math prompts and at position 2 on turn 2:
    acceptance length 1.9 (writing) and 1.8 (math) on turn 1, 1.8 and 1.7 on turn 2."""

    def accepted_per_pos(self, body):
        first = next(m["content"] for m in body["messages"] if m["role"] == "user")
        turn_2 = any(m["role"] == "assistant" for m in body["messages"])
        return [5, 3 - (first in MATH), 1 - turn_2]


@pytest.fixture
def mt_env(run_env, tmp_path, monkeypatch):  # noqa: F811 (run_env: the fixture imported above)
    serve_fakes(run_env, monkeypatch,
                lambda speculative: ByTurnAndCategoryVllm(with_draft=speculative is not None, diverge=run_env.diverge))
    run_env.mt_bench = write_jsonl(tmp_path / "mt_bench" / "question.jsonl", MT_BENCH)
    return run_env


def turn_2_requests(server) -> dict[str, list[dict]]:
    """{second user turn: the messages sent} of a server's turn-2 requests (those carrying an answer)."""
    return {body["messages"][-1]["content"]: body["messages"] for body in server.requests
            if any(m["role"] == "assistant" for m in body["messages"])}


def expected_turn_2(row: dict) -> list[dict]:
    """Turn 2 as it must be sent: the first turn, the target-alone answer (FakeVllm: "answer to ..."), the second."""
    first, second = row["turns"]
    return [{"role": "user", "content": first}, {"role": "assistant", "content": f"answer to {first}"},
            {"role": "user", "content": second}]


def counters(drafts: int, accepted_per_pos: list[int]) -> dict:
    return {"num_drafts": drafts, "num_draft_tokens": 3 * drafts, "num_accepted_tokens": sum(accepted_per_pos),
            "num_accepted_tokens_per_pos": accepted_per_pos}


def total(parts: list[dict]) -> dict:
    """The counters of several windows added up."""
    return {key: [sum(v) for v in zip(*(p[key] for p in parts))] if key == "num_accepted_tokens_per_pos" else
            sum(p[key] for p in parts) for key in parts[0]}


def test_turn_2_carries_the_target_alone_answer_and_is_reported_per_turn_and_category(mt_env, capsys):
    # The draft's own turn-1 answer to 101 differs: its turn 2 must still carry the target-alone answer.
    mt_env.diverge = ("Write a poem about rain.",)
    cfg = with_sets(mt_env.cfg, {"mt_bench": str(mt_env.mt_bench)}, num_prompts=5)
    assert evaluate.run_stage(cfg) == 0

    # The target alone first (the draft's turn 2 needs its answers), then the draft: the same turn-2 conversations.
    assert [s["speculative"] is not None for s in mt_env.started] == [False, True]
    alone, with_draft = (s["server"] for s in mt_env.started)
    expected = {row["turns"][1]: expected_turn_2(row) for row in MT_BENCH if len(row["turns"]) == 2}
    assert turn_2_requests(alone) == turn_2_requests(with_draft) == expected

    report = json.loads((mt_env.run / "eval" / "report.json").read_text())
    part = report["prompt_sets"]["mt_bench"]
    # turn 1, its numbers where they were: 2 writing requests (5+3+1 accepted of 10 drafts), 3 math (5+2+1)
    assert part["num_prompts"] == 5 and part["counters"] == counters(50, [25, 12, 5])
    assert part["acceptance_length"] == pytest.approx(1.84) and part["outputs"]["identical"] == 4
    cats = part["categories"]
    assert list(cats) == ["writing", "math"]
    assert cats["writing"]["turn_1"] == {"num_prompts": 2, "acceptance_length": pytest.approx(1.9),
                                         "per_position_acceptance": pytest.approx([0.5, 0.3, 0.1]), "counters": counters(20, [10, 6, 2])}
    assert cats["math"]["turn_1"]["counters"] == counters(30, [15, 6, 3]) and cats["math"]["turn_1"]["num_prompts"] == 3
    # turn 2: the four rows of two turns (105 has one), 5+3+0 (writing) and 5+2+0 (math)
    turn_2 = part["turn_2"]
    assert turn_2["num_prompts"] == 4 and "left_out" not in turn_2 and "throughput" not in turn_2
    assert turn_2["counters"] == counters(40, [20, 10, 0]) and turn_2["acceptance_length"] == pytest.approx(1.75)
    assert turn_2["outputs"]["identical"] == turn_2["outputs"]["compared"] == 4
    assert cats["writing"]["turn_2"]["counters"] == counters(20, [10, 6, 0])
    assert cats["math"]["turn_2"] == {"num_prompts": 2, "acceptance_length": pytest.approx(1.7),
                                      "per_position_acceptance": pytest.approx([0.5, 0.2, 0.0]), "counters": counters(20, [10, 4, 0])}
    # each turn's set numbers are its categories' windows added up
    assert total([c["turn_1"]["counters"] for c in cats.values()]) == part["counters"]
    assert total([c["turn_2"]["counters"] for c in cats.values()]) == turn_2["counters"]
    # the held-out prompts (no turns, no categories; 5 with num_prompts 5) as before
    assert "turn_2" not in report and "categories" not in report and report["counters"] == counters(50, [25, 15, 5])

    rows = {r["id"]: r for r in map(json.loads, (mt_env.run / "eval" / "outputs-mt_bench.jsonl").read_text().splitlines())}
    assert "turn_2" not in rows["105"]
    assert rows["101"]["turn_2"]["messages"] == expected["Now make it shorter."] and rows["101"]["turn_2"]["identical"]
    assert rows["101"]["with_draft"]["content"].endswith("(diverged)") and not rows["101"]["identical"]

    out = capsys.readouterr().out
    for line in ("prompt set mt_bench (5 prompts): acceptance length 1.84 (k=3) | per-position 0.50/0.24/0.10",
                 "prompt set mt_bench turn 2 (4 prompts): acceptance length 1.75 (k=3) | per-position 0.50/0.25/0.00 | "
                 "4/4 outputs identical",
                 "prompt set mt_bench per category, acceptance length turn 1/turn 2: writing 1.90/1.80, math 1.80/1.70"):
        assert f"05_evaluate: {line}" in out

    # The baseline cache holds turn 2; a new draft reuses it: no target-alone server, the same turn-2 conversations.
    cached = json.loads((mt_env.run / "eval" / "baseline-mt_bench.json").read_text())
    assert [p["messages"] for p in cached["turn_2"]["prompts"]] == list(expected.values())
    assert sorted(cached["turn_2"]["run"]["outputs"]) == ["101", "102", "103", "104"]
    (mt_env.final / "model.safetensors").write_bytes(b"fake weights v2")
    n = len(mt_env.started)
    assert evaluate.run_stage(cfg) == 0
    assert [s["speculative"] is not None for s in mt_env.started[n:]] == [True]
    assert turn_2_requests(mt_env.started[n]["server"]) == expected


def test_a_turn_2_too_long_with_the_answer_is_left_out_and_the_cached_baseline_is_reused(mt_env, monkeypatch, capsys):
    """A first turn the server takes whose turn 2 (with the answer) it would not: left out of turn 2, counted. The
    target-alone run on run_pipeline's server (--baseline-only) caches turn 2; 05 then starts only the draft's server.
    A cached baseline without turn 2 is measured again; --overwrite keeps the previous outputs until the draft's
    server answered, then writes the target-alone run it measured first."""
    long_first = "Summarise this: " + "and more " * 30  # ~170 tokens; with FakeVllm's echo of it, ~340
    rows = [{"question_id": 1, "category": "reading", "turns": [long_first, "Shorter."]}, *MT_BENCH[2:]]
    tree = with_sets(mt_env.cfg, {"mt_bench": str(write_jsonl(mt_env.run.parent / "long.jsonl", rows))}).to_dict()
    cfg = config_from_dict({**tree, "server": {**tree["server"], "max_model_len": 256}})
    with FakeVllm(with_draft=False) as server:
        assert evaluate.run_stage(cfg, baseline_only=True, base_url=server.base_url) == 0
        assert set(turn_2_requests(server)) == {"And 9 times 9?", "Is 21 prime?"}
    assert "mt_bench prompts) 4 prompts" in capsys.readouterr().out
    assert evaluate.missing_baselines(cfg) == []
    assert evaluate.run_stage(cfg) == 0
    assert [s["speculative"] is not None for s in mt_env.started] == [True]  # the cached target-alone runs reused
    part = json.loads((mt_env.run / "eval" / "report.json").read_text())["prompt_sets"]["mt_bench"]
    assert part["num_prompts"] == 4 and part["turn_2"]["num_prompts"] == 2
    assert part["turn_2"]["left_out"] == {"over_max_model_len": 1}
    assert part["categories"]["reading"] == {"turn_1": {"num_prompts": 1, "acceptance_length": pytest.approx(1.9),
                                                        "per_position_acceptance": pytest.approx([0.5, 0.3, 0.1]),
                                                        "counters": counters(10, [5, 3, 1])}}  # no turn 2 left
    out = capsys.readouterr().out
    assert "05_evaluate: prompt set mt_bench turn 2 (2 prompts, 1 left out: over_max_model_len 1): acceptance length 1.70" in out
    assert "05_evaluate: prompt set mt_bench per category, acceptance length turn 1/turn 2: reading 1.90/-, math 1.80/1.70" in out

    # A baseline cached before turn 2 was measured (the same key, no turn_2) is not reused.
    path = mt_env.run / "eval" / "baseline-mt_bench.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in doc.items() if k != "turn_2"}))
    assert evaluate.missing_baselines(cfg) == ["mt_bench"]
    assert evaluate.cached_baseline(cfg) is not None  # the held-out one has no turn 2 to miss

    # --overwrite: the target alone first; a draft server that does not start leaves every previous output as it was.
    before = {p.name: p.read_bytes() for p in sorted((mt_env.run / "eval").iterdir()) if p.is_file()}
    started_ok = serve.target_server

    @contextlib.contextmanager
    def draft_server_fails(cfg_, speculative=None, log_path=None):
        if speculative:
            raise PipelineError("the vLLM server exited with code 1 while starting; see its log")
        with started_ok(cfg_, speculative, log_path) as server:
            yield server

    with monkeypatch.context() as m:
        m.setattr(serve, "target_server", draft_server_fails)
        with pytest.raises(PipelineError, match="while starting"):
            evaluate.run_stage(cfg, overwrite=True)
    assert {p.name: p.read_bytes() for p in sorted((mt_env.run / "eval").iterdir()) if p.is_file()} == before
    n = len(mt_env.started)
    assert evaluate.run_stage(cfg, overwrite=True) == 0
    assert [s["speculative"] is not None for s in mt_env.started[n:]] == [False, True]
    assert evaluate.missing_baselines(cfg) == []  # written once the draft's server answered
    assert json.loads(path.read_text())["turn_2"]["left_out"] == {"over_max_model_len": 1}


def test_a_category_window_without_drafts_has_no_acceptance_length_and_is_no_error():
    """Every answer of a category a token long: no drafts in its window, so no acceptance length (its set's windows
    together still have drafts); the category line shows "-"."""
    from common.evaluate.report import category_lines

    empty = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "num_accepted_tokens_per_pos": {}}
    numbers = serve.category_acceptance(empty, 3)
    assert numbers == {"acceptance_length": None, "per_position_acceptance": None, "counters": counters(0, [0, 0, 0])}
    full = {"num_drafts": 10.0, "num_draft_tokens": 30.0, "num_accepted_tokens": 9.0, "num_accepted_tokens_per_pos": {0: 5.0, 1: 3.0, 2: 1.0}}
    assert serve.acceptance_metrics(serve.summed([empty, full]), 3)["acceptance_length"] == pytest.approx(1.9)
    assert category_lines("mt_bench", {"coding": {"turn_1": numbers}, "math": {"turn_1": serve.category_acceptance(full, 3)}}) == [
        "prompt set mt_bench per category, acceptance length: coding -, math 1.90"]
