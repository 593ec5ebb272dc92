"""Rounds under a disk budget (extract.max_disk_gb; docs/design.md#rounds-under-a-disk-budget), and
streaming (extract.stream; docs/design.md#streaming).

The hidden states of the whole data set do not fit: 02 extracts a round (a seeded random share of one
epoch's train samples, next to the eval shards), 04 trains on it, records it in consumed.json and deletes
it, 02 extracts the next, as run_pipeline.py alternates them. Streaming, 02 and 04 run at the same time
and wait for each other through the files. Real stages in subprocesses on a tiny random Llama (hf
backend), a disk sampler on hidden/, SIGKILLs at random moments of both stages.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import run_pipeline

from tests.helpers import (REPO, base_config, cpu_seconds, error_line, kill_while_working, last_logged, make_target,
                           run_stage, stage_env, start_in_own_group, structured_samples, write_yaml)

EPOCHS = 2


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The tiny target of every run here (read only)."""
    return make_target(tmp_path_factory.mktemp("rounds-target") / "target")


def build(root: Path, target: Path, max_disk_gb: float | None, stream: bool = False, n_train: int = 64) -> Path:
    from common.core.io import write_jsonl_atomic

    run_dir = root / "run"
    write_jsonl_atomic(run_dir / "data" / "train.jsonl", structured_samples(n_train, 1, "tr"))
    write_jsonl_atomic(run_dir / "data" / "eval.jsonl", structured_samples(8, 2, "ev"))
    cfg = base_config(run_dir, target, max_steps=None, epochs=EPOCHS, eval_every=0, checkpoint_every=3, log_every=5)
    cfg["extract"]["shard_max_tokens"] = 600
    if max_disk_gb is not None:
        cfg["extract"]["max_disk_gb"] = max_disk_gb
    if stream:
        cfg["extract"]["stream"] = True
        cfg["extract"]["stream_wait_minutes"] = 5  # a stage whose partner died fails the test instead of hanging
    return write_yaml(root / "run.yaml", cfg)


def stage_cmd(script: str, cfg: Path) -> list[str]:
    return [sys.executable, str(REPO / script), "--config", str(cfg)]


def stage(script: str, cfg: Path, timeout: float = 600, nproc: int = 1) -> subprocess.CompletedProcess:
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={nproc}"]
    res = subprocess.run([*launch, str(REPO / script), "--config", str(cfg)], cwd=REPO, env=stage_env(),
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{script}: {res.stdout[-2000:]}{res.stderr[-3000:]}"
    return res


def train_state(run_dir: Path) -> str:
    manifest = run_dir / "stages" / "04_train.json"
    return json.loads(manifest.read_text())["state"] if manifest.is_file() else "none"


class RoundsPipeline(run_pipeline.Pipeline):
    """run_pipeline.py's own orchestrator, with one stub: 04 under torchrun when nproc > 1. Counts each stage's runs."""

    def __init__(self, cfg: Path, nproc: int = 1):
        from common.core.config import load_config

        args = argparse.Namespace(config=str(cfg), overrides=[], stop_after=None, server_url=None, tiny_target=None,
                                  real_target=None)
        super().__init__(args, load_config(cfg))
        self.nproc = nproc
        self.runs: collections.Counter = collections.Counter()

    def stage_command(self, name: str, script: str, *extra: str) -> list[str]:
        self.runs[name] += 1
        command = super().stage_command(name, script, *extra)
        if name == "04_train" and self.nproc > 1:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}",
                    *command[1:]]
        return command


def alternate(cfg: Path, run_dir: Path, nproc: int = 1) -> int:
    """What run_pipeline.py runs, by its own code: 02, 03, then Pipeline.train (04, then 02 and 04 in turn until 04
    is complete; it stops on a round without progress). Returns the 04 runs."""
    pipeline = RoundsPipeline(cfg, nproc)
    pipeline.extract()
    pipeline.stage("03_build_vocab_map", "03_build_vocab_map.py")
    pipeline.train()
    assert train_state(run_dir) == "complete"
    return pipeline.runs["04_train"]


