"""The run-folder contract (common/run_folder.py): stage manifests, the per-stage lock, and the
cases of issue 10 that a hostile user found (each now a one-line error or the correct resumed
result). Real subprocesses on real files; the holder of a lock is a real process too.

    manifest      complete / resume / mismatch error / redo / --overwrite
    lock          a second copy exits 2 naming the holder's pid; SIGKILL leaves no stale lock;
                  two real copies of 01, 01b, 02, 03 and 04 at once: one runs, the other exits 2,
                  nothing is written twice (05: a held lock stops it before it does anything)
    04            stale train/final after vocab/ or hidden/ changed; a damaged latest checkpoint
                  (falls back to the previous one, exact result); a damaged shard
    01b           401/403 stop the run at once; every request failing (5xx, non-JSON, empty
                  choices, timeouts) or too many failing is an error; prompts 01 would drop
    config        ranges, choices, duplicate keys, "did you mean"
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from common.errors import ConfigError, DataError
from common.run_folder import Layout, StageBusy, StageManifest, read_manifest, stage_lock
from tests.fault_server import Faults, FaultServer
from tests.helpers import REPO, clone_run, read_metrics, train_env, write_yaml


def run_stage(script: str, cfg: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), "--config", str(cfg), *args], cwd=REPO,
                          env=env or train_env(), capture_output=True, text=True, timeout=timeout)


def error_line(res: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, no traceback, and exactly one 'error:' line, the last of stderr."""
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-3000:])
    lines = [line for line in res.stderr.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], res.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


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
    from common.io import file_sha256
    from common.run_folder import content_fingerprint

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


HOLDER = """
import sys, time
from common.run_folder import stage_lock
with stage_lock(sys.argv[1], sys.argv[2]):
    print("locked", flush=True)
    time.sleep(600)
"""


