"""Stage 02: run the target over every tokenized sample and store the hidden states EAGLE-3 trains on.

Output under run_dir/hidden/ (docs/design.md#artifact-formats; paths from common.core.run_folder.Layout):
    the shards and index.json, in the format common.hidden.shards owns (writer, index, verification):
        one row per token, samples concatenated; per shard, the index lists file, split, sample_ids (in
        shard order), num_tokens, sha256, bytes; "complete" once every planned shard is written
    plan.json    which samples go in which shard, fixed before the first forward pass (here)

Which tensors, and why (docs/design.md#aux-layer-convention and #artifact-formats)
- aux id k = the residual stream after k decoder layers = the input of decoder layer k, captured by a
  forward pre-hook on layers[k] of the decoder stack (ids ascending: vLLM hands them over in layer order).
- final_hidden = the final-norm output = exactly what the target lm_head reads; 04 applies the lm_head
  in chunks (H_t values per token instead of V logits: 23x smaller for Kimi-K2.5).
- Only the decoder stack runs (no [T, V] logits) and output_hidden_states is never asked for; hooks copy
  the needed states at unpadded positions to CPU in extract.dtype as soon as a layer produces them.

Batching and memory
- Samples of one shard are sorted by length (longest first, ties by input order) and packed into
  right-padded batches with rows * max_len <= extract.batch_max_tokens (a single longer sample gets a
  batch of its own); the attention mask hides the padding. A batch's results go to CPU immediately;
  a shard is written when complete, so host memory is bounded by one shard being filled plus one being
  written (by a background thread, overlapping disk I/O and hashing with the next forward passes).
  Peak host RAM ~ 2 * shard_max_tokens * bytes_per_token: pick shard_max_tokens accordingly
  (Kimi-K2.5 bf16: 57,353 B/token, so 65,536 tokens per shard = 3.8 GB per shard).

Resume and integrity
- plan.json is computed once from the input files (deterministic: train then eval, input order,
  contiguous runs of samples up to shard_max_tokens) and saved atomically before any shard. Resume works
  at shard granularity and reproduces the same batches, so on CPU a resumed run writes byte-identical
  shards. Shards are written to a temp name and renamed (common.hidden.shards.write_shard); the index
  is rewritten atomically after every shard with the shard's sha256 (computed while writing).
- On rerun every indexed shard is verified (common.hidden.shards.verify_entry with extract.verify:
  sha256, or size for huge runs); a missing, truncated or corrupted shard is reported and recomputed.
  An index or plan in a format_version this code does not read is an error that suggests --overwrite. A shard file that exists but is not in the
  index (killed between rename and index update) is recomputed. Changed inputs or settings are a clear
  error that suggests --overwrite. plan.json's sha256 is recorded in 02's manifest before the plan is
  written; a plan whose settings, budget or sha256 disagree (edited or replaced) is refused before anything
  is extracted by it. The temp files and vllm request directories a killed run left are removed.
- --overwrite: everything that can refuse comes first (check_overwrite: every sample, the new plan, the free
  disk; then the backend's own start), and only then are the previous outputs deleted.

Rounds under a disk budget (extract.max_disk_gb; docs/design.md#rounds-under-a-disk-budget)
- When the data set does not fit, plan_rounds cuts each epoch's seeded permutation of the train samples
  into rounds that fit beside the eval shards; a run extracts the rounds that are due (not in
  hidden/consumed.json, which 04 writes) and exits. Everything above holds within a round.
- The budget covers every file in hidden/: beside the shards (bounded by shard_bytes), make_plan reserves
  plan["reserve_bytes"] for the bookkeeping (plan.json, index.json, index fragments, consumed.json and the temp
  copies of their atomic rewrites; common.hidden.shards.bookkeeping_bytes), measured on the plan itself.

Placement and multi-GPU
- Single process: extract.device (auto = cuda if available, else cpu). target.device_map "auto" puts the
  model on one GPU if its weights fit in 90% of that GPU's memory, else shards it over all visible GPUs
  with transformers device_map="auto" (layers on different GPUs, run one after the other: it works for
  any size that fits the node, at 1/num_gpus utilisation). Any other value ("balanced", "sequential")
  is passed to transformers as is.
- torchrun (WORLD_SIZE > 1): data parallel, one full model copy per GPU (cuda:LOCAL_RANK). Rank 0 does
  the setup (plan, verification, disk check) and broadcasts it over a gloo process group; shard k goes
  to rank k % world_size; each rank writes its shards and an index fragment (Layout.index_fragment,
  atomic); rank 0 merges the fragments into index.json after each of its shards and once more after
  the final barrier (the merge is a pure function of the fragments, so it is idempotent).

Backends (extract.backend; docs/design.md#hidden-state-extraction-through-vllm)
- hf: the above, the target in transformers. The reference, and for targets vLLM cannot run; it refuses
  a target whose materialised weights (quantized ones decompressed, e.g. Kimi-K2.5's int4 experts to
  bf16) exceed the memory it would use, naming the vllm backend.
- vllm (auto = vllm where installed): the target runs in vLLM with its "extract_hidden_states" method
  and our KV connector (common/extract/vllm_backend.py, common/extract/vllm_connector.py), with TP/DP/EP from
  extract.*; same plan, shards, index and resume as above, one request per sample.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tqdm import tqdm

from common.target.loading import target_fingerprint
from common.target.tokenization import check_token_range, parse_tokenized_line
from common.core.errors import ConfigError, DataError
from common.core.io import atomic_write_text, bytes_bar, file_sha256, format_bytes, read_json
from common.core.run_folder import Layout, StageManifest, remember_fingerprint
from common.hidden.stream import StreamWait
from common.hidden.shards import (FORMAT_VERSION, bookkeeping_bytes, build_index, bytes_per_token, check_format_version,
                                  describe_bytes_per_token, index_header, json_text, read_consumed, read_entries, rounds_on_disk,
                                  shard_entry, verify_entry, write_fragment, write_index, write_shard)

if TYPE_CHECKING:  # torch is imported only when the stage runs
    from common.core.distributed import DistEnv

log = logging.getLogger("extract")

# ---------------------------------------------------------------------------------------------
# Inputs: one pass over train.jsonl / eval.jsonl validates every sample and records where it is.
# ---------------------------------------------------------------------------------------------


@dataclass
class InputSample:
    """One tokenized sample of data/{split}.jsonl as the scan saw it (the plan is made of these)."""

    id: str
    length: int  # tokens
    position: int  # line order within its split


@dataclass
class SplitScan:
    split: str
    path: Path
    sha256: str
    samples: list[InputSample]
    line_offsets: list[int]  # byte offset of each sample's line, plus the file size at the end


def parse_sample(line: bytes, path: Path, lineno: int) -> dict:
    """Parse and check one tokenized line; 02 additionally refuses empty samples."""
    sample = parse_tokenized_line(line, path, lineno)
    if not sample["input_ids"]:
        raise DataError(f"sample '{sample['id']}' ({path}:{lineno}) has no tokens; remove it or rerun 01b_generate_synthetic.py")
    return sample


def check_sample(sample: dict, vocab_size: int, max_positions: int | None, model: str) -> None:
    sid, ids = sample["id"], sample["input_ids"]
    check_token_range(sample, vocab_size, f"'{model}'")
    if max_positions is not None and len(ids) > max_positions:
        raise DataError(
            f"sample '{sid}' has {len(ids)} tokens, more than the target's max_position_embeddings {max_positions}; "
            f"lower tokenize.max_seq_len and rerun 01b_generate_synthetic.py"
        )


def scan_split(path: Path, split: str, vocab_size: int, max_positions: int | None, model: str) -> SplitScan:
    h = hashlib.sha256()
    samples, offsets = [], []
    pos = 0
    with open(path, "rb") as f, bytes_bar(path.stat().st_size, f"02 scan {path.name}") as bar:
        for lineno, line in enumerate(f, start=1):
            h.update(line)
            bar.update(len(line))
            start, pos = pos, pos + len(line)
            if not line.strip():
                continue
            row = parse_sample(line, path, lineno)
            check_sample(row, vocab_size, max_positions, model)
            offsets.append(start)
            samples.append(InputSample(row["id"], len(row["input_ids"]), len(samples)))
    offsets.append(pos)
    return SplitScan(split, path, h.hexdigest(), samples, offsets)


def input_paths(layout: Layout) -> dict[str, Path]:
    train = layout.train_jsonl
    if not train.is_file():
        raise DataError(f"{train} not found; run 01b_generate_synthetic.py first (it writes data/train.jsonl and data/eval.jsonl)")
    paths = {"train": train}
    if layout.eval_jsonl.is_file():
        paths["eval"] = layout.eval_jsonl
    return paths


def stage_manifest(cfg, info):
    """02's record (common.core.run_folder): the tokenized inputs by content, and every setting that
    changes the stored features (aux layers, target, dtype, shard plan)."""
    layout = Layout.of(cfg)
    inputs = layout.named(*input_paths(layout).values())
    target_config = Path(cfg.target.model) / "config.json"
    if target_config.is_file():
        inputs["target config.json"] = target_config
    weights = target_fingerprint(layout, cfg.target.model)
    if weights:  # new weights in the same shapes change every hidden state
        inputs["target weights"] = weights
    return StageManifest(layout, "02_extract_hidden", inputs=inputs, settings=_settings(cfg, info),
                         added_later=["target weights"])


# ---------------------------------------------------------------------------------------------
# The plan: which samples go in which shard, in which order. Fixed before the first forward pass.
# ---------------------------------------------------------------------------------------------


def shard_order(samples: list[InputSample]) -> list[InputSample]:
    """Longest first (padding is limited and the largest batch, the likeliest OOM, comes first)."""
    return sorted(samples, key=lambda s: (-s.length, s.position))


def make_plan_shards(scans: list[SplitScan], shard_max_tokens: int, layout: Layout, first: int = 0) -> list[dict]:
    """Cut each split, in input order, into runs of samples with at most shard_max_tokens tokens.
    Shard k is the file Layout.shard(first + k)."""
    shards: list[dict] = []

    def close(scan: SplitScan, run: list[InputSample]) -> None:
        first_sample, last = run[0].position, run[-1].position
        shards.append({
            "file": layout.shard(first + len(shards)).name,
            "split": scan.split,
            "byte_start": scan.line_offsets[first_sample],
            "byte_end": scan.line_offsets[last + 1],
            "num_samples": len(run),
            "num_tokens": sum(s.length for s in run),
            "sample_ids": [s.id for s in shard_order(run)],
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


SHARD_OVERHEAD = 1024  # a shard's safetensors header, at most (the sample offsets are counted per sample)


def sample_bytes(length: int, per_token: int) -> int:
    """What one sample takes in a shard: its rows and its sample_offsets entry."""
    return length * per_token + 8


def shard_bytes(shard: dict, per_token: int) -> int:
    """A planned shard's size on disk, at most: its samples and the header (SHARD_OVERHEAD)."""
    return shard["num_tokens"] * per_token + 8 * shard["num_samples"] + SHARD_OVERHEAD


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


