"""The rounds protocol under a disk budget (docs/design.md#rounds-under-a-disk-budget): the one module that reads
hidden/plan.json's rounds, and says from them and hidden/consumed.json (common.hidden.index's: read_consumed,
mark_trained) what is due and what may be deleted.

When the hidden states of the whole data set do not fit extract.max_disk_gb, 02 cuts each epoch's train samples
into rounds (common.extract.planning.plan_rounds) and writes them in plan.json. Then:

    02  extracts the eval shards first (a streaming 04 starts on them), then the rounds due now: the first one not
        consumed and the ones after it while they fit the budget together (HiddenPlan.rounds_on_disk).
    04  trains a round, checkpoints, records it in consumed.json, then deletes its shards (rank 0,
        common.hidden.index.mark_trained).

Who deletes what:
    04           a trained round's train shards, after its checkpoint and its record in consumed.json;
    02           train shards of rounds not due now (delete_not_due): a kill can come between 04's record and its
                 deletion, and the budget holds only if nothing else is there;
    04 on resume un-records rounds at or after its checkpoint's position (02 extracts them again), and finishes
                 the deletion of rounds before it (mark_trained with keep_out);
    04 --overwrite empties consumed.json (training starts over: 02 extracts from the first round again);
    02 --overwrite deletes everything in hidden/, consumed.json included.

Without a budget (plan.json has no "rounds") 02 extracts everything in one go and nothing is deleted: the plan's
rounds are then one per epoch, each over every train shard (as many epochs as 04 trains: HiddenPlan.add_epoch), so
04 reads one kind of plan either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

from common.core.errors import ConfigError
from common.core.io import read_json
from common.core.json_fields import INTEGER, INTEGERS, OBJECT, OBJECTS, STRING, STRINGS, check_fields
from common.hidden.shards import check_format_version

if TYPE_CHECKING:
    from common.core.run_folder import Layout


# The JSON types of plan.json's fields that 02 and 04 read: its planned shards and rounds, which 02 writes whole.
PLAN_FIELDS = {"settings": OBJECT, "shards": OBJECTS, "rounds": OBJECTS, "max_disk_bytes": INTEGER, "eval_bytes": INTEGER,
               "reserve_bytes": INTEGER}
PLAN_SHARD_FIELDS = {"file": STRING, "split": STRING, "num_samples": INTEGER, "num_tokens": INTEGER,
                     "sample_ids": STRINGS, "lengths": INTEGERS}
PLAN_ROUND_FIELDS = {"epoch": INTEGER, "shards": STRINGS, "num_samples": INTEGER, "num_tokens": INTEGER, "bytes": INTEGER}


def check_plan_fields(doc: dict, path: Path) -> None:
    """A one-line DataError naming the field unless plan.json has its fields' types (an edited file would otherwise
    stop 02 or 04 with a TypeError)."""
    fix = (f"restore the plan 02 made, or rerun 02_extract_hidden.py with --overwrite to plan again (it deletes what "
           f"{path.parent} holds)")
    check_fields(doc, PLAN_FIELDS, path, fix, required=["shards"])
    for i, shard in enumerate(doc["shards"]):
        check_fields(shard, PLAN_SHARD_FIELDS, path, fix, where=f"shards[{i}].",
                     required=["file", "split", "num_samples", "num_tokens", "sample_ids"])
    for i, rd in enumerate(doc.get("rounds", [])):
        check_fields(rd, PLAN_ROUND_FIELDS, path, fix, where=f"rounds[{i}].", required=PLAN_ROUND_FIELDS)


@dataclass(frozen=True)
class Round:
    """One round of plan.json: train shards that are on disk together, a random share of one epoch's samples."""

    number: int  # its place in the plan (0-based); a data position's round
    epoch: int
    shards: tuple[str, ...]
    num_samples: int
    num_tokens: int
    bytes: int  # its shards' size, at most

    def describe(self, total: int) -> str:
        return f"round {self.number + 1} of {total} (epoch {self.epoch + 1})"


