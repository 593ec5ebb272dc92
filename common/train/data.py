"""Training data for stage 04: hidden-state shards -> packed micro-batches.

Stage 02 writes `hidden/shard-NNNNN.safetensors` (one row per token, samples back to back,
`sample_offsets` marks where each sample starts) and `hidden/index.json`. Here we:

1. verify the index (complete, every shard present and readable, sizes consistent) and
   list every sample with its shard, row range and split (`HiddenIndex.load`);
2. pack samples into micro-batches of at most `batch_max_tokens` tokens, one packed row per
   micro-batch (`pack_micro_batches`): a seeded permutation per epoch (seed + epoch), then
   best-fit-decreasing within windows of that permutation, then a seeded shuffle of the
   micro-batches. Same inputs -> same micro-batches, on any number of processes;
3. read a micro-batch lazily (safetensors `safe_open`, one slice per sample and tensor) and
   cast the hidden states to the training dtype (`ShardReader`, `MicroBatch`).

Data position and multiple processes. The packed micro-batches of an epoch form one global
sequence. An optimizer step consumes `world * grad_accum` consecutive micro-batches of it;
rank r takes the ones at offsets r, r + world, r + 2*world, ... of that step's slice. So one
process with grad_accum=2 and two processes with grad_accum=1 see exactly the same global
batches (and, since the trainer divides every micro-batch loss by the position count of the whole
global step, the same gradients). The last step of an epoch wraps
around to the epoch's first micro-batches so that every rank gets the same number of them.
A position is (epoch, index of the next global micro-batch), which is what a checkpoint stores.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from common.core.errors import DataError
from common.core.io import read_json

RERUN_02 = "rerun 02_extract_hidden.py (it rebuilds missing or incomplete shards)"
SHARD_KEYS = ("input_ids", "loss_mask", "aux_hidden", "final_hidden", "sample_offsets")
SPLITS = ("train", "eval")


@dataclass
class ShardInfo:
    file: str
    path: Path
    num_tokens: int
    sample_ids: list[str]


@dataclass
class SampleRef:
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

    hidden_dir: Path
    aux_layer_ids: list[int]
    target_hidden_size: int
    num_target_layers: Optional[int]
    dtype: str
    shards: list[ShardInfo]
    samples: list[SampleRef]
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
    def load(cls, hidden_dir: str | Path) -> "HiddenIndex":
        hidden_dir = Path(hidden_dir)
        index_path = hidden_dir / "index.json"
        if not index_path.is_file():
            raise DataError(f"no hidden-state index at {index_path}; run 02_extract_hidden.py first")
        raw = read_json(index_path)
        if not raw.get("complete", False):
            raise DataError(f"{index_path} says the extraction is incomplete (complete=false); {RERUN_02}")
        for key in ("aux_layer_ids", "target_hidden_size", "shards"):
            if key not in raw:
                raise DataError(f"{index_path} has no '{key}' field; {RERUN_02} with --overwrite")
        aux_ids = [int(k) for k in raw["aux_layer_ids"]]
        h_t = int(raw["target_hidden_size"])
        shards: list[ShardInfo] = []
        samples: list[SampleRef] = []
        for si, entry in enumerate(raw["shards"]):
            path = hidden_dir / entry["file"]
            ids = [str(x) for x in entry.get("sample_ids", [])]
            info = ShardInfo(entry["file"], path, int(entry.get("num_tokens", -1)), ids)
            offsets = _verify_shard(info, len(aux_ids), h_t)
            split = entry.get("split")  # 02 keeps train and eval samples in separate shards
            if split not in SPLITS:
                raise DataError(f"index entry for {path} has split {split!r}, expected train or eval; {RERUN_02} with --overwrite")
            for j, sid in enumerate(ids):
                start, end = int(offsets[j]), int(offsets[j + 1])
                if end <= start:
                    raise DataError(f"hidden shard {path}: sample '{sid}' has no tokens (offsets {start}..{end}); {RERUN_02} with --overwrite")
                samples.append(SampleRef(si, start, end, sid, split))
            shards.append(info)
        if not samples:
            raise DataError(f"{index_path} lists no samples; check data/train.jsonl and {RERUN_02}")
        return cls(hidden_dir, aux_ids, h_t, raw.get("num_target_layers"), str(raw.get("dtype", "")), shards, samples, raw)


def _verify_shard(info: ShardInfo, num_aux: int, h_t: int) -> np.ndarray:
    """Open the shard header (cheap: no tensor data is read except sample_offsets) and check it."""
    from safetensors import safe_open

    path = info.path
    if not path.is_file():
        raise DataError(f"hidden shard {path} is missing; {RERUN_02}")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            missing = [k for k in SHARD_KEYS if k not in keys]
            if missing:
                raise DataError(f"hidden shard {path} lacks tensors {missing}; {RERUN_02} with --overwrite")
            offsets = f.get_tensor("sample_offsets").numpy()
            shapes = {k: list(f.get_slice(k).get_shape()) for k in SHARD_KEYS}
    except DataError:
        raise
    except Exception as e:  # SafetensorError: truncated file, bad header
        raise DataError(f"hidden shard {path} is truncated or corrupt ({e}); delete it and {RERUN_02}") from None
    n = int(offsets[-1]) if len(offsets) else -1
    if len(offsets) != len(info.sample_ids) + 1 or offsets[0] != 0:
        raise DataError(
            f"hidden shard {path} has {len(offsets) - 1} samples but index.json lists {len(info.sample_ids)}; {RERUN_02} with --overwrite"
        )
    if info.num_tokens >= 0 and n != info.num_tokens:
        raise DataError(f"hidden shard {path} holds {n} tokens but index.json says {info.num_tokens}; {RERUN_02} with --overwrite")
    want = {"input_ids": [n], "loss_mask": [n], "aux_hidden": [n, num_aux * h_t], "final_hidden": [n, h_t]}
    for k, shape in want.items():
        if shapes[k] != shape:
            raise DataError(
                f"hidden shard {path}: '{k}' has shape {shapes[k]}, expected {shape} "
                f"({num_aux} aux layers x hidden {h_t}); {RERUN_02} with --overwrite"
            )
    info.num_tokens = n
    return offsets


def verify_shard_files(index: HiddenIndex, layout, env, mode: str = "sha256") -> None:
    """Check every shard's bytes against the size and sha256 02 recorded in index.json (mode
    "size": sizes only, extract.verify), so a shard damaged after extraction stops 04 with one line
    instead of training on bad bytes. Ranks share the hashing; results are cached by (size, mtime)
    in run_dir/stages/hashes.json, so a resumed run does not read the shards again."""
    from tqdm import tqdm

    from common.core.run_folder import content_fingerprint

    entries = index.raw.get("shards") or []
    mine = [e for i, e in enumerate(entries) if i % env.world_size == env.rank]
    total = sum(int(e.get("bytes") or 0) for e in mine)
    with tqdm(total=total, unit="B", unit_scale=True, desc="04 verify shards", disable=not env.is_main or mode != "sha256",
              mininterval=1.0) as bar:
        for entry in mine:
            path = index.hidden_dir / entry["file"]
            want_bytes, want_sha = entry.get("bytes"), entry.get("sha256")
            size = path.stat().st_size
            if want_bytes is not None and size != want_bytes:
                raise DataError(f"hidden shard {path} has {size} bytes but 02 wrote {want_bytes} (truncated or overwritten); {RERUN_02}")
            if mode == "sha256" and want_sha and content_fingerprint(layout, path) != want_sha:
                raise DataError(f"hidden shard {path} does not match the sha256 02 recorded in index.json (the file was "
                                f"damaged after extraction); {RERUN_02}")
            bar.update(size)


# ---------------------------------------------------------------------------------------
# Packing


def pack_micro_batches(
    lengths: np.ndarray, budget: int, seed: int, epoch: int, window: int = 4096, shuffle: bool = True
) -> list[list[int]]:
    """Group sample positions 0..len(lengths)-1 into micro-batches of <= budget tokens.

    shuffle=True: seeded permutation (seed, epoch), best-fit-decreasing inside consecutive
    windows of `window` samples (long and short samples of a window share micro-batches, so
    budgets fill up while the order stays random at the window scale), then a seeded shuffle
    of the micro-batches. shuffle=False (eval): one window over everything, in length order.
    """
    n = len(lengths)
    if n == 0:
        return []
    too_long = int(np.max(lengths))
    if too_long > budget:
        raise DataError(
            f"a sample has {too_long} tokens, more than train.batch_max_tokens={budget}; "
            f"raise train.batch_max_tokens to >= {too_long} or lower tokenize.max_seq_len and rerun 01b/02"
        )
    if shuffle:
        rng = np.random.default_rng([seed, epoch])
        order = rng.permutation(n)
    else:
        order = np.arange(n)
        window = n
    batches: list[list[int]] = []
    for w in range(0, n, window):
        chunk = order[w : w + window]
        # Stable sort: equal lengths keep their permutation order (determinism).
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        batches.extend(_best_fit(chunk, lengths, budget))
    if shuffle:
        perm = rng.permutation(len(batches))
        batches = [batches[k] for k in perm]
    return batches


def _best_fit(items: np.ndarray, lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Best-fit decreasing: each item goes to the open bin with the least room that still fits it."""
    bins: list[list[int]] = []
    # Open bins as (remaining room, bin id), sorted: bisect finds the tightest bin that fits.
    rooms: list[tuple[int, int]] = []
    for i in items.tolist():
        size = int(lengths[i])
        k = bisect.bisect_left(rooms, (size, -1))
        if k < len(rooms):
            room, b = rooms.pop(k)
        else:
            room, b = budget, len(bins)
            bins.append([])
        bins[b].append(i)
        room -= size
        if room > 0:
            bisect.insort(rooms, (room, b))
    return bins


