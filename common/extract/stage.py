"""Stage 02: run the target over every tokenized sample and store the hidden states EAGLE-3 trains on.

Output under run_dir/hidden/ (docs/design.md#artifact-formats; paths from common.core.run_folder.Layout):
    the shards (their format, writer and verification: common.hidden.shards) and index.json (with its rank
    fragments under torchrun: common.hidden.index):
        one row per token, samples concatenated; per shard, the index lists file, split, sample_ids (in
        shard order), num_tokens, sha256, bytes; "complete" once every planned shard is written
    plan.json    which samples go in which shard, fixed before the first forward pass (common.extract.planning)

Which tensors, and why (docs/design.md#aux-layer-convention and #artifact-formats)
- aux id k = the residual stream after k decoder layers = the input of decoder layer k, captured by a
  forward pre-hook on layers[k] of the decoder stack (ids ascending: vLLM hands them over in layer order).
- final_hidden = the final-norm output = exactly what the target lm_head reads; 04 applies the lm_head
  in chunks (H_t values per token instead of V logits: 23x smaller for Kimi-K2.5).
- Only the decoder stack runs (no [T, V] logits) and output_hidden_states is never asked for; hooks copy
  the needed states at unpadded positions to CPU in extract.dtype as soon as a layer produces them.

The modules of 02: common.extract.scan (the inputs), common.extract.planning (plan.json: shards, rounds, the
disk budget), common.extract.shard_loop (the backend and the shard loop), and here the driver: run_extraction,
what is due (survey -> Due), the disk check, resume and --overwrite.

Resume and integrity
- Resume works at shard granularity and reproduces the same plan and batches (common.extract.planning).
- On rerun every indexed shard is verified (common.hidden.shards.verify_entry with extract.verify:
  sha256, or size for huge runs); a missing, truncated or corrupted shard is reported and recomputed.
  A shard file that exists but is not in the index (killed between rename and index update) is recomputed.
  Changed inputs or settings are a clear error that suggests --overwrite. The temp files and vllm request
  directories a killed run left are removed.
- Before any forward pass the disk space the due shards need is said and checked (check_disk_for), keeping
  extract.min_free_disk_gb free.
- --overwrite: everything that can refuse comes first (check_overwrite: every sample, the new plan, the free
  disk; then the backend's own start), and only then are the previous outputs deleted.
- Under a disk budget (plan.json's rounds; common.hidden.rounds) a run extracts the rounds that are due and
  exits; with extract.stream it waits for 04 to free room and goes on until every round is extracted.

torchrun (WORLD_SIZE > 1): data parallel, one full model copy per GPU (cuda:LOCAL_RANK). Rank 0 does the
setup (plan, verification, disk check) and broadcasts it (a Due) over a gloo process group; shard k goes to
rank k % world_size; rank 0 merges the ranks' index fragments into index.json once more after the final barrier.
"""

from __future__ import annotations

import datetime
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from common.core.errors import ConfigError, DataError
from common.core.io import bytes_bar, folder_bytes, format_bytes
from common.core.run_folder import Layout, StageManifest
from common.extract.planning import load_plan, make_plan, plan_header, plan_settings, shard_bytes, write_plan
from common.extract.scan import input_paths
from common.extract.shard_loop import ExtractStats, extract_shards, open_extractor
from common.hidden.index import build_index, drop_fragments, merge_index, read_consumed, read_entries, read_index, write_index
from common.hidden.rounds import HiddenPlan, delete_not_due
from common.hidden.shards import describe_bytes_per_token, verify_entry
from common.hidden.stream import StreamWait
from common.target.loading import target_fingerprint

if TYPE_CHECKING:  # torch is imported only when the stage runs
    from common.core.distributed import DistEnv

log = logging.getLogger("extract")


