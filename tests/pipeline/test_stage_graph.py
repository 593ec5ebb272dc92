"""The stage graph (common.core.stage_lock.STAGE_READS) and what derives from it: --overwrite refused while a
stage that reads the outputs runs (every edge), run_pipeline's order, and 04 started while 02 still writes
hidden/ (not streaming) saying that 02 is running rather than "rerun 02"."""

from __future__ import annotations

import json
import signal

import pytest

from common.core.run_folder import Layout
from common.core.stage_lock import STAGE_READS, StageBusy, readers_of, refuse_overwrite_while_read
from tests.helpers import clone_run, error_line, hold_lock, run_stage

EDGES = [(reader, written) for reader, sources in STAGE_READS.items() for written in sources]


def release(holder) -> None:
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)


def files_under(path) -> dict:
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_the_table_is_in_run_order_and_names_layout_paths():
    """Every stage reads only stages before it (so the table's order is a run order: run_pipeline's), each read is
    a path Layout spells, and the edges the code has that an earlier table missed are there (05 reads 02's
    hidden/index.json for the run's aux ids)."""
    stages = list(STAGE_READS)
    for reader, sources in STAGE_READS.items():
        for written, reads in sources.items():
            assert stages.index(written) < stages.index(reader), (reader, written)
            assert reads and all(isinstance(getattr(Layout, name, None), property) for name in reads), (reader, reads)
    assert STAGE_READS["05_evaluate"]["02_extract_hidden"] == ("hidden_index",)
    assert readers_of("02_extract_hidden") == ["04_train", "05_evaluate"]
    assert readers_of("05_evaluate") == []


@pytest.mark.parametrize("reader,written", EDGES, ids=[f"{r}-reads-{w}" for r, w in EDGES])
def test_every_edge_refuses_the_overwrite_of_what_a_running_stage_reads(tmp_path, reader, written):
    """For each (reader, written) edge of the table: while the reader holds its lock, written's --overwrite is refused
    naming the reader and its pid; the stages the reader does not read are not refused by it."""
    holder = hold_lock(tmp_path, reader)
    try:
        with pytest.raises(StageBusy) as refused:
            refuse_overwrite_while_read(tmp_path, written)
        assert str(refused.value) == (
            f"{written} --overwrite would delete what {reader} is reading: {reader} is running on {tmp_path} "
            f"(pid {holder.pid}); wait for it to finish or stop it, then rerun")
        for other in STAGE_READS:
            if other not in STAGE_READS[reader]:
                refuse_overwrite_while_read(tmp_path, other)  # not read by the running stage: allowed
    finally:
        release(holder)
    refuse_overwrite_while_read(tmp_path, written)  # the reader is gone: allowed


def test_02_overwrite_is_refused_while_05_runs(tmp_path, hidden_run):
    """02 --overwrite at other aux ids under a running 05 would delete hidden/index.json, which 05 reads for the aux
    ids of the draft it measures: one error line, exit 2, hidden/ untouched."""
    cfg = clone_run(hidden_run, tmp_path)
    run = tmp_path / "run"
    hidden_before = files_under(run / "hidden")
    holder = hold_lock(run, "05_evaluate")
    try:
        res = run_stage("02_extract_hidden.py", cfg, "--overwrite", "--set", "extract.backend=hf",
                        "--set", "target.aux_layer_ids=[0,1,2]", timeout=300)
    finally:
        release(holder)
    error_line(res, f"error: 02_extract_hidden --overwrite would delete what 05_evaluate is reading: 05_evaluate is "
                    f"running on {run} (pid {holder.pid}); wait for it to finish or stop it, then rerun")
    assert files_under(run / "hidden") == hidden_before


def drop_first_shard_from_index(run) -> str:
    """index.json as 02 leaves it mid-run: the first shard not listed yet. Returns that shard's name."""
    index_path = run / "hidden" / "index.json"
    index = json.loads(index_path.read_text())
    first = index["shards"].pop(0)["file"]
    index["complete"] = False
    index_path.write_text(json.dumps(index))
    return first


def test_04_started_while_02_writes_hidden_says_02_is_running(tmp_path, hidden_run):
    """04 (not streaming) finding hidden/ incomplete while 02 holds its lock: the error says 02 is running, with its
    pid, and to wait for it (or stream), not "rerun 02_extract_hidden.py"; without 02 running the advice is to rerun
    02. Nothing under hidden/ is touched, and 04 trains nothing."""
    cfg = clone_run(hidden_run, tmp_path)
    run = tmp_path / "run"
    missing = drop_first_shard_from_index(run)
    hidden_before = files_under(run / "hidden")
    holder = hold_lock(run, "02_extract_hidden")
    try:
        res = run_stage("04_train.py", cfg, timeout=300)
    finally:
        release(holder)
    line = error_line(
        res, f"error: hidden/ is not complete yet ({run / 'hidden' / 'index.json'} does not list {missing} yet): "
             f"02_extract_hidden is running on {run} (pid {holder.pid}); wait for it to finish, then rerun "
             f"04_train.py; or, to train while 02 extracts, run both with extract.stream: true and extract.max_disk_gb")
    assert "rerun 02_extract_hidden.py" not in line
    assert files_under(run / "hidden") == hidden_before
    assert not (run / "train" / "checkpoints").exists()

    # 02 not running: the same hidden/ is 02's to repair
    error_line(run_stage("04_train.py", cfg, timeout=300), f"does not list {missing} yet; rerun 02_extract_hidden.py")


def test_04_started_before_02_wrote_an_index_says_02_is_running(tmp_path, hidden_run):
    """No index.json yet (02 --overwrite has just started): the same answer."""
    cfg = clone_run(hidden_run, tmp_path)
    run = tmp_path / "run"
    (run / "hidden" / "index.json").unlink()
    holder = hold_lock(run, "02_extract_hidden")
    try:
        res = run_stage("04_train.py", cfg, timeout=300)
    finally:
        release(holder)
    error_line(res, f"error: hidden/ is not complete yet (no hidden-state index at {run / 'hidden' / 'index.json'}): "
                    f"02_extract_hidden is running on {run} (pid {holder.pid}); wait for it to finish")


def test_streaming_04_still_waits_for_a_running_02(tmp_path, hidden_run):
    """extract.stream: 04 waits for 02's index instead of refusing (here until its wait runs out, 02 showing no
    sign of life)."""
    cfg = clone_run(hidden_run, tmp_path)
    run = tmp_path / "run"
    (run / "hidden" / "index.json").unlink()
    holder = hold_lock(run, "02_extract_hidden")
    try:
        res = run_stage("04_train.py", cfg, "--set", "extract.stream=true", "--set", "extract.max_disk_gb=1",
                        "--set", "extract.stream_wait_minutes=0.02",
                        timeout=300)
    finally:
        release(holder)
    line = error_line(res, "04_train waited 0 min for 02_extract_hidden to write hidden/plan.json and the first shards")
    assert "is not complete yet" not in line
    assert "04_train: waiting for 02_extract_hidden to write hidden/plan.json" in res.stdout
