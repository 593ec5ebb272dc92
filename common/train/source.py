"""What 04 trains from: 02's plan and its rounds, the hidden-state index, the streaming wait for 02, shard
verification and the sample ledger (docs/design.md#rounds-under-a-disk-budget, #streaming, #sample-ledger).

The trainer asks it for one optimizer step's data at a time and reports its steps:

    source = TrainSource(cfg, env, say)        # streaming: waits for 02's plan and eval shards; loads the index
    source.open(dtype, pin_memory)             # the packed schedule of every round (common.train.data.TrainData)
    source.start(pos, ledger, checkpoint)      # the ledger at the position (checked against a resumed one)
    batch = source.next_batch(pos, steps_left) # a StepBatch; None: the round at pos is not extracted yet (02's turn)
    source.record_step(pos)                    # after each optimizer step
    source.round_trained(r)                    # after the checkpoint of a batch that frees its round

Every plan has rounds (common.hidden.rounds): without a disk budget one per epoch over every train shard, all
on disk and never deleted; under one, several per epoch, each on disk only while it is trained. The index holds
the round being trained (and the eval shards); next_batch swaps it when a round starts on other shards.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from common.core.distributed import DistEnv, barrier, on_rank0
from common.core.errors import DataError
from common.core.io import file_sha256, read_json
from common.core.run_folder import Layout, read_manifest
from common.core.stage_lock import StageBusy, lock_holder
from common.hidden.index import index_fingerprint, mark_trained, read_consumed, read_entries
from common.hidden.rounds import HiddenPlan, extracted
from common.hidden.shards import RERUN_02, HiddenIndex, verify_shard_files
from common.hidden.stream import StreamWait
from common.train.data import DataPosition, MicroBatch, RoundSamples, TrainData
from common.train.ledger import SampleLedger


NO_HIDDEN_ADVICE = "; run 02_extract_hidden.py first"


def without_02_advice(message: str) -> str:
    """What 04 found missing in hidden/, without the advice to run 02 that ends the message (a path may hold "; ")."""
    for advice in (f"; {RERUN_02}", NO_HIDDEN_ADVICE):
        message = message.removesuffix(advice)
    return message


@dataclass
class StepBatch:
    """One optimizer step's data on this rank."""

    pos: DataPosition  # where the step starts
    next_pos: DataPosition  # where the next one starts
    micro_batches: Iterator[tuple[MicroBatch, bool]]  # this rank's, read ahead; False: a stand-in with weight 0
    count: int  # how many micro_batches yields
    tokens: int  # tokens of the whole global step (all ranks)
    denominator: int  # what every micro-batch loss is divided by: positions (or tokens) of the whole global step
    ends_round: bool  # the last step of its round
    frees_round: bool  # ... and its round's shards are deleted after it (a disk budget): checkpoint it first


