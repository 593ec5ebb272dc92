"""04 keeps the checkpoint with the best replayed acceptance length and exports it as train/best/
(docs/design.md#artifact-formats, #resume-rules): the step whose logged eval/replay_al_k is the
highest, kept through keep_checkpoints pruning and through a SIGKILL + resume. Each export carries
prediction.json, the eval at its own step, which 05 reads beside the draft it measures."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.helpers import (REPO, checkpoint_steps, clone_run, kill_while_working, last_logged, read_metrics, stage_env,
                           start_in_own_group)

SCRIPT = REPO / "tests" / "train" / "scripted_al_run.py"
K = "3"  # evaluate.num_speculative_tokens (default 3) = train.ttt_steps of the fixture run


def _logged_best(run_dir: Path) -> tuple[int, float]:
    """(step, AL) of the highest replayed acceptance length in metrics.jsonl (the first on a tie)."""
    evals = [r for r in read_metrics(run_dir) if r["type"] == "eval"]
    top = max(evals, key=lambda r: (r["replay"][K]["acceptance_length"], -r["step"]))
    return top["step"], top["replay"][K]["acceptance_length"]


def _assert_best_export_is_checkpoint(run_dir: Path, step: int) -> None:
    best = load_file(str(run_dir / "train" / "best" / "model.safetensors"))
    ckpt = load_file(str(run_dir / "train" / "checkpoints" / f"step-{step}" / "model.safetensors"))
    assert best.keys() <= ckpt.keys() and "fc.weight" in best
    for k, v in best.items():
        assert torch.equal(v, ckpt[k].to(v.dtype)), k


def test_best_checkpoint_survives_pruning_and_is_exported(hidden_run, tmp_path, one_torch_thread):
    """The best eval (step 10) falls between checkpoints (every 20) and keep_checkpoints is 1: 04
    checkpoints step 10 anyway, keeps it past two later checkpoints, and exports it as train/best."""
    sys.path.insert(0, str(SCRIPT.parent))
    from scripted_al_run import main as scripted_main

    cfg = clone_run(hidden_run, tmp_path, max_steps=40, eval_every=5, checkpoint_every=20, keep_checkpoints=1)
    scripted = {"5": 1.3, "10": 2.0, "15": 1.6, "20": 1.5, "25": 2.0, "30": 1.2, "35": 1.9, "40": 1.8}
    assert scripted_main(str(cfg), scripted) == 0
    run_dir = tmp_path / "run"
    assert _logged_best(run_dir) == (10, 2.0)  # 25 ties: the first one stays
    assert checkpoint_steps(run_dir) == [10, 40]
    info = json.loads((run_dir / "train" / "best" / "best.json").read_text())
    assert (info["step"], info["k"], info["acceptance_length"]) == (10, 3, 2.0)
    assert info["checkpoint"] == "checkpoints/step-10" and info["last_step"] == 40
    _assert_best_export_is_checkpoint(run_dir, 10)
    # exported like train/final (same config), and final is the last step, not the best
    assert (run_dir / "train" / "best" / "config.json").read_text() == (run_dir / "train" / "final" / "config.json").read_text()
    final = load_file(str(run_dir / "train" / "final" / "model.safetensors"))
    last = load_file(str(run_dir / "train" / "checkpoints" / "step-40" / "model.safetensors"))
    assert torch.equal(final["fc.weight"], last["fc.weight"].to(final["fc.weight"].dtype))
    assert not torch.equal(final["fc.weight"], load_file(str(run_dir / "train" / "best" / "model.safetensors"))["fc.weight"])
    summary = json.loads((run_dir / "train" / "final" / "training_summary.json").read_text())
    assert summary["best"]["step"] == 10


def test_best_checkpoint_survives_sigkill_and_resume(hidden_run, tmp_path):
    """SIGKILLed between checkpoints step-20 and step-40 (step-20's state records best = step 10): the resumed
    run keeps step 10 until a better eval (step 50) replaces it, and ends with what an uninterrupted run has."""
    kw = dict(max_steps=60, eval_every=5, checkpoint_every=20, keep_checkpoints=1, log_every=1)
    scripted = json.dumps({"5": 1.3, "10": 2.0, "15": 1.6, "20": 1.5, "25": 1.4, "30": 1.2, "35": 1.3, "40": 1.1,
                           "45": 1.6, "50": 2.5, "55": 1.9, "60": 1.7})
    env = stage_env()
    ref_cfg = clone_run(hidden_run, tmp_path / "ref", **kw)
    cut_cfg = clone_run(hidden_run, tmp_path / "cut", **kw)
    ref = subprocess.run([sys.executable, str(SCRIPT), str(ref_cfg), scripted], env=env, capture_output=True, text=True,
                         timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]

    # killed at a logged step drawn from 21-30: past checkpoint step-20, ten steps before step-40 would replace it
    cut_run = tmp_path / "cut" / "run"
    assert kill_while_working(lambda: start_in_own_group([sys.executable, str(SCRIPT), str(cut_cfg), scripted], env=env),
                              lambda _: last_logged(cut_run), 30, random.Random(20), begin=21) == 1
    on_disk = checkpoint_steps(cut_run)
    assert 10 in on_disk and 20 in on_disk and not (cut_run / "train" / "best").exists()
    if max(on_disk) == 20:  # killed before step 40: the latest checkpoint vouches for best = step 10
        state = json.loads((cut_run / "train" / "checkpoints" / "step-20" / "state.json").read_text())
        assert state["best"]["step"] == 10

    resumed = subprocess.run([sys.executable, str(SCRIPT), str(cut_cfg), scripted], env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    for run_dir in (tmp_path / "ref" / "run", cut_run):
        assert _logged_best(run_dir) == (50, 2.5)
        assert checkpoint_steps(run_dir) == [50, 60]  # step 10 went once step 50 was the best and step 60 the kept one
        assert json.loads((run_dir / "train" / "best" / "best.json").read_text())["step"] == 50
        _assert_best_export_is_checkpoint(run_dir, 50)
        evals = {r["step"]: r for r in read_metrics(run_dir) if r["type"] == "eval"}  # each export's prediction: its step's
        for export, step in (("best", 50), ("final", 60)):
            predicted = json.loads((run_dir / "train" / export / "prediction.json").read_text())["eval"]
            # the per-sample first-turn table is in the export's prediction, not in every metrics.jsonl line
            assert predicted.pop("replay_first_turn")["sample_ids"] and "replay_first_turn" not in evals[step]
            assert predicted == evals[step]
    a = load_file(str(tmp_path / "ref" / "run" / "train" / "best" / "model.safetensors"))
    b = load_file(str(cut_run / "train" / "best" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_without_an_eval_split_only_the_last_is_exported(hidden_run, tmp_path, one_torch_thread, capsys):
    """No eval shards (index.json lists only train shards): 04 says so and exports only train/final, whose
    prediction.json says why there is no eval at its step; 05 reports that as the reason it has no prediction."""
    from common.core.config import load_config
    from common.core.run_folder import Layout
    from common.evaluate.draft import checked_draft
    from common.train.trainer import run_training

    cfg_path = clone_run(hidden_run, tmp_path, max_steps=6, eval_every=3, checkpoint_every=3, keep_checkpoints=1)
    run_dir = tmp_path / "run"
    index = json.loads((run_dir / "hidden" / "index.json").read_text())
    eval_files = {s["file"] for s in index["shards"] if s["split"] == "eval"}
    assert eval_files
    index["shards"] = [s for s in index["shards"] if s["file"] not in eval_files]
    (run_dir / "hidden" / "index.json").write_text(json.dumps(index))
    plan = json.loads((run_dir / "hidden" / "plan.json").read_text())  # as 02 plans data.eval_fraction 0
    plan["shards"] = [s for s in plan["shards"] if s["file"] not in eval_files]
    (run_dir / "hidden" / "plan.json").write_text(json.dumps(plan))
    record = run_dir / "stages" / "02_extract_hidden.json"  # 02's record of the plan's sha256, when the clone has it
    if record.is_file():
        manifest = json.loads(record.read_text())
        manifest["result"]["plan_sha256"] = hashlib.sha256((run_dir / "hidden" / "plan.json").read_bytes()).hexdigest()
        record.write_text(json.dumps(manifest))
    assert run_training(load_config(cfg_path)) == 0
    out = capsys.readouterr().out
    assert "no eval ran" in out and "train/best is not written" in out
    assert (run_dir / "train" / "final" / "model.safetensors").is_file() and not (run_dir / "train" / "best").exists()
    final = run_dir / "train" / "final"
    prediction = json.loads((final / "prediction.json").read_text())
    assert prediction["step"] == 6 and prediction["eval"] is None
    assert prediction["missing"].startswith("04 logged no eval at step 6: this run has no eval split")
    cfg = load_config(cfg_path)
    offline = checked_draft(cfg, Layout.of(cfg), None, foreign_draft=False).offline  # 05 on train/final
    assert offline.prediction is None and offline.missing == f"{prediction['missing']} ({final / 'prediction.json'})"


def test_each_export_carries_the_eval_at_its_step_and_05_reads_it_beside_the_draft(hidden_run, tmp_path,
                                                                                    one_torch_thread):
    """train/final and train/best each hold prediction.json: the eval 04 logged at that export's own step (best:
    step 4, final: step 10, evaluated although eval_every does not divide max_steps). 05 reads it from the draft
    directory it measures: a copy elsewhere keeps its prediction with nothing of the run's train/ left, and a
    draft directory without prediction.json gets the reason there is none."""
    sys.path.insert(0, str(SCRIPT.parent))
    from scripted_al_run import main as scripted_main

    from common.core.config import load_config
    from common.core.run_folder import Layout
    from common.evaluate.draft import checked_draft, offline_report

    cfg_path = clone_run(hidden_run, tmp_path, max_steps=10, eval_every=4, checkpoint_every=10, keep_checkpoints=1)
    assert scripted_main(str(cfg_path), {"4": 2.0, "8": 1.5, "10": 1.2}) == 0
    run_dir = tmp_path / "run"
    evals = {r["step"]: r for r in read_metrics(run_dir) if r["type"] == "eval"}
    assert sorted(evals) == [4, 8, 10]  # the last step is evaluated whatever eval_every says
    for export, step in (("final", 10), ("best", 4)):
        prediction = json.loads((run_dir / "train" / export / "prediction.json").read_text())
        assert prediction["eval"].pop("replay_first_turn")["sample_ids"]  # kept here, not in metrics.jsonl's lines
        assert prediction == {"step": step, "k": int(K), "eval": evals[step], "missing": None}, export

    cfg = load_config(cfg_path)
    layout = Layout.of(cfg)
    copy = shutil.copytree(run_dir / "train" / "best", tmp_path / "elsewhere" / "best-copy")
    shutil.rmtree(run_dir / "train")  # nothing of the run's logs or exports is read for it
    offline = checked_draft(cfg, layout, str(copy), foreign_draft=False).offline
    assert offline.missing is None
    assert offline.prediction == offline_report(cfg, evals[4], copy / "prediction.json", copy)
    assert offline.prediction["step"] == 4 and offline.prediction["expected_acceptance_length"] == 2.0

    (copy / "prediction.json").unlink()  # e.g. a draft exported by an earlier version of 04
    offline = checked_draft(cfg, layout, str(copy), foreign_draft=False).offline
    assert offline.prediction is None
    assert offline.missing.startswith(f"{copy} has no prediction.json: 04 predicted nothing for it (")


def test_a_run_resumed_at_its_last_step_exports_the_eval_its_checkpoint_records(hidden_run, tmp_path, one_torch_thread,
                                                                                 capsys):
    """Stopped after its last checkpoint and before its export (here train/final and train/eval_report.json are
    removed): the rerun resumes at the last step, evaluates nothing, and train/final's prediction.json is still
    that step's eval, the one the checkpoint records (state.json "eval")."""
    from common.core.config import load_config
    from common.train.trainer import run_training

    cfg_path = clone_run(hidden_run, tmp_path, max_steps=4, eval_every=2, checkpoint_every=2, keep_checkpoints=1)
    assert run_training(load_config(cfg_path)) == 0
    run_dir = tmp_path / "run"
    final = run_dir / "train" / "final"
    before = json.loads((final / "prediction.json").read_text())
    state = json.loads((run_dir / "train" / "checkpoints" / "step-4" / "state.json").read_text())
    assert before["step"] == 4 and before["eval"]["step"] == 4 and state["eval"] == before["eval"]

    shutil.rmtree(final)
    (run_dir / "train" / "eval_report.json").unlink()
    capsys.readouterr()
    assert run_training(load_config(cfg_path)) == 0
    assert "resuming from" in capsys.readouterr().out
    assert not (run_dir / "train" / "eval_report.json").exists()  # no eval ran again
    assert json.loads((final / "prediction.json").read_text()) == before
