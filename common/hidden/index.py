"""hidden/index.json, its rank fragments and hidden/consumed.json: the one module that reads and writes them.

Stage 02 (common/extract/stage.py, common/extract/shard_loop.py) records its shards here, stage 04
(common/train/source.py) reads what is recorded and records the rounds it has trained; both take their paths
from common.core.run_folder.Layout (docs/design.md#artifact-formats):

    Layout.hidden_index       format_version, the settings (aux_layer_ids, target_hidden_size,
                              num_target_layers, dtype, storage, ...), "complete", per-split counts, and one entry
                              per written shard (file, split, num_samples, num_tokens, sha256, bytes,
                              num_loss_tokens, sample_ids in shard order)
    Layout.index_fragment(r)  under torchrun, rank r's entries; rank 0 merges them into the index
    Layout.hidden_consumed    under a disk budget, the rounds 04 has trained on and deleted (common.hidden.rounds)

What is here:
- the JSON of hidden/: json_text, write_json (compact: they list every sample id, and under a disk budget they
  count against it; plan.json, common.extract.planning's, is written in it too) and bookkeeping_bytes;
- index.json's contents: shard_entry, index_header, build_index, INDEX_SHARD_FIELDS;
- reading it: read_index (the file as it is), read_entries (the entries recorded so far: index.json and, for
  02, the rank fragments), index_fingerprint (what 04 keys its outputs on: the content, not the target's path);
- writing it: write_index, record_entries (after each shard: this rank's fragment, rank 0's index.json),
  merge_index (rank 0 after a barrier), drop_fragments;
- consumed.json: read_consumed, write_consumed, mark_trained.
The shards themselves (the writer, HiddenIndex.load, verification) are common.hidden.shards'; plan.json's rounds
are common.hidden.rounds'. Every file here is written atomically (common.core.io.atomic_write_text).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from common.core.errors import DataError
from common.core.io import atomic_write_text
from common.hidden.shards import FORMAT_VERSION, SPLITS, bytes_per_token, check_format_version, check_index_fields, storage_of

if TYPE_CHECKING:
    from common.core.distributed import DistEnv
    from common.core.run_folder import Layout
    from common.hidden.rounds import HiddenPlan

log = logging.getLogger("shards")  # the name its warnings have always carried


# ---------------------------------------------------------------------------------------------
# hidden/'s JSON
# ---------------------------------------------------------------------------------------------


def json_text(obj: Any) -> str:
    """How hidden/'s JSON files are written: compact, since plan.json and index.json list every sample and
    their bytes count against extract.max_disk_gb (bookkeeping_bytes measures this very text)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n"


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json_text(obj))


def bookkeeping_bytes(plan: dict, header: dict, shard_bytes: Callable[[dict], int]) -> int:
    """The most that hidden/ holds besides the shards over a whole run by this plan (a plan.json dict, before it
    is written): plan.json, index.json listing every planned shard, the rank fragments (together at most that
    index), consumed.json listing every round, and for each the temp copy of its atomic rewrite. Measured on the
    very text write_json writes (header: index_header's; shard_bytes(shard): an upper bound of the shard's size,
    for its digits)."""
    entries = {s["file"]: shard_entry(s, {"sha256": "0" * 64, "bytes": shard_bytes(s), "num_loss_tokens": s["num_tokens"]})
               for s in plan["shards"]}
    index = len(json_text(build_index(header, plan["shards"], entries)).encode())
    consumed = len(json_text(_consumed_doc(range(len(plan["rounds"])))).encode()) if "rounds" in plan else 0
    # index.json and the fragments (at most an index together), consumed.json: each with its temp copy
    return len(json_text(plan).encode()) + 2 * (index + index + consumed)


# ---------------------------------------------------------------------------------------------
# index.json's contents: one entry per written shard
# ---------------------------------------------------------------------------------------------


def shard_entry(shard: dict, written: dict) -> dict:
    """The index entry of a written shard: its plan record ({"file", "split", "num_samples",
    "num_tokens", "sample_ids", ...}) and what write_shard returned."""
    return {"file": shard["file"], "split": shard["split"], "num_samples": shard["num_samples"],
            "num_tokens": shard["num_tokens"], **written, "sample_ids": shard["sample_ids"]}