def hold_lock(run_dir: Path, stage: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), stage], cwd=REPO, env=train_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


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
    env = env or train_env()
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
    from tests.test_generate import SECRET, config, make_prompts

    prompts = make_prompts(run_dir, 30)
    with FaultServer(Faults(latency_s=0.02)) as server:
        cfg = config(write_config, server, chat_tokenizer_dir, concurrency=4)
        two_copies("01b_generate_synthetic.py", cfg, run_dir, env=train_env() | {"EAGLE3_TEST_API_KEY": SECRET})
        assert server.stats.chat_requests == sum(sum(m["role"] == "user" for m in p["messages"]) for p in prompts)
    raw = [json.loads(line) for line in (run_dir / "data" / "raw_responses.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in raw) == sorted(p["id"] for p in prompts)  # every id once


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """tests/helpers.build_run: target, tokenized data, hidden states, vocab map."""
    from tests.helpers import build_run

    return build_run(tmp_path_factory.mktemp("run-folder"))


@pytest.mark.slow  # ~55 s: builds the hidden-state fixture, then 02 and 03 twice
def test_two_copies_of_02_and_03(tmp_path, tiny_run):
    src = yaml.safe_load(tiny_run.read_text())
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


def test_two_copies_of_04_log_every_line_once(tmp_path, tiny_run):
    cfg = clone_run(tiny_run, tmp_path, max_steps=6, checkpoint_every=3, eval_every=3, log_every=1)
    two_copies("04_train.py", cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    keys = [(r["type"], r["step"]) for r in rows]
    assert keys == [("train", s) for s in (1, 2, 3)] + [("eval", 3)] + [("train", s) for s in (4, 5, 6)] + [("eval", 6)]


def test_05_waits_for_nobody(tmp_path):
    """05 takes its lock before it reads anything (its real runs need vLLM: tests/test_evaluate.py)."""
    run_dir = tmp_path / "run"
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(run_dir)})
    holder = hold_lock(run_dir, "05_evaluate")
    try:
        error_line(run_stage("05_evaluate.py", cfg), f"05_evaluate is already running on {run_dir} (pid {holder.pid}")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert not (run_dir / "eval").exists()


# ============================================================================ 04: inputs changed, damaged files


@pytest.mark.slow  # ~60 s: five 04 runs
def test_04_changed_vocab_or_hidden_is_an_error_not_a_stale_final(tmp_path, tiny_run):
    """Issue 10, case 1: a rebuilt vocab map (or hidden/) used to leave train/final from the old one."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = clone_run(tiny_run, tmp_path, max_steps=4, checkpoint_every=2, eval_every=0)
    run_dir = tmp_path / "run"
    assert run_stage("04_train.py", cfg).returncode == 0
    assert "already complete" in run_stage("04_train.py", cfg).stdout
    # 03 rebuilt with another draft vocab size (here: the first 64 ids of the old map)
    old = load_file(str(run_dir / "vocab" / "vocab_map.safetensors"))
    ids = (torch.arange(128) + old["d2t"])[:64]
    t2d = torch.zeros_like(old["t2d"])
    t2d[ids] = True
    save_file({"d2t": ids - torch.arange(64), "t2d": t2d}, str(run_dir / "vocab" / "vocab_map.safetensors"))
    error_line(run_stage("04_train.py", cfg, "--set", "vocab.draft_vocab_size=64"),
               "vocab/vocab_map.safetensors changed", "--overwrite")
    assert run_stage("04_train.py", cfg, "--set", "vocab.draft_vocab_size=64", "--overwrite").returncode == 0
    assert load_file(str(run_dir / "train" / "final" / "model.safetensors"))["d2t"].numel() == 64
    # hidden/ re-extracted (a new index.json): the same
    index = json.loads((run_dir / "hidden" / "index.json").read_text())
    (run_dir / "hidden" / "index.json").write_text(json.dumps({**index, "target_model": "re-extracted"}))
    error_line(run_stage("04_train.py", cfg, "--set", "vocab.draft_vocab_size=64"), "hidden/index.json changed", "--overwrite")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_run) -> Path:
    """A finished 8-step run with checkpoints at 4, 6 and 8 (keep 3)."""
    root = tmp_path_factory.mktemp("trained")
    cfg = clone_run(tiny_run, root, max_steps=8, checkpoint_every=2, keep_checkpoints=3, eval_every=4, log_every=1)
    res = run_stage("04_train.py", cfg)
    assert res.returncode == 0, res.stderr[-2000:]
    return root


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.pt", "state.json"])
def test_04_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, trained, damaged):
    """Issue 10, case 2: a truncated file of the latest checkpoint crashed 04 with a traceback."""
    shutil.copytree(trained, tmp_path / "t")
    run_dir = tmp_path / "t" / "run"
    cfg = tmp_path / "t" / "run.yaml"
    cfg.write_text(cfg.read_text().replace(str(trained), str(tmp_path / "t")))
    final = (run_dir / "train" / "final" / "model.safetensors").read_bytes()
    metrics = read_metrics(run_dir)
    shutil.rmtree(run_dir / "train" / "final")  # as if killed between the last checkpoint and the export...
    latest = run_dir / "train" / "checkpoints" / "step-8" / damaged
    with open(latest, "r+b") as f:  # ...and the disk lost the end of a file
        f.truncate(latest.stat().st_size // 2)
    res = run_stage("04_train.py", cfg)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"checkpoint {latest.parent} is damaged ({damaged}" in res.stderr
    assert "resuming from" in res.stdout and "step-6" in res.stdout
    # the redone steps give the same draft and the same metrics, each line once
    assert (run_dir / "train" / "final" / "model.safetensors").read_bytes() == final
    assert [(r["type"], r["step"], r.get("loss")) for r in read_metrics(run_dir)] == \
        [(r["type"], r["step"], r.get("loss")) for r in metrics]


def test_04_verifies_the_shards_it_loads(tmp_path, tiny_run):
    """Issue 10, case 7: 8 zeroed bytes in a shard trained silently."""
    cfg = clone_run(tiny_run, tmp_path, max_steps=2)
    shard = sorted((tmp_path / "run" / "hidden").glob("shard-*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(b"\0" * 8)
    error_line(run_stage("04_train.py", cfg), f"hidden shard {shard} does not match the sha256", "rerun 02_extract_hidden.py")
    assert not (tmp_path / "run" / "train" / "final").exists()


# ============================================================================ 01b: failures


@pytest.fixture
def gen(run_dir, write_config, chat_tokenizer_dir):
    """(make a config for a server, run 01b on it) with the test API key."""
    from tests.test_generate import SECRET, config

    def make(server, **generate):
        return config(write_config, server, chat_tokenizer_dir, **generate)

    def run(cfg):
        return run_stage("01b_generate_synthetic.py", cfg, env=train_env() | {"EAGLE3_TEST_API_KEY": SECRET}, timeout=300)

    return make, run


@pytest.mark.parametrize("status", [401, 403])
def test_01b_auth_error_stops_the_run_at_once(run_dir, gen, status):
    """Issue 10, case 4: a 401 on chat was recorded once per prompt (50k rows at scale) and exited 0."""
    from tests.test_generate import make_prompts

    make, run = gen
    make_prompts(run_dir, 40)
    with FaultServer(Faults(chat_status=status)) as server:
        res = run(make(server, concurrency=4))
        assert server.stats.chat_requests <= 4  # the requests already in flight, no more
    error_line(res, f"refused a chat request with {status}", "EAGLE3_TEST_API_KEY", "recorded no prompt as failed")
    assert not (run_dir / "data" / "failed.jsonl").read_text().strip()
    assert not (run_dir / "data" / "train.jsonl").exists()
    report = json.loads((run_dir / "data" / "generate_report.json").read_text())
    assert report["complete"] is False and str(status) in report["error"]


@pytest.mark.parametrize("faults, cause", [
    (Faults(p_503=1.0), "503 x12"),
    (Faults(p_non_json=1.0), "MalformedResponse x12"),
    (Faults(p_empty_choices=1.0), "MalformedResponse x12"),
    (Faults(p_hang=1.0, hang_s=5.0), "APITimeoutError x12"),
], ids=["5xx", "non-json", "empty-choices", "timeouts"])
def test_01b_every_request_failing_is_an_error(run_dir, gen, faults, cause):
    """Issue 10, case 4: every request failing exited 0 and wrote an empty train.jsonl."""
    from tests.test_generate import make_prompts

    make, run = gen
    make_prompts(run_dir, 12)
    with FaultServer(faults) as server:
        res = run(make(server, max_retries=1, timeout_s=0.5, concurrency=12))
    line = error_line(res, "no prompt got an answer: all 12 of 12 failed every retry", "failed.jsonl")
    assert cause in line
    assert not (run_dir / "data" / "train.jsonl").exists()
    assert json.loads((run_dir / "data" / "generate_report.json").read_text())["error"] == line[len("error: "):]


@pytest.mark.slow  # ~40 s: two 01b subprocesses with retries
def test_01b_failure_share_over_the_limit_is_an_error(run_dir, gen):
    from tests.test_generate import make_prompts

    make, run = gen
    make_prompts(run_dir, 20, always_fail=(3, 7, 11))  # 15% fail every retry
    with FaultServer(Faults()) as server:
        error_line(run(make(server, max_retries=0, max_failure_fraction=0.1)),
                   "3 of 20 prompts (15%) failed every retry, more than generate.max_failure_fraction=0.1 (503 x3)")
        assert not (run_dir / "data" / "train.jsonl").exists()
        res = run(make(server, max_retries=0, max_failure_fraction=0.2))  # within the limit: samples, a partial stage
        assert res.returncode == 0, res.stderr[-2000:]
    assert len((run_dir / "data" / "failed.jsonl").read_text().splitlines()) == 3
    assert read_manifest(Layout(run_dir), "01b_generate_synthetic")["state"] == "running"


@pytest.mark.slow  # ~40 s: five 01b subprocesses
def test_01b_never_mixes_two_generations(run_dir, gen):
    """Changed sampling settings with finished rows: an error, not a data set of two generations;
    changed tokenization: retokenized; new prompts: generated."""
    from tests.test_generate import make_prompts

    make, run = gen
    make_prompts(run_dir, 6)
    with FaultServer(Faults()) as server:
        assert run(make(server)).returncode == 0
        error_line(run(make(server, temperature=0.2)), '"temperature": 0.6', '"temperature": 0.2', "--overwrite")
        make_prompts(run_dir, 8)
        res = run(make(server))
        assert res.returncode == 0 and "2 generated" in res.stdout, res.stdout
    assert "already complete" in run(make(server)).stdout  # the server is gone: nothing left to ask it


def test_01b_skips_prompts_stage_01_would_drop(run_dir, gen):
    """Issue 10, case 8: a message without "role" was a KeyError traceback; empty prompts were sent."""
    make, run = gen
    rows = [
        {"id": "ok", "messages": [{"role": "user", "content": "What is 2 plus 2?"}]},
        {"id": "no-role", "messages": [{"content": "hello"}]},
        {"id": "empty", "messages": [{"role": "user", "content": "   "}]},
        {"id": "system-only", "messages": [{"role": "system", "content": "be brief"}]},
        {"id": "bad-role", "messages": [{"role": "wizard", "content": "hi"}]},
    ]
    (run_dir / "data").mkdir(parents=True)
    (run_dir / "data" / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with FaultServer(Faults()) as server:
        res = run(make(server))
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert server.stats.chat_requests == 1 and list(server.stats.requests_by_prompt) == ["What is 2 plus 2?"]
    report = json.loads((run_dir / "data" / "generate_report.json").read_text())
    assert report["skipped_prompts"] == {"bad_fields": 2, "empty": 1, "no_user_turn": 1} and report["num_done"] == 1


# ============================================================================ config


@pytest.mark.parametrize("override, message", [
    ("train.log_every=0", "config key 'train.log_every' must be >= 1, got 0"),
    ("train.checkpoint_every=0", "config key 'train.checkpoint_every' must be >= 1, got 0"),
    ("train.betas=[0.9,2.0]", "config key 'train.betas[1]' must be >= 0 and < 1, got 2.0"),
    ("generate.backoff_initial_s=-1", "config key 'generate.backoff_initial_s' must be >= 0, got -1.0"),
    ("generate.temperature=-3", "config key 'generate.temperature' must be >= 0, got -3.0"),
    ("generate.top_p=7", "config key 'generate.top_p' must be > 0 and <= 1, got 7.0"),
    ("train.warmup_ratio=5", "config key 'train.warmup_ratio' must be >= 0 and <= 1, got 5.0"),
    ("train.grad_clip=-1", "config key 'train.grad_clip' must be >= 0, got -1.0"),
    ("train.epochs=0", "config key 'train.epochs' must be >= 1, got 0"),
    ("train.eval_every=-1", "config key 'train.eval_every' must be >= 0, got -1"),
    ("extract.min_free_disk_gb=-100", "config key 'extract.min_free_disk_gb' must be >= 0, got -100.0"),
    ("train.num_workers=-2", "config key 'train.num_workers' must be >= 0, got -2"),
    ("server.port=99999", "config key 'server.port' must be >= 0 and <= 65535, got 99999"),
    ("evaluate.num_prompts=0", "config key 'evaluate.num_prompts' must be >= 1, got 0"),
    ("generate.max_failure_fraction=1.5", "config key 'generate.max_failure_fraction' must be >= 0 and <= 1, got 1.5"),
    ("train.precision=bf17", "config key 'train.precision' must be one of auto, bf16, fp32, got 'bf17'; did you mean 'bf16'?"),
    ("train.learning_rate=1e-4", "unknown config key 'train.learning_rate'; did you mean 'train.lr'?"),
])
def test_config_values_are_checked_at_load(tmp_path, override, message):
    """Issue 10, cases 5 and 8: values that gave tracebacks, or were accepted, are one line at load."""
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run")})
    line = error_line(run_stage("03_build_vocab_map.py", cfg, "--set", override, timeout=120))
    assert line == f"error: {message}"
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_config_duplicate_keys_are_an_error(tmp_path):
    """Issue 10, case 6: YAML keeps the last of two equal keys silently."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("run_dir: out\ntrain:\n  lr: 1.0e-4\n  max_steps: 10\n  lr: 3.0e-4\n")
    error_line(run_stage("04_train.py", cfg, timeout=120),
               f"config key 'lr' appears twice in one section of {cfg} (lines 3 and 5); keep one of them")