@dataclass
class Due:
    """What is to be extracted now, as rank 0 found it (prepare, next_in_stream), handed to every rank by on_rank0."""

    plan: HiddenPlan
    header: dict  # index.json's header (plan_header)
    todo: list[str]  # the planned shards to extract now, in extraction order
    entries: dict[str, dict]  # index entries to keep: the sound shards on disk, and those of consumed rounds
    note: str | None  # under a disk budget: which rounds this run extracts, and what comes next

    @property
    def nothing_due(self) -> bool:
        """Nothing to extract now (under a disk budget, the rounds due may still be a part of the plan)."""
        return not self.todo

    @property
    def all_extracted(self) -> bool:
        """Every planned shard is extracted (index.json "complete"; under rounds, 04 may have deleted some since)."""
        return all(s["file"] in self.entries for s in self.plan.shards)

    def index(self) -> dict:
        return build_index(self.header, self.plan.shards, self.entries)


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
    return StageManifest(layout, "02_extract_hidden", inputs=inputs, settings=plan_settings(cfg, info))


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def run_extraction(cfg, overwrite: bool = False) -> dict:
    """Extract all planned shards (this rank's share under torchrun). Returns a summary dict."""
    from common.core.distributed import barrier, close_distributed, init_distributed, on_rank0
    from common.target.loading import load_target_info, torch_dtype

    layout = Layout.of(cfg)
    input_paths(layout)  # a missing train.jsonl is reported before any heavy import
    info = load_target_info(cfg.target)  # resolves and checks target.aux_layer_ids (range, distinct, ascending)
    _warn_vllm_limits(info)
    # gloo for coordination only (tiny objects); long timeout: ranks finish at different times.
    env = init_distributed("gloo", timeout=datetime.timedelta(days=7))
    extractor = None
    try:
        _check_parallelism(cfg, info, env)
        fresh: HiddenPlan | None = None  # --overwrite's new plan, on rank 0
        if overwrite:
            # Every refusal before --overwrite deletes anything: the inputs, the plan and the disk (rank 0), then
            # the backend's own (a target too large for transformers, a vLLM engine that cannot start).
            def check_on_rank0() -> None:
                nonlocal fresh
                fresh = check_overwrite(cfg, info, layout)

            on_rank0(check_on_rank0, env)
            extractor = open_extractor(cfg, info, layout, env, torch_dtype(cfg.extract.dtype))
        due = on_rank0(lambda: prepare(cfg, info, layout, fresh), env)
        plan, header = due.plan, due.header
        streaming = cfg.extract.stream and plan.budgeted
        if due.nothing_due and (not streaming or due.all_extracted):
            return _nothing_to_extract(cfg, info, layout, due, env)

        # Extract what is due; streaming: then wait for 04 to free room, and go on until every round is extracted.
        owner = {s["file"]: k % env.world_size for k, s in enumerate(plan.shards)}  # shard k goes to rank k % world
        wait = StreamWait("02_extract_hidden", "04_train", [layout.hidden_consumed, layout.metrics, layout.manifest("04_train")],
                          cfg.extract.stream_wait_minutes, lambda text: print(text, flush=True))
        stats = ExtractStats()
        try:
            while True:
                if not due.nothing_due:
                    extractor = extractor or open_extractor(cfg, info, layout, env, torch_dtype(cfg.extract.dtype))
                    mine = [f for f in due.todo if owner[f] == env.rank]
                    busiest = max(sum(owner[f] == r for f in due.todo) for r in range(env.world_size))
                    stats += extract_shards(cfg, layout, plan, header, mine, due.entries, env, extractor, busiest)
                    barrier(env)
                    if env.is_main:
                        merge_index(layout, header, plan.shards)
                if not streaming:
                    break
                due = on_rank0(lambda: next_in_stream(cfg, layout, plan, header, wait), env)
                if due.nothing_due:  # next_in_stream returns nothing due only once every round is extracted
                    break
        finally:
            if extractor is not None:
                extractor.close()
                extractor = None
        summary = {"status": "extracted", **asdict(stats), "tokens_per_s": stats.tokens_per_s}
        if env.is_main:
            summary["complete"] = _report_extracted(cfg, info, layout, due, stats)
        return summary
    finally:
        if extractor is not None:  # --overwrite opened it before prepare, which may have refused
            extractor.close()
        close_distributed(env)


