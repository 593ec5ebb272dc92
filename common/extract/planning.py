"""Stage 02's plan, hidden/plan.json: which samples go in which shard, in which order, fixed before the first
forward pass (docs/design.md#artifact-formats and #resume-rules).

- make_plan scans every input sample (common.extract.scan) and cuts each split, train then eval, in input
  order, into contiguous runs of samples up to extract.shard_max_tokens (make_plan_shards); within a shard the
  samples are longest first. The plan is deterministic, so a resumed run reproduces the same shards and
  batches (on CPU, byte-identical shards).
- write_plan saves it atomically before any shard, after recording its sha256 in 02's manifest; load_plan
  refuses a plan whose settings, budget or sha256 disagree (edited or replaced) before anything is extracted
  by it, and an index or plan in a format_version this code does not read (common.hidden.shards) is an error
  that suggests --overwrite.

Rounds under a disk budget (extract.max_disk_gb; docs/design.md#rounds-under-a-disk-budget)
- When the data set does not fit, plan_rounds cuts each epoch's seeded permutation of the train samples into
  rounds that fit beside the eval shards; a run extracts the rounds that are due (not in hidden/consumed.json,
  which 04 writes) and exits. Everything about shards and resume holds within a round. Reading the rounds back
  (what is due, what may be deleted) is common.hidden.rounds' (HiddenPlan).
- The budget covers every file in hidden/: beside the shards (bounded by shard_bytes), make_plan reserves
  plan.json's "reserve_bytes" for the bookkeeping (plan.json, index.json, index fragments, consumed.json and the
  temp copies of their atomic rewrites; common.hidden.index.bookkeeping_bytes), measured on the plan itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from common.core.errors import ConfigError, DataError
from common.core.io import atomic_write_text, file_sha256, format_bytes
from common.core.run_folder import Layout, StageManifest
from common.extract.scan import InputSample, SplitScan, scan_split, shard_order
from common.hidden.index import bookkeeping_bytes, index_header, json_text
from common.hidden.rounds import HiddenPlan
from common.hidden.shards import FORMAT_VERSION, bytes_per_token
from common.target.loading import target_fingerprint

log = logging.getLogger("extract")


def plan_settings(cfg, info) -> dict:
    """Every setting that changes the stored features: plan.json's "settings" and 02's manifest's."""
    return {
        "aux_layer_ids": list(info.aux_layer_ids),
        "num_target_layers": info.num_layers,
        "target_hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "model_type": info.model_type,
        "target_dtype": cfg.target.dtype,
        "dtype": cfg.extract.dtype,
        "shard_max_tokens": cfg.extract.shard_max_tokens,
        "storage": cfg.extract.storage,
        # rounds under a disk budget: the rounds are cut per epoch from a permutation seeded by train.seed
        **({"max_disk_gb": cfg.extract.max_disk_gb, "epochs": cfg.train.epochs, "seed": cfg.train.seed}
           if cfg.extract.max_disk_gb is not None else {}),
        **({"stream": True} if cfg.extract.stream else {}),  # rounds of half the budget
    }


def plan_header(cfg, layout: Layout, plan: HiddenPlan) -> dict:
    """index.json's header for this plan (common.hidden.index.index_header)."""
    return index_header(plan.settings, cfg.target.model, plan.doc["inputs"], target_fingerprint(layout, cfg.target.model))


# ---------------------------------------------------------------------------------------------
# Sizes: what a planned shard takes on disk, at most (the disk budget and the disk check use them)
# ---------------------------------------------------------------------------------------------

SHARD_OVERHEAD = 1024  # a shard's safetensors header, at most (the sample offsets are counted per sample)


def sample_bytes(length: int, per_token: int) -> int:
    """What one sample takes in a shard: its rows and its sample_offsets entry."""
    return length * per_token + 8


def shard_bytes(shard: dict, per_token: int) -> int:
    """A planned shard's size on disk, at most: its samples and the header (SHARD_OVERHEAD)."""
    return shard["num_tokens"] * per_token + 8 * shard["num_samples"] + SHARD_OVERHEAD


