"""Rounds under a disk budget (extract.max_disk_gb; docs/design.md#rounds-under-a-disk-budget).

The hidden states of the whole data set do not fit: 02 extracts a round (a seeded random share of one
epoch's train samples, next to the eval shards), 04 trains on it, records it in consumed.json and deletes
it, 02 extracts the next, as run_pipeline.py alternates them. Real stages in subprocesses on a tiny
random Llama (hf backend), a disk sampler on hidden/, SIGKILLs at random moments of both stages.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, base_config, make_target, structured_samples, train_env, write_yaml

EPOCHS = 2


def build(root: Path, max_disk_gb: float | None) -> Path:
    from common.core.io import write_jsonl_atomic

    target = root.parent / "target"
    if not target.exists():
        make_target(target)
    run_dir = root / "run"
    write_jsonl_atomic(run_dir / "data" / "train.jsonl", structured_samples(64, 1, "tr"))
    write_jsonl_atomic(run_dir / "data" / "eval.jsonl", structured_samples(8, 2, "ev"))
    cfg = base_config(run_dir, target, max_steps=None, epochs=EPOCHS, eval_every=0, checkpoint_every=3, log_every=5)
    cfg["extract"]["shard_max_tokens"] = 600
    if max_disk_gb is not None:
        cfg["extract"]["max_disk_gb"] = max_disk_gb
    return write_yaml(root / "run.yaml", cfg)


def stage(script: str, cfg: Path, timeout: float = 600, nproc: int = 1) -> subprocess.CompletedProcess:
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={nproc}"]
    res = subprocess.run([*launch, str(REPO / script), "--config", str(cfg)], cwd=REPO, env=train_env(),
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{script}: {res.stdout[-2000:]}{res.stderr[-3000:]}"
    return res


def train_state(run_dir: Path) -> str:
    manifest = run_dir / "stages" / "04_train.json"
    return json.loads(manifest.read_text())["state"] if manifest.is_file() else "none"


def alternate(cfg: Path, run_dir: Path, max_rounds: int = 40, nproc: int = 1) -> int:
    """What run_pipeline.py does: 02, 03, 04, then 02 and 04 until 04 is complete. Returns the 04 runs."""
    stage("02_extract_hidden.py", cfg)
    stage("03_build_vocab_map.py", cfg)
    stage("04_train.py", cfg, nproc=nproc)
    runs = 1
    while train_state(run_dir) != "complete":
        assert runs < max_rounds, "02 and 04 do not converge"
        stage("02_extract_hidden.py", cfg)
        stage("04_train.py", cfg, nproc=nproc)
        runs += 1
    return runs


class DiskSampler:
    """The bytes of hidden/'s shards (temp files included) every `every` seconds, in a thread."""

    def __init__(self, hidden: Path, every: float = 0.05):
        self.hidden, self.every, self.peak, self.samples = hidden, every, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for p in list(self.hidden.glob("*shard-*")) if self.hidden.is_dir() else []:
                try:
                    total += p.stat().st_size
                except FileNotFoundError:
                    pass
            self.peak = max(self.peak, total)
            self.samples += 1
            time.sleep(self.every)

    def __enter__(self) -> "DiskSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def ledger_of(run_dir: Path) -> dict:
    ckpts = sorted((run_dir / "train" / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return json.loads((ckpts[-1] / "ledger.json").read_text())


def budget_of(tmp_path: Path) -> tuple[float, int, dict]:
    """A budget of the eval shards + a quarter of the train shards of an unbounded extraction; the
    largest shard; the unbounded plan's index."""
    cfg = build(tmp_path / "whole", None)
    stage("02_extract_hidden.py", cfg)
    index = json.loads((tmp_path / "whole" / "run" / "hidden" / "index.json").read_text())
    train = sum(s["bytes"] for s in index["shards"] if s["split"] == "train")
    evals = sum(s["bytes"] for s in index["shards"] if s["split"] == "eval")
    return (evals + train / 4) / 1e9, max(s["bytes"] for s in index["shards"]), index


def check_ledger(run_dir: Path) -> None:
    ledger = ledger_of(run_dir)
    train_ids = [json.loads(line)["id"] for line in (run_dir / "data" / "train.jsonl").read_text().splitlines()]
    assert sorted(ledger["sample_ids"]) == sorted(train_ids)
    assert len(ledger["epochs"]) == EPOCHS and all(c == [1] * len(train_ids) for c in ledger["epochs"])


@pytest.mark.slow
def test_rounds_hold_the_budget_and_train_every_sample_once_per_epoch(tmp_path):
    budget_gb, largest_shard, whole = budget_of(tmp_path)
    cfg = build(tmp_path / "rounds", budget_gb)
    run_dir = tmp_path / "rounds" / "run"
    with DiskSampler(run_dir / "hidden") as disk:
        runs = alternate(cfg, run_dir)
    plan = json.loads((run_dir / "hidden" / "plan.json").read_text())
    assert len(plan["rounds"]) >= 4 * EPOCHS and runs == len(plan["rounds"])
    assert [r["epoch"] for r in plan["rounds"]] == sorted(r["epoch"] for r in plan["rounds"])
    assert disk.samples > 50 and disk.peak <= budget_gb * 1e9 + largest_shard, (disk.peak, budget_gb * 1e9)
    check_ledger(run_dir)
    # every train shard was deleted once trained; the eval shards stay
    left = sorted(p.name for p in (run_dir / "hidden").glob("shard-*"))
    assert left == [s["file"] for s in plan["shards"] if s["split"] == "eval"]
    assert json.loads((run_dir / "hidden" / "consumed.json").read_text())["rounds"] == list(range(len(plan["rounds"])))
    summary = json.loads((run_dir / "train" / "final" / "training_summary.json").read_text())
    assert summary["ledger"]["min_times"] == summary["ledger"]["max_times"] == EPOCHS
    # one LR schedule over the whole run: the rate falls along a cosine to the last step (no restart per round)
    rows = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if r["type"] == "train"]
    peak = lrs.index(max(lrs))
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:])) and rows[-1]["step"] == summary["total_steps"]
    # the rounds see the same samples and tokens per epoch as one extraction does
    assert plan["inputs"]["train"]["num_tokens"] * EPOCHS == sum(r["num_tokens"] for r in plan["rounds"])
    assert whole["splits"]["train"]["num_tokens"] == plan["inputs"]["train"]["num_tokens"]
    again = stage("04_train.py", cfg)
    assert "already complete" in again.stdout


