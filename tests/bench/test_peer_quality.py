"""bench/peer_quality.py, the part that runs without SpecForge.

Its training step is SpecForge's and imports specforge, which lives only in the peer venv (bench/peer_setup.sh), not in
the project's: that part is not tested here (its CPU smoke run is in bench/README.md). What is tested runs in the
project venv: bad inputs are one `error:` line (before specforge is imported), 04's step-0 draft and first batch as the
script reads them (04's step-1 loss is recomputed from them), and the export 05 takes for --compare.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, clone_run, error_line, read_metrics, stage_env

SCRIPT = REPO / "bench" / "peer_quality.py"


def run_script(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO, env=stage_env(),
                          capture_output=True, text=True, timeout=300)


def load_script():
    spec = importlib.util.spec_from_file_location("peer_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("remove, says", [
    ("hidden/index.json", "has no extracted hidden states; run 02_extract_hidden.py"),
    ("vocab/vocab_map.safetensors", "has no vocab map; run 03_build_vocab_map.py"),
])
def test_a_run_without_02_or_03_is_one_error_line(hidden_run, tmp_path, remove, says):
    cfg = clone_run(hidden_run, tmp_path)
    (tmp_path / "run" / remove).unlink()
    error_line(run_script("--config", cfg, "--threads", "1"), says)


def test_an_out_dir_it_would_clobber_is_refused(hidden_run, tmp_path):
    cfg = clone_run(hidden_run, tmp_path)
    error_line(run_script("--config", cfg, "--out", tmp_path / "run" / "train" / "final"), "inside a stage's outputs")
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    error_line(run_script("--config", cfg, "--out", other), "is not an earlier peer_quality.py output")
    assert (other / "notes.txt").read_text() == "keep me"


def test_04s_initial_draft_and_first_batch_and_the_export_05_takes(hidden_run, tmp_path, one_torch_thread):
    from common.core.config import load_config
    from common.model.draft import Eagle3DraftModel
    from common.model.ttt import ttt_loss
    from common.target.loading import load_target_tensors
    from common.train.data import DataPosition
    from common.train.trainer import run_training

    cfg_path = clone_run(hidden_run, tmp_path, max_steps=1, eval_every=0, init_lm_head="target")
    cfg = load_config(cfg_path)
    assert run_training(cfg) == 0  # 04: one step, train/final
    first = next(r for r in read_metrics(Path(cfg.run_dir)) if r["type"] == "train" and r["step"] == 1)

    pq = load_script()
    cfg = load_config(cfg_path)
    trainer = pq.open_run(cfg, torch.device("cpu"))
    target = load_target_tensors(cfg.target.model)
    state = pq.initial_weights(trainer, target)
    # the weights SpecForge starts from are 04's step 0: on 04's first micro-batch (as the script reads it) they give
    # the loss 04 logged for step 1, which was computed before its first update
    draft = Eagle3DraftModel(trainer.draft_cfg)
    draft.load_state_dict(state, strict=True)
    mine, real, _ = trainer.data.step_micro_batches(DataPosition())
    assert len(mine) == 1 and real == [True]
    mb = trainer.data.reader.read(mine[0])
    t = cfg.train
    with torch.no_grad():
        out = ttt_loss(draft, mb.aux_hidden.float(), mb.input_ids, mb.final_hidden.float(), mb.loss_mask, mb.position_ids,
                       mb.seq_lens, target["lm_head"].float(), t.ttt_steps, t.loss_decay,
                       denominator=trainer.data.step_loss_positions(DataPosition()))
    assert float(out.loss) == pytest.approx(first["loss"], rel=1e-5)
    assert pq.first_step_of_04(trainer.layout, cfg)["loss"] == first["loss"]  # the reference it prints
    other = load_config(cfg_path, ["train.batch_max_tokens=200"])
    assert pq.first_step_of_04(trainer.layout, other) == {"missing": "train/final was trained with other train.batch_max_tokens"}
    assert torch.equal(state["lm_head.weight"], target["lm_head"][draft.draft_vocab_target_ids()].float())  # init_lm_head

    out_dir = tmp_path / "run" / "peer" / "specforge"
    pq.check_out_dir(out_dir, trainer.layout)
    pq.export(trainer, state, out_dir)
    check = pq.verify_export(cfg, out_dir, state, target["embed"])  # our loader, 05's checked_draft
    assert check["config_json_equals_train_final"] is True, check["config_json_diff"]
    assert f"{out_dir} has no prediction.json: 04 predicted nothing for it" in check["no_offline_prediction_because"]
    (out_dir / pq.RESULT_FILE).write_text("{}")
    pq.check_out_dir(out_dir, trainer.layout)  # its own earlier output may be replaced
