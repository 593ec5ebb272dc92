"""Who may touch a run folder's stage outputs while another stage runs (docs/design.md#run-folder).

`stage_lock`: an exclusive flock on run_dir/stages/<stage>.lock, held for the stage's life. The OS releases it
when the process dies (SIGKILL included), so a lock is never stale; a second copy fails at once with the
holder's pid. `lock_holder` probes another stage's lock. STAGE_READS is the stage graph, written once: what
each stage reads of the others' outputs. --overwrite is refused along its edges while the reader runs (it would
delete what a running stage reads); the other way along an edge, refuse_read_while_written keeps 05 from
reading a draft that a running 04 writes, and 04 says that 02 is running when it finds hidden/ incomplete
(common.train.source).
"""

from __future__ import annotations

import contextlib
import fcntl
import errno
import os
import time
from pathlib import Path
from typing import Iterable, Iterator

from common.core.errors import PipelineError
from common.core.run_folder import Layout


class StageBusy(PipelineError):
    """Another process holds the stage's lock."""


# A probe of another stage's lock (lock_holder) holds it shared for a moment: a stage starting in that
# moment retries this long before it calls the lock busy.
_LOCK_RETRY_S = 0.5


@contextlib.contextmanager
def stage_lock(run_dir: str | os.PathLike, stage: str) -> Iterator[None]:
    """Hold run_dir/stages/<stage>.lock exclusively for the block (flock: released by the OS
    when the process exits or dies, so it is never stale). A second holder raises StageBusy."""
    layout = Layout.of(run_dir)
    path = layout.lock(stage)
    try:
        layout.stages.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise PipelineError(f"cannot create the stage lock {path} ({e.strerror}); make run_dir {layout.run_dir} writable "
                            f"or point run_dir elsewhere") from None
    try:
        deadline = time.monotonic() + _LOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
                raise StageBusy(
                    f"{stage} is already running on {layout.run_dir} (pid {holder}, lock {path}); wait for it to finish "
                    f"or stop that process, then rerun"
                ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the flock; the file stays (unlinking it would race a waiter)


def lock_holder(run_dir: str | os.PathLike, stage: str) -> str | None:
    """The pid (as written in the lock file) of the process running `stage` on run_dir, or None when
    none does. Probes with a shared, non-blocking flock that is dropped at once; touches nothing."""
    path = Layout.of(run_dir).lock(stage)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None  # never locked here
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# The stage graph, in run order (run_pipeline.py runs the stages in this order): for each stage, the earlier
# stages whose outputs it reads while it runs, and which of them (Layout's names). --overwrite deletes a stage's
# outputs, so it is refused while a reader of them runs: a reader would go on with files of two generations (02
# --overwrite under a running 04 gave a draft labelled with the old aux ids; under a running 05, a report of a
# draft whose aux ids hidden/index.json no longer holds). Not reads here: 01 reads data.source (outside the run
# folder), and under a disk budget 02 follows 04's ledger (hidden/consumed.json): that is the rounds protocol,
# and 04 --overwrite beside it has 02 extract the rounds again.
STAGE_READS: dict[str, dict[str, tuple[str, ...]]] = {
    "01_prepare_data": {},
    "01b_generate_synthetic": {"01_prepare_data": ("prompts",)},
    "02_extract_hidden": {"01b_generate_synthetic": ("train_jsonl", "eval_jsonl")},
    "03_build_vocab_map": {"01b_generate_synthetic": ("train_jsonl",)},
    "04_train": {"02_extract_hidden": ("hidden",), "03_build_vocab_map": ("vocab_map",)},
    # the eval split and the train split it must not measure; the aux ids of this run's draft; the draft and
    # the training curve of report.png
    "05_evaluate": {"01_prepare_data": ("prompts",), "02_extract_hidden": ("hidden_index",),
                    "04_train": ("final", "metrics")},
}


def readers_of(stage: str) -> list[str]:
    """The stages that read `stage`'s outputs (STAGE_READS)."""
    return [reader for reader, sources in STAGE_READS.items() if stage in sources]


def refuse_overwrite_while_read(run_dir: str | os.PathLike, stage: str) -> None:
    """Raise StageBusy when a stage that reads `stage`'s outputs is running on run_dir."""
    for reader in readers_of(stage):
        holder = lock_holder(run_dir, reader)
        if holder is not None:
            raise StageBusy(
                f"{stage} --overwrite would delete what {reader} is reading: {reader} is running on "
                f"{Layout.of(run_dir).run_dir} (pid {holder}); wait for it to finish or stop it, then rerun")


def refuse_read_while_written(run_dir: str | os.PathLike, reader: str, writer: str, outputs: os.PathLike,
                              reads: Iterable[os.PathLike]) -> None:
    """Raise StageBusy when `reader` would read under `outputs` (the folder `writer` writes) while `writer` runs on
    run_dir: 05 measuring train/final while 04 runs, whose --overwrite deletes it and whose export replaces it.
    The reader holds its own lock meanwhile, so a writer's --overwrite that starts later is refused (STAGE_READS)."""
    # realpath, not resolve(): a symlink loop given as --draft is found unreadable later with one error line
    root = Path(os.path.realpath(outputs))
    inside = [Path(p) for p in reads if Path(os.path.realpath(p)).is_relative_to(root)]
    holder = lock_holder(run_dir, writer) if inside else None
    if holder is not None:
        raise StageBusy(
            f"{reader} would read {inside[0]}, which {writer} is writing: {writer} is running on "
            f"{Layout.of(run_dir).run_dir} (pid {holder}); wait for it to finish or stop it, then rerun")
