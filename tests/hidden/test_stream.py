"""StreamWait (common/hidden/stream.py): how a streaming stage waits for the other one.

On a fake clock (it moves only when the wait sleeps) and sign files whose mtimes the test sets on that
clock: every moment below is exact, however loaded the machine is.
"""

from __future__ import annotations

import os

import pytest

from common.core.errors import PipelineError
from common.hidden.stream import StreamWait

MINUTES = 0.1  # 6 s of silence allowed
POLL_S, HEARTBEAT_S = 1.0, 4.0


class FakeClock:
    """time.time and time.sleep for one test: sleep(s) moves the clock by s, at once."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def stamp(path, when: float) -> None:
    """The partner writes `path` at `when` (on the fake clock)."""
    path.write_text("{}")
    os.utime(path, (when, when))


def test_the_wait_stops_after_the_allowed_silence_counted_from_its_start_or_the_last_sign(tmp_path):
    clock = FakeClock()
    sign = tmp_path / "index.json"
    stamp(sign, clock.now - 3600)  # the partner's last sign: an hour before the wait
    said: list[str] = []
    wait = StreamWait("04_train", "02_extract_hidden", [sign, tmp_path / "absent.json"], minutes=MINUTES, say=said.append,
                      poll_s=POLL_S, heartbeat_s=HEARTBEAT_S, clock=clock.time, sleep=clock.sleep)
    t0 = clock.now
    # the clock starts with the wait (not with the old sign): 6 s of silence are allowed, the poll at 7 s stops
    with pytest.raises(PipelineError) as e:
        for _ in range(100):
            wait.tick("round 3")
    assert clock.now - t0 == 7 * POLL_S
    assert "04_train waited" in str(e.value) and "is 02_extract_hidden running?" in str(e.value)
    assert "extract.stream_wait_minutes=0.1" in str(e.value) and "index.json" in str(e.value)
    assert said[0] == "04_train: waiting for round 3"
    assert [line.split(" (")[0] for line in said[1:]] == ["04_train: still waiting for round 3"]  # one heartbeat, at 4 s

    # a partner that keeps writing is waited for as long as it lives (here three times the allowed silence)
    wait.reset()
    start = clock.now
    while clock.now - start < 3 * MINUTES * 60:
        stamp(sign, clock.now)  # a new shard indexed
        wait.tick("round 4")
    last_sign = clock.now - POLL_S
    assert said[-1].startswith("04_train: still waiting for round 4")

    # once it stops, the allowed silence is counted from its last sign
    with pytest.raises(PipelineError, match="for round 4 and 02_extract_hidden showed no sign of life"):
        for _ in range(100):
            wait.tick("round 4")
    assert clock.now - last_sign == 7 * POLL_S