def index_header(settings: dict, target_model: str, inputs: dict, target_weights: str | None = None) -> dict:
    """index.json's fields before the shard list: the format version and the settings that shaped the
    states (settings: aux_layer_ids, num_target_layers, target_hidden_size, vocab_size, model_type,
    dtype, target_dtype, storage when not "full"); inputs: the tokenized files they were made from;
    target_weights: the target's content fingerprint (common.target.loading.target_fingerprint), which 04
    checks against the target it loads."""
    s = settings
    storage = storage_of(s)
    return {
        "format_version": FORMAT_VERSION,
        "storage": storage,
        "aux_layer_ids": s["aux_layer_ids"],
        "num_target_layers": s["num_target_layers"],
        "target_hidden_size": s["target_hidden_size"],
        "vocab_size": s["vocab_size"],
        "model_type": s["model_type"],
        "dtype": s["dtype"],
        "target_dtype": s["target_dtype"],
        "target_model": target_model,
        "bytes_per_token": bytes_per_token(len(s["aux_layer_ids"]), s["target_hidden_size"], s["dtype"], storage),
        "inputs": inputs,
        **({"target_weights": target_weights} if target_weights else {}),
    }


# The fields build_index adds to the header: they grow as 02 writes shards (under rounds, all run long).
INDEX_SHARD_FIELDS = ("complete", "num_shards", "num_planned_shards", "num_tokens", "num_samples", "bytes", "splits", "shards")


