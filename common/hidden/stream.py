"""Streaming (extract.stream; docs/design.md#streaming): 02 and 04 run at the same time on one run folder.

The filesystem is the only channel: 02 announces shards in hidden/index.json, 04 announces trained rounds
in hidden/consumed.json (and deletes them). Each stage polls the other's file while it waits; StreamWait is
that wait: a poll, a line every `heartbeat_s`, and a deadline counted from the other stage's last sign of
life (the newest mtime among the files it writes), so a stage whose partner died stops instead of hanging.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterable

from common.core.errors import PipelineError

POLL_S = 1.0  # reading a small JSON file once a second costs nothing next to a forward pass
HEARTBEAT_S = 60.0


def newest_mtime(paths: Iterable[Path]) -> float:
    newest = 0.0
    for p in paths:
        try:
            newest = max(newest, os.stat(p).st_mtime)
        except OSError:
            pass
    return newest


class StreamWait:
    """One stage waiting for the other: check(what) raises PipelineError when the partner has shown no sign
    of life (no change to `signs`) for `minutes` since the wait began; tick(what) checks and sleeps a poll.

    `clock` and `sleep` are the wall clock the file mtimes are compared with and the poll's sleep (a test
    passes a fake pair: its clock moves only when its sleep is called)."""

    def __init__(self, stage: str, partner: str, signs: list[Path], minutes: float, say: Callable[[str], None],
                 poll_s: float = POLL_S, heartbeat_s: float = HEARTBEAT_S, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep):
        self.stage, self.partner, self.signs, self.minutes, self.say = stage, partner, signs, minutes, say
        self.poll_s, self.heartbeat_s = poll_s, heartbeat_s
        self.clock, self.sleep = clock, sleep
        self.started: float | None = None
        self.last_heartbeat = 0.0

    def reset(self) -> None:
        """The awaited thing happened: the next wait starts its clock afresh."""
        self.started = None

    def tick(self, what: str) -> None:
        """One poll: check(what), then sleep."""
        self.check(what)
        self.sleep(self.poll_s)

    def check(self, what: str) -> None:
        """Say that (and, every heartbeat, how long) the stage waits; raise once the partner is silent too long."""
        now = self.clock()
        if self.started is None:
            self.started = self.last_heartbeat = now
            self.say(f"{self.stage}: waiting for {what}")
        alive = max(self.started, newest_mtime(self.signs))
        silent = now - alive
        if silent > self.minutes * 60:
            raise PipelineError(
                f"{self.stage} waited {silent / 60:.0f} min for {what} and {self.partner} showed no sign of life "
                f"(no change to {', '.join(p.name for p in self.signs)}) for extract.stream_wait_minutes="
                f"{self.minutes:g}; is {self.partner} running? start it (or raise extract.stream_wait_minutes), "
                f"then rerun {self.stage}: it resumes")
        if now - self.last_heartbeat >= self.heartbeat_s:
            self.last_heartbeat = now
            self.say(f"{self.stage}: still waiting for {what} ({(now - self.started) / 60:.1f} min; {self.partner}'s "
                     f"last sign of life {silent:.0f} s ago)")
