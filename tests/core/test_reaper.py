"""Children die with their stage (common/core/reaper.py), even when the stage is SIGKILLed: real
processes, the stage's own children, a grandchild and a child in its own session (as vLLM's api_server)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil

from tests.helpers import REPO, stage_env

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


def _is_watchdog(proc: psutil.Process) -> bool:
    return "common.core.reaper" in " ".join(proc.cmdline())


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.01)


def _wait_until_the_watchdog_has_looked(watchdog: psutil.Process) -> None:
    """Return once the watchdog has listed the stage's descendants at least once after this call. Past its
    imports (which may block on the disk) it blocks once per look, in the sleep after it: of three more voluntary
    context switches than now, one may end a look begun before this call, one ends a whole look begun after it,
    and one is to spare."""
    _wait_for(lambda: any("_psutil_linux" in m.path for m in watchdog.memory_maps()), "psutil imported by the watchdog")
    now = watchdog.num_ctx_switches().voluntary
    _wait_for(lambda: watchdog.num_ctx_switches().voluntary >= now + 3, "look by the watchdog")


def test_a_sigkilled_stage_takes_its_processes_with_it():
    stage = subprocess.Popen([sys.executable, "-c", STAGE], cwd=REPO, env=stage_env(), stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(stage.stdout.readline())
        _wait_for(lambda: len(_descendants(stage.pid)) == 5, "grandchild")  # 3 children + grandchild + watchdog
        _wait_until_the_watchdog_has_looked(next(p for p in _descendants(stage.pid) if _is_watchdog(p)))
        procs = [p for p in _descendants(stage.pid) if not _is_watchdog(p)]
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
    # the stage ends when the test closes its stdin: its watchdog is counted while it surely lives
    code = ("import sys; from common.core.reaper import watch_children; watch_children(); print('watching', flush=True); "
            "sys.stdin.read()")
    stage = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=stage_env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert stage.stdout.readline().strip() == "watching"
        watchdogs = [p for p in _descendants(stage.pid) if _is_watchdog(p)]
    finally:
        stage.stdin.close()
    assert len(watchdogs) == 1
    assert stage.wait(timeout=60) == 0
    _, alive = psutil.wait_procs(watchdogs, timeout=60)
    assert not alive
