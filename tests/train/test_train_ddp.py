"""Stage 04 under torch.distributed (gloo, CPU): 2-process DDP and FSDP2 give the same training as
one process with grad_accum=2 (the same global batches, the same token-mean loss), and resume exactly
after a SIGKILL."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import (build_run, checkpoint_steps, clone_run, kill_while_working, read_metrics, stage_env,
                           start_in_own_group, train_cmd)

STEPS = 6
SETTINGS = dict(max_steps=STEPS, batch_max_tokens=160, log_every=1, eval_every=0, checkpoint_every=100, keep_checkpoints=1)


@pytest.fixture(scope="module")
def fixture_cfg(tmp_path_factory) -> Path:
    return build_run(tmp_path_factory.mktemp("ddp-fixture"), n_train=48, n_eval=8)


def _torchrun(cfg_path: Path, nproc: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *train_cmd(cfg_path)[1:]]
    return subprocess.run(cmd, env=stage_env(), capture_output=True, text=True, timeout=900)


def _final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "train" / "checkpoints" / f"step-{STEPS}" / "model.safetensors"))


def _assert_same_training(a_dir: Path, b_dir: Path) -> None:
    a_rows, b_rows = read_metrics(a_dir), read_metrics(b_dir)
    a_train = [r for r in a_rows if r["type"] == "train"]
    b_train = [r for r in b_rows if r["type"] == "train"]
    assert [r["step"] for r in a_train] == [r["step"] for r in b_train] == list(range(1, STEPS + 1))
    for ra, rb in zip(a_train, b_train):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), (ra["step"], ra["loss"], rb["loss"])
        assert rb["step_losses"] == pytest.approx(ra["step_losses"], rel=1e-5)
        assert rb["step_acc"] == pytest.approx(ra["step_acc"], abs=1e-6)
        assert rb["tokens"] == ra["tokens"]
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
    a_eval = [r for r in a_rows if r["type"] == "eval"][-1]
    b_eval = [r for r in b_rows if r["type"] == "eval"][-1]
    assert b_eval["step_counts"] == a_eval["step_counts"]
    assert b_eval["loss"] == pytest.approx(a_eval["loss"], rel=1e-4)
    wa, wb = _final_weights(a_dir), _final_weights(b_dir)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k].float(), wb[k].float(), rtol=1e-4, atol=1e-5), k


def test_ddp_and_fsdp_match_grad_accum(fixture_cfg, tmp_path):
    single = clone_run(fixture_cfg, tmp_path / "single", grad_accum=2, **SETTINGS)
    res = subprocess.run(train_cmd(single), env=stage_env(), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "1 process(es) x grad_accum 2" in res.stdout

    ddp = clone_run(fixture_cfg, tmp_path / "ddp", grad_accum=1, parallel="ddp", **SETTINGS)
    res = _torchrun(ddp, 2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 process(es) x grad_accum 1" in res.stdout and "parallel=ddp" in res.stdout
    _assert_same_training(tmp_path / "single" / "run", tmp_path / "ddp" / "run")

    fsdp = clone_run(fixture_cfg, tmp_path / "fsdp", grad_accum=1, parallel="fsdp", **SETTINGS)
    res = _torchrun(fsdp, 2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "parallel=fsdp" in res.stdout
    _assert_same_training(tmp_path / "single" / "run", tmp_path / "fsdp" / "run")
    # rank 0 exported the (gathered) FSDP draft
    config = json.loads((tmp_path / "fsdp" / "run" / "train" / "final" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_process_sigkill_then_resume_is_exact(fixture_cfg, tmp_path, parallel):
    """torchrun with 2 processes, SIGKILLed (agent and both ranks, as a crash or an OOM-killed node does) after a
    checkpoint, then started again: the same weights, bit for bit, and the same logged curve as an uninterrupted
    2-process run."""
    import psutil
    from safetensors.torch import load_file

    steps = 24
    kw = dict(max_steps=steps, batch_max_tokens=160, log_every=1, eval_every=0, checkpoint_every=3, keep_checkpoints=2,
              grad_accum=1, parallel=parallel)
    ref = clone_run(fixture_cfg, tmp_path / "ref", **kw)
    cut = clone_run(fixture_cfg, tmp_path / "cut", **kw)
    res = _torchrun(ref, 2)
    assert res.returncode == 0, res.stderr[-3000:]

    cut_run = tmp_path / "cut" / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *train_cmd(cut)[1:]]
    hit: list = []  # torchrun starts each rank in a session of its own: kill_tree kills the agent and each rank by pid
    # killed once a checkpoint drawn from all but the last two is written
    assert kill_while_working(lambda: start_in_own_group(cmd), lambda _: max(checkpoint_steps(cut_run), default=0),
                              steps - 6, random.Random(parallel), after_each=hit.extend) == 1
    ranks = hit[1:]
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert len(ranks) >= 2 and not alive  # the two ranks (and whatever they started)
    assert not (cut_run / "train" / "final").exists()
    resumed = _torchrun(cut, 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout

    for sub in ("train/final/model.safetensors", f"train/checkpoints/step-{steps}/model.safetensors"):
        a, b = load_file(str(tmp_path / "ref" / "run" / sub)), load_file(str(cut_run / sub))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{parallel} {sub}:{k} differs after resume"
    ref_rows, cut_rows = read_metrics(tmp_path / "ref" / "run"), read_metrics(cut_run)
    assert [(r["type"], r["step"]) for r in cut_rows] == [(r["type"], r["step"]) for r in ref_rows]
    for key in ("loss", "step_losses", "step_acc", "grad_norm", "lr", "tokens"):
        assert [r.get(key) for r in cut_rows] == [r.get(key) for r in ref_rows], key