def read_shard_samples(path: Path, shard: dict) -> list[dict]:
    """The shard's samples from the input file, in shard order (as the plan lists them)."""
    if "lines" in shard:  # rounds mode: a random share of the file, one byte range per sample
        with open(path, "rb") as f:
            rows = []
            for start, end in shard["lines"]:
                f.seek(start)
                rows.append(parse_sample(f.read(end - start), path, 0))
        if [r["id"] for r in rows] != shard["sample_ids"]:
            raise DataError(f"{path} changed since hidden/plan.json was made; rerun 02_extract_hidden.py with --overwrite")
        return rows
    with open(path, "rb") as f:
        f.seek(shard["byte_start"])
        data = f.read(shard["byte_end"] - shard["byte_start"])
    rows = [parse_sample(line, path, 0) for line in data.split(b"\n") if line.strip()]
    refs = shard_order([InputSample(r["id"], len(r["input_ids"]), i) for i, r in enumerate(rows)])
    ordered = [rows[r.position] for r in refs]
    if [r["id"] for r in ordered] != shard["sample_ids"]:
        raise DataError(f"{path} changed since hidden/plan.json was made; rerun 02_extract_hidden.py with --overwrite")
    return ordered


# ---------------------------------------------------------------------------------------------
# Disk space
# ---------------------------------------------------------------------------------------------


