"""05's built long-context set (evaluate.prompt_sets.NAME: {built: long_context}): held-out documents pasted before a
question, in buckets of prompt length up to the target's context, measured per bucket (report.json and the plot).
On the fake vLLM server of test_evaluate.py; the target is a config and the tiny chat tokenizer."""

from __future__ import annotations

import json

import pytest

from common.core.config import config_from_dict
from common.core.errors import ConfigError
from common.evaluate import stage as evaluate
from common.evaluate.built_sets import context_limit
from common.evaluate.prompt_sets import context_check, load_prompt_set
from tests.evaluate.test_evaluate import run_env, serve_fakes  # noqa: F401 (run_env: a fixture)
from tests.helpers import FakeVllm

ANSWER = "The target's own answer about {} walks through it slowly: first the idea, then an example, then a check."


def long_context_env(run_env, positions: int = 1024, **spec):
    """run_env with a target of `positions` positions, 01b's answers for the eval split, and a long-context set."""
    target = run_env.cfg.target.model
    with open(f"{target}/config.json", "w") as f:
        json.dump({"model_type": "llama", "max_position_embeddings": positions}, f)
    rows = [json.loads(line) for line in (run_env.run / "data" / "prompts.jsonl").read_text().splitlines()]
    with open(run_env.run / "data" / "raw_responses.jsonl", "w") as f:
        for r in rows:  # 01b's rows: the conversation with the target's answer (train rows too: never pasted)
            answer = ANSWER.format(r["messages"][1]["content"])
            f.write(json.dumps({"id": r["id"], "messages": [*r["messages"][:2], {"role": "assistant", "content": answer}],
                                "content": answer}) + "\n")
    tree = run_env.cfg.to_dict()
    return config_from_dict({**tree, "evaluate": {**tree["evaluate"], "prompt_sets": {"long": {"built": "long_context", **spec}}}})


def test_buckets_reach_the_target_context_less_the_answer_and_hold_prompts_of_their_length(run_env):
    cfg = long_context_env(run_env, positions=1024, prompts_per_bucket=3)
    assert context_limit(cfg)[0] == 1024 - 64  # evaluate.max_tokens 64 left for the answer; server.max_model_len 4096
    s = load_prompt_set(cfg, "long")
    assert s.buckets == {"<=512 tokens": 512, "<=960 tokens": 960}
    check = context_check(cfg)
    for label, low, bound in (("<=512 tokens", 0, 512), ("<=960 tokens", 512, 960)):
        prompts = [p for p in s.prompts if p["category"] == label]
        assert len(prompts) == 3
        for p in prompts:
            assert check.length(p["messages"]) == p["prompt_tokens"]  # as the server renders it
            assert low < p["prompt_tokens"] <= bound and p["prompt_tokens"] >= bound - (bound - low) // 8, p["prompt_tokens"]
    texts = [p["messages"][-1]["content"] for p in s.prompts]
    assert len(set(texts)) == len(texts)  # each prompt its own document start or question
    joined = "\n".join(texts)
    # the documents are the eval split's conversations with the target's answers; nothing of the training split
    assert "question 3" in joined and ANSWER.format("question 3")[:40] in joined
    for i in range(0, 12, 2):
        assert f"question {i}\n" not in joined and ANSWER.format(f"question {i}") not in joined
    assert s.built["limit_tokens"] == 960 and "max_position_embeddings 1024" in s.built["limit"]


def test_buckets_beyond_the_context_are_one_config_error_and_bad_specs_fail_at_load(run_env):
    cfg = long_context_env(run_env, positions=1024, buckets=[512, 1000])
    with pytest.raises(ConfigError) as e:
        load_prompt_set(cfg, "long")
    assert str(e.value) == ("config key 'evaluate.prompt_sets.long.buckets': 1000 tokens leave no room for the answer: at "
                            "most 960 (the target's max_position_embeddings 1024 less evaluate.max_tokens 64); lower the "
                            "bucket, or raise server.max_model_len where the target has the positions")
    tree = run_env.cfg.to_dict()
    for spec, said in (({"built": "long_context", "buckets": [1024, 512]}, "must be increasing prompt lengths"),
                       ({"built": "long_contexts"}, "'evaluate.prompt_sets.x.built' must be one of long_context, system_prompts"),
                       ({"built": "system_prompts", "buckets": [512]}, "a built system_prompts set takes built, got buckets")):
        with pytest.raises(ConfigError, match=said):
            config_from_dict({**tree, "evaluate": {**tree["evaluate"], "prompt_sets": {"x": spec}}})


class LongerIsHarderVllm(FakeVllm):
    """FakeVllm whose draft does worse on long prompts: 5+3+1 of 30 draft tokens under 1000 characters, 2+1+0 above (the test tokenizer: about 1.5 characters a token)."""

    def accepted_per_pos(self, body):
        return [5, 3, 1] if len(body["messages"][-1]["content"]) < 1000 else [2, 1, 0]


def test_05_reports_acceptance_per_bucket_in_report_json_and_the_plot(run_env, monkeypatch):
    cfg = long_context_env(run_env, positions=1024, prompts_per_bucket=2)

    serve_fakes(run_env, monkeypatch, lambda speculative: LongerIsHarderVllm(with_draft=speculative is not None))
    assert evaluate.run_stage(cfg) == 0
    report = json.loads((run_env.run / "eval" / "report.json").read_text())
    part = report["prompt_sets"]["long"]
    short, long = part["buckets"]["<=512 tokens"], part["buckets"]["<=960 tokens"]
    assert short["max_prompt_tokens"] == 512 and long["max_prompt_tokens"] == 960
    assert short["num_prompts"] == long["num_prompts"] == 2
    assert 448 <= short["prompt_tokens"][0] <= short["prompt_tokens"][1] <= 512
    assert 905 <= long["prompt_tokens"][0] <= long["prompt_tokens"][1] <= 960
    # each bucket measured in its own window of vLLM's counters: 10 drafts per request
    assert short["acceptance_length"] == pytest.approx(1.9) and short["per_position_acceptance"] == pytest.approx([0.5, 0.3, 0.1])
    assert long["acceptance_length"] == pytest.approx(1.3) and long["per_position_acceptance"] == pytest.approx([0.2, 0.1, 0.0])
    assert part["acceptance_length"] == pytest.approx(1.6)  # the set: both windows together
    assert report["acceptance_length_by_bucket"] == {"long": {"<=512 tokens": pytest.approx(1.9), "<=960 tokens": pytest.approx(1.3)}}
    assert report["acceptance_length_by_set"] == {"held_out": pytest.approx(1.9), "long": pytest.approx(1.6)}
    assert part["built"]["kind"] == "long_context"
    assert (run_env.run / "eval" / "report.png").stat().st_size > 20_000