# ---------------------------------------------------------------------------------------------
# Cutting the samples into shards (and, under a budget, rounds)
# ---------------------------------------------------------------------------------------------


def make_plan_shards(scans: list[SplitScan], shard_max_tokens: int, layout: Layout, first: int = 0) -> list[dict]:
    """Cut each split, in input order, into runs of samples with at most shard_max_tokens tokens.
    Shard k is the file Layout.shard(first + k)."""
    shards: list[dict] = []

    def close(scan: SplitScan, run: list[InputSample]) -> None:
        first_sample, last = run[0].position, run[-1].position
        ordered = shard_order(run)
        # train shards carry their samples' lengths: 04 packs every epoch from the plan (common.hidden.rounds)
        lengths = {"lengths": [s.length for s in ordered]} if scan.split == "train" else {}
        shards.append({
            "file": layout.shard(first + len(shards)).name,
            "split": scan.split,
            "byte_start": scan.line_offsets[first_sample],
            "byte_end": scan.line_offsets[last + 1],
            "num_samples": len(run),
            "num_tokens": sum(s.length for s in run),
            "sample_ids": [s.id for s in ordered],
            **lengths,
        })

    for scan in scans:
        run, tokens = [], 0
        for s in scan.samples:
            if run and tokens + s.length > shard_max_tokens:
                close(scan, run)
                run, tokens = [], 0
            run.append(s)
            tokens += s.length
        if run:
            close(scan, run)
    return shards


def plan_rounds(cfg, train: SplitScan, per_token: int, layout: Layout, eval_bytes: int, reserve: int
                ) -> tuple[list[dict], list[dict]]:
    """Rounds mode (extract.max_disk_gb): (train shards, rounds) for a budget that also holds the eval shards
    (eval_bytes) and the bookkeeping (reserve: plan.json, index.json, ...; bookkeeping_bytes).

    Per epoch, a seeded permutation (train.seed, epoch) of the train samples is cut into rounds whose shards
    fit the budget next to the eval shards (kept from the first round to the last; streaming: two rounds
    fit, so each is cut at half of what is left), and each round into
    shards of at most extract.shard_max_tokens tokens. A round is a fair random share of the data; epoch e+1
    re-extracts in another order (docs/design.md#rounds-under-a-disk-budget)."""
    import numpy as np

    budget = int(cfg.extract.max_disk_gb * 1e9)
    shard_max = cfg.extract.shard_max_tokens
    # streaming: two rounds on disk at once, the one 04 trains and the one 02 extracts
    slots = 2 if cfg.extract.stream else 1
    capacity = (budget - eval_bytes - reserve) // slots
    largest = max(sample_bytes(s.length, per_token) for s in train.samples) + SHARD_OVERHEAD
    if capacity < largest:
        two = " and, streaming, two rounds of" if slots == 2 else ""
        raise ConfigError(
            f"extract.max_disk_gb={cfg.extract.max_disk_gb:g} cannot hold the eval shards ({format_bytes(eval_bytes)}), "
            f"02's and 04's bookkeeping in hidden/ (plan.json, index.json, consumed.json: {format_bytes(reserve)}){two} and the "
            f"longest train sample ({format_bytes(largest)}); raise extract.max_disk_gb to at least "
            f"{(eval_bytes + reserve + slots * largest) / 1e9:.3g} (a few rounds' worth is better: each round restarts the engine)")
    shards: list[dict] = []
    rounds: list[dict] = []
    for epoch in range(cfg.train.epochs):
        order = np.random.default_rng([cfg.train.seed, epoch]).permutation(len(train.samples))
        run: list[InputSample] = []
        run_tokens = run_bytes = 0  # the open shard's
        files: list[str] = []
        used = 0  # bytes of the round's closed shards

        def close_shard() -> None:
            nonlocal run, run_tokens, run_bytes, used
            if run:
                ordered = shard_order(run)
                shards.append({
                    "file": layout.shard(len(shards)).name, "split": "train", "epoch": epoch, "round": len(rounds),
                    "lines": [[train.line_offsets[x.position], train.line_offsets[x.position + 1]] for x in ordered],
                    "num_samples": len(run), "num_tokens": run_tokens,
                    "sample_ids": [x.id for x in ordered], "lengths": [x.length for x in ordered]})
                files.append(shards[-1]["file"])
                used += run_bytes + SHARD_OVERHEAD
                run, run_tokens, run_bytes = [], 0, 0

        def close_round() -> None:
            nonlocal files, used
            close_shard()
            if files:
                mine = shards[-len(files):]
                rounds.append({"epoch": epoch, "shards": files, "num_samples": sum(sh["num_samples"] for sh in mine),
                               "num_tokens": sum(sh["num_tokens"] for sh in mine), "bytes": used})
                files, used = [], 0

        for k in order.tolist():
            sample = train.samples[k]
            size = sample_bytes(sample.length, per_token)
            if run and run_tokens + sample.length > shard_max:
                close_shard()
            if used + run_bytes + SHARD_OVERHEAD + size > capacity:
                close_round()
            run.append(sample)
            run_tokens += sample.length
            run_bytes += size
        close_round()
    return shards, rounds


