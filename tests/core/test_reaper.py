"""Children die with their stage (common/core/reaper.py), even when the stage is SIGKILLed: real
processes, the stage's own children, a grandchild and a child in its own session (as vLLM's api_server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from tests.helpers import REPO

STAGE = r"""
import json, subprocess, sys, time
from common.core.reaper import watch_children
watch_children()
sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
child = subprocess.Popen(sleep)                              # like vLLM's EngineCore
session = subprocess.Popen(sleep, start_new_session=True)   # like the api_server 05 starts
parent_of_grandchild = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"])
print(json.dumps([child.pid, session.pid, parent_of_grandchild.pid]), flush=True)
time.sleep(300)
"""


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_a_sigkilled_stage_takes_its_processes_with_it():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    stage = subprocess.Popen([sys.executable, "-c", STAGE], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(stage.stdout.readline())
        deadline = time.time() + 30  # the grandchild and the watchdog's first look
        while time.time() < deadline and len(_descendants(stage.pid)) < 5:  # 3 children + grandchild + watchdog
            time.sleep(0.1)
        time.sleep(1.0)
        procs = [p for p in _descendants(stage.pid) if "common.core.reaper" not in " ".join(p.cmdline())]
        assert len(procs) == 4 and {p.pid for p in procs} >= set(pids)
        stage.send_signal(signal.SIGKILL)
        stage.wait(timeout=10)
        gone, alive = psutil.wait_procs(procs, timeout=20)
        assert not alive, f"still running after the stage was killed: {[p.pid for p in alive]}"
    finally:
        stage.kill()
        for p in psutil.process_iter():
            try:
                if "time.sleep(300)" in " ".join(p.cmdline()):
                    p.kill()
            except psutil.Error:
                pass


def test_the_watchdog_leaves_when_the_stage_ends_normally():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = "from common.core.reaper import watch_children; watch_children(); import time; time.sleep(1.5)"
    stage = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env)
    time.sleep(1.0)
    watchdogs = [p for p in _descendants(stage.pid) if "common.core.reaper" in " ".join(p.cmdline())]
    assert len(watchdogs) == 1
    assert stage.wait(timeout=20) == 0
    _, alive = psutil.wait_procs(watchdogs, timeout=10)
    assert not alive