def check_disk_space(hidden_dir: Path, needed: int, min_free_gb: float, disk_usage: Callable = shutil.disk_usage,
                     freed: int = 0) -> None:
    """freed: what --overwrite will delete first (it is checked before the deletion)."""
    free = disk_usage(hidden_dir).free + freed
    headroom = int(min_free_gb * 1e9)
    required = needed + headroom  # the shards, and the head-room left free after them
    if required > free:
        raise DataError(
            f"not enough disk space in {hidden_dir}: need {format_bytes(needed)} for the shards + {format_bytes(headroom)} "
            f"head-room (extract.min_free_disk_gb={min_free_gb:g}) = {format_bytes(required)}, free {format_bytes(free)}; "
            f"{format_bytes(required - free)} missing: free space, move run_dir, or set extract.storage: fp8 (half of bf16)"
        )


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------


def _settings(cfg, info) -> dict:
    return {
        "aux_layer_ids": list(info.aux_layer_ids),
        "num_target_layers": info.num_layers,
        "target_hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "model_type": info.model_type,
        "target_dtype": cfg.target.dtype,
        "dtype": cfg.extract.dtype,
        "shard_max_tokens": cfg.extract.shard_max_tokens,
        # only when not "full": run folders made before extract.storage existed stay complete
        **({"storage": cfg.extract.storage} if cfg.extract.storage != "full" else {}),
        # rounds under a disk budget: the rounds are cut per epoch from a permutation seeded by train.seed
        **({"max_disk_gb": cfg.extract.max_disk_gb, "epochs": cfg.train.epochs, "seed": cfg.train.seed}
           if cfg.extract.max_disk_gb is not None else {}),
        **({"stream": True} if cfg.extract.stream else {}),  # rounds of half the budget
    }


def _warn_vllm_limits(info) -> None:
    # vLLM's DeepSeek-V2/V3 stack (also Kimi-K2.x) computes aux = hidden + residual before layer idx,
    # with residual None before layer 0, so id 0 crashes there (llama-style stacks handle it).
    if 0 in info.aux_layer_ids and any(s in info.model_type for s in ("deepseek", "kimi")):
        log.warning("aux layer id 0 (the embeddings) works here but vLLM %s targets cannot capture it "
                    "(deepseek_v2.py adds a None residual); use ids >= 1 for a draft you will serve", info.model_type)


def _max_positions(info) -> int | None:
    value = getattr(info.text_config, "max_position_embeddings", None)
    return int(value) if value else None


