"""Training data for stage 04: hidden-state shards -> packed micro-batches.

Stage 02 writes the shards and their index; common.hidden.shards owns that format. There,
`HiddenIndex.load` verifies the index (readable format_version, complete, every shard present and
readable, sizes consistent) and lists every sample with its shard, row range and split
(`SampleRef`), and `ShardReader` reads samples' rows. Here we:

1. take the train (or eval) samples of that index;
2. pack samples into micro-batches of at most `batch_max_tokens` tokens, one packed row per
   micro-batch (`pack_micro_batches`): a seeded permutation per epoch (seed + epoch), then
   best-fit-decreasing within windows of that permutation, then a seeded shuffle of the
   micro-batches. Same inputs -> same micro-batches, on any number of processes;
3. read a micro-batch lazily through `ShardReader` (one slice per sample and tensor; it decodes
   fp8 storage) with the hidden states in the training dtype (`MicroBatchReader`, `MicroBatch`).

Data position and multiple processes. The packed micro-batches of an epoch form one global
sequence. An optimizer step consumes `world * grad_accum` consecutive micro-batches of it;
rank r takes the ones at offsets r, r + world, r + 2*world, ... of that step's slice. So one
process with grad_accum=2 and two processes with grad_accum=1 see exactly the same global
batches (and, since the trainer divides every micro-batch loss by the position count of the whole
global step, the same gradients). In the last step of an epoch a rank that runs out gets one of the
epoch's first micro-batches again with weight 0 (collectives stay in step; no sample counts twice).
A position is (round, index of the next global micro-batch), which is what a checkpoint stores, with
the ledger of which sample was trained in which epoch (common.train.ledger). The rounds are 02's plan's
(common.hidden.rounds): without a disk budget one per epoch, under one several per epoch, each a random share
of its samples.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from common.core.errors import DataError
from common.hidden.shards import HiddenIndex, ShardReader
from common.train.ledger import SampleLedger

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


class MicroBatchReader:
    """Reads micro-batches: the samples' rows (common.hidden.shards.ShardReader) packed into one row,
    the hidden states cast to the training dtype, position ids restarting at each sample."""

    def __init__(self, index: HiddenIndex, dtype: torch.dtype = torch.float32, max_open: int = 32, pin_memory: bool = False):
        self.index = index
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.shards = ShardReader(index, max_open=max_open)

    def loss_positions(self, i: int) -> int:
        """Positions of sample i with a step-0 loss: the t with loss_mask[t+2] == 1."""
        if self.index.samples[i].length < 3:
            return 0
        return int(self.shards.rows(i, "loss_mask", skip=2).sum())

    def read(self, sample_indices: list[int]) -> MicroBatch:
        rows = self.shards.read(sample_indices, dtype=self.dtype)  # fp8 storage decoded there
        refs = [self.index.samples[i] for i in sample_indices]
        seq_lens = [ref.length for ref in refs]
        aux, final = rows["aux_hidden"], rows["final_hidden"]
        if self.pin_memory:
            aux, final = aux.pin_memory(), final.pin_memory()
        return MicroBatch(
            input_ids=rows["input_ids"].long(),
            loss_mask=rows["loss_mask"].long(),
            aux_hidden=aux,
            final_hidden=final,
            position_ids=torch.cat([torch.arange(n, dtype=torch.long) for n in seq_lens]),
            seq_lens=seq_lens,
            sample_ids=[ref.sample_id for ref in refs],
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
    round: int = 0  # the round of the plan (without a disk budget: the epoch)
    micro_batch: int = 0  # index of the next global micro-batch within the round

    def to_dict(self) -> dict:
        return {"round": self.round, "micro_batch": self.micro_batch}

    @classmethod
    def from_dict(cls, d: dict) -> "DataPosition":
        return cls(int(d["round"]), int(d["micro_batch"]))


@dataclass
class RoundSamples:
    """One round's train samples, as 02's plan cut them (common.hidden.rounds): without a disk budget an epoch over
    every train sample, under one a random share of an epoch."""

    epoch: int
    sample_ids: list[str]  # in index order (the round's shards in plan order, each in shard order)
    lengths: list[int]


class TrainData:
    """The train split as a deterministic sequence of packed micro-batches per round.

    Round r is a set of train samples (`rounds`, from 02's plan: TrainSource) packed with seed (train.seed, r).
    `index` holds at least the shards of the round being trained (use_index swaps it when the next round's are
    on disk); the packing and the step counts of every round come from the plan's lengths, so the whole schedule
    is known up front."""

    def __init__(self, index: HiddenIndex, batch_max_tokens: int, seed: int, *, rounds: list[RoundSamples],
                 world_size: int = 1, rank: int = 0, grad_accum: int = 1, dtype: torch.dtype = torch.float32,
                 num_workers: int = 0, pin_memory: bool = False, window: int = 4096, split: str = "train"):
        self.split, self.dtype, self.pin_memory = split, dtype, pin_memory
        self.rounds = rounds
        self.budget = batch_max_tokens
        self.seed = seed
        self.world_size = world_size
        self.rank = rank
        self.grad_accum = grad_accum
        self.window = window
        self.num_workers = num_workers
        self._sizes: dict[int, int] = {}
        self.use_index(index)
        for r in range(len(rounds)):  # validates lengths against the budget at startup
            self.steps_in_round(r)

    def use_index(self, index: HiddenIndex) -> None:
        """Read from `index` from now on (the shards of the round about to be trained)."""
        self.index = index
        self.samples = index.split_indices(self.split)
        self._index_of = {index.samples[i].sample_id: i for i in self.samples}
        self.reader = MicroBatchReader(index, dtype=self.dtype, pin_memory=self.pin_memory)
        self._loss_positions = np.full(len(index.samples), -1, dtype=np.int64)  # filled lazily
        self._packed: dict[int, list[list[int]]] = {}

    def add_round(self, samples: RoundSamples) -> None:
        self.rounds.append(samples)
        self.steps_in_round(len(self.rounds) - 1)

    # -- rounds ----------------------------------------------------------------------------

    def _round_lengths(self, r: int) -> np.ndarray:
        return np.asarray(self.rounds[r].lengths, dtype=np.int64)

    def _round_samples(self, r: int) -> list[int]:
        try:
            return [self._index_of[sid] for sid in self.rounds[r].sample_ids]
        except KeyError:
            raise DataError(f"round {r + 1} is not in {self.index.path}; rerun 02_extract_hidden.py") from None

    def _first_epoch(self) -> list[RoundSamples]:
        return [rd for rd in self.rounds if rd.epoch == self.rounds[0].epoch]

    # -- the ledger ------------------------------------------------------------------------

    def new_ledger(self) -> SampleLedger:
        """An empty ledger over the train samples: every sample of the first epoch's rounds."""
        return SampleLedger([sid for rd in self._first_epoch() for sid in rd.sample_ids])

    def record_step(self, ledger: SampleLedger, pos: DataPosition) -> None:
        """Count the samples of the global step at `pos` as trained in its epoch."""
        ledger.record_ids(self.rounds[pos.round].epoch,
                          (self.index.samples[i].sample_id for mb in self.step_global_micro_batches(pos) for i in mb))

    def ledger_at(self, pos: DataPosition) -> SampleLedger:
        """The ledger of a run that stopped at `pos`: every earlier round whole (positions only move to
        the next round after the last micro-batch), and the first pos.micro_batch of pos's round."""
        ledger = self.new_ledger()
        for r in range(pos.round):
            ledger.record_ids(self.rounds[r].epoch, self.rounds[r].sample_ids)
        if pos.micro_batch:
            ids = self.rounds[pos.round].sample_ids
            packed = pack_micro_batches(self._round_lengths(pos.round), self.budget, self.seed, pos.round, self.window)
            ledger.record_ids(self.rounds[pos.round].epoch, (ids[k] for mb in packed[: pos.micro_batch] for k in mb))
        return ledger

    @property
    def micro_per_step(self) -> int:
        return self.world_size * self.grad_accum

    @property
    def num_tokens(self) -> int:
        """Train tokens of one epoch."""
        return int(sum(sum(rd.lengths) for rd in self._first_epoch()))

    def round_micro_batches(self, r: int) -> list[list[int]]:
        """The global micro-batches of round r, as lists of sample indices into index.samples."""
        if r not in self._packed:
            packed = pack_micro_batches(self._round_lengths(r), self.budget, self.seed, r, self.window)
            samples = self._round_samples(r)
            # keep two rounds: the prefetcher may run into the next one while the loop finishes this one
            self._packed = {k: v for k, v in self._packed.items() if k == r - 1}
            self._packed[r] = [[samples[i] for i in mb] for mb in packed]
            self._sizes[r] = len(packed)
        return self._packed[r]

    def steps_in_round(self, r: int) -> int:
        """Optimizer steps in a round (from the lengths alone: known for rounds not on disk yet)."""
        if r not in self._sizes:
            self._sizes[r] = len(pack_micro_batches(self._round_lengths(r), self.budget, self.seed, r, self.window))
        return math.ceil(self._sizes[r] / self.micro_per_step)

    def steps_left_in_round(self, pos: DataPosition) -> int:
        self.steps_in_round(pos.round)
        return math.ceil((self._sizes[pos.round] - pos.micro_batch) / self.micro_per_step)

    def total_steps(self) -> int:
        """Steps of every round."""
        return sum(self.steps_in_round(r) for r in range(len(self.rounds)))

    def epochs_done(self, pos: DataPosition) -> float:
        """Epochs trained at `pos`, fractional (counted in samples)."""
        per_epoch = sum(len(rd.sample_ids) for rd in self._first_epoch())
        done = sum(len(rd.sample_ids) for rd in self.rounds[: pos.round])
        if pos.micro_batch:
            done += sum(len(mb) for mb in self.round_micro_batches(pos.round)[: pos.micro_batch])
        return done / max(1, per_epoch)

    def step_micro_batches(self, pos: DataPosition) -> tuple[list[list[int]], list[bool], DataPosition]:
        """This rank's micro-batches for the optimizer step at `pos`, whether each one is real, and the
        position after the step. At an epoch's end a rank can run out: it gets one of the epoch's
        first micro-batches again to keep the collectives in step, marked not real (the trainer gives
        it weight 0), so every sample is trained exactly once per epoch."""
        mbs = self.round_micro_batches(pos.round)
        m = len(mbs)
        start = pos.micro_batch
        slots = [start + j * self.world_size + self.rank for j in range(self.grad_accum)]
        nxt = start + self.micro_per_step
        nxt_pos = DataPosition(pos.round, nxt) if nxt < m else DataPosition(pos.round + 1, 0)
        return [mbs[g % m] for g in slots], [g < m for g in slots], nxt_pos

    def step_global_micro_batches(self, pos: DataPosition) -> list[list[int]]:
        """The real micro-batches of the whole global step at `pos` (all ranks), computed locally."""
        mbs = self.round_micro_batches(pos.round)
        return mbs[pos.micro_batch : pos.micro_batch + self.micro_per_step]

    def step_tokens(self, pos: DataPosition) -> int:
        """Tokens in the whole global step at `pos` (all ranks), computed locally."""
        return sum(self.index.samples[i].length for mb in self.step_global_micro_batches(pos) for i in mb)

    def step_loss_positions(self, pos: DataPosition) -> int:
        """Positions that get a step-0 loss in the whole global step (all ranks): per sample of
        length L, the t with loss_mask[t+2] == 1 (the target x_{t+2} lies inside the sample).
        Known before the forward pass, so every rank can normalise by the global count."""
        total = 0
        for mb in self.step_global_micro_batches(pos):
            for i in mb:
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
                mine, _, p = self.step_micro_batches(p)
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
