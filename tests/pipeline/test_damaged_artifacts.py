"""Files between stages that were lost or edited (issue 42, items 5-7).

- A run folder moved elsewhere whose hidden/index.json was lost: 02 rebuilds it from the byte-identical shards (it
  then names the target's new path), and a finished 04 stays complete: 04 keys on index.json's content, not on the
  path text.
- hidden/index.json or hidden/plan.json with a field of another type: 02 and 04 stop with one error line that names
  the file and the field, and delete nothing.
- A draft's prediction.json with a field of another type: 05 stops with one error line before vLLM starts, even
  where its report would be "already complete".
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from common.evaluate import stage as evaluate
from tests.evaluate.test_evaluate import cli_config, eval_files, run_env  # noqa: F401 (run_env: the fixture)
from tests.helpers import base_config, clone_run, error_line, write_yaml
from tests.pipeline.test_bad_inputs import assert_ok, cli  # noqa: F401 (cli: the fork server fixture)


def files_under(root: Path, *subs: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for sub in subs for p in sorted((root / sub).rglob("*")) if p.is_file()}


# ============================================================================ a lost index.json in a moved run


def test_a_moved_run_whose_lost_index_02_rebuilds_stays_complete_in_04(cli, tmp_path, hidden_run):
    """Issue 42, item 5: the run folder and its target moved, hidden/index.json lost. 02 rebuilt it with the same
    shards but the target's new path, and 04 then said "hidden/index.json changed; rerun 04_train.py with
    --overwrite": a retrain for a path. Now 04 finds its draft complete."""
    train = {"max_steps": 2, "eval_every": 0, "checkpoint_every": 2}
    old = tmp_path / "old"
    shutil.copytree(yaml.safe_load(hidden_run.read_text())["target"]["model"], old / "target")
    clone_run(hidden_run, old)
    cfg = write_yaml(old / "run.yaml", base_config(old / "run", old / "target", **train))
    assert_ok(cli("02_extract_hidden.py", "--config", cfg))  # 02's record of the copied shards
    assert_ok(cli("04_train.py", "--config", cfg))
    final = files_under(old / "run", "train/final")

    new = tmp_path / "new"
    shutil.move(old, new)
    run = new / "run"
    cfg = write_yaml(new / "run.yaml", base_config(run, new / "target", **train))
    shards = files_under(run, "hidden")
    (run / "hidden" / "index.json").unlink()
    del shards["hidden/index.json"]
    assert_ok(cli("02_extract_hidden.py", "--config", cfg))
    index = json.loads((run / "hidden" / "index.json").read_text())
    assert index["complete"] and index["target_model"] == str(new / "target")  # the path it names now
    assert {k: v for k, v in files_under(run, "hidden").items() if k != "hidden/index.json"} == shards

    res = cli("04_train.py", "--config", cfg)
    assert_ok(res)
    assert "04_train: already complete" in res.stdout, res.stdout[-2000:]
    assert files_under(run, "train/final") == final
    # what the draft was trained on does count: other hidden states are still a change
    (run / "hidden" / "index.json").write_text(json.dumps({**index, "target_dtype": "bfloat16"}))
    error_line(cli("04_train.py", "--config", cfg), "hidden/index.json changed", "--overwrite")


# ============================================================================ index.json / plan.json of other types


def set_field(doc: dict, path: str, value) -> None:
    """doc's field at `path` ("shards.0.num_tokens") set to value."""
    *parents, last = path.split(".")
    for key in parents:
        doc = doc[int(key)] if isinstance(doc, list) else doc[key]
    doc[last] = value