# ---------------------------------------------------------------------------------------
# Reading


@dataclass
class MicroBatch:
    """One packed row: samples back to back (seq_lens sums to num_tokens)."""

    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 [T] (0/1)
    aux_hidden: torch.Tensor  # [T, n_aux*H_t]
    final_hidden: torch.Tensor  # [T, H_t]
    position_ids: torch.Tensor  # int64 [T], restarting at 0 for each sample
    seq_lens: list[int]
    sample_ids: list[str]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return MicroBatch(
            move(self.input_ids), move(self.loss_mask), move(self.aux_hidden), move(self.final_hidden),
            move(self.position_ids), list(self.seq_lens), list(self.sample_ids),
        )


class ShardReader:
    """Reads samples from the shards lazily; keeps up to `max_open` shards open (LRU)."""

    def __init__(self, index: HiddenIndex, dtype: torch.dtype = torch.float32, max_open: int = 32, pin_memory: bool = False):
        self.index = index
        self.dtype = dtype
        self.max_open = max_open
        self.pin_memory = pin_memory
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
            raise DataError(f"hidden shard {path} is truncated or corrupt ({e}); delete it and {RERUN_02}") from None
        self._open[shard] = h
        if len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return h

    def loss_positions(self, i: int) -> int:
        ref = self.index.samples[i]
        if ref.length < 3:
            return 0
        return int(self._handle(ref.shard).get_slice("loss_mask")[ref.start + 2 : ref.end].sum())

    def read(self, sample_indices: list[int]) -> MicroBatch:
        parts = {k: [] for k in ("input_ids", "loss_mask", "aux_hidden", "final_hidden")}
        seq_lens, ids = [], []
        for i in sample_indices:
            ref = self.index.samples[i]
            h = self._handle(ref.shard)
            for k in parts:
                parts[k].append(h.get_slice(k)[ref.start : ref.end])
            seq_lens.append(ref.length)
            ids.append(ref.sample_id)
        aux = torch.cat(parts["aux_hidden"]).to(self.dtype)
        final = torch.cat(parts["final_hidden"]).to(self.dtype)
        if self.pin_memory:
            aux, final = aux.pin_memory(), final.pin_memory()
        return MicroBatch(
            input_ids=torch.cat(parts["input_ids"]).long(),
            loss_mask=torch.cat(parts["loss_mask"]).long(),
            aux_hidden=aux,
            final_hidden=final,
            position_ids=torch.cat([torch.arange(n, dtype=torch.long) for n in seq_lens]),
            seq_lens=seq_lens,
            sample_ids=ids,
        )