class HiddenPlan:
    """hidden/plan.json: the planned shards (dicts, as written: 02 writes and hashes them) and the rounds 04 trains
    (typed): under a disk budget the planned ones (`budgeted`), else one per epoch over every train shard."""

    def __init__(self, doc: dict, epochs: int = 1):
        self.doc = doc
        self.shards: list[dict] = doc["shards"]
        self.settings: dict = doc.get("settings", {})
        self.budgeted = "rounds" in doc  # 04 deletes each round once trained, 02 extracts them one after another
        self.max_disk_bytes: Optional[int] = doc.get("max_disk_bytes")
        self.eval_bytes: int = doc.get("eval_bytes", 0)
        self.reserve_bytes: int = doc.get("reserve_bytes", 0)
        self.by_file = {s["file"]: s for s in self.shards}
        if self.budgeted:
            self.rounds = [Round(k, int(r["epoch"]), tuple(r["shards"]), int(r["num_samples"]), int(r["num_tokens"]),
                                 int(r["bytes"])) for k, r in enumerate(doc["rounds"])]
        else:
            self.rounds = []
            for _ in range(epochs):
                self.add_epoch()

    @classmethod
    def read(cls, path: Path, epochs: Optional[int] = None) -> Optional["HiddenPlan"]:
        """plan.json, or None when 02 has not planned yet. epochs (04: train.epochs): a budgeted plan must have
        been planned for it; an unbudgeted one gets a round per epoch."""
        if not path.is_file():
            return None
        doc = read_json(path)
        check_format_version(doc, path)
        check_plan_fields(doc, path)
        plan = cls(doc, epochs or 1)
        planned = plan.settings.get("epochs")
        if epochs is not None and plan.budgeted and planned != epochs:
            raise ConfigError(f"02 planned its rounds for train.epochs={planned} but the config says {epochs}; set "
                              f"train.epochs back, or rerun 02_extract_hidden.py --overwrite (it plans the rounds again)")
        return plan

    def check_more_epochs(self, why: str) -> None:
        """More rounds than train.epochs' are wanted (`why`): fine for an unbudgeted plan (add_epoch), a ConfigError
        for a budgeted one, which has exactly the rounds 02 planned."""
        if self.budgeted:
            raise ConfigError(f"{why} the {len(self.rounds)} rounds 02 planned for train.epochs="
                              f"{self.settings.get('epochs')}; lower train.max_steps, or raise train.epochs and rerun "
                              f"02_extract_hidden.py --overwrite (it plans the rounds again)")

    def add_epoch(self) -> Round:
        """One more round over every train shard (an unbudgeted plan; train.max_steps runs past train.epochs)."""
        self.check_more_epochs("one more epoch is more than")
        train = [s for s in self.shards if s["split"] == "train"]
        e = len(self.rounds)
        self.rounds.append(Round(e, e, tuple(s["file"] for s in train), sum(s["num_samples"] for s in train),
                                 sum(s["num_tokens"] for s in train), 0))
        return self.rounds[-1]

    def describe_round(self, r: int) -> str:
        """A data position's round in 04's lines: "round 3 of 8 (epoch 2)" under a budget, else "epoch 3"."""
        if not self.budgeted:
            return f"epoch {r + 1}"
        return self.rounds[r].describe(len(self.rounds)) if r < len(self.rounds) else f"all {len(self.rounds)} rounds"

    def eval_files(self) -> list[str]:
        return [s["file"] for s in self.shards if s["split"] != "train"]

    def files_of_round(self, r: int) -> list[str]:
        """What round r trains from: its shards and the eval shards, in plan order."""
        mine = set(self.rounds[r].shards)
        return [s["file"] for s in self.shards if s["file"] in mine or s["split"] != "train"]

    def round_samples(self, r: int) -> tuple[list[str], list[int]]:
        """Round r's train sample ids and lengths, in index order (its shards in plan order, each in shard order)."""
        shards = [self.by_file[f] for f in self.rounds[r].shards]
        return [sid for s in shards for sid in s["sample_ids"]], [n for s in shards for n in s["lengths"]]

    def planned_lengths(self) -> list[int]:
        """Every planned train sample's length (the rounds not on disk have no index yet)."""
        return [n for s in self.shards for n in s.get("lengths", [])]

    def identity(self) -> list:
        """What identifies the data 04 trains (its checkpoint fingerprint): under a budget each round's epoch,
        shards and tokens; without one, the train shards (more epochs on the same shards resume)."""
        if self.budgeted:
            return [(r.epoch, list(r.shards), r.num_tokens) for r in self.rounds]
        return [(s["file"], s["num_tokens"], s["sample_ids"][:1], s["num_samples"]) for s in self.shards if s["split"] == "train"]

    def rounds_on_disk(self, consumed: set[int]) -> list[int]:
        """The rounds whose shards should be on disk now: the first one not consumed, and the ones after it while
        they fit max_disk_bytes together (the eval shards and the bookkeeping are part of every round's budget)."""
        pending = [r for r in range(len(self.rounds)) if r not in consumed]
        if not pending:
            return []
        chosen = [pending[0]]
        used = self.eval_bytes + self.reserve_bytes + self.rounds[pending[0]].bytes
        for r in pending[1:]:
            if r != chosen[-1] + 1 or used + self.rounds[r].bytes > self.max_disk_bytes:
                break
            chosen.append(r)
            used += self.rounds[r].bytes
        return chosen

    def due_files(self, consumed: set[int]) -> list[str]:
        """The shards that should be on disk now: all of them, or under rounds the eval shards first (so that a
        streaming 04 can start) and then the train shards of rounds_on_disk."""
        if not self.budgeted:
            return [s["file"] for s in self.shards]
        now = self.files_of_rounds(self.rounds_on_disk(consumed))
        return self.eval_files() + [s["file"] for s in self.shards if s["split"] == "train" and s["file"] in now]

    def files_of_rounds(self, rounds: Iterable[int]) -> set[str]:
        return {f for r in rounds for f in self.rounds[r].shards}

    def first_pending(self, consumed: set[int]) -> Optional[Round]:
        return next((rd for rd in self.rounds if rd.number not in consumed), None)

    def describe_due(self, consumed: set[int]) -> str:
        """02's line after extracting what is due."""
        now = self.rounds_on_disk(consumed)
        total = len(self.rounds)
        if not now:
            return f"all {total} rounds extracted and trained on; nothing left to extract"
        which = f"round {now[0] + 1}" if len(now) == 1 else f"rounds {now[0] + 1}-{now[-1] + 1}"
        return (f"{which} of {total} (epoch {self.rounds[now[0]].epoch + 1}) extracted; run 04_train.py to train on it "
                f"(it deletes it), then 02 again for the next one (run_pipeline.py alternates them)")


def extracted(files: Iterable[str], listed: dict[str, dict], hidden_dir: Path) -> bool:
    """Whether these shards are all indexed (in `listed`: common.hidden.index.read_entries) and on disk."""
    return all(f in listed and (hidden_dir / f).is_file() for f in files)


def delete_not_due(layout: "Layout", plan: HiddenPlan, consumed: set[int]) -> None:
    """02: the train shards of rounds not due now go (see the module docstring: who deletes what)."""
    due = set(plan.due_files(consumed))
    for s in plan.shards:
        if s["split"] == "train" and s["file"] not in due:
            (layout.hidden / s["file"]).unlink(missing_ok=True)
