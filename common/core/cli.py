"""The command line every stage shares: --config, --set, --overwrite.

A stage script is a thin wrapper:

    from common.core.cli import stage_main
    def run(cfg, args): ...
    if __name__ == "__main__":
        stage_main("01_prepare_data", __doc__, run)

User errors (PipelineError) print one line and exit 2; Ctrl-C exits 130. Processes a stage starts
(vLLM's engine, an api_server) are stopped when the stage dies, SIGKILL included (common.core.reaper). Each stage holds
an exclusive lock on run_dir for its life (common.core.stage_lock): a second copy on the
same run_dir exits 2 naming the holder's pid, and so does --overwrite while a stage that reads this
stage's outputs runs (common.core.stage_lock.STAGE_READS).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import sys
from typing import Callable

from common.core.errors import PipelineError, printable


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose bad flag is one `error:` line and exit 2, like every refusal of the pipeline
    (argparse prints its usage and `prog: error:` otherwise). For the stages and scripts/."""

    def error(self, message: str):
        print(f"error: {printable(message)}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)


def build_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="the run's YAML config, e.g. configs/tiny.yaml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.lr=1e-4 (repeatable; value parsed as YAML)",
    )
    parser.add_argument("--overwrite", action="store_true", help="discard this stage's outputs and start over")
    return parser


@contextlib.contextmanager
def _stage_lock(cfg, stage: str, overwrite: bool):
    """One copy of a stage per run_dir, and no --overwrite while a stage that reads this one's outputs
    runs. Under torchrun only global rank 0 takes the lock: the ranks of one launch are one copy (a
    second launch fails on its rank 0, and torchrun stops the rest)."""
    from common.core.stage_lock import refuse_overwrite_while_read, stage_lock

    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    with stage_lock(cfg.run_dir, stage):
        if overwrite:
            refuse_overwrite_while_read(cfg.run_dir, stage)
        yield


_RELAY_SOCKETS: list = []
_STOP_REQUESTED: list = []  # non-empty once a stop signal arrived (a library may swallow the KeyboardInterrupt)
# After Ctrl-C, how long cleanup may take before the stage exits anyway (tests shorten it).
STOP_GRACE_S = float(os.environ.get("EAGLE3_STOP_GRACE_S", "60"))


def relay_signals_to_main_thread(prog: str) -> None:
    """Ctrl-C (or SIGTERM, where a stage handles it) exits 130 at any moment, within STOP_GRACE_S.

    Python runs signal handlers in the main thread, between bytecodes. When the kernel hands SIGINT to
    another thread (tqdm's monitor, a torch or vLLM thread) while the main thread waits in C, nothing
    interrupts the wait. Python's wakeup fd sees every signal whatever thread got it: a small relay thread
    reads it and nudges the main thread with SIGUSR2 (a no-op handler), whose EINTR lets the waiting call
    run the pending handler (Python's own calls and pyzmq check for signals on EINTR). Cleanup after the
    KeyboardInterrupt can hang too (vLLM's zmq context waits for its engine while the engine starts), so
    the relay exits the process with 130 when the stage is still alive STOP_GRACE_S later, or at a second
    Ctrl-C; the reaper (common/core/reaper.py) then stops the engine processes."""
    import signal
    import socket
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    main = threading.main_thread().ident
    receiver, sender = socket.socketpair()
    _RELAY_SOCKETS.extend((receiver, sender))  # alive for the process: the wakeup fd must stay valid
    sender.setblocking(False)
    signal.set_wakeup_fd(sender.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGUSR2, lambda signum, frame: None)
    stops = {signal.SIGINT, signal.SIGTERM}

    def force_exit(why: str) -> None:
        print(f"{prog}: interrupted; {why}, exiting now (finished work is kept; rerun the same command to resume)",
              file=sys.stderr, flush=True)
        os._exit(130)

    def relay() -> None:
        stopping = False
        while True:
            try:
                data = receiver.recv(64)
            except OSError:
                return
            if not data:
                return
            if not any(b in stops for b in data):
                continue
            if stopping:
                force_exit("a second stop signal")
            stopping = True
            _STOP_REQUESTED.append(True)
            signal.pthread_kill(main, signal.SIGUSR2)
            timer = threading.Timer(STOP_GRACE_S, force_exit, args=(f"still stopping after {STOP_GRACE_S:.0f} s",))
            timer.daemon = True
            timer.start()

    threading.Thread(target=relay, name="signal-relay", daemon=True).start()


def stage_main(
    prog: str,
    description: str | None,
    run: Callable[[object, argparse.Namespace], int | None],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    parser = build_parser(prog, description)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Heavy imports (torch, transformers) happen after --help has been served.
    from common.core.config import load_config

    from common.core.reaper import watch_children

    watch_children()  # the engine processes this stage may start die with it, even on SIGKILL
    relay_signals_to_main_thread(prog)  # Ctrl-C exits 130 at any moment, even while vLLM's engine starts
    try:
        cfg = load_config(args.config, args.overrides)
        with _stage_lock(cfg, prog, getattr(args, "overwrite", False)):
            code = run(cfg, args)
    except PipelineError as e:
        print(f"error: {printable(str(e))}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        where = f" while writing {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or e}{where}; free space (or fix the filesystem) and rerun: finished work is kept",
              file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; finished work is saved, rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    if _STOP_REQUESTED:  # the interrupt was swallowed on its way (vLLM can): still a stopped run
        print(f"{prog}: interrupted; finished work is saved, rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