class DiskSampler:
    """The bytes of every file under hidden/ (shards, temp files, plan.json, index.json, consumed.json, ...: the
    budget covers them all) every `every` seconds, in a thread; peak_other: the most of it that was not shards."""

    def __init__(self, hidden: Path, every: float = 0.05):
        self.hidden, self.every, self.peak, self.peak_other, self.samples = hidden, every, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = other = 0
            for folder, _, files in os.walk(self.hidden):
                for name in files:
                    try:
                        size = os.stat(os.path.join(folder, name)).st_size
                    except FileNotFoundError:
                        continue
                    total += size
                    other += 0 if name.startswith(("shard-", ".tmp-shard-")) else size
            self.peak, self.peak_other = max(self.peak, total), max(self.peak_other, other)
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


@pytest.fixture(scope="module")
def budget_of(tmp_path_factory, target):
    """budget_of(n_train) -> a budget of the eval shards + a quarter of the train shards of an unbounded
    extraction of n_train samples; the largest shard; the unbounded plan's index. One extraction per size for
    the module (read only)."""
    made: dict[int, tuple[float, int, dict]] = {}

    def budget(n_train: int = 64) -> tuple[float, int, dict]:
        if n_train not in made:
            root = tmp_path_factory.mktemp(f"whole-{n_train}")
            stage("02_extract_hidden.py", build(root, target, None, n_train=n_train))
            index = json.loads((root / "run" / "hidden" / "index.json").read_text())
            train = sum(s["bytes"] for s in index["shards"] if s["split"] == "train")
            evals = sum(s["bytes"] for s in index["shards"] if s["split"] == "eval")
            made[n_train] = (evals + train / 4) / 1e9, max(s["bytes"] for s in index["shards"]), index
        return made[n_train]

    return budget


def check_ledger(run_dir: Path) -> None:
    ledger = ledger_of(run_dir)
    train_ids = [json.loads(line)["id"] for line in (run_dir / "data" / "train.jsonl").read_text().splitlines()]
    assert sorted(ledger["sample_ids"]) == sorted(train_ids)
    assert len(ledger["epochs"]) == EPOCHS and all(c == [1] * len(train_ids) for c in ledger["epochs"])


@pytest.mark.slow
def test_rounds_hold_the_budget_and_train_every_sample_once_per_epoch(tmp_path, target, budget_of):
    budget_gb, largest_shard, whole = budget_of()
    cfg = build(tmp_path / "rounds", target, budget_gb)
    run_dir = tmp_path / "rounds" / "run"
    with DiskSampler(run_dir / "hidden") as disk:
        runs = alternate(cfg, run_dir)
    plan = json.loads((run_dir / "hidden" / "plan.json").read_text())
    assert len(plan["rounds"]) >= 4 * EPOCHS and runs == len(plan["rounds"])
    assert [r["epoch"] for r in plan["rounds"]] == sorted(r["epoch"] for r in plan["rounds"])
    assert disk.samples > 50 and disk.peak <= budget_gb * 1e9, (disk.peak, budget_gb * 1e9)  # every file in hidden/
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
def test_rounds_survive_sigkills_of_02_and_04_at_random_moments(tmp_path, target, budget_of):
    """02 and 04 alternate; each is SIGKILLed three times at a moment drawn from a whole run's work (in CPU
    seconds: a run here is mostly start-up, which leaves no sign on disk), and rerun; then the job finishes
    within the budget (plus the shard a kill left half-written) with every sample once per epoch."""
    budget_gb, largest_shard, _ = budget_of()
    cfg = build(tmp_path / "rounds", target, budget_gb)
    run_dir = tmp_path / "rounds" / "run"
    stage("03_build_vocab_map.py", cfg)
    rng = random.Random(16)
    kills = {"02_extract_hidden.py": 0, "04_train.py": 0}
    work: dict[str, float] = {}  # each stage's last whole run, in CPU seconds: the kill moments are drawn within it

    def whole(script: str) -> None:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        stage(script, cfg)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        work[script] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime

    with DiskSampler(run_dir / "hidden") as disk:
        whole("02_extract_hidden.py")
        whole("04_train.py")
        for _ in range(60):  # until each stage has been killed 3 times; a run the kill missed moves the job on
            if all(k == 3 for k in kills.values()) or train_state(run_dir) == "complete":
                break
            for script in kills:
                if kills[script] == 3:
                    whole(script)
                else:
                    kills[script] += kill_while_working(lambda: start_in_own_group(stage_cmd(script, cfg)), cpu_seconds,
                                                        work[script], rng, max_runs=1)
        assert all(k == 3 for k in kills.values()), kills  # three random moments each
        alternate(cfg, run_dir)  # the reruns finish the job
    assert disk.peak <= budget_gb * 1e9 + largest_shard, (disk.peak, budget_gb * 1e9)
    check_ledger(run_dir)


