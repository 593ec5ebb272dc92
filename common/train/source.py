"""What 04 trains from: the hidden-state index, the rounds of 02's plan, the streaming wait for 02, shard
verification and the sample ledger (docs/design.md#rounds-under-a-disk-budget, #streaming, #sample-ledger).

The trainer asks it for micro-batches and reports its steps:

    source = TrainSource(cfg, env, say)        # streaming: waits for 02's plan and eval shards; loads the index
    source.open(dtype, pin_memory)             # the packed schedule (common.train.data.TrainData): total_steps
    source.start(pos, checkpoint)              # the ledger at the position (checked against a resumed one)
    batches = source.batches(pos, steps)       # None: the round at pos is not extracted yet (02's turn)
    source.record_step(pos)                    # after each optimizer step
    source.round_trained(r)                    # after round r's checkpoint: consumed.json, its shards deleted

Without a disk budget the index holds everything and a round is an epoch. Under one, the index holds the round
being trained (and the eval shards); batches() swaps it when the position moves to the next round, and 02's
plan knows every round's samples and lengths, so the schedule is whole from the start.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from common.core.distributed import DistEnv, barrier, on_rank0
from common.core.errors import ConfigError, DataError
from common.core.io import file_sha256, read_json
from common.core.run_folder import Layout, read_manifest
from common.hidden.index import INDEX_SHARD_FIELDS, mark_trained, read_consumed, read_entries, write_consumed
from common.hidden.rounds import HiddenPlan, extracted
from common.hidden.shards import HiddenIndex, verify_shard_files
from common.hidden.stream import StreamWait
from common.train.data import DataPosition, MicroBatch, RoundSamples, TrainData
from common.train.ledger import SampleLedger


class TrainSource:
    def __init__(self, cfg, env: DistEnv, say: Callable[[str], None]):
        self.cfg, self.env, self.say = cfg, env, say
        self.layout = layout = Layout.of(cfg)
        self.stream = cfg.extract.stream
        self.wait = StreamWait("04_train", "02_extract_hidden", [layout.hidden_index, layout.hidden_plan,
                               layout.manifest("02_extract_hidden")], cfg.extract.stream_wait_minutes, say)
        if self.stream:
            self.wait_for_extraction()
        plan = HiddenPlan.read(layout.hidden_plan)
        self.plan = plan if plan is not None and plan.has_rounds else None  # None: one extraction of everything
        if self.plan is not None:
            self.check_plan_is_02s()
        self.round_loaded: Optional[int] = None  # under rounds: the round whose shards self.index holds
        self.index = HiddenIndex.load(layout.hidden_index, self.first_files_on_disk() if self.plan else None)
        self.data: Optional[TrainData] = None
        self.ledger: Optional[SampleLedger] = None

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
        """The packed schedule of every round (common.train.data), in the training dtype."""
        t = self.cfg.train
        self.data = TrainData(self.index, t.batch_max_tokens, t.seed, world_size=self.env.world_size, rank=self.env.rank,
                              grad_accum=t.grad_accum, dtype=dtype, num_workers=t.num_workers, pin_memory=pin_memory,
                              rounds=self.round_samples())

    def round_samples(self) -> Optional[list[RoundSamples]]:
        if self.plan is None:
            return None
        planned, epochs = self.plan.settings.get("epochs"), self.cfg.train.epochs
        if planned != epochs:
            raise ConfigError(f"02 planned its rounds for train.epochs={planned} but the config says {epochs}; set "
                              f"train.epochs back, or rerun 02_extract_hidden.py --overwrite (it plans the rounds again)")
        return [RoundSamples(rd.epoch, *self.plan.round_samples(rd.number)) for rd in self.plan.rounds]

    def total_steps(self) -> int:
        """train.max_steps, or the steps of train.epochs (under rounds: of every planned round)."""
        t = self.cfg.train
        planned = self.data.total_steps(t.epochs)
        if self.plan is not None and t.max_steps and t.max_steps > planned:
            raise ConfigError(
                f"train.max_steps={t.max_steps} is more than the {planned} steps of the {len(self.plan.rounds)} "
                f"rounds 02 planned for train.epochs={t.epochs}; lower train.max_steps, or raise train.epochs and rerun "
                f"02_extract_hidden.py --overwrite (it plans the rounds again)")
        return t.max_steps or planned

    def identity(self) -> list:
        """What identifies the data for a checkpoint: the aux layers and the shards (under rounds: the rounds)."""
        if self.plan is None:
            return self.index.fingerprint()
        return [self.index.aux_layer_ids, self.plan.identity()]

    def sample_lengths(self) -> list[int]:
        """Every sample's length known now (under rounds, the plan has the rounds not on disk)."""
        return [s.length for s in self.index.samples] + (self.plan.planned_lengths() if self.plan else [])

    def describe_position(self, pos: DataPosition) -> str:
        if self.plan is None:
            return f"epoch {pos.round + 1}"
        return self.plan.rounds[pos.round].describe(len(self.plan.rounds)) if pos.round < len(self.plan.rounds) else \
            f"all {len(self.plan.rounds)} rounds"

    # -- the ledger ------------------------------------------------------------------------

    def start(self, pos: DataPosition, saved_ledger: Optional[dict] = None, checkpoint: Optional[Path] = None) -> None:
        """The ledger at `pos`: what the schedule says was trained before it. A resumed checkpoint's own ledger
        must agree (a checkpoint from before ledgers existed has none)."""
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
        it waits for only ever appears) until plan.json and index.json are there and, under rounds, the eval
        shards (02 writes them first); without rounds, until the whole extraction is complete."""
        layout = self.layout

        def ready() -> bool:
            plan = HiddenPlan.read(layout.hidden_plan)
            if plan is None or not layout.hidden_index.is_file():
                return False
            if not plan.has_rounds:
                return bool(read_json(layout.hidden_index).get("complete"))
            return extracted(plan.eval_files(), read_entries(layout, fragments=False), layout.hidden)

        while not ready():
            self.wait.tick("02_extract_hidden to write hidden/plan.json and the first shards")
        self.wait.reset()

    def verify_all(self) -> None:
        """Without rounds, before training: every shard's bytes against index.json (extract.verify)."""
        if self.plan is None:
            verify_shard_files(self.index, self.layout, self.env, self.cfg.extract.verify)

    def first_files_on_disk(self) -> list[str]:
        """The files of the first round not consumed that is on disk (else just the eval shards): what the
        trainer starts from before it knows its position."""
        consumed = read_consumed(self.layout)
        listed = read_entries(self.layout, fragments=False)  # once, not once per round
        for rd in self.plan.rounds:
            if rd.number not in consumed and extracted(self.plan.files_of_round(rd.number), listed, self.layout.hidden):
                self.round_loaded = rd.number
                return self.plan.files_of_round(rd.number)
        return self.plan.eval_files()

    def batches(self, pos: DataPosition, steps_left: int) -> Optional[Iterator[MicroBatch]]:
        """This rank's micro-batches from `pos` to the end of its round (or `steps_left` steps), read ahead; None
        under rounds when 02 has not extracted the round at `pos` yet (streaming: after waiting for it)."""
        if self.plan is not None:
            r = pos.round
            if not self.round_ready(r):
                return None
            if self.round_loaded != r:
                self.index = HiddenIndex.load(self.layout.hidden_index, self.plan.files_of_round(r))
                self.data.use_index(self.index)
                self.round_loaded = r
            verify_shard_files(self.index, self.layout, self.env, self.cfg.extract.verify)
            steps_left = min(self.data.steps_left_in_round(pos), steps_left)
        return self.data.stream(pos, steps_left)

    def round_ready(self, r: int) -> bool:
        """Whether round r is on disk. Rank 0 decides, so that every rank trains the round or every rank waits for
        it (a rank may have loaded it at the start, another not). Streaming: poll until it is there, one decision
        per poll."""
        def decide() -> str:
            if self.round_loaded == r or extracted(self.plan.files_of_round(r), read_entries(self.layout, fragments=False),
                                                   self.layout.hidden):
                return "ready"
            if self.stream:
                self.wait.check(f"02_extract_hidden to extract {self.plan.rounds[r].describe(len(self.plan.rounds))}")
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
                f"{self.plan.rounds[r].describe(len(self.plan.rounds))} is not extracted yet: run 02_extract_hidden.py, "
                f"then 04 again (run_pipeline.py alternates them)")

    # -- consumed rounds -------------------------------------------------------------------

    def reconcile(self, pos: DataPosition) -> None:
        """After a resume: rounds before the position are trained (consumed and deleted, even if a kill came
        between the checkpoint and the deletion); rounds from it on are not (a checkpoint that fell back past a
        deleted round has 02 extract it again)."""
        if self.plan is None:
            return
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
        if self.plan is not None:
            write_consumed(self.layout, [])

    # -- inputs changed under a running 04 -------------------------------------------------

    def inputs_identity(self) -> dict[str, Optional[str]]:
        """04's inputs by content, as far as they may change under a running 04: index.json (under rounds:
        plan.json and index.json's header, since 02 adds each round's shards to the rest) and the vocab map;
        None for a file that is gone. Small files, read whole: no cache to fool."""
        layout = self.layout

        def sha(data: Optional[bytes]) -> Optional[str]:
            return None if data is None else hashlib.sha256(data).hexdigest()

        def read(path) -> Optional[bytes]:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                return None

        ident = {layout.name(layout.vocab_map): sha(read(layout.vocab_map))}
        index = read(layout.hidden_index)
        if self.plan is None:
            ident[layout.name(layout.hidden_index)] = sha(index)
            return ident
        ident[layout.name(layout.hidden_plan)] = sha(read(layout.hidden_plan))
        try:
            header = {k: v for k, v in json.loads(index).items() if k not in INDEX_SHARD_FIELDS}
        except (TypeError, ValueError, AttributeError):
            header = None  # gone or unreadable: a change
        ident[f"{layout.name(layout.hidden_index)} (its header)"] = sha(json.dumps(header, sort_keys=True).encode())
        return ident

    def remember_inputs(self) -> None:
        self.inputs_at_start = on_rank0(self.inputs_identity, self.env)

    def changed_inputs(self) -> list[str]:
        """The inputs whose content changed since remember_inputs (rank 0 reads them, every rank gets the answer)."""
        now = on_rank0(self.inputs_identity, self.env)
        return [name for name, digest in self.inputs_at_start.items() if now.get(name) != digest]
