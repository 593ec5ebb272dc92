"""05's built system-prompt set (evaluate.prompt_sets.NAME: {built: system_prompts}): the held-out prompts under
system prompts the training data never had, measured beside the held-out set. On the fake vLLM server of
test_evaluate.py."""

from __future__ import annotations

import json

from common.core.config import config_from_dict
from common.core.run_folder import HELD_OUT
from common.evaluate import stage as evaluate
from common.evaluate.built_sets import SYSTEM_PROMPTS
from common.evaluate.prompt_sets import load_prompt_set
from tests.evaluate.test_evaluate import run_env  # noqa: F401 (a fixture)


def test_held_out_questions_under_system_prompts_the_training_split_never_had(run_env, capsys):
    prompts_file = run_env.run / "data" / "prompts.jsonl"
    rows = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    rows[0]["messages"][0]["content"] = SYSTEM_PROMPTS[0]  # p0, a training row, has the list's first system prompt
    prompts_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tree = run_env.cfg.to_dict()
    cfg = config_from_dict({**tree, "evaluate": {**tree["evaluate"], "prompt_sets": {"sys": {"built": "system_prompts"}}}})

    s = load_prompt_set(cfg, "sys")
    held_out = load_prompt_set(cfg, HELD_OUT)
    trained = {m["content"] for r in rows if r["split"] == "train" for m in r["messages"] if m["role"] == "system"}
    assert trained == {"be brief", SYSTEM_PROMPTS[0]}
    # the held-out questions, in order, each under the next unseen system prompt (the one the training split has: left out)
    assert [p["id"] for p in s.prompts] == [f"sys-{p['id']}" for p in held_out.prompts]
    assert [p["messages"][1:] for p in s.prompts] == [[m for m in p["messages"] if m["role"] == "user"] for p in held_out.prompts]
    systems = [p["messages"][0] for p in s.prompts]
    assert systems == [{"role": "system", "content": SYSTEM_PROMPTS[i]} for i in (1, 2, 3, 4)]
    assert not {m["content"] for m in systems} & trained
    assert s.built == {"kind": "system_prompts", "system_prompts": len(SYSTEM_PROMPTS) - 1,
                       "system_prompts_in_training_left_out": 1}

    assert evaluate.run_stage(cfg) == 0
    report = json.loads((run_env.run / "eval" / "report.json").read_text())
    part = report["prompt_sets"]["sys"]
    assert part["num_prompts"] == 4 and part["acceptance_length"] == 1.9 and part["built"]["kind"] == "system_prompts"
    assert report["acceptance_length_by_set"] == {"held_out": 1.9, "sys": 1.9}
    sent = [b["messages"] for b in run_env.started[0]["server"].requests if b["messages"][0]["content"] in SYSTEM_PROMPTS]
    assert len(sent) == 4  # with the draft: each prompt once, under its system prompt
    assert "prompt set sys (4 prompts): acceptance length 1.90" in capsys.readouterr().out
