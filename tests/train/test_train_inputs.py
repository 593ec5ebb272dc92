"""04 against changed or damaged inputs: a stale train/final after vocab/ or hidden/ changed is an
error; a damaged latest checkpoint falls back to the previous one (exact result); a damaged shard is
named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import checkpoint_steps, clone_run, error_line, read_metrics, run_stage


# ============================================================================ 04: inputs changed, damaged files


@pytest.mark.slow  # ~60 s: five 04 runs
def test_04_changed_vocab_or_hidden_is_an_error_not_a_stale_final(tmp_path, hidden_run):
    """A rebuilt vocab map (or hidden/) under a finished run: 04 stops with one line instead of keeping the old
    train/final; with --overwrite it trains on the new one."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = clone_run(hidden_run, tmp_path, max_steps=4, checkpoint_every=2, eval_every=0)
    run_dir = tmp_path / "run"
    assert run_stage("04_train.py", cfg).returncode == 0
    assert "already complete" in run_stage("04_train.py", cfg).stdout
    # 03 rebuilt with another draft vocab size (here: the first 64 ids of the old map)
    old = load_file(str(run_dir / "vocab" / "vocab_map.safetensors"))
    ids = (torch.arange(128) + old["d2t"])[:64]
    t2d = torch.zeros_like(old["t2d"])
    t2d[ids] = True
    save_file({"d2t": ids - torch.arange(64), "t2d": t2d}, str(run_dir / "vocab" / "vocab_map.safetensors"))
    error_line(run_stage("04_train.py", cfg, "--set", "vocab.draft_vocab_size=64"),
               "vocab/vocab_map.safetensors changed", "--overwrite")
    assert run_stage("04_train.py", cfg, "--set", "vocab.draft_vocab_size=64", "--overwrite").returncode == 0
    assert load_file(str(run_dir / "train" / "final" / "model.safetensors"))["d2t"].numel() == 64
    # hidden/ re-extracted (a new index.json: here from the target in bf16): the same
    index = json.loads((run_dir / "hidden" / "index.json").read_text())
    (run_dir / "hidden" / "index.json").write_text(json.dumps({**index, "target_dtype": "bfloat16"}))
    error_line(run_stage("04_train.py", cfg, "--set", "vocab.draft_vocab_size=64"), "hidden/index.json changed", "--overwrite")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, hidden_run) -> Path:
    """A finished 8-step run with checkpoints at 4, 6 and 8 (keep 3)."""
    root = tmp_path_factory.mktemp("trained")
    cfg = clone_run(hidden_run, root, max_steps=8, checkpoint_every=2, keep_checkpoints=3, eval_every=4, log_every=1)
    res = run_stage("04_train.py", cfg)
    assert res.returncode == 0, res.stderr[-2000:]
    return root


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.pt", "state.json"])
def test_04_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, trained, damaged):
    """A truncated file in the latest checkpoint: 04 says it is damaged, resumes from the one before, and redoes
    the steps into the same draft and the same metrics (no traceback)."""
    shutil.copytree(trained, tmp_path / "t")
    run_dir = tmp_path / "t" / "run"
    cfg = tmp_path / "t" / "run.yaml"
    cfg.write_text(cfg.read_text().replace(str(trained), str(tmp_path / "t")))
    final = (run_dir / "train" / "final" / "model.safetensors").read_bytes()
    metrics = read_metrics(run_dir)
    shutil.rmtree(run_dir / "train" / "final")  # as if killed between the last checkpoint and the export...
    latest = run_dir / "train" / "checkpoints" / "step-8" / damaged
    with open(latest, "r+b") as f:  # ...and the disk lost the end of a file
        f.truncate(latest.stat().st_size // 2)
    res = run_stage("04_train.py", cfg)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"checkpoint {latest.parent} is damaged ({damaged}" in res.stderr
    assert "resuming from" in res.stdout and "step-6" in res.stdout
    # the redone steps give the same draft and the same metrics, each line once
    assert (run_dir / "train" / "final" / "model.safetensors").read_bytes() == final
    assert [(r["type"], r["step"], r.get("loss")) for r in read_metrics(run_dir)] == \
        [(r["type"], r["step"], r.get("loss")) for r in metrics]


def test_04_verifies_the_shards_it_loads(tmp_path, hidden_run):
    """8 zeroed bytes in a shard: 04 names the shard (its sha256 differs) instead of training on it."""
    cfg = clone_run(hidden_run, tmp_path, max_steps=2)
    shard = sorted((tmp_path / "run" / "hidden").glob("shard-*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(b"\0" * 8)
    error_line(run_stage("04_train.py", cfg), f"hidden shard {shard} does not match the sha256", "rerun 02_extract_hidden.py")
    assert not (tmp_path / "run" / "train" / "final").exists()


# ============================================================================ 04 resumed under other settings


def test_04_resumes_with_another_ttt_steps(tmp_path, hidden_run):
    """A checkpoint from a run with another train.ttt_steps: the weights do not depend on it, so training goes on
    with the new count (and says so)."""
    cfg = clone_run(hidden_run, tmp_path, max_steps=6, checkpoint_every=2, eval_every=0, log_every=1)
    assert run_stage("04_train.py", cfg, "--set", "train.max_steps=4").returncode == 0
    shutil.rmtree(tmp_path / "run" / "train" / "final")
    res = run_stage("04_train.py", cfg, "--set", "train.ttt_steps=2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "the checkpoint trained with train.ttt_steps=3, this run uses 2" in res.stdout
    rows = [r for r in read_metrics(tmp_path / "run") if r["type"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [len(r["step_acc"]) for r in rows] == [3, 3, 3, 3, 2, 2]


def test_04_max_steps_below_the_finished_or_checkpointed_steps_is_an_error(tmp_path, hidden_run):
    """max_steps below what a finished draft (or, with final/ gone, the latest checkpoint) was trained for is an
    error, never "already complete" or a 6-step draft exported as the 3-step one; --overwrite trains anew."""
    cfg = clone_run(hidden_run, tmp_path, max_steps=6, checkpoint_every=2, eval_every=0)
    assert run_stage("04_train.py", cfg).returncode == 0
    final = tmp_path / "run" / "train" / "final" / "model.safetensors"
    before = final.read_bytes()
    error_line(run_stage("04_train.py", cfg, "--set", "train.max_steps=3"), "holds a draft trained for 6 steps but this "
               "config trains 3", "--overwrite")
    assert final.read_bytes() == before
    shutil.rmtree(tmp_path / "run" / "train" / "final")
    error_line(run_stage("04_train.py", cfg, "--set", "train.max_steps=3"), "checkpoints/step-6 is at step 6, past the 3 "
               "steps this config trains", "raise train.max_steps to at least 6")
    assert not final.exists()
    res = run_stage("04_train.py", cfg, "--set", "train.max_steps=3", "--overwrite")
    assert res.returncode == 0 and "done: 3 steps" in res.stdout


# ============================================================================ 04 and what others do to its folder


@pytest.mark.slow  # ~40 s: a 04 that runs while 02 and 03 try to overwrite its inputs
def test_overwrite_under_a_running_04_is_refused_and_04_stops_when_its_inputs_change(tmp_path, hidden_run):
    """02/03 --overwrite are refused while 04 trains on the same folder (they would change its inputs mid-run),
    and a 04 whose index.json changes under it anyway stops at its next check without saving or exporting."""
    import subprocess

    from tests.helpers import stage_env, train_cmd, wait_for_checkpoint

    # more steps than it can train before the index changes, however fast the machine: only that stops it
    cfg = clone_run(hidden_run, tmp_path, max_steps=1_000_000, checkpoint_every=2, keep_checkpoints=100, eval_every=0,
                    log_every=1)
    run_dir = tmp_path / "run"

    def snapshot() -> dict:
        return {p: p.read_bytes() for sub in ("hidden", "vocab") for p in sorted((run_dir / sub).rglob("*")) if p.is_file()}

    proc = subprocess.Popen(train_cmd(cfg), env=stage_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_checkpoint(proc, run_dir, 2)
        before = snapshot()
        for stage in ("03_build_vocab_map", "02_extract_hidden"):
            error_line(run_stage(f"{stage}.py", cfg, "--overwrite"),
                       f"{stage} --overwrite would delete what 04_train is reading", f"(pid {proc.pid})")
        assert snapshot() == before  # nothing deleted or rewritten
        assert proc.poll() is None
        # hidden/ rewritten under 04 anyway (another machine, a stage of an older version): 04 notices
        index = run_dir / "hidden" / "index.json"
        index.write_text(json.dumps({**json.loads(index.read_text()), "aux_layer_ids": [0, 1, 2]}))
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    line = error_line(res, "hidden/index.json changed while 04 was training", "without saving or exporting")
    stopped = int(line.split("stopped at step ")[1].split("/")[0])
    assert stopped not in checkpoint_steps(run_dir)  # the check comes before the step's save
    assert not (run_dir / "train" / "final").exists() and not (run_dir / "train" / "best").exists()


@pytest.mark.slow  # ~35 s: three 04 runs
def test_04_refuses_before_deleting_and_knows_its_target_by_content(tmp_path, hidden_run):
    """A memory budget nothing fits, with --overwrite: 04 refuses before it empties train/ (a finished draft)
    and suggests nothing that does not fit either. The same target weights at another path are the same
    target: the run is already complete."""
    cfg = clone_run(hidden_run, tmp_path, max_steps=2, checkpoint_every=2, eval_every=0)
    run_dir = tmp_path / "run"
    assert run_stage("04_train.py", cfg).returncode == 0
    train_files = {p: p.read_bytes() for p in sorted((run_dir / "train").rglob("*")) if p.is_file()}
    line = error_line(run_stage("04_train.py", cfg, "--overwrite", "--set", "train.gpu_memory_gb=0.000001"),
                      "does not fit", "use GPUs with more memory or a smaller draft")
    assert "gradient_checkpointing" not in line and "batch_max_tokens to" not in line  # neither fits
    assert {p: p.read_bytes() for p in sorted((run_dir / "train").rglob("*")) if p.is_file()} == train_files
    # the same weights, copied elsewhere: the same target
    target = Path(yaml_load(cfg)["target"]["model"])
    shutil.copytree(target, tmp_path / "target-copy")
    res = run_stage("04_train.py", cfg, "--set", f"target.model={tmp_path / 'target-copy'}")
    assert res.returncode == 0 and "already complete" in res.stdout, res.stderr[-2000:]


def yaml_load(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())
