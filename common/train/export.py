"""04's exports in vLLM's format (common/model/export.py): train/final/ (the last step's draft) and
train/best/ (the checkpoint with the best replayed acceptance length, with best.json)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from common.core.distributed import DistEnv, barrier
from common.core.io import atomic_write_json, fsync_dir
from common.core.run_folder import BEST_JSON, TRAINING_SUMMARY, Layout
from common.model.draft import DraftModelConfig, Eagle3DraftModel
from common.model.export import export_vllm_draft
from common.train.checkpoint import checkpoint_problem, full_model_state, writing


def export_final(parallel: str, env: DistEnv, draft, draft_cfg: DraftModelConfig, index, layout: Layout, summary: dict) -> None:
    """04's train/final/: the vLLM-loadable draft + training_summary.json, written by rank 0 under a
    temp name and renamed. Every rank calls it (under FSDP gathering the weights is collective)."""
    full = full_model_state(draft) if (env.distributed and parallel == "fsdp") else None  # collective
    tmp, final = layout.final_tmp, layout.final
    with writing(f"the final draft {final}", tmp, layout.train):
        _export_on_main(env, draft, draft_cfg, index, summary, full, tmp, final)
    barrier(env)


def _export_on_main(env, draft, draft_cfg, index, summary, full, tmp: Path, final: Path) -> None:
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        to_export = draft
        if full is not None:  # FSDP: an unsharded copy on CPU
            to_export = Eagle3DraftModel(draft_cfg)
            to_export.load_state_dict(full, strict=False)
        export_vllm_draft(to_export, tmp, extra_config={"eagle_aux_hidden_state_layer_ids": list(index.aux_layer_ids)})
        atomic_write_json(tmp / TRAINING_SUMMARY, summary)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)




def export_best(env: DistEnv, draft_cfg: DraftModelConfig, index, layout: Layout, best: dict | None, last_step: int) -> str:
    """04's train/best/: the checkpoint with the best replayed acceptance length (best["step"]), exported
    like train/final/ plus best.json (step, k, acceptance length). Rank 0 reads the checkpoint's weights
    from disk, so no collective. Returns the line 04 prints. Without an eval (no eval split) there is
    no best: a stale train/best is removed and only train/final stands."""
    from safetensors.torch import load_file

    if not env.is_main:
        return ""
    if best is None:
        shutil.rmtree(layout.best, ignore_errors=True)
        return ("no eval ran (no eval split): train/best is not written; train/final is the only export "
                "(docs/design.md#artifact-formats)")
    ckpt = layout.checkpoint(int(best["step"]))
    problem = checkpoint_problem(ckpt) if ckpt.is_dir() else "missing"
    if problem is not None:
        shutil.rmtree(layout.best, ignore_errors=True)
        return f"warning: the best checkpoint {ckpt} is {problem}; train/best is not written, train/final is"
    tmp, out = layout.best_tmp, layout.best
    with writing(f"the best draft {out}", tmp, layout.train):
        shutil.rmtree(tmp, ignore_errors=True)
        model = Eagle3DraftModel(draft_cfg)
        model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)  # the frozen embedding is not exported
        export_vllm_draft(model, tmp, extra_config={"eagle_aux_hidden_state_layer_ids": list(index.aux_layer_ids)})
        atomic_write_json(tmp / BEST_JSON, {**best, "checkpoint": str(ckpt.relative_to(layout.train)), "last_step": last_step})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    return (f"best checkpoint: step {best['step']} (replayed acceptance length {best['acceptance_length']:.3f} at "
            f"k={best['k']}), exported to {out}")