def prefetch(read_fn, items, workers: int) -> Iterator:
    """Yield read_fn(item) in order; with workers > 0, up to workers+1 reads run ahead in threads."""
    if workers <= 0:
        for item in items:
            yield read_fn(item)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        pending: collections.deque = collections.deque()
        it = iter(items)
        for item in it:
            pending.append(pool.submit(read_fn, item))
            if len(pending) > workers:
                break
        for item in it:
            yield pending.popleft().result()
            pending.append(pool.submit(read_fn, item))
        while pending:
            yield pending.popleft().result()


# ---------------------------------------------------------------------------------------
# The schedule of micro-batches across epochs, steps and ranks


@dataclass
class DataPosition:
    epoch: int = 0
    micro_batch: int = 0  # index of the next global micro-batch within the epoch

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "micro_batch": self.micro_batch}

    @classmethod
    def from_dict(cls, d: dict) -> "DataPosition":
        return cls(int(d["epoch"]), int(d["micro_batch"]))


class TrainData:
    """The train split as a deterministic sequence of packed micro-batches per epoch."""

    def __init__(self, index: HiddenIndex, batch_max_tokens: int, seed: int, *, world_size: int = 1, rank: int = 0,
                 grad_accum: int = 1, dtype: torch.dtype = torch.float32, num_workers: int = 0, pin_memory: bool = False,
                 window: int = 4096, split: str = "train"):
        self.index = index
        self.samples = index.split_indices(split)
        if not self.samples:
            raise DataError(f"no '{split}' samples in {index.hidden_dir / 'index.json'}; check data/{split}.jsonl and rerun 02")
        self.lengths = np.array([index.samples[i].length for i in self.samples], dtype=np.int64)
        self.budget = batch_max_tokens
        self.seed = seed
        self.world_size = world_size
        self.rank = rank
        self.grad_accum = grad_accum
        self.window = window
        self.num_workers = num_workers
        self.reader = ShardReader(index, dtype=dtype, pin_memory=pin_memory)
        self._loss_positions = np.full(len(index.samples), -1, dtype=np.int64)  # filled lazily
        self._epochs: dict[int, list[list[int]]] = {}
        self._epoch_sizes: dict[int, int] = {}
        self.epoch_micro_batches(0)  # validates lengths against the budget at startup

    @property
    def micro_per_step(self) -> int:
        return self.world_size * self.grad_accum

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def epoch_micro_batches(self, epoch: int) -> list[list[int]]:
        """The global micro-batches of an epoch, as lists of sample indices into index.samples."""
        if epoch not in self._epochs:
            packed = pack_micro_batches(self.lengths, self.budget, self.seed, epoch, self.window)
            # keep two epochs: the prefetcher may run into the next one while the loop finishes this one
            self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = [[self.samples[i] for i in mb] for mb in packed]
            self._epoch_sizes[epoch] = len(packed)
        return self._epochs[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        if epoch not in self._epoch_sizes:
            self.epoch_micro_batches(epoch)
        return math.ceil(self._epoch_sizes[epoch] / self.micro_per_step)

    def total_steps(self, epochs: int) -> int:
        return sum(self.steps_in_epoch(e) for e in range(epochs))

    def step_micro_batches(self, pos: DataPosition) -> tuple[list[list[int]], DataPosition]:
        """This rank's micro-batches for the optimizer step at `pos`, and the position after it."""
        mbs = self.epoch_micro_batches(pos.epoch)
        m = len(mbs)
        start = pos.micro_batch
        mine = [mbs[(start + j * self.world_size + self.rank) % m] for j in range(self.grad_accum)]
        nxt = start + self.micro_per_step
        nxt_pos = DataPosition(pos.epoch, nxt) if nxt < m else DataPosition(pos.epoch + 1, 0)
        return mine, nxt_pos

    def step_tokens(self, pos: DataPosition) -> int:
        """Tokens in the whole global step at `pos` (all ranks), computed locally."""
        mbs = self.epoch_micro_batches(pos.epoch)
        m = len(mbs)
        return sum(self.index.samples[i].length for g in range(pos.micro_batch, pos.micro_batch + self.micro_per_step) for i in mbs[g % m])

    def step_loss_positions(self, pos: DataPosition) -> int:
        """Positions that get a step-0 loss in the whole global step (all ranks): per sample of
        length L, the t with loss_mask[t+2] == 1 (the target x_{t+2} lies inside the sample).
        Known before the forward pass, so every rank can normalise by the global count."""
        mbs = self.epoch_micro_batches(pos.epoch)
        m = len(mbs)
        total = 0
        for g in range(pos.micro_batch, pos.micro_batch + self.micro_per_step):
            for i in mbs[g % m]:
                if self._loss_positions[i] < 0:
                    self._loss_positions[i] = self.reader.loss_positions(i)
                total += int(self._loss_positions[i])
        return total

    def stream(self, pos: DataPosition, num_steps: int) -> Iterator[MicroBatch]:
        """This rank's micro-batches for `num_steps` steps from `pos`, in order, read ahead by
        num_workers threads (across step boundaries)."""

        def schedule():
            p = pos
            for _ in range(num_steps):
                mine, p = self.step_micro_batches(p)
                yield from mine

        return prefetch(self.reader.read, schedule(), self.num_workers)


def eval_micro_batches(index: HiddenIndex, budget: int, world_size: int, rank: int) -> tuple[list, int, list[int]]:
    """The eval split packed in length order: this rank's share (r, r+W, ...), the per-rank
    count and the first micro-batch (a stand-in for ranks that run out).

    Every rank gets the same number of entries (FSDP needs all ranks in every forward):
    ranks short of a micro-batch get None entries.
    """
    samples = index.split_indices("eval")
    if not samples:
        return [], 0, []
    lengths = np.array([index.samples[i].length for i in samples], dtype=np.int64)
    packed = pack_micro_batches(lengths, budget, 0, 0, shuffle=False)
    packed = [[samples[i] for i in mb] for mb in packed]
    per_rank = math.ceil(len(packed) / world_size)
    mine = [packed[k] if k < len(packed) else None for k in range(rank, per_rank * world_size, world_size)]
    return mine, per_rank, packed[0]
