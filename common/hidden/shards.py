"""The hidden-state shard format: the one module that writes, reads and verifies the shards.

Stage 02 (common/extract/stage.py) writes it, stage 04 (common/train/data.py) reads it; both take their
paths from common.core.run_folder.Layout, this module takes paths. Under run_dir/hidden/
(docs/design.md#artifact-formats), one row per token:

    Layout.shard(k)           a safetensors file, the samples of the shard back to back (TENSORS):
        input_ids       int64 [N]
        loss_mask       uint8 [N]
        aux_hidden      [N, n_aux*H_t]  the aux states concatenated in aux_layer_ids order
        final_hidden    [N, H_t]        the final-norm output = input of the target lm_head
        sample_offsets  int64 [n_samples+1]; sample i is rows offsets[i]:offsets[i+1]
      and with storage "fp8" two more (FP8_SCALES):
        aux_scale       float32 [N, n_aux]
        final_scale     float32 [N, 1]
    The states are in extract.dtype (storage "full"), or float8 e4m3 with one float32 scale per token
    per tensor (storage "fp8": value = e4m3 * scale; docs/design.md#fp8-hidden-states).
    Layout.hidden_index       one entry per written shard (file, split, sha256, bytes, sample_ids, ...), with
                              rank fragments under torchrun: common.hidden.index writes and merges them

What is here:
- names and arithmetic: FORMAT_VERSION (written), READ_VERSIONS (read), SPLITS, TENSORS, STORAGES,
  bytes_per_token, describe_bytes_per_token, storage_of, check_format_version (index.json's and plan.json's),
  check_index_fields (index.json's and its rank fragments' field types);
- the fp8 codec: fp8_encode, fp8_decode;
- writing: write_shard (atomic, hashed while written by the streaming write_safetensors); its index entry,
  index.json, the rank fragments and hidden/'s compact JSON are common.hidden.index';
- reading: HiddenIndex.load (04: index.json complete, in a readable version, every shard's header checked) and
  ShardReader (samples' rows, lazily, via safetensors safe_open, fp8 states decoded); the rounds of plan.json
  are common.hidden.rounds';
- verification: verify_entry (02's rerun: a reason or None) and verify_shard_files (04's start: one-line
  DataError).
"""

from __future__ import annotations

import collections
import hashlib
import json
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from common.core.errors import DataError, PipelineError
from common.core.io import atomic_path, file_sha256, read_json
from common.core.json_fields import BOOLEAN, INTEGER, INTEGERS, OBJECTS, STRING, STRINGS, check_fields

if TYPE_CHECKING:  # torch is imported only when shards are written or read (02's --help stays fast)
    import numpy as np
    import torch

    from common.core.distributed import DistEnv
    from common.core.run_folder import Layout

FORMAT_VERSION = 3  # what write_* produce (3: plan.json's train shards list their samples' lengths)
READ_VERSIONS = (FORMAT_VERSION,)  # one run-folder version: an earlier one is rewritten, not read
SPLITS = ("train", "eval")
TENSORS = ("input_ids", "loss_mask", "aux_hidden", "final_hidden", "sample_offsets")
ROW_TENSORS = TENSORS[:4]  # one row per token (sample_offsets is per sample)
STORAGES = ("full", "fp8")  # extract.storage
FP8_SCALES = {"aux_hidden": "aux_scale", "final_hidden": "final_scale"}  # state tensor -> its per-token scales
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
ID_MASK_BYTES = 8 + 1  # int64 input_ids + uint8 loss_mask per token
SCALE_BYTES = 4  # one float32 scale per token per tensor (fp8)
# The least destructive advice that repairs hidden/ (never --overwrite, which under rounds throws away the
# plan and consumed.json): a plain rerun of 02 rebuilds missing and unindexed shards and rewrites index.json
# from plan.json; a shard whose bytes disagree with index.json is deleted first, so that 02 extracts it again
# whatever extract.verify says (with "size" a same-size corruption would pass 02's check).
RERUN_02 = "rerun 02_extract_hidden.py (it rebuilds missing or incomplete shards and rewrites index.json)"


