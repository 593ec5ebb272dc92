"""Children die with their stage, even when the stage is SIGKILLed.

02's vllm backend runs vLLM's EngineCore and workers as child processes, 05 and run_pipeline.py start
an api_server in its own session. A SIGKILL of the stage (the OOM killer, `kill -9`, a job scheduler)
gives the stage no chance to stop them: they are reparented to PID 1 and keep their memory (~70 GB of
weights per GPU on the user's box, so the rerun cannot start). `watch_children()` starts a small
watchdog process (psutil only) in its own session. It lists the stage's descendants every
POLL_S seconds while the stage lives; once the stage is gone, it terminates every listed process that
is still running (and their children), waits GRACE_S, kills what is left and exits. psutil identifies
a process by pid and start time, so a reused pid is never hit. The watchdog exits by itself when the
stage ends normally (its children are gone by then; stragglers are stopped the same way).

    python -m common.core.reaper PID      (what watch_children starts; not for users)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 5.0


def watch_children() -> None:
    """Start the watchdog for this process (once per process)."""
    if os.environ.get("EAGLE3_REAPER_FOR") == str(os.getpid()):
        return
    os.environ["EAGLE3_REAPER_FOR"] = str(os.getpid())
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.Popen([sys.executable, "-m", "common.core.reaper", str(os.getpid())], cwd=root, start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     env={**os.environ, "PYTHONPATH": root})


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch(parent_pid: int) -> None:
    import psutil

    try:
        parent = psutil.Process(parent_pid)
    except psutil.Error:
        return
    me = os.getpid()
    known: dict[int, psutil.Process] = {}
    while _alive(parent):
        try:
            for child in parent.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child)
        except psutil.Error:
            pass
        time.sleep(POLL_S)
    survivors = {p.pid: p for p in known.values() if _alive(p)}
    for p in list(survivors.values()):  # children they started after the last look
        try:
            survivors.update({c.pid: c for c in p.children(recursive=True) if c.pid != me})
        except psutil.Error:
            pass
    procs = [p for p in survivors.values() if _alive(p)]
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(procs, timeout=GRACE_S)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    watch(int(sys.argv[1]))
