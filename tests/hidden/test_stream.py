"""StreamWait (common/hidden/stream.py): how a streaming stage waits for the other one."""

from __future__ import annotations

import os
import time

import pytest

from common.core.errors import PipelineError
from common.hidden.stream import StreamWait


def test_wait_stops_when_the_partner_is_silent_and_goes_on_while_it_lives(tmp_path):
    sign = tmp_path / "index.json"
    sign.write_text("{}")
    os.utime(sign, (time.time() - 3600, time.time() - 3600))  # the partner's last sign: an hour ago
    said: list[str] = []
    wait = StreamWait("04_train", "02_extract_hidden", [sign, tmp_path / "absent.json"], minutes=0.5 / 60, say=said.append,
                      poll_s=0.05, heartbeat_s=0.2)
    t0 = time.monotonic()
    # the clock starts with the wait (not with the old sign): 0.5 s of silence, then the error
    with pytest.raises(PipelineError) as e:
        for _ in range(100):
            wait.tick("round 3")
    assert 0.45 <= time.monotonic() - t0 < 2.0
    assert "04_train waited" in str(e.value) and "is 02_extract_hidden running?" in str(e.value)
    assert "extract.stream_wait_minutes=0.00833333" in str(e.value) and "index.json" in str(e.value)
    assert said[0] == "04_train: waiting for round 3"
    assert any(line.startswith("04_train: still waiting for round 3") for line in said[1:])  # the heartbeat

    # a partner that keeps writing is waited for as long as it lives
    wait.reset()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:  # three times the allowed silence
        sign.write_text("{}")  # a new shard indexed
        wait.tick("round 4")