@pytest.mark.slow
def test_rounds_under_torchrun_train_like_one_process_with_grad_accum(tmp_path, target, budget_of):
    """2 DDP ranks (gloo) vs 1 process x grad_accum 2, both in rounds: the same global batches, so the same
    losses per step, the same ledger, and every rank waits for (and trains) the same round."""
    budget_gb, _, whole = budget_of()
    train = sum(s["bytes"] for s in whole["shards"] if s["split"] == "train")
    budget_gb += train / 4 / 1e9  # half the train shards per round: 2 rounds per epoch
    logs = {}
    for name, nproc, accum in (("one", 1, 2), ("ddp", 2, 1)):
        cfg = build(tmp_path / name, target, budget_gb)
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


def start(script: str, cfg: Path, log: Path) -> subprocess.Popen:
    return start_in_own_group(stage_cmd(script, cfg), log=log)


def finish(procs: dict[str, subprocess.Popen], logs: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    for script, proc in procs.items():
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert proc.returncode == 0, (script, (logs / f"{script}.log").read_text()[-3000:])


@pytest.mark.slow
def test_streaming_runs_02_and_04_at_once_within_the_budget(tmp_path, target, budget_of):
    budget_gb, largest_shard, _ = budget_of()
    cfg = build(tmp_path / "stream", target, budget_gb, stream=True)
    run_dir = tmp_path / "stream" / "run"
    stage("03_build_vocab_map.py", cfg)
    with DiskSampler(run_dir / "hidden") as disk:
        # 04 first: it waits for 02's plan and first shards
        procs = {s: start(s, cfg, tmp_path / f"{s}.log") for s in ("04_train.py", "02_extract_hidden.py")}
        finish(procs, tmp_path)
    plan = json.loads((run_dir / "hidden" / "plan.json").read_text())
    # half the budget per round (two on disk at once): twice the rounds of the alternating mode
    assert len(plan["rounds"]) >= 8 * EPOCHS
    assert max(r["bytes"] for r in plan["rounds"]) <= (budget_gb * 1e9 - plan["eval_bytes"]) / 2
    assert disk.samples > 50 and disk.peak <= budget_gb * 1e9, (disk.peak, budget_gb * 1e9)  # every file in hidden/
    check_ledger(run_dir)
    log02 = (tmp_path / "02_extract_hidden.py.log").read_text()
    log04 = (tmp_path / "04_train.py.log").read_text()
    # they ran at the same time: 02 waited for 04 to free room, 04 waited for 02's first round
    assert "02_extract_hidden: waiting for 04_train to finish round" in log02
    assert "04_train: waiting for 02_extract_hidden" in log04
    left = sorted(p.name for p in (run_dir / "hidden").glob("shard-*"))
    assert left == [s["file"] for s in plan["shards"] if s["split"] == "eval"]
    assert json.loads((run_dir / "stages" / "02_extract_hidden.json").read_text())["state"] == "complete"
    assert train_state(run_dir) == "complete"


@pytest.mark.slow
def test_streaming_survives_sigkills_of_02_and_04_at_random_moments(tmp_path, target, budget_of):
    """Both run; one of them is SIGKILLed at a moment drawn from its work still left (02: shards written; 04:
    epochs trained) and restarted at once while the other goes on (waiting for it through the files), three
    times each, alternating; then both finish."""
    budget_gb, largest_shard, _ = budget_of(192)  # ~1 min of work: room for six kills
    cfg = build(tmp_path / "stream", target, budget_gb, stream=True, n_train=192)
    run_dir = tmp_path / "stream" / "run"
    hidden = run_dir / "hidden"
    stage("03_build_vocab_map.py", cfg)

    def plan() -> dict:
        return json.loads((hidden / "plan.json").read_text()) if (hidden / "plan.json").is_file() else {"shards": [None]}

    def shards_written(victim=None) -> int:
        """02's work done: the shards on disk and those of the rounds 04 consumed (and deleted)."""
        consumed = json.loads((hidden / "consumed.json").read_text())["rounds"] if (hidden / "consumed.json").is_file() else []
        return len(list(hidden.glob("shard-*"))) + sum(len(plan()["rounds"][r]["shards"]) for r in consumed)

    work = {"02_extract_hidden.py": (shards_written, lambda: len(plan()["shards"])),
            "04_train.py": (lambda victim=None: last_logged(run_dir, "epoch"), lambda: EPOCHS)}
    rng = random.Random(18)
    scripts = ("02_extract_hidden.py", "04_train.py")
    kills = dict.fromkeys(scripts, 0)
    with DiskSampler(hidden) as disk:
        procs = {s: start(s, cfg, tmp_path / f"{s}.log") for s in scripts}
        for k in range(6):
            script = scripts[k % 2]
            done, end = work[script]
            now, left = done(), 3 - kills[script]  # this kill is drawn from a 1/left share of the work left
            landed = kill_while_working(lambda: start(script, cfg, tmp_path / f"{script}.log"), done,
                                        now + (end() - now) / left, rng, jitter_s=0.3, running=procs[script], max_runs=1)
            assert landed == 1, (script, "finished before its kill", (tmp_path / f"{script}.log").read_text()[-3000:])
            kills[script] += landed
            procs[script] = start(script, cfg, tmp_path / f"{script}.log")
        finish(procs, tmp_path)
    assert kills == dict.fromkeys(scripts, 3)
    assert disk.peak <= budget_gb * 1e9 + largest_shard, (disk.peak, budget_gb * 1e9)
    check_ledger(run_dir)
    assert train_state(run_dir) == "complete"


def test_streaming_04_stops_with_one_error_line_when_02_never_comes(tmp_path, target):
    cfg = build(tmp_path / "alone", target, 0.001, stream=True)
    tree = yaml.safe_load(cfg.read_text())
    tree["extract"]["stream_wait_minutes"] = 0.05  # 3 s
    write_yaml(cfg, tree)
    res = run_stage("04_train.py", cfg, timeout=300)  # the timeout: a hang guard
    error_line(res, "04_train waited", "is 02_extract_hidden running?", "extract.stream_wait_minutes=0.05")
    assert "04_train: waiting for 02_extract_hidden to write hidden/plan.json" in res.stdout
    # Stopped at its 3 s limit, before the wait's first heartbeat (a minute of waiting): read in 04's own output, not
    # timed with its start-up, which the machine's load decides (tests/hidden/test_stream.py times the wait exactly).
    assert "still waiting" not in res.stdout
    assert not (tmp_path / "alone" / "run" / "train").exists()  # nothing written


# ---------------------------------------------------------------------------------------------
# The budget covers every file in hidden/, a plan edited after 02 made it is refused, and the advice for a
# damaged shard under rounds keeps the plan. 02 in this process (hf backend); where 04 would act, these
# tests do what it does, with the functions it does it with (consume_round, HiddenIndex.load).
# ---------------------------------------------------------------------------------------------


def consume_round(run_dir: Path, plan: dict, r: int) -> None:
    """What 04 does at a round's end (TrainSource.round_trained): record it in consumed.json, then delete its shards."""
    from common.core.run_folder import Layout
    from common.hidden.index import mark_trained
    from common.hidden.rounds import HiddenPlan

    assert all((run_dir / "hidden" / f).is_file() for f in HiddenPlan(plan).rounds[r].shards)  # 04 deletes what it trained
    mark_trained(Layout.of(str(run_dir)), HiddenPlan(plan), {r})


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_budget_holds_every_file_in_hidden_bookkeeping_included(tmp_path, target, one_torch_thread, capsys):
    """The budget covers every file in hidden/, plan.json and index.json included, not only the shards. Here
    a budget so small that the bookkeeping is a large share of it and there are many rounds: every file under
    hidden/, sampled every few ms while 02 extracts round after round, stays within the budget, and the
    bookkeeping within the reserve the plan set aside for it. 02's summary line says what hidden/ holds now,
    not only what was extracted so far (which outgrows the budget as rounds are trained and deleted)."""
    from common.core.config import load_config
    from common.core.io import folder_bytes, format_bytes
    from common.extract.stage import run_extraction

    budget_gb = 0.0004
    cfg = load_config(build(tmp_path, target, budget_gb, n_train=48))
    run_dir = tmp_path / "run"
    extracted_so_far = []
    with DiskSampler(run_dir / "hidden", every=0.002) as disk:
        for _ in range(60):
            capsys.readouterr()
            if run_extraction(cfg)["status"] == "extracted":
                line = next(x for x in capsys.readouterr().out.splitlines() if "extracted so far" in x)
                index = json.loads((run_dir / "hidden" / "index.json").read_text())
                assert (f"{format_bytes(index['bytes'])} extracted so far, "
                        f"{format_bytes(folder_bytes(run_dir / 'hidden'))} in {run_dir / 'hidden'} now") in line
                extracted_so_far.append(index["bytes"])
            plan = json.loads((run_dir / "hidden" / "plan.json").read_text())
            consumed = set(json.loads((run_dir / "hidden" / "consumed.json").read_text())["rounds"]) \
                if (run_dir / "hidden" / "consumed.json").is_file() else set()
            due = [r for r in range(len(plan["rounds"])) if r not in consumed]
            if not due:
                break
            assert all((run_dir / "hidden" / f).is_file() for f in plan["rounds"][due[0]]["shards"])
            consume_round(run_dir, plan, due[0])
    assert not due and json.loads((run_dir / "stages" / "02_extract_hidden.json").read_text())["state"] == "complete"
    assert len(plan["rounds"]) >= 8 and plan["max_disk_bytes"] == int(budget_gb * 1e9)
    assert plan["reserve_bytes"] > 0.05 * plan["max_disk_bytes"]  # the bookkeeping matters at this size
    assert disk.samples > 100 and disk.peak_other > 0
    assert disk.peak <= plan["max_disk_bytes"], (disk.peak, plan["max_disk_bytes"])
    assert disk.peak_other <= plan["reserve_bytes"], (disk.peak_other, plan["reserve_bytes"])
    assert len(extracted_so_far) == len(plan["rounds"]) and extracted_so_far[-1] > plan["max_disk_bytes"]


def test_a_plan_edited_after_02_made_it_is_refused_before_anything_is_extracted(tmp_path, target, one_torch_thread):
    """An edited plan.json (say max_disk_bytes x10, which would let 02 extract every round past the budget): 02
    checks the plan against the config and against the sha256 it recorded when it wrote it, and refuses with one
    line before it extracts or deletes anything; so does 04."""
    from common.core.config import load_config
    from common.core.errors import DataError
    from common.extract.stage import run_extraction

    cfg_path = build(tmp_path, target, 0.0005)
    run_dir = tmp_path / "run"
    hidden = run_dir / "hidden"
    run_extraction(load_config(cfg_path))  # round 1 and the eval shards
    plan = json.loads((hidden / "plan.json").read_text())
    consume_round(run_dir, plan, 0)  # 04's turn is over: the next 02 extracts round 2
    plan_text = (hidden / "plan.json").read_text()
    before = tree_bytes(hidden)

    edited = json.loads(plan_text)
    edited["max_disk_bytes"] *= 10  # every round would fit
    (hidden / "plan.json").write_text(json.dumps(edited))
    res = run_stage("02_extract_hidden.py", cfg_path)
    error_line(res, "hidden/plan.json cuts its rounds for max_disk_bytes 5000000", "extract.max_disk_gb=0.0005 is 500000 bytes",
               "restore the plan 02 made, or rerun 02_extract_hidden.py with --overwrite")
    assert tree_bytes(hidden) == {**before, "plan.json": json.dumps(edited).encode()}  # nothing extracted, nothing deleted

    edited = json.loads(plan_text)
    edited["rounds"][1]["shards"] = edited["rounds"][1]["shards"][:1]  # any other edit: the recorded sha256 catches it
    (hidden / "plan.json").write_text(json.dumps(edited))
    with pytest.raises(DataError, match=r"plan.json is not the plan 02 made \(its sha256 differs from the one recorded in "
                                        r".*02_extract_hidden.json\): it was edited or replaced; restore"):
        run_extraction(load_config(cfg_path))
    assert tree_bytes(hidden) == {**before, "plan.json": json.dumps(edited).encode()}
    # 04 would train other rounds than 02 extracts: it refuses the edited plan too
    error_line(run_stage("04_train.py", cfg_path), "plan.json is not the plan 02 made", "restore it")
    assert not (run_dir / "train").exists()

    (hidden / "plan.json").write_text(plan_text)  # the plan 02 made: it goes on with round 2
    run_extraction(load_config(cfg_path))
    assert all((hidden / f).is_file() for f in plan["rounds"][1]["shards"])


def test_a_damaged_shard_under_rounds_is_repaired_by_the_advice_without_losing_the_plan(tmp_path, target, one_torch_thread):
    """For a damaged shard under rounds the advice is to delete the shard and rerun 02 (never --overwrite, which
    throws away the plan and consumed.json): followed, it repairs the round (the same bytes again) and keeps the
    plan, consumed.json and every other shard."""
    from common.core.config import load_config
    from common.core.distributed import DistEnv
    from common.core.errors import DataError
    from common.core.run_folder import Layout
    from common.extract.stage import run_extraction
    from common.hidden.rounds import HiddenPlan
    from common.hidden.shards import HiddenIndex, verify_shard_files

    cfg = load_config(build(tmp_path, target, 0.0005))
    layout = Layout.of(cfg)
    run_extraction(cfg)
    plan = json.loads(layout.hidden_plan.read_text())
    consume_round(layout.run_dir, plan, 0)
    run_extraction(cfg)  # round 2 is on disk: 04 opens it
    files = HiddenPlan(plan).files_of_round(1)

    def open_round() -> None:  # what 04 does when it starts a round (TrainSource.batches)
        verify_shard_files(HiddenIndex.load(layout.hidden_index, files), layout, DistEnv(), "sha256")

    open_round()
    kept = {p.name: p.read_bytes() for p in [layout.hidden_plan, layout.hidden_consumed, *layout.shard_files()]}
    for offset in (-10, 5000):  # in sample_offsets (the header check sees it), in the states (only sha256 does)
        shard = layout.hidden / plan["rounds"][1]["shards"][0]
        damaged = bytearray(kept[shard.name])
        damaged[offset] ^= 0xFF
        shard.write_bytes(bytes(damaged))
        with pytest.raises(DataError) as err:
            open_round()
        message = str(err.value)
        assert f"delete {shard} and rerun 02_extract_hidden.py (it extracts that shard again and keeps the rest)" in message
        assert "--overwrite" not in message, message
        shard.unlink()  # the advice
        assert run_extraction(cfg)["shards"] == 1
        open_round()
        assert {p.name: p.read_bytes() for p in [layout.hidden_plan, layout.hidden_consumed, *layout.shard_files()]} == kept


def sharegpt_array(path: Path, n: int, long_every: int, tail: bool = True) -> dict:
    """A ShareGPT-shaped JSON array (ShareGPT_V3_unfiltered_cleaned_split.json's shape) of the first n sample prompts,
    every long_every-th first user turn grown past 2048 tokens, and, like the published file, a last record cut in
    the middle. Returns the counts the run must report."""
    rows = [json.loads(line) for line in (REPO / "data" / "sample_prompts.jsonl").read_text().splitlines()][:n + 1]
    records, long_ids = [], []
    for i, row in enumerate(rows):
        turns = row.get("conversations") or [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                              "value": m["content"]} for m in row["messages"]]
        turns = [dict(t) for t in turns if t["from"] != "system"]
        turns[0]["value"] += f" (question {i})"  # no duplicates for 01 to drop
        if i % long_every == 1:
            turns[0]["value"] += " Please read all of this:" + " and more" * 1500
            long_ids.append(f"sg-{i}")
        records.append({"id": f"sg-{i}", "conversations": turns})
    text = "[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n"
    last = text.rindex('{"id"')
    path.write_text(text[:last + 40] if tail else text)  # the last record torn after 40 bytes
    return {"complete": n, "long": [x for x in long_ids if x != f"sg-{n}"]}