def prepare(cfg, info, layout: Layout, fresh: dict | None = None) -> dict:
    """Rank 0's setup: plan (new or checked), verification of existing shards, disk check.

    fresh: --overwrite's new plan, made by check_overwrite, which checked everything that can refuse
    before this deletes the previous outputs.
    Returns {"status": "complete"|"todo", "plan", "entries", "todo": [shard files], ...}.
    """
    paths = input_paths(layout)
    manifest = stage_manifest(cfg, info)
    plan_path = layout.hidden_plan
    if fresh is not None:
        delete_outputs(layout)
        manifest.begin(True)
        plan = write_plan(layout, manifest, fresh)
    else:
        clear_temp(layout)
        # Changed inputs or settings since the plan was made: one error asking for --overwrite.
        manifest.begin(False, outputs=[layout.hidden_index], started=plan_path.is_file())
        if plan_path.is_file():
            plan = load_plan(cfg, info, layout, manifest.result.get("plan_sha256"))
        else:
            plan = write_plan(layout, manifest, make_plan(cfg, info, paths, layout))
    header = plan_header(cfg, layout, plan)
    todo, entries, note = survey(cfg, layout, plan)
    if not todo:
        index = build_index(header, plan["shards"], entries)
        existing = read_json(layout.hidden_index) if layout.hidden_index.is_file() else None
        # an index written before 02 recorded target_weights stays as it is: 04 fingerprints index.json
        if existing is None or existing not in (index, {k: v for k, v in index.items() if k != "target_weights"}):
            write_index(layout.hidden_index, index)
        for frag in layout.index_fragments():
            frag.unlink(missing_ok=True)
        return {"status": "complete", "plan": plan, "entries": entries, "todo": [], "header": header, "note": note,
                "complete": index["complete"]}
    if fresh is None:  # check_overwrite checked the disk before the deletion
        check_disk_for(cfg, layout, plan, header, todo)
    write_index(layout.hidden_index, build_index(header, plan["shards"], entries))
    return {"status": "todo", "plan": plan, "entries": entries, "todo": todo, "header": header, "note": note}


def check_overwrite(cfg, info, layout: Layout) -> dict:
    """--overwrite, rank 0: everything that can refuse, before anything is deleted (a refused --overwrite
    leaves the previous outputs whole): every input sample, the new plan (the disk budget) and the free
    disk space its first shards need, counting what the deletion frees. Returns the plan (not written)."""
    paths = input_paths(layout)
    clear_temp(layout)
    plan = make_plan(cfg, info, paths, layout)
    header = plan_header(cfg, layout, plan)
    freed = sum(p.stat().st_size for p in outputs_of(layout) if p.is_file())
    check_disk_for(cfg, layout, plan, header, due_shards(plan, set()), freed)
    return plan


def plan_header(cfg, layout: Layout, plan: dict) -> dict:
    """index.json's header for this plan (common.hidden.shards.index_header)."""
    return index_header(plan["settings"], cfg.target.model, plan["inputs"], target_fingerprint(layout, cfg.target.model))


def due_shards(plan: dict, consumed: set[int]) -> list[str]:
    """The shards that should be on disk now: all of them, or in rounds mode the eval shards first (so
    that a streaming 04 can start) and then the next rounds that fit the budget."""
    if "rounds" not in plan:
        return [s["file"] for s in plan["shards"]]
    now = rounds_on_disk(plan, consumed)
    return ([s["file"] for s in plan["shards"] if s["split"] != "train"] +
            [s["file"] for s in plan["shards"] if s["split"] == "train" and s["round"] in now])


def survey(cfg, layout: Layout, plan: dict, known: dict[str, dict] | None = None) -> tuple[list[str], dict[str, dict], str | None]:
    """What is due now: (the wanted shards not on disk and sound, in extraction order; the index entries to
    keep; in rounds mode, what to tell the user). known: entries this process wrote or verified itself
    (streaming: not hashed again while their files are there)."""
    wanted, kept, note = [s["file"] for s in plan["shards"]], {}, None
    if "rounds" in plan:
        wanted, kept, note = round_shards_wanted(layout, plan)
    known = {f: e for f, e in (known or {}).items() if f in wanted and (layout.hidden / f).is_file()}
    good = {**known, **verified_shards(cfg, layout, plan, set(wanted) - set(known))}
    return [f for f in wanted if f not in good], {**kept, **good}, note


def round_shards_wanted(layout: Layout, plan: dict) -> tuple[list[str], dict[str, dict], str]:
    """Rounds mode: the shards that should be on disk now (the eval shards first, so that a streaming 04
    can start, then the next rounds that fit the budget), the index entries of the consumed rounds'
    shards, and what to tell the user. Train shards of rounds not due now are deleted: 04 deletes a
    round once it is trained, but a kill may come between its record in consumed.json and the deletion,
    and the budget holds only if nothing else is there."""
    consumed = read_consumed(layout.hidden_consumed)
    rounds = plan["rounds"]
    now = rounds_on_disk(plan, consumed)
    entries = read_entries(layout.hidden_index, layout.index_fragments())
    gone = {f for r in consumed for f in rounds[r]["shards"]}
    kept = {f: e for f, e in entries.items() if f in gone}
    wanted = due_shards(plan, consumed)
    due = set(wanted)
    for s in plan["shards"]:
        if s["split"] == "train" and s["file"] not in due:
            (layout.hidden / s["file"]).unlink(missing_ok=True)
    if now:
        which = f"round {now[0] + 1}" if len(now) == 1 else f"rounds {now[0] + 1}-{now[-1] + 1}"
        note = (f"{which} of {len(rounds)} (epoch {rounds[now[0]]['epoch'] + 1}) extracted; run 04_train.py to train on it "
                f"(it deletes it), then 02 again for the next one (run_pipeline.py alternates them)")
    else:
        note = f"all {len(rounds)} rounds extracted and trained on; nothing left to extract"
    return wanted, kept, note


