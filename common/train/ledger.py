"""The sample ledger: how many times each train sample was trained in each epoch.

It is part of 04's checkpoint state (`ledger.json` in train/checkpoints/step-N/, covered by the
checkpoint's manifest), so what a resumed run has trained is on record, not inferred: a resume checks
that the ledger agrees with the checkpoint's data position, and the run's end reports whether every
sample was trained exactly once per epoch (docs/design.md#sample-ledger). Every rank keeps the same
ledger (the global schedule is known to all ranks); rank 0 writes it.

    ledger.json = {"sample_ids": [id, ...], "epochs": [[count per sample], ...]}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

LEDGER_FILE = "ledger.json"


class SampleLedger:
    def __init__(self, sample_ids: list[str]):
        self.sample_ids = list(sample_ids)
        self.position = {sid: k for k, sid in enumerate(self.sample_ids)}
        self.epochs: list[np.ndarray] = []  # per epoch, int32 [num samples]

    def record(self, epoch: int, positions: Iterable[int]) -> None:
        """Count one training of each sample at these positions (into sample_ids) in `epoch`."""
        while len(self.epochs) <= epoch:
            self.epochs.append(np.zeros(len(self.sample_ids), dtype=np.int32))
        np.add.at(self.epochs[epoch], np.fromiter(positions, dtype=np.int64), 1)

    def record_ids(self, epoch: int, sample_ids: Iterable[str]) -> None:
        self.record(epoch, (self.position[sid] for sid in sample_ids))

    def to_json(self) -> str:
        return json.dumps({"sample_ids": self.sample_ids, "epochs": [c.tolist() for c in self.epochs]}, separators=(",", ":"))

    @classmethod
    def from_file(cls, path: Path) -> "SampleLedger":
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        ledger = cls(doc["sample_ids"])
        ledger.epochs = [np.asarray(c, dtype=np.int32) for c in doc["epochs"]]
        return ledger

    def __eq__(self, other) -> bool:
        return (isinstance(other, SampleLedger) and self.sample_ids == other.sample_ids and len(self.epochs) == len(other.epochs)
                and all(np.array_equal(a, b) for a, b in zip(self.epochs, other.epochs)))

    def times_trained(self) -> np.ndarray:
        """Per sample, over all epochs."""
        return sum(self.epochs, np.zeros(len(self.sample_ids), dtype=np.int32))

    def describe(self) -> str:
        """One line: how often the samples were trained, per epoch."""
        if not self.epochs:
            return "ledger: nothing trained yet"
        per_epoch = [f"{int((c > 0).sum())}/{len(c)}" + ("" if c.max() <= 1 else f" ({int((c > 1).sum())} twice or more)")
                     for c in self.epochs]
        total = self.times_trained()
        if total.min() == total.max():
            head = f"ledger: every one of {len(total)} train samples trained exactly {int(total.min())} time(s)"
        else:
            head = f"ledger: train samples trained {int(total.min())} to {int(total.max())} times"
        return f"{head}; per epoch {', '.join(per_epoch)}"

    def summary(self) -> dict:
        total = self.times_trained()
        return {"num_samples": len(self.sample_ids), "epochs": len(self.epochs),
                "min_times": int(total.min()) if len(total) else 0, "max_times": int(total.max()) if len(total) else 0,
                "per_epoch_trained": [int((c > 0).sum()) for c in self.epochs]}
