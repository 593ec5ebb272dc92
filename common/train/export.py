"""04's train/final/: the trained draft exported in vLLM's format (common/model/export.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from common.core.distributed import DistEnv, barrier
from common.core.io import atomic_write_json, fsync_dir
from common.core.run_folder import Layout
from common.model.draft import DraftModelConfig, Eagle3DraftModel
from common.model.export import export_vllm_draft
from common.train.checkpoint import full_model_state, writing


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
        atomic_write_json(tmp / "training_summary.json", summary)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)