def outputs_of(layout: Layout) -> list[Path]:
    """Everything 02 wrote (and 04's consumed.json, which belongs to 02's plan): what --overwrite deletes."""
    return layout.shard_files() + [layout.hidden_index, *layout.index_fragments(), layout.hidden_plan, layout.hidden_consumed]


def delete_outputs(layout: Layout) -> None:
    """--overwrite, once everything that can refuse has been checked (check_overwrite)."""
    for p in outputs_of(layout):
        p.unlink(missing_ok=True)


def clear_temp(layout: Layout) -> None:
    """What a killed 02 left behind, never visible under a final name: temp files of atomic writes, and the
    vllm backend's request directories (an engine is opened after this, so none of them is in use). A temp
    copy of consumed.json is 04's: a streaming 04 may be writing it right now."""
    hidden_dir = layout.hidden
    hidden_dir.mkdir(parents=True, exist_ok=True)
    for tmp in hidden_dir.glob(".tmp-*"):
        if not tmp.name.startswith(f".tmp-{layout.hidden_consumed.name}."):
            tmp.unlink(missing_ok=True)
    for requests in layout.vllm_requests_dirs():
        shutil.rmtree(requests, ignore_errors=True)


def write_plan(layout: Layout, manifest: StageManifest, plan: dict) -> dict:
    """Save the plan; its sha256 goes into 02's manifest first, so that a plan edited or replaced later
    is refused (load_plan) instead of trusted (a kill between the two leaves no plan: it is made again)."""
    text = json_text(plan)
    manifest.partial({**manifest.result, "plan_sha256": hashlib.sha256(text.encode()).hexdigest()}, outcome="running")
    atomic_write_text(layout.hidden_plan, text)
    return plan


def load_plan(cfg, info, layout: Layout, recorded_sha256: str | None) -> dict:
    """plan.json as 02 made it for this config. A plan whose settings or budget disagree with the config, or
    whose sha256 is not the one write_plan recorded, was edited or replaced: extracting by it could break
    extract.max_disk_gb or mix samples, so it is refused before anything is deleted or extracted."""
    plan_path = layout.hidden_plan
    plan = read_json(plan_path)
    check_format_version(plan, plan_path)
    redo = (f"restore the plan 02 made, or rerun 02_extract_hidden.py with --overwrite to plan again (it deletes what "
            f"{layout.hidden} holds)")
    settings = json.loads(json.dumps(_settings(cfg, info)))
    planned = plan.get("settings") if isinstance(plan.get("settings"), dict) else {}
    changed = sorted(k for k in set(settings) | set(planned) if planned.get(k) != settings.get(k))
    if changed:
        raise DataError(f"{plan_path} was made for other settings than the config's ("
                        f"{'; '.join(f'{k}: {json.dumps(planned.get(k))} in the plan, {json.dumps(settings.get(k))} now' for k in changed)}); {redo}")
    if "rounds" in plan and plan.get("max_disk_bytes") != int(cfg.extract.max_disk_gb * 1e9):
        raise DataError(f"{plan_path} cuts its rounds for max_disk_bytes {json.dumps(plan.get('max_disk_bytes'))}, but "
                        f"extract.max_disk_gb={cfg.extract.max_disk_gb:g} is {int(cfg.extract.max_disk_gb * 1e9)} bytes: the plan "
                        f"was edited; {redo}")
    if recorded_sha256 is not None and file_sha256(plan_path) != recorded_sha256:
        raise DataError(f"{plan_path} is not the plan 02 made (its sha256 differs from the one recorded in "
                        f"{layout.manifest('02_extract_hidden')}): it was edited or replaced; {redo}")
    if plan.get("batch_max_tokens") != cfg.extract.batch_max_tokens:
        log.warning("extract.batch_max_tokens changed (%s -> %s): new shards are batched differently (same values "
                    "up to rounding, not byte-identical)", plan.get("batch_max_tokens"), cfg.extract.batch_max_tokens)
    return plan