WRONG_TYPES = {  # file, field (as the error line names it), value
    "index: shards a string": ("index.json", "shards", "x", '"x", expected a list of objects'),
    "index: a shard's num_tokens a string": ("index.json", "shards.0.num_tokens", "abc", "shards[0].num_tokens is "
                                             '"abc", expected an integer'),
    "index: aux_layer_ids of strings": ("index.json", "aux_layer_ids", ["1", "2", "3"], 'aux_layer_ids is ["1", "2", '
                                        '"3"], expected a list of integers'),
    "plan: a shard's sample_ids a number": ("plan.json", "shards.1.sample_ids", 7, "shards[1].sample_ids is 7, "
                                            "expected a list of strings"),
}
FIXES = {"index.json": ["(02_extract_hidden.py rebuilds it from the shards) or rerun 02_extract_hidden.py with --overwrite"],
         "plan.json": ["restore the plan 02 made, or rerun 02_extract_hidden.py with --overwrite"]}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_hidden_json_with_a_field_of_another_type_is_one_error_line(cli, tmp_path, hidden_run, case):
    """Issue 42, item 6: index.json with "shards": "x" stopped 02 with a TypeError traceback (04 too). Now 02 and 04
    each name the file and the field in one line, exit 2, and delete nothing."""
    name, field, value, says = WRONG_TYPES[case]
    cfg = clone_run(hidden_run, tmp_path)
    run = tmp_path / "run"
    path = run / "hidden" / name
    doc = json.loads(path.read_text())
    set_field(doc, field, value)
    path.write_text(json.dumps(doc))
    before = files_under(run, "data", "hidden", "vocab")
    for script in ("02_extract_hidden.py", "04_train.py"):
        line = error_line(cli(script, "--config", cfg), f"error: {path}: ", says, *FIXES[name])
        if name == "index.json":
            assert f"delete {path} " in line
        assert files_under(run, "data", "hidden", "vocab") == before
        assert not (run / "train").exists()


# ============================================================================ prediction.json of other types


PREDICTIONS = {  # the eval's field, its value, what the error line says
    "step_acc a string": ("step_acc", "abc", 'eval.step_acc is "abc", expected a list of numbers or null'),
    "tau a list": ("tau", [1, 2], "eval.tau is [1, 2], expected an object or null"),
    "a replay a string": ("replay", {"3": "oops"}, 'eval.replay.3 is "oops", expected an object'),
}


@pytest.mark.parametrize("case", list(PREDICTIONS))
def test_05_prediction_with_a_field_of_another_type_is_one_error_line_before_vllm(cli, run_env, tmp_path, case):
    """Issue 42, item 7: a draft's prediction.json with a field of another type stopped 05 (--draft on a copy of
    train/final) with a ValueError / AttributeError / TypeError traceback, even where its report was complete. Now one
    line names the file and the field, before vLLM starts, and eval/ is left as it was."""
    draft = tmp_path / "draft"
    shutil.copytree(run_env.final, draft)
    assert evaluate.run_stage(run_env.cfg, draft_dir=str(draft)) == 0  # measured (a fake vLLM): already complete next
    before = eval_files(run_env.run)
    field, value, says = PREDICTIONS[case]
    prediction = draft / "prediction.json"
    record = json.loads(prediction.read_text())
    record["eval"][field] = value
    prediction.write_text(json.dumps(record))
    for args in ((), ("--overwrite",)):
        res = cli("05_evaluate.py", "--config", cli_config(run_env), "--draft", draft, *args, timeout=120)
        error_line(res, f"error: {prediction}: {says}; re-export the draft (rerun 04_train.py), or delete {prediction} "
                        f"to measure the draft without 04's prediction")
        assert "vllm" not in res.stderr.lower() and "vllm" not in res.stdout.lower()
        assert eval_files(run_env.run) == before


def test_05_index_with_aux_layer_ids_of_another_type_is_one_error_line(cli, run_env):
    """05 reads this run's aux layer ids from hidden/index.json: strings there were a ValueError traceback."""
    index = run_env.run / "hidden" / "index.json"
    index.parent.mkdir()
    index.write_text(json.dumps({"format_version": 3, "aux_layer_ids": [1, 2, "three"]}))
    res = cli("05_evaluate.py", "--config", cli_config(run_env), timeout=120)
    error_line(res, f"error: {index}: aux_layer_ids is [1, 2, \"three\"], expected a list of integers; delete {index}")
    assert "vllm" not in res.stderr.lower() and not (run_env.run / "eval").exists()