@pytest.mark.slow
def test_rounds_survive_sigkills_of_02_and_04_at_random_moments(tmp_path):
    budget_gb, largest_shard, _ = budget_of(tmp_path)
    cfg = build(tmp_path / "rounds", budget_gb)
    run_dir = tmp_path / "rounds" / "run"
    stage("03_build_vocab_map.py", cfg)
    rng = random.Random(16)
    kills = {"02_extract_hidden.py": 0, "04_train.py": 0}
    took: dict[str, float] = {}  # each stage's last whole run: the kill moments are drawn within it

    def run(script: str, kill: bool) -> None:
        proc = subprocess.Popen([sys.executable, str(REPO / script), "--config", str(cfg)], cwd=REPO, env=train_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        try:
            proc.wait(timeout=rng.uniform(0.3, 1.0) * took[script] if kill else 600)
            took[script] = time.monotonic() - t0
            assert proc.returncode == 0, (script, proc.returncode)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
            kills[script] += 1

    with DiskSampler(run_dir / "hidden") as disk:
        run("02_extract_hidden.py", kill=False)
        run("04_train.py", kill=False)
        for _ in range(60):  # until each stage has been killed 3 times; a run the kill missed moves the job on
            if all(k == 3 for k in kills.values()) or train_state(run_dir) == "complete":
                break
            for script in kills:
                run(script, kill=kills[script] < 3)
        assert all(k == 3 for k in kills.values()), kills  # three random moments each
        alternate(cfg, run_dir)  # the reruns finish the job
    assert disk.peak <= budget_gb * 1e9 + largest_shard, (disk.peak, budget_gb * 1e9)
    check_ledger(run_dir)


@pytest.mark.slow
def test_rounds_under_torchrun_train_like_one_process_with_grad_accum(tmp_path):
    """2 DDP ranks (gloo) vs 1 process x grad_accum 2, both in rounds: the same global batches, so the same
    losses per step, the same ledger, and every rank waits for (and trains) the same round."""
    budget_gb, _, whole = budget_of(tmp_path)
    train = sum(s["bytes"] for s in whole["shards"] if s["split"] == "train")
    budget_gb += train / 4 / 1e9  # half the train shards per round: 2 rounds per epoch
    logs = {}
    for name, nproc, accum in (("one", 1, 2), ("ddp", 2, 1)):
        cfg = build(tmp_path / name, budget_gb)
        tree = yaml.safe_load(cfg.read_text())
        tree["train"]["grad_accum"] = accum
        tree["train"]["log_every"] = 1
        write_yaml(cfg, tree)
        run_dir = tmp_path / name / "run"
        alternate(cfg, run_dir, nproc=nproc)
        check_ledger(run_dir)
        logs[name] = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    one, ddp = ([r for r in logs[k] if r["type"] == "train"] for k in ("one", "ddp"))
    assert [r["step"] for r in one] == [r["step"] for r in ddp] and len(one) >= 4
    for a, b in zip(one, ddp):
        assert b["tokens"] == a["tokens"] and b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
        assert b["epoch"] == a["epoch"]
    assert one[-1]["epoch"] == EPOCHS  # every sample trained twice