def redo_shard(path: Path) -> str:
    """The advice for one shard whose bytes disagree with index.json."""
    return f"delete {path} and rerun 02_extract_hidden.py (it extracts that shard again and keeps the rest)"


def dtype_bytes(name: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[name]


def bytes_per_token(num_aux: int, hidden_size: int, dtype: str, storage: str = "full") -> int:
    """Stored bytes per token: the aux states, the final state (with their scales for fp8), input id
    and loss mask."""
    if storage == "fp8":
        return (num_aux + 1) * (hidden_size + SCALE_BYTES) + ID_MASK_BYTES
    return (num_aux + 1) * hidden_size * dtype_bytes(dtype) + ID_MASK_BYTES


def describe_bytes_per_token(num_aux: int, hidden_size: int, dtype: str, storage: str = "full") -> str:
    """bytes_per_token as the sum it is, for 02's planner line."""
    total = bytes_per_token(num_aux, hidden_size, dtype, storage)
    if storage == "fp8":
        return (f"{total:,} B/token (({num_aux} aux + final) x (H {hidden_size} x 1 B fp8 + {SCALE_BYTES} B scale) + "
                f"{ID_MASK_BYTES} B ids/mask)")
    return (f"{total:,} B/token (({num_aux} aux + final) x H {hidden_size} x {dtype_bytes(dtype)} B {dtype} + "
            f"{ID_MASK_BYTES} B ids/mask)")


def storage_of(doc: dict) -> str:
    """index.json's or the plan settings' storage ("full" or "fp8")."""
    return doc["storage"]


def check_format_version(doc: dict, path: Path) -> None:
    """A one-line DataError unless `doc` (index.json or plan.json) is in the format this code writes."""
    found = doc.get("format_version") if isinstance(doc, dict) else None
    if type(found) is not int or found not in READ_VERSIONS:
        made_by = ("an earlier version of this pipeline" if type(found) is int and found < FORMAT_VERSION
                   else "another program or version")
        raise DataError(
            f"{path} was made by {made_by} (hidden-state format_version {json.dumps(found)}, this code reads "
            f"format_version {FORMAT_VERSION}): rerun 02_extract_hidden.py with --overwrite to rewrite the hidden states"
        )


# The JSON types of index.json's fields that 02 and 04 read (absent ones are the readers' business), and of every
# shard entry, which 02 always writes whole.
INDEX_FIELDS = {"complete": BOOLEAN, "storage": STRING, "dtype": STRING, "aux_layer_ids": INTEGERS,
                "target_hidden_size": INTEGER, "target_model": STRING, "target_weights": STRING, "shards": OBJECTS}
INDEX_ENTRY_FIELDS = {"file": STRING, "split": STRING, "num_samples": INTEGER, "num_tokens": INTEGER, "sha256": STRING,
                      "bytes": INTEGER, "num_loss_tokens": INTEGER, "sample_ids": STRINGS}


def check_index_fields(doc: dict, path: Path) -> None:
    """A one-line DataError naming the field unless index.json (or a rank fragment) has its fields' types: an
    edited file would otherwise stop 02 or 04 with a TypeError. Deleting it loses nothing: 02 rebuilds it from
    the shards on disk (verified against plan.json)."""
    fix = f"delete {path} (02_extract_hidden.py rebuilds it from the shards) or rerun 02_extract_hidden.py with --overwrite"
    check_fields(doc, INDEX_FIELDS, path, fix)
    for i, entry in enumerate(doc.get("shards", [])):
        check_fields(entry, INDEX_ENTRY_FIELDS, path, fix, where=f"shards[{i}].", required=INDEX_ENTRY_FIELDS)


# ---------------------------------------------------------------------------------------------
# The fp8 codec: float8 e4m3, one float32 scale per token per tensor
# ---------------------------------------------------------------------------------------------


def fp8_encode(x: "torch.Tensor", parts: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """x [N, parts*H] (parts tensors of width H side by side) -> (float8_e4m3fn [N, parts*H],
    float32 scales [N, parts]): each token's each part is divided by its own scale = its largest |value|
    / 448, so that value maps to e4m3's largest finite number and the rest keep e4m3's 3-bit mantissa
    (relative error <= 2^-4). A part that is all zeros gets the smallest normal scale (it decodes to 0)."""
    import torch

    n = x.shape[0]
    xf = x.float().view(n, parts, -1)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n, -1), scale.view(n, parts)


def fp8_decode(q: "torch.Tensor", scale: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
    """The inverse of fp8_encode, in `dtype` (the product is taken in float32)."""
    n, parts = scale.shape
    return (q.float().view(n, parts, -1) * scale.float().unsqueeze(-1)).view(n, -1).to(dtype)


# ---------------------------------------------------------------------------------------------
# Writing shards: a streaming safetensors writer that hashes while it writes.
# ---------------------------------------------------------------------------------------------

_ST_DTYPES = {"int64": "I64", "uint8": "U8", "bfloat16": "BF16", "float16": "F16", "float32": "F32",
              "float8_e4m3fn": "F8_E4M3"}


def write_safetensors(path: Path, tensors: list[tuple[str, list]]) -> tuple[str, int]:
    """Write [(name, [chunk, ...])] as one safetensors file, each tensor = its chunks along dim 0.

    Streams chunk by chunk (no concatenated copy of a multi-GB shard) and returns (sha256, size).
    Loadable by safetensors.safe_open / load_file; byte-identical for identical inputs.
    """
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, chunks in tensors:
        first = chunks[0]
        rows = sum(c.shape[0] for c in chunks)
        nbytes = sum(c.numel() * c.element_size() for c in chunks)
        header[name] = {"dtype": _ST_DTYPES[str(first.dtype).replace("torch.", "")], "shape": [rows, *first.shape[1:]],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for block in (struct.pack("<Q", len(text)), text):
            f.write(block)
            digest.update(block)
        for _, chunks in tensors:
            for c in chunks:
                raw = c.contiguous().view(torch.uint8).numpy()  # reinterpret (bf16 has no numpy dtype)
                f.write(raw.data)
                digest.update(raw.data)
        f.flush()
    return digest.hexdigest(), 8 + len(text) + offset


def write_shard(final_path: Path, samples: list[dict], batches: list[dict], storage: str = "full") -> dict:
    """Write one shard atomically from its samples (shard order: each {"input_ids", "loss_mask"}) and
    their states, a list of batches {"aux": [n, n_aux*H_t], "final": [n, H_t]} whose rows follow the
    samples' tokens; storage "full" writes the states as they are, "fp8" encodes them (fp8_encode).
    Returns {"sha256", "bytes", "num_loss_tokens"}."""
    import torch

    for b in batches:  # a NaN or inf state would train the draft on garbage without a word
        for key in ("aux", "final"):
            if not torch.isfinite(b[key]).all():
                raise DataError(f"the target produced non-finite (nan/inf) hidden states for {final_path.name}: check "
                                f"target.dtype (float16 overflows on some models) and the target's weights")

    lengths = [len(s["input_ids"]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    input_ids = torch.tensor([t for s in samples for t in s["input_ids"]], dtype=torch.int64)
    loss_mask = torch.tensor([int(m) for s in samples for m in s["loss_mask"]], dtype=torch.uint8)
    aux, final = [b["aux"] for b in batches], [b["final"] for b in batches]
    tensors = [("input_ids", [input_ids]), ("loss_mask", [loss_mask])]
    if storage == "fp8":
        n_aux = aux[0].shape[1] // final[0].shape[1]
        aux_q, aux_s = zip(*(fp8_encode(a, n_aux) for a in aux))
        final_q, final_s = zip(*(fp8_encode(f, 1) for f in final))
        tensors += [("aux_hidden", list(aux_q)), ("aux_scale", list(aux_s)),
                    ("final_hidden", list(final_q)), ("final_scale", list(final_s))]
    else:
        tensors += [("aux_hidden", aux), ("final_hidden", final)]
    tensors.append(("sample_offsets", [offsets]))
    rows = sum(a.shape[0] for a in aux)
    if rows != int(offsets[-1]):
        raise PipelineError(f"internal error: {rows} hidden-state rows for {int(offsets[-1])} tokens in {final_path.name}")
    with atomic_path(final_path) as tmp:
        sha, size = write_safetensors(tmp, tensors)
    return {"sha256": sha, "bytes": size, "num_loss_tokens": int(loss_mask.sum())}


# ---------------------------------------------------------------------------------------------
# Verification of the bytes on disk against the index
# ---------------------------------------------------------------------------------------------


def verify_entry(shard_path: Path, entry: dict, mode: str, progress: Callable[[int], Any] | None = None) -> str | None:
    """None if the shard on disk matches its entry, else why not (02's rerun). mode: extract.verify;
    progress(n): n more bytes hashed."""
    if not shard_path.is_file():
        return "missing"
    size = shard_path.stat().st_size
    if size != entry.get("bytes"):
        return f"size {size} != {entry.get('bytes')} bytes (truncated or overwritten)"
    if mode == "sha256" and file_sha256(shard_path, progress=progress) != entry["sha256"]:
        return "sha256 mismatch (corrupted)"
    return None


def verify_shard_files(index: "HiddenIndex", layout: "Layout", env: "DistEnv", mode: str = "sha256") -> None:
    """Check every shard's bytes against the size and sha256 02 recorded in index.json (mode
    "size": sizes only, extract.verify), so a shard damaged after extraction stops 04 with one line
    instead of training on bad bytes. Ranks share the hashing; results are cached by (size, mtime)
    in run_dir/stages/hashes.json, so a resumed run does not read the shards again."""
    from tqdm import tqdm

    from common.core.run_folder import content_fingerprint

    mine = [s for i, s in enumerate(index.shards) if i % env.world_size == env.rank]
    total = sum(s.bytes or 0 for s in mine)
    with tqdm(total=total, unit="B", unit_scale=True, desc="04 verify shards", disable=not env.is_main or mode != "sha256",
              mininterval=1.0) as bar:
        for shard in mine:
            path = shard.path
            size = path.stat().st_size
            if shard.bytes is not None and size != shard.bytes:
                raise DataError(f"hidden shard {path} has {size} bytes but 02 wrote {shard.bytes} (truncated or overwritten); {RERUN_02}")
            if mode == "sha256" and shard.sha256 and content_fingerprint(layout, path) != shard.sha256:
                raise DataError(f"hidden shard {path} does not match the sha256 02 recorded in index.json (the file was "
                                f"damaged after extraction); {redo_shard(path)}")
            bar.update(size)


# ---------------------------------------------------------------------------------------------
# Reading: the index with every shard's header checked, and samples' rows on demand
# ---------------------------------------------------------------------------------------------


@dataclass
class ShardInfo:
    file: str
    path: Path
    num_tokens: int
    sample_ids: list[str]
    bytes: Optional[int] = None  # as 02 recorded them (verify_shard_files)
    sha256: Optional[str] = None


@dataclass
class SampleRef:
    """Where one sample's rows are: a shard and a row range in it."""

    shard: int  # index into HiddenIndex.shards
    start: int  # first row in the shard
    end: int  # one past the last row
    sample_id: str
    split: str

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class HiddenIndex:
    """hidden/index.json, verified against the shard files."""

    path: Path  # the index.json it was loaded from; shard files are next to it
    aux_layer_ids: list[int]
    target_hidden_size: int
    num_target_layers: Optional[int]
    dtype: str
    shards: list[ShardInfo]
    samples: list[SampleRef]
    storage: str = "full"  # STORAGES
    raw: dict = field(repr=False, default_factory=dict)

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def split_indices(self, split: str) -> list[int]:
        return [i for i, s in enumerate(self.samples) if s.split == split]

    def fingerprint(self) -> list:
        """What identifies the data set (for checkpoint compatibility checks)."""
        return [self.aux_layer_ids, [(s.file, s.num_tokens, s.sample_ids[:1], len(s.sample_ids)) for s in self.shards]]

    @classmethod
    def load(cls, index_path: str | Path, files: Optional[list[str]] = None) -> "HiddenIndex":
        """Read index.json (Layout.hidden_index): complete, in a readable format_version, and every
        shard's header consistent with its entry (cheap: only sample_offsets is read).
        files (rounds mode): only these shards, which must all be indexed; the rest may be gone or not
        written yet."""
        index_path = Path(index_path)
        if not index_path.is_file():
            raise DataError(f"no hidden-state index at {index_path}; run 02_extract_hidden.py first")
        raw = read_json(index_path)
        check_format_version(raw, index_path)
        check_index_fields(raw, index_path)
        if files is None and not raw.get("complete", False):
            raise DataError(f"{index_path} says the extraction is incomplete (complete=false); {RERUN_02}")
        for key in ("aux_layer_ids", "target_hidden_size", "shards"):
            if key not in raw:
                raise DataError(f"{index_path} has no '{key}' field; {RERUN_02}")
        if files is not None:
            listed = {e["file"]: e for e in raw["shards"]}
            missing = [f for f in files if f not in listed]
            if missing:
                raise DataError(f"{index_path} does not list {missing[0]} yet; {RERUN_02}")
            raw = {**raw, "shards": [listed[f] for f in files]}
        aux_ids = [int(k) for k in raw["aux_layer_ids"]]
        h_t = int(raw["target_hidden_size"])
        storage = storage_of(raw)
        if storage not in STORAGES:
            raise DataError(f"{index_path} has storage {json.dumps(storage)}, this code reads {' or '.join(STORAGES)}; "
                            f"{RERUN_02}")
        shards: list[ShardInfo] = []
        samples: list[SampleRef] = []
        for si, entry in enumerate(raw["shards"]):
            path = index_path.parent / entry["file"]
            ids = [str(x) for x in entry.get("sample_ids", [])]
            info = ShardInfo(entry["file"], path, int(entry.get("num_tokens", -1)), ids, entry.get("bytes"), entry.get("sha256"))
            offsets = check_shard_header(info, len(aux_ids), h_t, storage)
            split = entry.get("split")  # 02 keeps train and eval samples in separate shards
            if split not in SPLITS:
                raise DataError(f"index entry for {path} has split {split!r}, expected train or eval; {RERUN_02}")
            for j, sid in enumerate(ids):
                start, end = int(offsets[j]), int(offsets[j + 1])
                if end <= start:
                    raise DataError(f"hidden shard {path}: sample '{sid}' has no tokens (offsets {start}..{end}); {redo_shard(path)}")
                samples.append(SampleRef(si, start, end, sid, split))
            shards.append(info)
        if not samples:
            raise DataError(f"{index_path} lists no samples; check data/train.jsonl and {RERUN_02}")
        return cls(index_path, aux_ids, h_t, raw.get("num_target_layers"), str(raw.get("dtype", "")), shards, samples,
                   storage, raw)


def check_shard_header(info: ShardInfo, num_aux: int, h_t: int, storage: str = "full") -> "np.ndarray":
    """Open the shard header (cheap: no tensor data is read except sample_offsets) and check it
    against its index entry and storage; returns sample_offsets. Sets info.num_tokens from the file."""
    from safetensors import safe_open

    path = info.path
    if not path.is_file():
        raise DataError(f"hidden shard {path} is missing; {RERUN_02}")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            names = TENSORS + (tuple(FP8_SCALES.values()) if storage == "fp8" else ())
            missing = [k for k in names if k not in keys]
            if missing:
                raise DataError(f"hidden shard {path} lacks tensors {missing} (index.json says storage {storage}); "
                                f"{redo_shard(path)}")
            offsets = f.get_tensor("sample_offsets").numpy()
            shapes = {k: list(f.get_slice(k).get_shape()) for k in names}
            state_dtype = f.get_slice("aux_hidden").get_dtype()
    except DataError:
        raise
    except Exception as e:  # SafetensorError: truncated file, bad header
        raise DataError(f"hidden shard {path} is truncated or corrupt ({e}); {redo_shard(path)}") from None
    n = int(offsets[-1]) if len(offsets) else -1
    if len(offsets) != len(info.sample_ids) + 1 or offsets[0] != 0:
        raise DataError(
            f"hidden shard {path} has {len(offsets) - 1} samples but index.json lists {len(info.sample_ids)}; {redo_shard(path)}"
        )
    if info.num_tokens >= 0 and n != info.num_tokens:
        raise DataError(f"hidden shard {path} holds {n} tokens but index.json says {info.num_tokens}; {redo_shard(path)}")
    if (state_dtype == "F8_E4M3") != (storage == "fp8"):
        raise DataError(f"hidden shard {path} holds {state_dtype} states but index.json says storage {storage}; "
                        f"{redo_shard(path)}")
    want = {"input_ids": [n], "loss_mask": [n], "aux_hidden": [n, num_aux * h_t], "final_hidden": [n, h_t]}
    if storage == "fp8":
        want.update({"aux_scale": [n, num_aux], "final_scale": [n, 1]})
    for k, shape in want.items():
        if shapes[k] != shape:
            raise DataError(
                f"hidden shard {path}: '{k}' has shape {shapes[k]}, expected {shape} "
                f"({num_aux} aux layers x hidden {h_t}); {redo_shard(path)}"
            )
    info.num_tokens = n
    return offsets


class ShardReader:
    """Reads samples' rows from the shards of a HiddenIndex lazily (safetensors safe_open, one slice
    per sample and tensor; fp8 states decoded with their scales); keeps up to `max_open` shards open
    (LRU). Safe to share between threads."""

    def __init__(self, index: HiddenIndex, max_open: int = 32):
        self.index = index
        self.max_open = max_open
        self._open: collections.OrderedDict[int, object] = collections.OrderedDict()
        self._lock = threading.Lock()  # prefetch threads share the handle cache

    def _handle(self, shard: int):
        with self._lock:
            return self._handle_locked(shard)

    def _handle_locked(self, shard: int):
        from safetensors import safe_open

        h = self._open.get(shard)
        if h is not None:
            self._open.move_to_end(shard)
            return h
        path = self.index.shards[shard].path
        try:
            h = safe_open(str(path), framework="pt")
        except FileNotFoundError:
            raise DataError(f"hidden shard {path} disappeared during training; {RERUN_02}") from None
        except Exception as e:
            raise DataError(f"hidden shard {path} is truncated or corrupt ({e}); {redo_shard(path)}") from None
        self._open[shard] = h
        if len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return h

    def rows(self, i: int, name: str, skip: int = 0) -> "torch.Tensor":
        """Sample i's rows of tensor `name` (one of ROW_TENSORS), from its `skip`-th row on."""
        ref = self.index.samples[i]
        return self._handle(ref.shard).get_slice(name)[ref.start + skip : ref.end]

    def read(self, sample_indices: list[int], names: tuple[str, ...] = ROW_TENSORS,
             dtype: "torch.dtype | None" = None) -> dict[str, "torch.Tensor"]:
        """The rows of these samples back to back, per tensor. The states come in `dtype`; None = as
        stored for storage "full", float32 for "fp8"."""
        import torch

        fp8 = self.index.storage == "fp8"
        read_names = [*names, *(FP8_SCALES[k] for k in names if fp8 and k in FP8_SCALES)]
        parts: dict[str, list] = {k: [] for k in read_names}
        for i in sample_indices:
            ref = self.index.samples[i]
            h = self._handle(ref.shard)
            for k in parts:
                parts[k].append(h.get_slice(k)[ref.start : ref.end])
        rows = {k: torch.cat(v) for k, v in parts.items()}
        for k in names:
            if k not in FP8_SCALES:
                continue
            if fp8:
                rows[k] = fp8_decode(rows[k], rows.pop(FP8_SCALES[k]), dtype or torch.float32)
            elif dtype is not None:
                rows[k] = rows[k].to(dtype)
        return rows
