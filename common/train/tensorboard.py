"""TensorBoard scalars for 04, optional: without the tensorboard package (or on ranks other than 0)
every call is a no-op and the metrics go to train/metrics.jsonl only."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional


class TensorBoard:
    def __init__(self, log_dir: Path, enabled: bool, purge_step: Optional[int]):
        """purge_step: after a resume, drop the events a killed run wrote past its last checkpoint."""
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("note: tensorboard is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
            return
        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