def build_index(header: dict, plan_shards: list[dict], entries: dict[str, dict]) -> dict:
    """index.json: the header, the planned shards that have entries (plan order), per-split counts."""
    shards = [entries[s["file"]] for s in plan_shards if s["file"] in entries]
    complete = len(shards) == len(plan_shards)
    splits = {}
    for split in SPLITS:
        mine = [s for s in shards if s["split"] == split]
        splits[split] = {"num_shards": len(mine), "num_samples": sum(s["num_samples"] for s in mine),
                         "num_tokens": sum(s["num_tokens"] for s in mine)}
    return {**header, "complete": complete, "num_shards": len(shards), "num_planned_shards": len(plan_shards),
            "num_tokens": sum(s["num_tokens"] for s in shards), "num_samples": sum(s["num_samples"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards), "splits": splits, "shards": shards}


# ---------------------------------------------------------------------------------------------
# Reading what is recorded
# ---------------------------------------------------------------------------------------------


def read_index(layout: "Layout") -> dict:
    """index.json as it is on disk; {} when there is none or it is unreadable (02's survey verifies its shards
    again). A field of another type is a DataError (check_index_fields)."""
    try:
        doc = json.loads(layout.hidden_index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    check_index_fields(doc, layout.hidden_index)
    return doc


def index_fingerprint(layout: "Layout", header_only: bool = False) -> str | None:
    """index.json by the content 04's outputs depend on (sha256): the shards (their sha256, samples, token
    counts), the aux layers, dtype, storage and the target by its weights' fingerprint (target_weights), not the
    path target_model names, which it keeps for the reader. A run folder moved, whose index.json 02 rebuilt
    (byte-identical shards, the target's new path), is the same input. header_only: the fields before the shard
    list (under a disk budget 02 adds each round's shards to the rest). None when there is no index.json; an
    unreadable one has a fingerprint of its own."""
    try:
        text = layout.hidden_index.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        place = ("target_model",) if doc.get("target_weights") else ()  # without weights (a hub id) it is the identity
        skip = (*place, *INDEX_SHARD_FIELDS) if header_only else place
        doc = {k: v for k, v in doc.items() if k not in skip}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def read_entries(layout: "Layout", fragments: bool = True) -> dict[str, dict]:
    """Shard entries recorded so far, from index.json and the rank fragments (union by file).

    fragments=False: index.json's alone. 04 reads that: HiddenIndex.load loads what index.json lists, and a
    shard another rank has recorded in its fragment is not there until rank 0 merges it.
    An unreadable file is skipped with a warning (its shards get verified again or recomputed); an
    index.json in a format this code does not read, or a file with a field of another type, is a DataError
    (check_format_version, check_index_fields)."""
    entries: dict[str, dict] = {}
    index_path = layout.hidden_index
    for src in [index_path, *(layout.index_fragments() if fragments else ())]:
        if not src.is_file():
            continue
        try:
            doc = json.loads(src.read_text(encoding="utf-8"))
        except (ValueError, OSError):
            log.warning("%s is unreadable; the shards it listed will be verified again or recomputed", src)
            continue
        if src == index_path:
            check_format_version(doc, src)
        if not isinstance(doc, dict):
            raise DataError(f"{src} holds a JSON {type(doc).__name__}, not an object; delete it (02_extract_hidden.py "
                            f"rebuilds it from the shards)")
        check_index_fields(doc, src)
        for e in doc.get("shards", []):
            entries[e["file"]] = e
    return entries


# ---------------------------------------------------------------------------------------------
# Writing: index.json, and the rank fragments under torchrun
# ---------------------------------------------------------------------------------------------


def write_index(layout: "Layout", index: dict) -> None:
    write_json(layout.hidden_index, index)


def write_fragment(layout: "Layout", rank: int, entries: list[dict]) -> None:
    """One rank's entries under torchrun (rank 0 merges the fragments with read_entries)."""
    write_json(layout.index_fragment(rank), {"rank": rank, "shards": entries})


def record_entries(layout: "Layout", env: "DistEnv", header: dict, plan_shards: list[dict], mine: dict[str, dict],
                   known: dict[str, dict]) -> None:
    """02, after each shard it writes (only once its file is renamed into place): under torchrun, this rank's
    entries (`mine`) become its fragment; rank 0 then rewrites index.json from the entries it knows (`known`: those
    kept at the start and the ones it wrote), under torchrun merged with every rank's fragment (the merge is a pure
    function of the fragments, so it is idempotent)."""
    if env.distributed:
        write_fragment(layout, env.rank, list(mine.values()))
    if env.is_main:
        entries = {**read_entries(layout), **known} if env.distributed else known
        write_index(layout, build_index(header, plan_shards, entries))


def merge_index(layout: "Layout", header: dict, plan_shards: list[dict]) -> dict:
    """Rank 0 after a barrier: index.json rewritten from itself and every rank's fragment; returns it."""
    index = build_index(header, plan_shards, read_entries(layout))
    write_index(layout, index)
    return index


def drop_fragments(layout: "Layout") -> None:
    """The rank fragments, once index.json holds what they list (rank 0)."""
    for frag in layout.index_fragments():
        frag.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# hidden/consumed.json: the rounds 04 has trained on (and deleted)
# ---------------------------------------------------------------------------------------------


def _consumed_doc(rounds: Iterable[int]) -> dict:
    return {"rounds": sorted(set(rounds))}


def read_consumed(layout: "Layout") -> set[int]:
    """The rounds 04 has trained on and deleted; none when the file is absent."""
    path = layout.hidden_consumed
    if not path.is_file():
        return set()
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return {int(r) for r in doc["rounds"]}
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{path} is unreadable; it lists the rounds 04 has trained on: delete it and rerun 04_train.py "
                        f"(it rewrites it from its checkpoint)") from None


def write_consumed(layout: "Layout", rounds: Iterable[int]) -> None:
    write_json(layout.hidden_consumed, _consumed_doc(rounds))


def mark_trained(layout: "Layout", plan: "HiddenPlan", rounds: set[int], keep_out: set[int] = frozenset()) -> None:
    """04, rank 0, after the checkpoint that covers `rounds`: record them as trained (02 reads it to know what
    comes next), then delete their shards. keep_out: rounds to un-record (a resumed checkpoint is before them).
    Without a disk budget nothing is recorded or deleted: every round reads the same shards."""
    if not plan.budgeted:
        return
    write_consumed(layout, (read_consumed(layout) | rounds) - set(keep_out))
    for f in plan.files_of_rounds(rounds):
        (layout.hidden / f).unlink(missing_ok=True)
