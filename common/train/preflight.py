"""What 04 checks before it trains: the hidden states against the target it loads, the run's fingerprint (what a
checkpoint must agree with to be resumed), and what train/ holds already (complete, resume or fresh).

Every refusal here comes before --overwrite deletes train/ (it may hold a finished draft), and is one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Optional

import torch

from common.core.distributed import DistEnv, on_rank0
from common.core.errors import ConfigError, DataError
from common.core.run_folder import Layout, StageManifest
from common.hidden.index import index_fingerprint
from common.hidden.shards import HiddenIndex
from common.model.draft import family_of_config
from common.target.loading import check_safetensors_readable, target_fingerprint
from common.train.checkpoint import clean_train_dir


def check_target(cfg, index: HiddenIndex, info, layout: Layout, env: DistEnv) -> str:
    """The hidden states were extracted from this target (aux layers, weights, width); returns the target as 04's
    outputs depend on it: its content fingerprint (the same weights at another path are the same target), or the
    hub id when it is not a local folder. Rank 0 hashes (cached by size and mtime); every rank gets the outcome."""
    if list(info.aux_layer_ids) != list(index.aux_layer_ids):
        raise ConfigError(
            f"the hidden states in {layout.hidden} were extracted at aux layers {index.aux_layer_ids} but the "
            f"config resolves target.aux_layer_ids to {info.aux_layer_ids}; rerun 02_extract_hidden.py --overwrite "
            f"(or fix target.aux_layer_ids)")
    recorded = index.raw.get("target_weights")
    if recorded:
        check_safetensors_readable(cfg.target.model)  # a damaged file is named as such, not as "other weights"
    current = on_rank0(lambda: target_fingerprint(layout, cfg.target.model), env)
    if recorded and recorded != current:
        raise DataError(
            f"the hidden states in {layout.hidden} were extracted from other target weights than those in "
            f"target.model {cfg.target.model} now (config.json or *.safetensors changed since 02 ran); training "
            f"on them would teach the draft a target that no longer exists: rerun 02_extract_hidden.py --overwrite, "
            f"or restore the weights")
    if index.target_hidden_size != info.hidden_size:
        raise DataError(
            f"hidden states have width {index.target_hidden_size} but target.model has hidden size "
            f"{info.hidden_size}; they come from another model: rerun 02_extract_hidden.py --overwrite")
    return current or cfg.target.model


def resolve_precision(cfg, device: torch.device) -> torch.dtype:
    """The compute dtype: train.precision "auto" = bf16 on GPU, fp32 on CPU (the master weights stay fp32;
    common.train.step)."""
    p = cfg.train.precision
    if p == "auto":
        p = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if p == "bf16" else torch.float32


def draft_identity(draft_cfg) -> dict:
    """The draft's sizes and its family (two families may share the sizes)."""
    return {**dataclasses.asdict(draft_cfg), "architecture": family_of_config(draft_cfg).architecture}


def run_fingerprint(draft_cfg, data_identity: list, d2t: torch.Tensor, t, init) -> str:
    """What a checkpoint must agree with to be resumable (hyper-parameters like lr may change)."""
    obj = {
        "draft": draft_identity(draft_cfg), "data": data_identity,
        "d2t": hashlib.sha256(d2t.numpy().tobytes()).hexdigest(),
        "batch_max_tokens": t.batch_max_tokens, "seed": t.seed,
        **({"init": init.identity} if init else {}),  # absent without one: older checkpoints still resume
    }
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def train_manifest(layout: Layout, budgeted: bool, target_id: str, draft_cfg, t, init) -> StageManifest:
    """04's record: its inputs by content (under a disk budget the plan, since index.json grows with every round 02
    extracts; else index.json's content, not the target path it names: index_fingerprint) and the settings its
    outputs depend on."""
    hidden = ({layout.name(layout.hidden_plan): layout.hidden_plan} if budgeted else
              {layout.name(layout.hidden_index): index_fingerprint(layout)})
    return StageManifest(
        layout, "04_train",
        inputs={**hidden, **layout.named(layout.vocab_map), **({"train.init_from": init.fingerprint} if init else {})},
        settings={"target": target_id, "draft": draft_identity(draft_cfg), "batch_max_tokens": t.batch_max_tokens,
                  "seed": t.seed, **({"init_vocab": init.mode} if init else {})})


def decide_outputs(manifest: StageManifest, overwrite: bool, total_steps: int, max_steps: Optional[int],
                   restart_rounds) -> str:
    """Rank 0: "complete", "resume" or "fresh", from train/'s stage manifest. Outputs made from another hidden/ or
    vocab/, or another draft, data order or packing, are an error that asks for --overwrite: never a stale
    train/final. --overwrite deletes train/ and has 02 extract the rounds again from the first (restart_rounds)."""
    layout = manifest.layout
    if overwrite:
        clean_train_dir(layout)
        restart_rounds()
    decision = manifest.begin(overwrite, outputs=[layout.final], started=layout.final.exists() or layout.checkpoints.exists())
    done = int(manifest.result.get("steps", -1))
    if decision == "complete" and done < total_steps:
        manifest.partial(manifest.result)  # more steps asked for: train on from the last checkpoint
        decision = "resume"
    elif decision == "complete" and done > total_steps:
        raise ConfigError(
            f"{layout.final} holds a draft trained for {done} steps but this config trains {total_steps} "
            f"(train.max_steps={max_steps}); set train.max_steps back to {done} (or more, to train "
            f"on), or rerun with --overwrite to train a {total_steps}-step draft")
    return decision