@pytest.mark.slow
@pytest.mark.vllm
def test_run_pipeline_on_sharegpt_data_under_a_disk_budget_trains_to_the_end(tmp_path, vllm_server, tiny_target_dir):
    """run_pipeline.py itself, as a user runs the real-data route under a disk budget: a ShareGPT JSON array with a torn
    last record and prompts longer than the served context -> 01 keeps the complete records -> 01b (real vLLM) leaves
    the long prompts out before any request -> the baseline -> then 02 and 04 alternate round after round
    (extract.backend hf) until 04 is complete. hidden/ is sampled all along and stays within the budget."""
    source = tmp_path / "ShareGPT_V3_like.json"
    expect = sharegpt_array(source, 60, long_every=12)
    tree = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    run_dir = tmp_path / "run"
    tree["run_dir"] = str(run_dir)
    tree["target"]["model"] = str(tiny_target_dir)
    tree["data"].update(source=str(source), eval_fraction=0.15)
    tree["generate"]["max_tokens"] = 96
    tree["server"]["max_model_len"] = 2048  # the session server's
    tree["extract"].update(backend="hf", shard_max_tokens=1024, max_disk_gb=0.006)
    tree["train"].update(epochs=EPOCHS, max_steps=None, checkpoint_every=5)
    tree["evaluate"].update(num_prompts=4, max_tokens=32, other_prompts=str(REPO / "data" / "other_prompts.jsonl"))
    cfg = write_yaml(tmp_path / "sharegpt.yaml", tree)
    cmd = [sys.executable, str(REPO / "run_pipeline.py"), "--config", str(cfg), "--server-url", vllm_server.base_url,
           "--stop-after", "04_train"]
    with DiskSampler(run_dir / "hidden") as disk:
        res = subprocess.run(cmd, cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "pipeline stopped after 04_train" in res.stdout

    prepared = json.loads((run_dir / "data" / "prepare_report.json").read_text())
    assert prepared["counts"]["read"] == expect["complete"] + 1 and prepared["counts"]["kept"] == expect["complete"], prepared
    assert {k: n for k, n in prepared["counts"]["dropped"].items() if n} == {"truncated_json_tail": 1}, prepared
    generated = json.loads((run_dir / "data" / "generate_report.json").read_text())
    assert generated["skipped_prompts"] == {"over_max_model_len": len(expect["long"])}, generated
    assert generated["num_done"] == expect["complete"] - len(expect["long"]) and generated["complete"]
    assert f"left out {len(expect['long'])} of {expect['complete']} prompts the server cannot take" in res.stdout

    plan = json.loads((run_dir / "hidden" / "plan.json").read_text())
    assert len(plan["rounds"]) >= 2 * EPOCHS, plan["rounds"]
    assert disk.samples > 50 and disk.peak <= plan["max_disk_bytes"], (disk.peak, plan["max_disk_bytes"])
    # run_pipeline ran 02 and 04 once per round (02 extracts a round, 04 trains and deletes it), and every round
    # was trained and deleted
    run = json.loads((run_dir / "logs" / "pipeline_runs.jsonl").read_text().splitlines()[-1])
    ran = collections.Counter(s["stage"] for s in run["stages"])
    assert ran["04_train"] == ran["02_extract_hidden"] == len(plan["rounds"]), (ran, len(plan["rounds"]))
    assert json.loads((run_dir / "hidden" / "consumed.json").read_text())["rounds"] == list(range(len(plan["rounds"])))
    check_ledger(run_dir)
    assert json.loads((run_dir / "stages" / "04_train.json").read_text())["state"] == "complete"
    assert (run_dir / "train" / "final" / "model.safetensors").is_file()
    # a rerun finds every stage complete
    again = subprocess.run(cmd, cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and re.search(r"^04_train .* already complete$", again.stdout, re.M), again.stdout[-3000:]