class TrainSource:
    def __init__(self, cfg, env: DistEnv, say: Callable[[str], None]):
        self.cfg, self.env, self.say = cfg, env, say
        self.layout = layout = Layout.of(cfg)
        self.stream = cfg.extract.stream
        self.wait = StreamWait("04_train", "02_extract_hidden", [layout.hidden_index, layout.hidden_plan,
                               layout.manifest("02_extract_hidden")], cfg.extract.stream_wait_minutes, say)
        if self.stream:
            self.wait_for_extraction()
        try:
            for path in (layout.hidden_index, layout.hidden_plan):
                if not path.is_file():
                    raise DataError(f"no hidden-state {path.stem} at {path}{NO_HIDDEN_ADVICE}")
            self.plan = HiddenPlan.read(layout.hidden_plan, epochs=cfg.train.epochs)
            self.check_plan_is_02s()
            self.files_loaded = self.first_files_on_disk()  # the shards self.index holds (all of them verified)
            self.index = HiddenIndex.load(layout.hidden_index, self.files_loaded)
        except DataError as e:
            if not self.stream:
                self.refuse_while_02_writes(e)
            raise
        self.data: Optional[TrainData] = None
        self.ledger: Optional[SampleLedger] = None
        self.reading: Optional[tuple[DataPosition, Iterator[MicroBatch]]] = None  # the open stream, at its next step
        self._last_samples: tuple = (None, None)  # (a round's shards, their ids and lengths): round_samples

    def refuse_while_02_writes(self, problem: DataError) -> None:
        """Not streaming, 04 started while 02 still writes hidden/: what 04 found missing is not written yet, and the
        error's advice (run 02) is wrong. Say that 02 is running instead (streaming, 04 waits for 02's shards)."""
        holder = lock_holder(self.cfg.run_dir, "02_extract_hidden")
        if holder is not None:
            found = without_02_advice(str(problem))
            raise StageBusy(
                f"hidden/ is not complete yet ({found}): 02_extract_hidden is running on {self.layout.run_dir} "
                f"(pid {holder}); wait for it to finish, then rerun 04_train.py; or, to train while 02 extracts, run "
                f"both with extract.stream: true and extract.max_disk_gb (README, \"Two GPU pools: streaming\")") from None

    # -- the plan and the schedule ---------------------------------------------------------

    def check_plan_is_02s(self) -> None:
        """plan.json as 02 wrote it (02 records its sha256): an edited plan would train other rounds than 02
        extracts, or break the disk budget."""
        layout = self.layout
        recorded = ((read_manifest(layout, "02_extract_hidden") or {}).get("result") or {}).get("plan_sha256")
        if recorded and file_sha256(layout.hidden_plan) != recorded:
            raise DataError(f"{layout.hidden_plan} is not the plan 02 made (its sha256 differs from the one in "
                            f"{layout.manifest('02_extract_hidden')}): it was edited or replaced; restore it, or rerun "
                            f"02_extract_hidden.py with --overwrite to plan again")

    def open(self, dtype, pin_memory: bool) -> None:
        """The packed schedule of every round of train.epochs (common.train.data), in the training dtype.
        train.max_steps past them: more epochs where the plan allows it, added when the position gets there
        (reach), else one ConfigError now."""
        t = self.cfg.train
        rounds = [self.round_samples(r) for r in range(len(self.plan.rounds))]
        self.data = TrainData(self.index, t.batch_max_tokens, t.seed, rounds=rounds, world_size=self.env.world_size,
                              rank=self.env.rank, grad_accum=t.grad_accum, dtype=dtype, num_workers=t.num_workers,
                              pin_memory=pin_memory)
        planned = self.data.total_steps()
        if t.max_steps and t.max_steps > planned:
            self.plan.check_more_epochs(f"train.max_steps={t.max_steps} is more than the {planned} steps of")

    def round_samples(self, r: int) -> RoundSamples:
        """Round r's samples. Rounds on the same shards (an unbudgeted plan's epochs) share one pair of lists: the
        ids and lengths of every train sample are held once, not once per epoch."""
        shards = self.plan.rounds[r].shards
        if self._last_samples[0] != shards:
            self._last_samples = (shards, self.plan.round_samples(r))
        return RoundSamples(self.plan.rounds[r].epoch, *self._last_samples[1])

    def reach(self, pos: DataPosition) -> None:
        """The rounds up to pos's (an unbudgeted plan past train.epochs: one more epoch each, HiddenPlan.add_epoch)."""
        while pos.round >= len(self.plan.rounds):
            self.plan.add_epoch()
            self.data.add_round(self.round_samples(len(self.plan.rounds) - 1))

    def total_steps(self) -> int:
        """train.max_steps, or the steps of every round of train.epochs."""
        return self.cfg.train.max_steps or self.data.total_steps()

    def identity(self) -> list:
        """What identifies the data for a checkpoint: the aux layers and the plan's rounds (common.hidden.rounds)."""
        return [self.index.aux_layer_ids, self.plan.identity()]

    def sample_lengths(self) -> list[int]:
        """Every sample's length known now (the plan has the train samples not on disk)."""
        return [s.length for s in self.index.samples] + self.plan.planned_lengths()

    def describe_position(self, pos: DataPosition) -> str:
        return self.plan.describe_round(pos.round)

    # -- the ledger ------------------------------------------------------------------------

    def start(self, pos: DataPosition, saved_ledger: Optional[dict] = None, checkpoint: Optional[Path] = None) -> None:
        """The ledger at `pos`: what the schedule says was trained before it. A resumed checkpoint's own ledger
        (saved_ledger; None on a fresh start) must agree."""
        self.reach(pos)
        implied = self.data.ledger_at(pos)
        if saved_ledger is not None and saved_ledger != implied:
            raise DataError(
                f"checkpoint {checkpoint} records other trained samples than its data position ({self.describe_position(pos)}, "
                f"micro-batch {pos.micro_batch}) implies; its ledger.json was edited or comes from another run: "
                f"remove {checkpoint} to resume from an earlier checkpoint, or rerun with --overwrite")
        self.ledger = implied

    def record_step(self, pos: DataPosition) -> None:
        self.data.record_step(self.ledger, pos)

    # -- what is on disk -------------------------------------------------------------------

    def wait_for_extraction(self) -> None:
        """Streaming: 04 may start before 02 has planned or written anything. Every rank waits (on its own: what
        it waits for only ever appears) until plan.json and index.json are there and, under a budget, the eval
        shards (02 writes them first); without one, until the whole extraction is complete."""
        layout = self.layout

        def ready() -> bool:
            if not (layout.hidden_plan.is_file() and layout.hidden_index.is_file()):
                return False
            plan = HiddenPlan.read(layout.hidden_plan)
            if not plan.budgeted:
                return bool(read_json(layout.hidden_index).get("complete"))
            return extracted(plan.eval_files(), read_entries(layout, fragments=False), layout.hidden)

        while not ready():
            self.wait.tick("02_extract_hidden to write hidden/plan.json and the first shards")
        self.wait.reset()

    def verify_loaded(self) -> None:
        """The loaded shards' bytes against index.json (extract.verify): before training, and at each swap."""
        verify_shard_files(self.index, self.layout, self.env, self.cfg.extract.verify)

    def first_files_on_disk(self) -> list[str]:
        """The files of the first round not consumed that is on disk (else just the eval shards): what the
        trainer starts from before it knows its position. Without a budget every shard is extracted before 04
        starts: all of them (a missing one is HiddenIndex.load's error, naming it)."""
        if not self.plan.budgeted:
            return self.plan.files_of_round(0)
        consumed = read_consumed(self.layout)
        listed = read_entries(self.layout, fragments=False)  # once, not once per round
        for rd in self.plan.rounds:
            if rd.number not in consumed and extracted(self.plan.files_of_round(rd.number), listed, self.layout.hidden):
                return self.plan.files_of_round(rd.number)
        return self.plan.eval_files()

    def next_batch(self, pos: DataPosition, steps_left: int) -> Optional[StepBatch]:
        """The data of the optimizer step at `pos`; None when 02 has not extracted the round at `pos` yet
        (streaming: after waiting for it). The micro-batches are read ahead to the end of the round (or of
        `steps_left` steps)."""
        if self.reading is None or self.reading[0] != pos:
            self.reach(pos)
            stream = self.open_round(pos, steps_left)
            if stream is None:
                return None
            self.reading = (pos, stream)
        data, stream = self.data, self.reading[1]
        mine, real, next_pos = data.step_micro_batches(pos)
        tokens = data.step_tokens(pos)
        # Each micro-batch loss is a sum over its positions divided by the step-0 position count of the whole
        # global step, so the step's gradient is the token mean over the global batch (the same for any split
        # into ranks x micro-batches).
        denominator = max(1, data.step_loss_positions(pos) if self.cfg.train.loss_normalization == "counted" else tokens)
        samples = self.index.samples

        def micro_batches() -> Iterator[tuple[MicroBatch, bool]]:
            for j, slot in enumerate(mine):
                mb = next(stream)
                assert mb.sample_ids == [samples[i].sample_id for i in slot], "data stream out of step"
                yield mb, real[j]

        ends_round = next_pos.round != pos.round
        last = ends_round or steps_left == 1
        self.reading = None if last else (next_pos, stream)
        return StepBatch(pos, next_pos, micro_batches(), len(mine), tokens, denominator, ends_round,
                         frees_round=last and self.plan.budgeted)

    def open_round(self, pos: DataPosition, steps_left: int) -> Optional[Iterator[MicroBatch]]:
        """This rank's micro-batches from `pos` to the end of its round (or `steps_left` steps), with the round's
        shards loaded (and verified) if the index does not hold them yet; None when they are not extracted."""
        r = pos.round
        if not self.round_ready(r):
            return None
        files = self.plan.files_of_round(r)
        if files != self.files_loaded:
            self.index = HiddenIndex.load(self.layout.hidden_index, files)
            self.files_loaded = files
            self.data.use_index(self.index)
            self.verify_loaded()
        return self.data.stream(pos, min(self.data.steps_left_in_round(pos), steps_left))

    def round_ready(self, r: int) -> bool:
        """Whether round r is on disk. Rank 0 decides, so that every rank trains the round or every rank waits for
        it (a rank may have loaded it at the start, another not). Streaming: poll until it is there, one decision
        per poll."""
        files = self.plan.files_of_round(r)

        def decide() -> str:
            if files == self.files_loaded or extracted(files, read_entries(self.layout, fragments=False), self.layout.hidden):
                return "ready"
            if self.stream:
                self.wait.check(f"02_extract_hidden to extract {self.plan.describe_round(r)}")
            return "wait"

        while True:
            if on_rank0(decide, self.env) == "ready":
                self.wait.reset()
                return True
            if not self.stream:
                return False
            time.sleep(self.wait.poll_s)

    def not_extracted_line(self, pos: DataPosition, step: int, total_steps: int) -> str:
        """04's line when it stops because the next round is not extracted yet (its checkpoint is saved)."""
        r = pos.round
        return (f"04_train: {r} of {len(self.plan.rounds)} rounds trained (step {step}/{total_steps}); "
                f"{self.plan.describe_round(r)} is not extracted yet: run 02_extract_hidden.py, "
                f"then 04 again (run_pipeline.py alternates them)")

    # -- consumed rounds (under a disk budget; common.hidden.index.mark_trained) -------------

    def reconcile(self, pos: DataPosition) -> None:
        """After a resume: rounds before the position are trained (consumed and deleted, even if a kill came
        between the checkpoint and the deletion); rounds from it on are not (a checkpoint that fell back past a
        deleted round has 02 extract it again)."""
        if self.env.is_main:
            redo = sorted(r for r in read_consumed(self.layout) if r >= pos.round)
            if redo:
                self.say(f"04_train: rounds {[r + 1 for r in redo]} were deleted after a later checkpoint that is gone; "
                         f"02 extracts them again")
            mark_trained(self.layout, self.plan, set(range(pos.round)), keep_out=set(redo))
        barrier(self.env)

    def round_trained(self, r: int) -> None:
        """Round r is trained and checkpointed: record it and delete its shards (rank 0; every rank waits)."""
        if self.env.is_main:
            mark_trained(self.layout, self.plan, {r})
        barrier(self.env)

    def restart_rounds(self) -> None:
        """--overwrite, rank 0: training starts over, so 02 extracts the rounds again from the first."""
        mark_trained(self.layout, self.plan, set(), keep_out=set(read_consumed(self.layout)))

    # -- inputs changed under a running 04 -------------------------------------------------

    def inputs_identity(self) -> dict[str, Optional[str]]:
        """04's inputs by content, as far as they may change under a running 04: index.json (index_fingerprint; under
        a disk budget plan.json and index.json's header, since 02 adds each round's shards to the rest) and the vocab
        map; None for a file that is gone. Small files, read whole: no cache to fool."""
        layout = self.layout

        def sha(path) -> Optional[str]:
            try:
                return hashlib.sha256(path.read_bytes()).hexdigest()
            except FileNotFoundError:
                return None

        ident = {layout.name(layout.vocab_map): sha(layout.vocab_map)}
        if not self.plan.budgeted:  # nothing may change in hidden/ while 04 trains
            ident[layout.name(layout.hidden_index)] = index_fingerprint(layout)
            return ident
        ident[layout.name(layout.hidden_plan)] = sha(layout.hidden_plan)
        ident[f"{layout.name(layout.hidden_index)} (its header)"] = index_fingerprint(layout, header_only=True)
        return ident

    def remember_inputs(self) -> None:
        self.inputs_at_start = on_rank0(self.inputs_identity, self.env)

    def changed_inputs(self) -> list[str]:
        """The inputs whose content changed since remember_inputs (rank 0 reads them, every rank gets the answer)."""
        now = on_rank0(self.inputs_identity, self.env)
        return [name for name, digest in self.inputs_at_start.items() if now.get(name) != digest]