def make_plan(cfg, info, paths: dict[str, Path], layout: Layout) -> dict:
    """Check every sample and fix which samples go in which shard, before the first forward pass (the
    caller saves it: write_plan)."""
    from common.extract.vllm_backend import check_prompt_lengths, max_model_len, resolve_backend

    max_pos = _max_positions(info)
    scans = [scan_split(p, split, info.vocab_size, max_pos, cfg.target.model) for split, p in paths.items()]
    if not scans[0].samples:
        raise DataError(f"{paths['train']} has no samples; rerun 01b_generate_synthetic.py")
    ids = [s.id for scan in scans for s in scan.samples]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(f"sample id '{dup}' appears more than once in data/train.jsonl + data/eval.jsonl; ids must be unique")
    if resolve_backend(cfg) == "vllm":  # before --overwrite deletes anything, not at the first long sample
        check_prompt_lengths(max_model_len(cfg, info) - 1, ((s.id, s.length) for scan in scans for s in scan.samples))
    settings = _settings(cfg, info)
    per_token = bytes_per_token(len(info.aux_layer_ids), info.hidden_size, cfg.extract.dtype, cfg.extract.storage)
    shard_max = cfg.extract.shard_max_tokens
    plan = {
        "format_version": FORMAT_VERSION,
        "settings": settings,
        "batch_max_tokens": cfg.extract.batch_max_tokens,
        "inputs": {scan.split: {"file": layout.name(scan.path), "sha256": scan.sha256, "num_samples": len(scan.samples),
                                "num_tokens": sum(s.length for s in scan.samples)} for scan in scans},
        "shards": make_plan_shards(scans, shard_max, layout),
    }
    if cfg.extract.max_disk_gb is None:
        return plan
    # extract.max_disk_gb bounds every file in hidden/: the shards, and the bookkeeping (plan.json, index.json,
    # consumed.json, ...), which grows with the number of shards and rounds. Plan with a reserve for it, measure
    # what that plan's bookkeeping takes, and plan again with more until the reserve holds it.
    budget = int(cfg.extract.max_disk_gb * 1e9)
    whole, header = dict(plan), plan_header(cfg, layout, plan)

    def bound(shard: dict) -> int:
        return shard_bytes(shard, per_token)

    eval_bytes = sum(bound(s) for s in make_plan_shards(scans[1:], shard_max, layout))
    reserve = 0
    while True:
        if sum(bound(s) for s in whole["shards"]) + reserve <= budget:
            plan = whole
        else:
            train_shards, rounds = plan_rounds(cfg, scans[0], per_token, layout, eval_bytes, reserve)
            plan = {**whole, "shards": train_shards + make_plan_shards(scans[1:], shard_max, layout, first=len(train_shards)),
                    "rounds": rounds, "max_disk_bytes": budget, "eval_bytes": eval_bytes, "reserve_bytes": reserve}
        need = bookkeeping_bytes(plan, header, bound)
        if need <= reserve:
            break
        reserve = need + need // 8  # a little more: a tighter cut adds shards, and with them plan and index bytes
    if "rounds" in plan:
        rounds, epochs = plan["rounds"], cfg.train.epochs
        print(f"02_extract_hidden: the data set does not fit extract.max_disk_gb={cfg.extract.max_disk_gb:g}: {len(rounds)} rounds "
              f"for {epochs} epoch(s) (~{len(rounds) / epochs:.1f} per epoch, up to {format_bytes(max(r['bytes'] for r in rounds))} "
              f"each, beside {format_bytes(plan['eval_bytes'])} of eval shards and up to {format_bytes(plan['reserve_bytes'])} "
              f"of plan, index and bookkeeping); 02 extracts a round, 04 trains on it and deletes it (run_pipeline.py "
              f"alternates them)", flush=True)
    return plan


def verified_shards(cfg, layout: Layout, plan: dict, wanted: set[str]) -> dict[str, dict]:
    """The index entries of the wanted planned shards that are on disk and sound (extract.verify)."""
    entries = read_entries(layout.hidden_index, layout.index_fragments())
    planned = {s["file"]: s for s in plan["shards"] if s["file"] in wanted}
    good: dict[str, dict] = {}
    to_hash = sum(e.get("bytes") or 0 for n, e in entries.items() if n in planned) if cfg.extract.verify == "sha256" else 0
    with bytes_bar(to_hash, "02 verify shards (sha256)") as bar:  # hours at Kimi scale
        for name, entry in sorted(entries.items()):
            if name not in planned:
                continue
            same_samples = entry.get("sample_ids") == planned[name]["sample_ids"] and entry.get("split") == planned[name]["split"]
            problem = (verify_entry(layout.hidden / name, entry, cfg.extract.verify, bar.update) if same_samples
                       else "recorded for other samples")
            if problem:
                print(f"02_extract_hidden: {name} is {problem}; recomputing it", flush=True)
            else:
                good[name] = entry
    return good


def check_disk_for(cfg, layout: Layout, plan: dict, header: dict, todo: list[str], freed: int = 0) -> None:
    """What the remaining shards need on disk, said and checked before any forward pass (freed: what
    --overwrite deletes first)."""
    per_token = header["bytes_per_token"]
    shards_by_name = {s["file"]: s for s in plan["shards"]}
    tokens = sum(shards_by_name[f]["num_tokens"] for f in todo)
    needed = sum(shard_bytes(shards_by_name[f], per_token) for f in todo)
    s = plan["settings"]
    per_token_text = describe_bytes_per_token(len(s["aux_layer_ids"]), s["target_hidden_size"], s["dtype"], header["storage"])
    print(f"02_extract_hidden: {len(todo)}/{len(plan['shards'])} shards to write, {tokens:,} tokens x {per_token_text} "
          f"= {format_bytes(needed)} needed", flush=True)
    check_disk_space(layout.hidden, needed, cfg.extract.min_free_disk_gb, freed=freed)