def _nothing_to_extract(cfg, info, layout: Layout, due: Due, env: DistEnv) -> dict:
    """Nothing due on this run: under rounds, the due rounds are there (04's turn); else all is extracted."""
    index = due.index()
    if env.is_main and due.note and not index["complete"]:
        print(f"02_extract_hidden: {due.note}", flush=True)
        record_result(cfg, info, index, "round_done")
    elif env.is_main:
        what = (f"all {len(due.plan.rounds)} rounds extracted" if due.plan.budgeted else
                f"{index['num_shards']} shards, {index['num_tokens']:,} tokens, {format_bytes(index['bytes'])}")
        print(f"02_extract_hidden: already complete ({what}) in {layout.hidden}; use --overwrite to redo", flush=True)
        record_result(cfg, info, index, "already_complete")
    return {"status": "complete", "complete": index["complete"], **{k: index[k] for k in ("num_shards", "num_tokens", "bytes")}}


def _report_extracted(cfg, info, layout: Layout, due: Due, stats: ExtractStats) -> bool:
    """Rank 0 after extracting: the final index.json, the summary line and 02's manifest. Returns whether every
    planned shard is extracted."""
    index = merge_index(layout, due.header, due.plan.shards)
    if index["complete"]:
        drop_fragments(layout)
    state = "done" if index["complete"] else "round done" if due.note else "INCOMPLETE"
    # Under rounds the index also counts the rounds 04 trained and deleted: say what hidden/ holds now too.
    where = (f"{format_bytes(index['bytes'])} extracted so far, {format_bytes(folder_bytes(layout.hidden))} in "
             f"{layout.hidden} now" if due.plan.budgeted else f"{format_bytes(index['bytes'])} in {layout.hidden}")
    print(f"02_extract_hidden: {state}: {index['num_shards']}/{index['num_planned_shards']} "
          f"shards, {index['num_tokens']:,} tokens (train {index['splits']['train']['num_samples']} / eval "
          f"{index['splits']['eval']['num_samples']} samples), {where}; "
          f"this run: {stats.tokens:,} tokens in {stats.seconds:.1f} s = {stats.tokens_per_s:,.0f} tok/s, "
          f"{format_bytes(stats.bytes)} written", flush=True)
    if due.note and not index["complete"]:
        print(f"02_extract_hidden: {due.note}", flush=True)
    record_result(cfg, info, index, "done" if index["complete"] else "round_done" if due.note else "partial")
    return index["complete"]


def record_result(cfg, info, index: dict, outcome: str) -> None:
    """02's manifest after a run: complete when every planned shard is there; the result keeps the plan's
    sha256 (write_plan)."""
    manifest = stage_manifest(cfg, info)
    result = {**manifest.result, "num_shards": index["num_shards"]}
    if index["complete"]:
        manifest.complete(result, outcome=outcome)
    else:
        manifest.partial(result, outcome=outcome)


