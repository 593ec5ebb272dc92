"""The run-folder contract (common/core/run_folder.py): stage manifests (complete / resume / mismatch
error / redo / --overwrite, fingerprints) and the per-stage lock (a second copy exits 2 naming the
holder's pid; SIGKILL leaves no stale lock). Real subprocesses on real files."""

from __future__ import annotations

import json
import os
import signal

import pytest

from common.core.errors import ConfigError, DataError
from common.core.run_folder import RUN_FOLDER_VERSION, Layout, StageManifest, read_manifest
from common.core.stage_lock import StageBusy, lock_holder, refuse_overwrite_while_read, stage_lock
from tests.helpers import hold_lock


# ============================================================================ the manifest


def test_manifest_complete_resume_mismatch_redo_and_overwrite(tmp_path):
    layout = Layout(tmp_path)
    src = tmp_path / "in.txt"
    src.write_text("one")
    out = tmp_path / "out.txt"

    def manifest(**settings):
        return StageManifest(layout, "stage", inputs={"in.txt": src}, settings={"a": 1, "tok": 1, **settings}, redo_on={"tok"})

    assert manifest().begin(False, outputs=[out]) == "fresh"
    out.write_text("partial")
    assert manifest().begin(False, outputs=[out]) == "resume"  # state "running": partial outputs
    manifest().complete({"n": 3})
    m = manifest()
    assert m.begin(False, outputs=[out]) == "complete" and m.result == {"n": 3}
    # a redo key changed: redo, not an error
    assert manifest(tok=2).begin(False, outputs=[out]) == "resume"
    manifest(tok=2).complete({"n": 3})
    # a setting changed: ConfigError naming it; an input changed: DataError naming it; both suggest --overwrite
    with pytest.raises(ConfigError, match=r"a: 1 -> 2\).*--overwrite"):
        manifest(a=2, tok=2).begin(False, outputs=[out])
    src.write_text("two")
    with pytest.raises(DataError, match=r"in.txt changed.*--overwrite"):
        manifest(tok=2).begin(False, outputs=[out])
    assert manifest(a=2).begin(True, outputs=[out]) == "fresh"  # --overwrite
    assert read_manifest(layout, "stage")["state"] == "running"
    # outputs deleted by hand: nothing to mix with, so an old record does not bind
    out.unlink()
    assert manifest(a=5).begin(False, outputs=[out]) == "fresh"


def test_run_pipeline_reads_stage_status_from_manifests(tmp_path):
    import run_pipeline

    before = run_pipeline.last_run(tmp_path, "03_build_vocab_map")
    manifest = StageManifest(Layout(tmp_path), "03_build_vocab_map", settings={"x": 1})
    manifest.begin(False)
    manifest.complete()
    assert run_pipeline.stage_status(tmp_path, "03_build_vocab_map", before) == "done"
    before = run_pipeline.last_run(tmp_path, "03_build_vocab_map")
    manifest.record("already_complete")
    assert run_pipeline.stage_status(tmp_path, "03_build_vocab_map", before) == "already complete"
    # a stage that recorded nothing (no manifest) counts as done, whatever it printed
    assert run_pipeline.stage_status(tmp_path, "05_baseline", None) == "done"


def test_fingerprints_are_content_hashes_cached_by_mtime(tmp_path):
    from common.core.io import file_sha256
    from common.core.run_folder import content_fingerprint

    layout = Layout(tmp_path)
    f = tmp_path / "big.bin"
    f.write_bytes(b"x" * 1000)
    assert content_fingerprint(layout, f) == file_sha256(f)
    cache = json.loads((layout.stages / "hashes.json").read_text())
    assert cache[str(f.resolve())]["sha256"] == file_sha256(f)
    # same size, same name, other bytes (what a names-and-sizes fingerprint misses)
    st = f.stat()
    f.write_bytes(b"y" * 1000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert content_fingerprint(layout, f) == file_sha256(f)


# ============================================================================ the lock


def test_lock_names_the_holder_and_dies_with_it(tmp_path):
    holder = hold_lock(tmp_path, "04_train")
    try:
        with pytest.raises(StageBusy, match=rf"04_train is already running on {tmp_path} \(pid {holder.pid}"):
            with stage_lock(tmp_path, "04_train"):
                pass
        with stage_lock(tmp_path, "03_build_vocab_map"):  # one lock per stage: other stages may run
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    # SIGKILL: the OS released the lock; no stale lock file blocks the next run
    with stage_lock(tmp_path, "04_train"):
        assert (tmp_path / "stages" / "04_train.lock").read_text().strip() == str(os.getpid())




def test_overwrite_is_refused_while_a_reader_of_the_outputs_runs(tmp_path):
    """--overwrite of a stage is refused while a stage that reads its outputs runs (02 --overwrite under a
    running 04 would rewrite the shards 04 reads); the probe leaves the reader's lock alone."""
    assert lock_holder(tmp_path, "04_train") is None  # never locked: no lock file, nothing created
    assert not (tmp_path / "stages").exists()
    holder = hold_lock(tmp_path, "04_train")
    try:
        assert lock_holder(tmp_path, "04_train") == str(holder.pid)
        for stage in ("02_extract_hidden", "03_build_vocab_map"):
            with pytest.raises(StageBusy, match=rf"{stage} --overwrite would delete what 04_train is reading: "
                                                rf"04_train is running on {tmp_path} \(pid {holder.pid}\)"):
                refuse_overwrite_while_read(tmp_path, stage)
        refuse_overwrite_while_read(tmp_path, "01_prepare_data")  # 01b reads 01's outputs, and 01b is not running
        refuse_overwrite_while_read(tmp_path, "05_evaluate")  # nothing reads 05's outputs
        # the probe leaves the holder's lock alone, and a stage starting during a probe waits it out
        with stage_lock(tmp_path, "02_extract_hidden"):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert lock_holder(tmp_path, "04_train") is None
    refuse_overwrite_while_read(tmp_path, "02_extract_hidden")


def test_a_manifest_of_another_run_folder_version_is_one_error_line(tmp_path):
    """One run-folder version: a manifest an earlier (or later) version recorded is refused with one line naming
    the stage, the versions and --overwrite, instead of being read through compatibility code; --overwrite starts
    over and records this version."""
    layout = Layout.of(tmp_path)
    StageManifest(layout, "04_train", settings={"target": "sha-of-weights", "seed": 0}).partial()
    assert read_manifest(layout, "04_train")["run_folder_version"] == RUN_FOLDER_VERSION
    for found in (None, RUN_FOLDER_VERSION - 1, RUN_FOLDER_VERSION + 1):
        record = read_manifest(layout, "04_train")
        record.pop("run_folder_version")
        layout.manifest("04_train").write_text(json.dumps({**record, **({"run_folder_version": found} if found else {})}))
        new = StageManifest(layout, "04_train", settings={"target": "sha-of-weights", "seed": 0})
        with pytest.raises(DataError) as e:
            new.begin(False)
        msg = str(e.value)
        made_by = "a later" if found and found > RUN_FOLDER_VERSION else "an earlier"
        assert "\n" not in msg and f"made by {made_by} version of this pipeline" in msg, msg
        assert f"run-folder version {json.dumps(found)}" in msg and "rerun 04_train.py with --overwrite" in msg, msg
        assert new.begin(True) == "fresh"
        assert read_manifest(layout, "04_train")["run_folder_version"] == RUN_FOLDER_VERSION