def run_extraction(cfg, overwrite: bool = False) -> dict:
    """Extract all planned shards (this rank's share under torchrun). Returns a summary dict."""
    from common.core.distributed import barrier, close_distributed, init_distributed, on_rank0
    from common.target.loading import load_target_info, torch_dtype

    layout = Layout.of(cfg)
    input_paths(layout)  # a missing train.jsonl is reported before any heavy import
    info = load_target_info(cfg.target)  # resolves and checks target.aux_layer_ids (range, distinct, ascending)
    _warn_vllm_limits(info)
    hidden_dir = layout.hidden
    # gloo for coordination only (tiny objects); long timeout: ranks finish at different times.
    env = init_distributed("gloo", timeout=datetime.timedelta(days=7))
    extractor = None
    try:
        _check_parallelism(cfg, info, env)
        fresh: dict = {}
        if overwrite:
            # Every refusal before --overwrite deletes anything: the inputs, the plan and the disk (rank 0), then
            # the backend's own (a target too large for transformers, a vLLM engine that cannot start).
            def check() -> dict:
                fresh["plan"] = check_overwrite(cfg, info, layout)
                return {}

            on_rank0(check, env)
            extractor = open_extractor(cfg, info, layout, env, torch_dtype(cfg.extract.dtype))
        setup = on_rank0(lambda: prepare(cfg, info, layout, fresh.get("plan")), env)
        plan, header = setup["plan"], setup["header"]
        streaming = cfg.extract.stream and "rounds" in plan
        if setup["status"] == "complete" and (not streaming or setup["complete"]):
            index = build_index(header, plan["shards"], setup["entries"])
            if env.is_main and setup["note"] and not index["complete"]:  # rounds: this round is there, 04's turn
                print(f"02_extract_hidden: {setup['note']}", flush=True)
                record_result(cfg, info, index, "round_done")
            elif env.is_main:
                what = (f"all {len(plan['rounds'])} rounds extracted" if "rounds" in plan else
                        f"{index['num_shards']} shards, {index['num_tokens']:,} tokens, {format_bytes(index['bytes'])}")
                print(f"02_extract_hidden: already complete ({what}) in {hidden_dir}; use --overwrite to redo", flush=True)
                record_result(cfg, info, index, "already_complete")
            return {"status": "complete", "complete": index["complete"], **{k: index[k] for k in ("num_shards", "num_tokens", "bytes")}}

        # Extract what is due; streaming: then wait for 04 to free room, and go on until every round is extracted.
        owner = {s["file"]: k % env.world_size for k, s in enumerate(plan["shards"])}  # shard k goes to rank k % world
        wait = StreamWait("02_extract_hidden", "04_train", [layout.hidden_consumed, layout.metrics, layout.manifest("04_train")],
                          cfg.extract.stream_wait_minutes, lambda text: print(text, flush=True))
        summary = {"tokens": 0, "bytes": 0, "seconds": 0.0, "shards": 0}
        try:
            while True:
                if setup["status"] == "todo":
                    extractor = extractor or open_extractor(cfg, info, layout, env, torch_dtype(cfg.extract.dtype))
                    mine = [f for f in setup["todo"] if owner[f] == env.rank]
                    rounds = max(sum(owner[f] == r for f in setup["todo"]) for r in range(env.world_size))
                    done = _extract_shards(cfg, layout, plan, header, mine, setup["entries"], env, extractor, rounds)
                    summary = {k: summary[k] + done[k] for k in summary}
                    barrier(env)
                    if env.is_main:
                        write_index(layout.hidden_index, build_index(header, plan["shards"],
                                                                     read_entries(layout.hidden_index, layout.index_fragments())))
                if not streaming:
                    break
                setup = on_rank0(lambda: next_in_stream(cfg, layout, plan, header, wait), env)
                if setup["status"] == "complete":
                    break
        finally:
            if extractor is not None:
                extractor.close()
                extractor = None
        summary["tokens_per_s"] = summary["tokens"] / max(summary["seconds"], 1e-9)
        if env.is_main:
            index = build_index(header, plan["shards"], read_entries(layout.hidden_index, layout.index_fragments()))
            write_index(layout.hidden_index, index)
            if index["complete"]:
                for frag in layout.index_fragments():
                    frag.unlink(missing_ok=True)
            state = "done" if index["complete"] else "round done" if setup["note"] else "INCOMPLETE"
            print(f"02_extract_hidden: {state}: {index['num_shards']}/{index['num_planned_shards']} "
                  f"shards, {index['num_tokens']:,} tokens (train {index['splits']['train']['num_samples']} / eval "
                  f"{index['splits']['eval']['num_samples']} samples), {format_bytes(index['bytes'])} in {hidden_dir}; "
                  f"this run: {summary['tokens']:,} tokens in {summary['seconds']:.1f} s = {summary['tokens_per_s']:,.0f} tok/s, "
                  f"{format_bytes(summary['bytes'])} written", flush=True)
            if setup["note"] and not index["complete"]:
                print(f"02_extract_hidden: {setup['note']}", flush=True)
            summary["complete"] = index["complete"]
            record_result(cfg, info, index, "done" if index["complete"] else "round_done" if setup["note"] else "partial")
        return {"status": "extracted", **summary}
    finally:
        if extractor is not None:  # --overwrite opened it before prepare, which may have refused
            extractor.close()
        close_distributed(env)


def record_result(cfg, info, index: dict, outcome: str) -> None:
    """02's manifest after a run: complete when every planned shard is there; the result keeps the plan's
    sha256 (write_plan)."""
    manifest = stage_manifest(cfg, info)
    result = {**manifest.result, "num_shards": index["num_shards"]}
    if index["complete"]:
        manifest.complete(result, outcome=outcome)
    else:
        manifest.partial(result, outcome=outcome)