def prepare(cfg, info, layout: Layout, fresh: HiddenPlan | None = None) -> Due:
    """Rank 0's setup: plan (new or checked), verification of existing shards, disk check; what is due.

    fresh: --overwrite's new plan, made by check_overwrite, which checked everything that can refuse
    before this deletes the previous outputs.
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
    existing = read_index(layout)
    header = plan_header(cfg, layout, plan)
    if header.get("target_weights") and existing.get("target_weights") == header["target_weights"]:
        # The same weights at another path are the same target: index.json keeps the path it names, so moving the
        # target rewrites nothing (04 keys on index.json's content without that path: index_fingerprint).
        header["target_model"] = existing.get("target_model")
    due = survey(cfg, layout, plan, header)
    index = due.index()
    if due.nothing_due:
        if existing != index:  # a no-op rerun rewrites nothing
            write_index(layout, index)
        drop_fragments(layout)
        return due
    if fresh is None:  # check_overwrite checked the disk before the deletion
        check_disk_for(cfg, layout, plan, due.header, due.todo)
    write_index(layout, index)
    return due


def next_in_stream(cfg, layout: Layout, plan: HiddenPlan, header: dict, wait: StreamWait) -> Due:
    """Streaming, rank 0: wait until 04 has freed room for the next round (or everything is extracted);
    then what is due, like prepare() returns it."""
    known = read_entries(layout)  # written or verified by this process
    while True:
        due = survey(cfg, layout, plan, header, known)
        if not due.nothing_due:
            wait.reset()
            check_disk_for(cfg, layout, plan, header, due.todo)
            return due
        if due.all_extracted:
            return due
        pending = plan.first_pending(read_consumed(layout))
        wait.tick(f"04_train to finish {pending.describe(len(plan.rounds))} (hidden/ is at its budget)")


def check_overwrite(cfg, info, layout: Layout) -> HiddenPlan:
    """--overwrite, rank 0: everything that can refuse, before anything is deleted (a refused --overwrite
    leaves the previous outputs whole): every input sample, the new plan (the disk budget) and the free
    disk space its first shards need, counting what the deletion frees. Returns the plan (not written)."""
    paths = input_paths(layout)
    clear_temp(layout)
    plan = make_plan(cfg, info, paths, layout)
    freed = sum(p.stat().st_size for p in outputs_of(layout) if p.is_file())
    check_disk_for(cfg, layout, plan, plan_header(cfg, layout, plan), plan.due_files(set()), freed)
    return plan


# ---------------------------------------------------------------------------------------------
# What is due: the planned shards that should be on disk now and are not there, sound
# ---------------------------------------------------------------------------------------------


def survey(cfg, layout: Layout, plan: HiddenPlan, header: dict, known: dict[str, dict] | None = None) -> Due:
    """What is due now: the wanted shards (all, or under rounds those of the rounds due now: HiddenPlan.due_files)
    not on disk and sound, in extraction order, and the index entries to keep. known: entries this process wrote
    or verified itself (streaming: not hashed again while their files are there)."""
    kept: dict[str, dict] = {}
    note = None
    if plan.budgeted:
        consumed = read_consumed(layout)
        wanted = plan.due_files(consumed)
        delete_not_due(layout, plan, consumed)  # a kill may come between 04's record of a round and its deletion
        gone = plan.files_of_rounds(consumed)  # their entries stay in the index: 04 trained on them
        kept = {f: e for f, e in read_entries(layout).items() if f in gone}
        note = plan.describe_due(consumed)
    else:
        wanted = plan.due_files(set())
    known = {f: e for f, e in (known or {}).items() if f in wanted and (layout.hidden / f).is_file()}
    good = {**known, **verified_shards(cfg, layout, plan, set(wanted) - set(known))}
    return Due(plan, header, [f for f in wanted if f not in good], {**kept, **good}, note)


def verified_shards(cfg, layout: Layout, plan: HiddenPlan, wanted: set[str]) -> dict[str, dict]:
    """The index entries of the wanted planned shards that are on disk and sound (extract.verify)."""
    entries = read_entries(layout)
    planned = {f: s for f, s in plan.by_file.items() if f in wanted}
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


# ---------------------------------------------------------------------------------------------
# Disk space
# ---------------------------------------------------------------------------------------------


def check_disk_for(cfg, layout: Layout, plan: HiddenPlan, header: dict, todo: list[str], freed: int = 0) -> None:
    """What the remaining shards need on disk, said and checked before any forward pass (freed: what
    --overwrite deletes first)."""
    per_token = header["bytes_per_token"]
    tokens = sum(plan.by_file[f]["num_tokens"] for f in todo)
    needed = sum(shard_bytes(plan.by_file[f], per_token) for f in todo)
    s = plan.settings
    per_token_text = describe_bytes_per_token(len(s["aux_layer_ids"]), s["target_hidden_size"], s["dtype"], header["storage"])
    print(f"02_extract_hidden: {len(todo)}/{len(plan.shards)} shards to write, {tokens:,} tokens x {per_token_text} "
          f"= {format_bytes(needed)} needed", flush=True)
    check_disk_space(layout.hidden, needed, cfg.extract.min_free_disk_gb, freed=freed)


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
# The outputs and what a killed run left behind
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Backend checks made before anything runs
# ---------------------------------------------------------------------------------------------


def _warn_vllm_limits(info) -> None:
    # vLLM's DeepSeek-V2/V3 stack (also Kimi-K2.x) computes aux = hidden + residual before layer idx,
    # with residual None before layer 0, so id 0 crashes there (llama-style stacks handle it).
    if 0 in info.aux_layer_ids and any(s in info.model_type for s in ("deepseek", "kimi")):
        log.warning("aux layer id 0 (the embeddings) works here but vLLM %s targets cannot capture it "
                    "(deepseek_v2.py adds a None residual); use ids >= 1 for a draft you will serve", info.model_type)


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
