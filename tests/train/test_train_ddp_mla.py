"""The MLA draft under torch.distributed (gloo, CPU), as the Llama draft in test_train_ddp.py: 2-process DDP and
FSDP2 train exactly as one process with grad_accum=2 (same global batches, same token-mean loss), and FSDP's
rank 0 exports the gathered MLA draft."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.helpers import stage_env, train_cmd, write_yaml
from tests.train.mla_run import ARCH, build_mla_run, build_mla_target
from tests.train.test_train_ddp import SETTINGS, _assert_same_training, _torchrun


def _variant(fixture_cfg: Path, dest: Path, **train) -> Path:
    """A copy of the MLA fixture run (data, hidden, vocab) whose config differs in train.*."""
    tree = yaml.safe_load(fixture_cfg.read_text())
    src_run = Path(tree["run_dir"])
    for sub in ("data", "hidden", "vocab"):
        shutil.copytree(src_run / sub, dest / "run" / sub)
    tree["run_dir"] = str(dest / "run")
    tree["train"].update(train)
    return write_yaml(dest / "run.yaml", tree)


def test_mla_draft_ddp_and_fsdp_match_grad_accum(tmp_path):
    target = build_mla_target(tmp_path / "target")
    fixture = build_mla_run(tmp_path / "fixture", target, draft_vocab_size=64, n_train=48, n_eval=8, **SETTINGS)

    single = _variant(fixture, tmp_path / "single", grad_accum=2)
    res = subprocess.run(train_cmd(single), env=stage_env(), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "1 process(es) x grad_accum 2" in res.stdout

    for parallel in ("ddp", "fsdp"):
        cfg = _variant(fixture, tmp_path / parallel, grad_accum=1, parallel=parallel)
        res = _torchrun(cfg, 2)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "2 process(es) x grad_accum 1" in res.stdout and f"parallel={parallel}" in res.stdout
        _assert_same_training(tmp_path / "single" / "run", tmp_path / parallel / "run")
    config = json.loads((tmp_path / "fsdp" / "run" / "train" / "final" / "config.json").read_text())
    assert config["architectures"] == [ARCH] and config["kv_lora_rank"] == 48  # the gathered MLA draft, exported