def make_plan(cfg, info, paths: dict[str, Path], layout: Layout) -> HiddenPlan:
    """Check every sample and fix which samples go in which shard, before the first forward pass (the
    caller saves it: write_plan). paths: the inputs by split (common.extract.scan.input_paths)."""
    from common.extract.vllm_backend import check_prompt_lengths, max_model_len, resolve_backend

    value = getattr(info.text_config, "max_position_embeddings", None)
    max_pos = int(value) if value else None
    scans = [scan_split(p, split, info.vocab_size, max_pos, cfg.target.model) for split, p in paths.items()]
    if not scans[0].samples:
        raise DataError(f"{paths['train']} has no samples; rerun 01b_generate_synthetic.py")
    ids = [s.id for scan in scans for s in scan.samples]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(f"sample id '{dup}' appears more than once in data/train.jsonl + data/eval.jsonl; ids must be unique")
    if resolve_backend(cfg) == "vllm":  # before --overwrite deletes anything, not at the first long sample
        check_prompt_lengths(max_model_len(cfg, info) - 1, ((s.id, s.length) for scan in scans for s in scan.samples))
    per_token = bytes_per_token(len(info.aux_layer_ids), info.hidden_size, cfg.extract.dtype, cfg.extract.storage)
    shard_max = cfg.extract.shard_max_tokens
    whole = {
        "format_version": FORMAT_VERSION,
        "settings": plan_settings(cfg, info),
        "batch_max_tokens": cfg.extract.batch_max_tokens,
        "inputs": {scan.split: {"file": layout.name(scan.path), "sha256": scan.sha256, "num_samples": len(scan.samples),
                                "num_tokens": sum(s.length for s in scan.samples)} for scan in scans},
        "shards": make_plan_shards(scans, shard_max, layout),
    }
    if cfg.extract.max_disk_gb is None:
        return HiddenPlan(whole)
    # extract.max_disk_gb bounds every file in hidden/: the shards, and the bookkeeping (plan.json, index.json,
    # consumed.json, ...), which grows with the number of shards and rounds. Plan with a reserve for it, measure
    # what that plan's bookkeeping takes, and plan again with more until the reserve holds it.
    budget = int(cfg.extract.max_disk_gb * 1e9)
    header = plan_header(cfg, layout, HiddenPlan(whole))

    def bound(shard: dict) -> int:
        return shard_bytes(shard, per_token)

    eval_bytes = sum(bound(s) for s in make_plan_shards(scans[1:], shard_max, layout))
    reserve = 0
    while True:
        if sum(bound(s) for s in whole["shards"]) + reserve <= budget:
            doc = whole
        else:
            train_shards, rounds = plan_rounds(cfg, scans[0], per_token, layout, eval_bytes, reserve)
            doc = {**whole, "shards": train_shards + make_plan_shards(scans[1:], shard_max, layout, first=len(train_shards)),
                   "rounds": rounds, "max_disk_bytes": budget, "eval_bytes": eval_bytes, "reserve_bytes": reserve}
        need = bookkeeping_bytes(doc, header, bound)
        if need <= reserve:
            break
        reserve = need + need // 8  # a little more: a tighter cut adds shards, and with them plan and index bytes
    plan = HiddenPlan(doc)
    if plan.budgeted:
        rounds, epochs = plan.rounds, cfg.train.epochs
        print(f"02_extract_hidden: the data set does not fit extract.max_disk_gb={cfg.extract.max_disk_gb:g}: {len(rounds)} rounds "
              f"for {epochs} epoch(s) (~{len(rounds) / epochs:.1f} per epoch, up to {format_bytes(max(r.bytes for r in rounds))} "
              f"each, beside {format_bytes(plan.eval_bytes)} of eval shards and up to {format_bytes(plan.reserve_bytes)} "
              f"of plan, index and bookkeeping); 02 extracts a round, 04 trains on it and deletes it (run_pipeline.py "
              f"alternates them)", flush=True)
    return plan


