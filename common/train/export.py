"""04's exports in vLLM's format (common/model/export.py): train/final/ (the last step's draft) and
train/best/ (the checkpoint with the best replayed acceptance length, with best.json).

Each export carries prediction.json (`prediction_record`): 04's eval at the export's step, the prediction
05 compares with vLLM's numbers, or why there is none. It lies beside the weights it predicts, so a copy
of the directory keeps its prediction and 05 needs nothing else of this run to find it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from common.core.distributed import DistEnv, barrier
from common.core.io import atomic_write_json, fsync_dir, read_json
from common.core.run_folder import BEST_JSON, PREDICTION_JSON, TRAINING_SUMMARY, Layout
from common.model.draft import DraftConfigContract, family_of_config
from common.model.export import export_vllm_draft
from common.train.checkpoint import checkpoint_problem, full_model_state, writing


def prediction_record(step: int, k: int, eval_report: Optional[dict], why_no_eval: str) -> dict:
    """prediction.json of the export at `step`: 04's eval at that very step (every k's replay is in it, so 05
    reads its own k) and k, 05's k when 04 ran (the best is chosen at it); without an eval at that step,
    "eval" is null and "missing" says why (05 reports it as the reason there is no prediction)."""
    if isinstance(eval_report, dict) and eval_report.get("step") == step:
        return {"step": step, "k": k, "eval": eval_report, "missing": None}
    return {"step": step, "k": k, "eval": None, "missing": f"04 logged no eval at step {step}: {why_no_eval}"}


def export_final(parallel: str, env: DistEnv, draft, draft_cfg: DraftConfigContract, index, layout: Layout, summary: dict,
                 prediction: dict) -> None:
    """04's train/final/: the vLLM-loadable draft + training_summary.json and prediction.json (prediction_record),
    written by rank 0 under a temp name and renamed. Every rank calls it (under FSDP gathering the weights is
    collective)."""
    full = full_model_state(draft) if (env.distributed and parallel == "fsdp") else None  # collective
    tmp, final = layout.final_tmp, layout.final
    with writing(f"the final draft {final}", tmp, layout.train):
        _export_on_main(env, draft, draft_cfg, index, summary, prediction, full, tmp, final)
    barrier(env)


def _export_on_main(env, draft, draft_cfg, index, summary, prediction, full, tmp: Path, final: Path) -> None:
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        to_export = draft
        if full is not None:  # FSDP: an unsharded copy on CPU
            to_export = family_of_config(draft_cfg).build(draft_cfg)
            to_export.load_state_dict(full, strict=False)
        export_vllm_draft(to_export, tmp, extra_config={"eagle_aux_hidden_state_layer_ids": list(index.aux_layer_ids)})
        atomic_write_json(tmp / TRAINING_SUMMARY, summary)
        atomic_write_json(tmp / PREDICTION_JSON, prediction)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)




def export_best(env: DistEnv, draft_cfg: DraftConfigContract, index, layout: Layout, best: dict | None, last_step: int) -> str:
    """04's train/best/: the checkpoint with the best replayed acceptance length (best["step"]), exported
    like train/final/ plus best.json (step, k, acceptance length) and prediction.json (the eval its
    state.json records). Rank 0 reads the checkpoint's weights from disk, so no collective. Returns the line
    04 prints. Without an eval (no eval split) there is no best: a stale train/best is removed and only
    train/final stands."""
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
        model = family_of_config(draft_cfg).build(draft_cfg)
        model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)  # the frozen embedding is not exported
        export_vllm_draft(model, tmp, extra_config={"eagle_aux_hidden_state_layer_ids": list(index.aux_layer_ids)})
        atomic_write_json(tmp / BEST_JSON, {**best, "checkpoint": str(ckpt.relative_to(layout.train)), "last_step": last_step})
        atomic_write_json(tmp / PREDICTION_JSON, best_prediction(best, ckpt, layout))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    return (f"best checkpoint: step {best['step']} (replayed acceptance length {best['acceptance_length']:.3f} at "
            f"k={best['k']}), exported to {out}")


def best_prediction(best: dict, ckpt: Path, layout: Layout) -> dict:
    """train/best's prediction.json: the eval the best checkpoint's state.json records (04 saves the eval of a
    checkpoint's step with it; a new best is checkpointed right after its eval)."""
    recorded = read_json(ckpt / "state.json")["eval"]  # checkpoint_problem has checked its bytes
    why = f"{ckpt.relative_to(layout.train) / 'state.json'} records no eval of its step"  # never for a best: evaluated first
    return prediction_record(int(best["step"]), int(best["k"]), recorded, why)