def next_in_stream(cfg, layout: Layout, plan: dict, header: dict, wait: StreamWait) -> dict:
    """Streaming, rank 0: wait until 04 has freed room for the next round (or everything is extracted);
    then what is due, like prepare() returns it."""
    known = read_entries(layout.hidden_index, layout.index_fragments())  # written or verified by this process
    while True:
        todo, entries, note = survey(cfg, layout, plan, known)
        if todo:
            wait.reset()
            check_disk_for(cfg, layout, plan, header, todo)
            return {"status": "todo", "entries": entries, "todo": todo, "note": note}
        index = build_index(header, plan["shards"], entries)
        if index["complete"]:
            return {"status": "complete", "note": note}
        consumed = read_consumed(layout.hidden_consumed)
        r = next(r for r in range(len(plan["rounds"])) if r not in consumed)
        wait.tick(f"04_train to finish round {r + 1} of {len(plan['rounds'])} (hidden/ is at its budget)")


def open_extractor(cfg, info, layout: Layout, env: DistEnv, out_dtype):
    """The backend that runs the target: HfExtractor, or VllmExtractor (common/extract/vllm_backend.py)."""
    from common.extract.hf_backend import HfExtractor
    from common.extract.vllm_backend import VllmExtractor, resolve_backend

    backend = resolve_backend(cfg)
    if env.is_main:
        print(f"02_extract_hidden: extract.backend {backend}" + (f" (TP {cfg.extract.tensor_parallel_size}, DP {env.world_size}, "
              f"expert parallel {cfg.extract.enable_expert_parallel})" if backend == "vllm" else ""), flush=True)
    if backend == "hf":
        return HfExtractor(cfg, info, env, out_dtype)
    return VllmExtractor(cfg, info, out_dtype, layout.vllm_requests(env.rank), dp_rank=env.rank, dp_size=env.world_size)


def _check_parallelism(cfg, info, env: DistEnv) -> None:
    from common.extract.vllm_backend import check_vllm_target, resolve_backend

    if resolve_backend(cfg) != "vllm":
        return
    check_vllm_target(cfg, info)
    dp = cfg.extract.data_parallel_size
    if env.world_size != dp:
        raise ConfigError(
            f"extract.data_parallel_size is {dp} but 02 runs as {env.world_size} process(es); the vllm backend runs one "
            f"engine per process: start it with torchrun --nproc_per_node {dp} 02_extract_hidden.py ..." if dp > 1 else
            f"02 runs under torchrun ({env.world_size} processes) with extract.backend vllm and extract.data_parallel_size 1; "
            f"set --set extract.data_parallel_size={env.world_size}, or run one process (TP/EP come from extract.tensor_parallel_size)")


def _extract_shards(cfg, layout: Layout, plan: dict, header: dict, mine: list[str], done: dict[str, dict],
                    env: DistEnv, extractor, rounds: int | None = None) -> dict:
    """Extract this process's shards with `extractor` (open_extractor). rounds: how many shards the busiest
    rank has (vLLM data-parallel engines step together, so a rank with fewer joins the remaining rounds
    with a dummy request)."""
    placement = getattr(extractor, "placement", "vllm")
    paths = {split: layout.split_jsonl(split) for split in plan["inputs"]}
    shards = {s["file"]: s for s in plan["shards"]}
    entries = dict(done)  # this process's view; rank 0 also sees the others' fragments when merging
    my_entries: dict[str, dict] = {}
    stats = {"tokens": 0, "bytes": 0}
    total = sum(shards[f]["num_tokens"] for f in mine)
    bar = tqdm(total=total, unit="tok", unit_scale=True, dynamic_ncols=True, file=sys.stderr,
               desc="extract" if not env.distributed else f"extract[rank {env.rank}]")
    log.info("target on %s; %d shards for this process", placement, len(mine))

    def finish(name: str, samples: list[dict], batches: list[dict]) -> None:
        # Runs in the writer thread: write the shard, then record it (index only after the rename).
        entry = shard_entry(shards[name], write_shard(layout.hidden / name, samples, batches, header["storage"]))
        remember_fingerprint(layout, layout.hidden / name, entry["sha256"])  # 04 checks it without reading it again
        my_entries[name] = entry
        entries[name] = entry
        if env.distributed:
            write_fragment(layout.index_fragment(env.rank), env.rank, list(my_entries.values()))
        if env.is_main:
            merged = {**read_entries(layout.hidden_index, layout.index_fragments()), **entries} if env.distributed else entries
            write_index(layout.hidden_index, build_index(header, plan["shards"], merged))
        stats["bytes"] += entry["bytes"]
        bar.set_postfix_str(f"{format_bytes(stats['bytes'])} written", refresh=False)

    def tick(n: int) -> None:
        bar.update(n)
        stats["tokens"] += n

    start = time.perf_counter()
    pending = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hidden-writer") as writer:
        try:
            for name in mine:
                shard = shards[name]
                samples = read_shard_samples(paths[shard["split"]], shard)
                batches = extractor.extract(samples, tick)
                if pending is not None:
                    pending.result()  # at most one shard waiting to be written: bounded memory
                pending = writer.submit(finish, name, samples, batches)
            for _ in range((rounds or 0) - len(mine)):
                extractor.idle_round()
            if pending is not None:
                pending.result()
        finally:
            bar.close()
    seconds = time.perf_counter() - start
    return {"tokens": stats["tokens"], "bytes": stats["bytes"], "seconds": seconds, "shards": len(mine)}
