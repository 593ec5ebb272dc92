"""Two real copies of 01, 01b, 02, 03 and 04 at once on one run folder: one runs, the other exits 2
naming the holder, nothing is written twice (05: a held lock stops it before it does anything)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from common.core.run_folder import Layout, read_manifest
from tests.fault_server import Faults, FaultServer
from tests.helpers import REPO, clone_run, error_line, hold_lock, read_metrics, run_stage, stage_env, write_yaml


def start_and_freeze(cmd: list[str], lock: Path, env: dict) -> subprocess.Popen:
    """Start a stage; once it holds its lock (its pid is in the lock file), SIGSTOP it, so the
    second copy meets a running first copy however fast the stage is."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if lock.read_text().strip() == str(proc.pid):
                proc.send_signal(signal.SIGSTOP)
                return proc
        except OSError:
            pass
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.002)
    raise AssertionError(f"{cmd} never took {lock}")


def two_copies(script: str, cfg: Path, run_dir: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `script` twice at once on one run_dir; assert the second exits 2 naming the first's pid
    and the first finishes; returns the first's result."""
    env = env or stage_env()
    stage = Path(script).stem
    first = start_and_freeze([sys.executable, str(REPO / script), "--config", str(cfg)], run_dir / "stages" / f"{stage}.lock", env)
    try:
        second = run_stage(script, cfg, env=env, timeout=timeout)
    finally:
        first.send_signal(signal.SIGCONT)
    error_line(second, f"{stage} is already running on {run_dir} (pid {first.pid}")
    out, err = first.communicate(timeout=timeout)
    assert first.returncode == 0, err[-3000:]
    return subprocess.CompletedProcess(first.args, first.returncode, out, err)


def test_two_copies_of_01(tmp_path):
    run_dir = tmp_path / "run"
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(run_dir), "data": {"source": str(REPO / "data" / "sample_prompts.jsonl")}})
    two_copies("01_prepare_data.py", cfg, run_dir)
    rows = [json.loads(line) for line in (run_dir / "data" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == len({r["id"] for r in rows}) > 300
    assert read_manifest(Layout(run_dir), "01_prepare_data")["state"] == "complete"


def test_two_copies_of_01b_write_every_id_once(run_dir, write_config, chat_tokenizer_dir):
    from tests.data.test_generate import SECRET, config, make_prompts

    prompts = make_prompts(run_dir, 30)
    with FaultServer(Faults(latency_s=0.02)) as server:
        cfg = config(write_config, server, chat_tokenizer_dir, concurrency=4)
        two_copies("01b_generate_synthetic.py", cfg, run_dir, env=stage_env() | {"EAGLE3_TEST_API_KEY": SECRET})
        assert server.stats.chat_requests == sum(sum(m["role"] == "user" for m in p["messages"]) for p in prompts)
    raw = [json.loads(line) for line in (run_dir / "data" / "raw_responses.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in raw) == sorted(p["id"] for p in prompts)  # every id once


@pytest.mark.slow  # ~55 s: builds the hidden-state fixture, then 02 and 03 twice
def test_two_copies_of_02_and_03(tmp_path, hidden_run):
    src = yaml.safe_load(hidden_run.read_text())
    run_dir = tmp_path / "run"
    shutil.copytree(Path(src["run_dir"]) / "data", run_dir / "data")
    cfg = write_yaml(tmp_path / "run.yaml", {**src, "run_dir": str(run_dir)})
    first = two_copies("02_extract_hidden.py", cfg, run_dir)
    assert "02_extract_hidden: done:" in first.stdout, first.stdout
    index = json.loads((run_dir / "hidden" / "index.json").read_text())
    assert index["complete"] and sorted(p.name for p in (run_dir / "hidden").glob("shard-*")) == [s["file"] for s in index["shards"]]
    assert not list((run_dir / "hidden").glob(".tmp-*"))
    two_copies("03_build_vocab_map.py", cfg, run_dir)
    assert (run_dir / "vocab" / "vocab_map.safetensors").is_file()


def test_two_copies_of_04_log_every_line_once(tmp_path, hidden_run):
    cfg = clone_run(hidden_run, tmp_path, max_steps=6, checkpoint_every=3, eval_every=3, log_every=1)
    two_copies("04_train.py", cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    keys = [(r["type"], r["step"]) for r in rows]
    assert keys == [("train", s) for s in (1, 2, 3)] + [("eval", 3)] + [("train", s) for s in (4, 5, 6)] + [("eval", 6)]


def test_05_waits_for_nobody(tmp_path):
    """05 takes its lock before it reads anything (its real runs need vLLM: tests/evaluate/test_evaluate.py)."""
    run_dir = tmp_path / "run"
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(run_dir)})
    holder = hold_lock(run_dir, "05_evaluate")
    try:
        error_line(run_stage("05_evaluate.py", cfg), f"05_evaluate is already running on {run_dir} (pid {holder.pid}")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert not (run_dir / "eval").exists()
