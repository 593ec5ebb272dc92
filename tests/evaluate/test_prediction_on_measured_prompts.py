"""04's prediction on exactly the prompts 05 measured. 04's replay covers every eval sample and every assistant turn;
05 sends the first evaluate.num_prompts held-out prompts, first turn only. 04 keeps each eval sample's first-turn
replay counts (prediction.json: eval.replay_first_turn) and 05 sums those of its own prompts; report.json labels both
predictions and both errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.core.errors import DataError
from common.evaluate import stage as evaluate
from common.evaluate.draft import offline_prediction
from common.model.acceptance import ReplayTotals, replay_sample
from common.train.offline_eval import FirstTurnReplay, first_turn_mask
from tests.evaluate.test_evaluate import prediction_of, run_env  # noqa: F401 (run_env: a fixture)


def test_the_first_turn_table_is_each_samples_first_answer_and_the_totals_are_unchanged():
    rng = np.random.default_rng(0)
    # two samples back to back: a two-turn one (prompt, answer, user turn, answer) and a one-turn one
    mask_a = [0] * 4 + [1] * 30 + [0] * 5 + [1] * 25
    mask_b = [0] * 6 + [1] * 40
    mask = np.array(mask_a + mask_b, dtype=bool)
    hits = rng.random((3, len(mask))) < 0.7
    totals, table = ReplayTotals(3, max_new_tokens=20), FirstTurnReplay(3, [7, 9], 20)
    table.add_packed_row(totals, [9, 7], hits, mask, [len(mask_a), len(mask_b)])  # eval samples 9 then 7
    reference = ReplayTotals(3, max_new_tokens=20)
    reference.add_packed_row(hits, mask, [len(mask_a), len(mask_b)])
    assert totals.report() == reference.report()  # the eval split's replay, as before

    report = table.report(["ev-7", "ev-9"])
    assert report["sample_ids"] == ["ev-7", "ev-9"]
    first_a = np.array([0] * 4 + [1] * 30 + [0] * 30, dtype=bool)
    assert first_turn_mask(np.array(mask_a, dtype=bool)).tolist() == first_a.tolist()
    for k in (1, 2, 3):
        a = replay_sample(hits[:, :len(mask_a)], first_a, k, 20)
        b = replay_sample(hits[:, len(mask_a):], np.array(mask_b, dtype=bool), k, 20)
        # row 0 is sample 7 (the one-turn one, packed second), row 1 sample 9 (its first answer only)
        assert report["counts"][str(k)] == [[b.rounds, *b.accepted_per_pos], [a.rounds, *a.accepted_per_pos]]
        assert a.rounds < replay_sample(hits[:, :len(mask_a)], np.array(mask_a, dtype=bool), k, 20).rounds


def test_04s_eval_keeps_a_first_turn_row_per_eval_sample(hidden_run, tmp_path, one_torch_thread):
    """The real eval (an exported random draft on the fixture run's hidden states): one row per eval sample, in the
    eval split's order; its samples are one-turn, so the rows add up to the eval split's replay exactly."""
    from common.core.config import load_config
    from common.hidden.shards import HiddenIndex
    from common.core.run_folder import Layout
    from common.train.offline_eval import evaluate_export
    from tests.evaluate.test_prompt_sets import random_draft
    from tests.helpers import clone_run

    cfg = load_config(clone_run(hidden_run, tmp_path))
    report = evaluate_export(random_draft(cfg.target.model, tmp_path / "draft", seed=0), cfg)
    index = HiddenIndex.load(Layout.of(cfg).hidden_index)
    first = report["replay_first_turn"]
    assert first["sample_ids"] == [index.samples[i].sample_id for i in index.split_indices("eval")]
    for k, replay in report["replay"].items():
        rows = np.array(first["counts"][k])
        assert rows.shape == (len(first["sample_ids"]), int(k) + 1)
        assert [int(x) for x in rows.sum(axis=0)] == [replay["rounds"], *replay["accepted_per_pos"]]
        assert (rows[:, 0] > 0).all()  # every sample has generated tokens: at least one round


FIRST_TURN = {"sample_ids": ["p1", "p3", "p5", "p9", "p11"],  # p7 is not in 04's eval (01b failed it, say)
              "counts": {"3": [[10, 8, 6, 4], [20, 10, 5, 0], [10, 6, 1, 0], [50, 50, 50, 50], [7, 0, 0, 0]]}}


def test_05_reports_the_prediction_on_its_own_prompts_beside_the_eval_splits(run_env, capsys):
    eval_line = {"type": "eval", "step": 40, "loss": 1.0, "step_acc": [0.6, 0.5, 0.4], "tau": {"3": 2.02},
                 "replay": {"3": {"acceptance_length": 2.2, "per_position": [0.6, 0.4, 0.2], "rounds": 97,
                                  "accepted_per_pos": [70, 67, 55]}},
                 "replay_first_turn": FIRST_TURN}
    (run_env.final / "prediction.json").write_text(json.dumps(prediction_of(eval_line)))
    assert evaluate.run_stage(run_env.cfg) == 0
    report = json.loads((run_env.run / "eval" / "report.json").read_text())
    measured_ids = [json.loads(line)["id"] for line in (run_env.run / "eval" / "outputs.jsonl").read_text().splitlines()]
    assert measured_ids == ["p1", "p3", "p5", "p7"]  # 05's prompts: the first 4 held-out ones
    mine = report["offline_on_measured_prompts"]
    # p1 + p3 + p5 (p7 has no sample; p9 and p11 are eval samples 05 did not send): 40 rounds, 24 + 12 + 4 accepted per position
    assert mine["expected_acceptance_length"] == pytest.approx(1 + 40 / 40)
    assert mine["expected_per_position"] == pytest.approx([24 / 40, 12 / 40, 4 / 40])
    assert mine["replay_rounds"] == 40 and mine["num_prompts"] == 3
    assert mine["not_in_04s_eval"] == {"count": 1, "first": "p7"}
    assert mine["predicted_on"].startswith("05's held-out prompts, first turn")
    assert report["offline"]["predicted_on"] == "04's eval split: every sample, every assistant turn"
    assert report["offline"]["expected_acceptance_length"] == 2.2
    assert report["prediction_error"] == {"on_measured_prompts": pytest.approx((2.0 - 1.9) / 1.9),
                                          "on_eval_split": pytest.approx((2.2 - 1.9) / 1.9)}
    assert report["offline_prediction_error"] == report["prediction_error"]["on_eval_split"]
    assert "offline replay 2.20 (+15.8%) on 04's eval split, 2.00 (+5.3%) on these prompts' first turn" in capsys.readouterr().out


def test_a_prediction_without_the_per_sample_table_says_so_and_a_broken_table_is_one_line(run_env):
    eval_line = {"type": "eval", "step": 40, "loss": 1.0, "step_acc": [0.6, 0.5, 0.4], "tau": {"3": 2.02}}
    (run_env.final / "prediction.json").write_text(json.dumps(prediction_of(eval_line)))
    assert evaluate.run_stage(run_env.cfg) == 0
    report = json.loads((run_env.run / "eval" / "report.json").read_text())
    assert "no per-sample replay" in report["offline_on_measured_prompts"]["missing"]
    assert report["prediction_error"]["on_measured_prompts"] is None

    broken = {**FIRST_TURN, "counts": {"3": [[10, 8, 6]] * 5}}  # a row one short
    (run_env.final / "prediction.json").write_text(json.dumps(prediction_of({**eval_line, "replay_first_turn": broken})))
    with pytest.raises(DataError) as e:
        offline_prediction(run_env.cfg, run_env.final)
    assert str(e.value).startswith(f"{run_env.final / 'prediction.json'}: eval.replay_first_turn.counts.3 is [[10, 8, 6], [10, 8, 6]")
    assert "expected a list of 5 lists of 4 integers" in str(e.value) and "\n" not in str(e.value)