# ---------------------------------------------------------------------------------------------
# Saving the plan, and loading it back on a rerun
# ---------------------------------------------------------------------------------------------


def write_plan(layout: Layout, manifest: StageManifest, plan: HiddenPlan) -> HiddenPlan:
    """Save the plan; its sha256 goes into 02's manifest first, so that a plan edited or replaced later
    is refused (load_plan) instead of trusted (a kill between the two leaves no plan: it is made again)."""
    text = json_text(plan.doc)
    manifest.partial({**manifest.result, "plan_sha256": hashlib.sha256(text.encode()).hexdigest()}, outcome="running")
    atomic_write_text(layout.hidden_plan, text)
    return plan


def load_plan(cfg, info, layout: Layout, recorded_sha256: str | None) -> HiddenPlan:
    """plan.json as 02 made it for this config. A plan whose settings or budget disagree with the config, or
    whose sha256 is not the one write_plan recorded, was edited or replaced: extracting by it could break
    extract.max_disk_gb or mix samples, so it is refused before anything is deleted or extracted."""
    plan_path = layout.hidden_plan
    plan = HiddenPlan.read(plan_path)
    redo = (f"restore the plan 02 made, or rerun 02_extract_hidden.py with --overwrite to plan again (it deletes what "
            f"{layout.hidden} holds)")
    settings = json.loads(json.dumps(plan_settings(cfg, info)))
    planned = plan.settings if isinstance(plan.settings, dict) else {}
    changed = sorted(k for k in set(settings) | set(planned) if planned.get(k) != settings.get(k))
    if changed:
        raise DataError(f"{plan_path} was made for other settings than the config's ("
                        f"{'; '.join(f'{k}: {json.dumps(planned.get(k))} in the plan, {json.dumps(settings.get(k))} now' for k in changed)}); {redo}")
    if plan.budgeted and plan.max_disk_bytes != int(cfg.extract.max_disk_gb * 1e9):
        raise DataError(f"{plan_path} cuts its rounds for max_disk_bytes {json.dumps(plan.max_disk_bytes)}, but "
                        f"extract.max_disk_gb={cfg.extract.max_disk_gb:g} is {int(cfg.extract.max_disk_gb * 1e9)} bytes: the plan "
                        f"was edited; {redo}")
    if recorded_sha256 is not None and file_sha256(plan_path) != recorded_sha256:
        raise DataError(f"{plan_path} is not the plan 02 made (its sha256 differs from the one recorded in "
                        f"{layout.manifest('02_extract_hidden')}): it was edited or replaced; {redo}")
    planned_batch = plan.doc.get("batch_max_tokens")
    if planned_batch != cfg.extract.batch_max_tokens:
        log.warning("extract.batch_max_tokens changed (%s -> %s): new shards are batched differently (same values "
                    "up to rounding, not byte-identical)", planned_batch, cfg.extract.batch_max_tokens)
    return plan
