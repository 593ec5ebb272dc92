"""End to end: run_pipeline.py on the embedded tiny default, with a real vLLM (CPU build).

The slow tests run every stage (tiny target -> 01 -> vLLM -> 01b -> 02 -> 03 -> 04 -> 05) in a
temporary run_dir and check what vLLM measured: acceptance length with 3 speculative tokens
>= 1.8 (a random draft gets 1.0), greedy outputs identical with and without the draft on the
held-out and the other-kind prompts, and the replay's prediction against vLLM's counters.
Each takes a few minutes on 2 CPU cores.

The fast tests check run_pipeline.py's own behaviour: a clear error for a missing target, a
failing stage named with its log, and Ctrl-C stopping the stage's whole process group.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.fault_server import FaultServer
from tests.helpers import REPO, error_line

TINY_CONFIG = REPO / "configs" / "tiny.yaml"

# The e2e tests run configs/tiny.yaml exactly as the demo does (its training is sized for 2
# cores: measured vLLM acceptance length 3.45 for llama, 3.22 for qwen3; README).


def run_pipeline(run: Path, *args: str, timeout: float = 1500, log_name: str = "pipeline",
                 config: Path = TINY_CONFIG) -> tuple[int, str]:
    log = run.parent / f"{run.name}-{log_name}.log"
    cmd = [sys.executable, str(REPO / "run_pipeline.py"), "--config", str(config),
           "--set", f"run_dir={run}", "--set", f"target.model={run / 'target'}", *args]
    with open(log, "wb") as out:
        proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    return proc.returncode, log.read_text(encoding="utf-8", errors="replace")


def check_measured(run: Path, out: str) -> dict:
    report = json.loads((run / "eval" / "report.json").read_text())
    print(f"acceptance length {report['acceptance_length']:.3f}, per-position {report['per_position_acceptance']}, "
          f"offline {report['offline']}, throughput {report['throughput']}, outputs {report['outputs']['identical']}/"
          f"{report['outputs']['compared']}")
    assert report["num_speculative_tokens"] == 3
    assert report["counters"]["num_drafts"] > 0
    assert report["acceptance_length"] >= 1.8, report
    # Greedy: speculative decoding must not change a single output.
    assert report["outputs"]["greedy"] is True
    assert report["outputs"]["identical"] == report["outputs"]["compared"] == report["num_prompts"], report["outputs"]
    assert (run / "eval" / "report.png").stat().st_size > 5_000
    assert "measured in vLLM: acceptance length" in out
    # The replay of vLLM's rounds (common.model.acceptance) over the very outputs vLLM served reproduces its
    # counters (measured: -0.1% and 938 rounds on both sides). 04's prediction replays the eval split's
    # sampled (temperature 0.7) responses instead of the greedy ones, on 31 prompts: same prompts,
    # other text, so it is also off by the sampling noise of ~1000 rounds (measured +0.9% to +2.1%).
    served = report["replay_on_served"]
    assert served["num_sequences"] == 31 and abs(served["relative_error"]) <= 0.02, served
    assert report["offline"]["prediction"] == "replay"
    assert abs(report["offline_prediction_error"]) <= 0.05, report["offline"]
    # the other-kind prompts (data/other_prompts.jsonl) are measured on the same server, losslessly
    other = report["other_prompts"]
    assert other["num_prompts"] == 32 and other["counters"]["num_drafts"] > 0 and other["acceptance_length"] > 1.0
    assert other["outputs"]["identical"] == other["outputs"]["compared"] == 32, other["outputs"]
    # the long-context set (built from the held-out conversations): 4 prompts per bucket, each within its bucket,
    # measured per bucket, losslessly; and 04's prediction on exactly the prompts measured (first turn)
    long = report["prompt_sets"]["long_context"]
    assert {label: (b["num_prompts"], b["max_prompt_tokens"]) for label, b in long["buckets"].items()} == {
        "<=512 tokens": (4, 512), "<=896 tokens": (4, 896)}, long["buckets"]
    assert 448 <= long["buckets"]["<=512 tokens"]["prompt_tokens"][0] and long["buckets"]["<=896 tokens"]["prompt_tokens"][0] > 800
    assert all(b["acceptance_length"] > 1.0 for b in long["buckets"].values()), long["buckets"]
    assert long["outputs"]["identical"] == long["outputs"]["compared"] == 8, long["outputs"]
    mine = report["offline_on_measured_prompts"]
    assert mine["num_prompts"] + mine.get("not_in_04s_eval", {}).get("count", 0) == 31, mine
    assert abs(report["prediction_error"]["on_measured_prompts"]) <= 0.05, mine
    return report


CHAT_TEMPLATE_SET = ("--set", "evaluate.prompt_sets.chat_template={built: chat_template}")


def check_chat_template_set(run: Path) -> None:
    """The held-out prompts under built_sets.CHANGED_TEMPLATE: vLLM's prompt token ids are that template's rendering
    (not the target's own), the outputs are lossless and the draft is still accepted."""
    from transformers import AutoTokenizer

    from common.evaluate.built_sets import CHANGED_TEMPLATE

    part = json.loads((run / "eval" / "report.json").read_text())["prompt_sets"]["chat_template"]
    assert part["num_prompts"] == 31 and part["acceptance_length"] > 1.0, part
    assert part["outputs"]["identical"] == part["outputs"]["compared"] == 31, part["outputs"]
    tokenizer = AutoTokenizer.from_pretrained(run / "target")
    rows = [json.loads(line) for line in (run / "eval" / "outputs-chat_template.jsonl").read_text().splitlines()]
    assert len(rows) == 31
    for row in rows:
        text = tokenizer.apply_chat_template(row["messages"], chat_template=CHANGED_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
        assert text.endswith("### Assistant:\n") and "<|im_start|>" not in text
        assert row["with_draft"]["prompt_token_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"], row["id"]


@pytest.mark.slow
@pytest.mark.vllm
def test_pipeline_tiny_llama(tmp_path):
    run = tmp_path / "llama"
    # plus a built chat_template set: vLLM renders its requests' own template (both servers trust it)
    code, out = run_pipeline(run, "--tiny-target", "llama", *CHAT_TEMPLATE_SET)
    assert code == 0, out[-5000:]
    check_measured(run, out)
    check_chat_template_set(run)
    # Rerun: every stage finds its outputs complete, no server is started.
    t0 = time.monotonic()
    code, out = run_pipeline(run, "--tiny-target", "llama", *CHAT_TEMPLATE_SET, timeout=600, log_name="rerun")
    assert code == 0, out[-5000:]
    assert "starting a vLLM server" not in out
    table = out[out.index("pipeline complete"):]
    for stage in ("01_prepare_data", "01b_generate_synthetic", "02_extract_hidden", "03_build_vocab_map", "04_train", "05_evaluate"):
        assert re.search(rf"^{stage} .* already complete$", table, re.M), table
    print(f"rerun took {time.monotonic() - t0:.0f}s")
    runs = [json.loads(line) for line in (run / "logs" / "pipeline_runs.jsonl").read_text().splitlines()]
    assert [r["outcome"] for r in runs] == ["complete", "complete"]
    assert {s["stage"] for s in runs[0]["stages"]} >= {"target", "vllm server start", "05_baseline", "04_train", "05_evaluate"}


@pytest.mark.slow
@pytest.mark.vllm
def test_pipeline_tiny_qwen3_custom_vocab_and_aux_layers(tmp_path):
    run = tmp_path / "qwen3"
    sets = ["vocab.draft_vocab_size=512", "target.aux_layer_ids=[1,2,3]"]
    code, out = run_pipeline(run, "--tiny-target", "qwen3", *[a for s in sets for a in ("--set", s)])
    assert code == 0, out[-5000:]
    check_measured(run, out)
    draft_cfg = json.loads((run / "train" / "final" / "config.json").read_text())
    assert draft_cfg["draft_vocab_size"] == 512
    assert draft_cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert json.loads((run / "target" / "config.json").read_text())["model_type"] == "qwen3"


# The Kimi-shaped proxy (tiny DeepSeek-V3) end to end, 05 included: tests/pipeline/test_kimi_proxy_serves_mla_draft.py


@pytest.mark.slow
@pytest.mark.vllm
def test_sigterm_while_serving_stops_the_vllm_server(tmp_path):
    """SIGTERM (like Ctrl-C) once the generation server is up: exit 130, no vLLM process left."""
    run = tmp_path / "term"
    log = tmp_path / "term-pipeline.log"
    cmd = [sys.executable, str(REPO / "run_pipeline.py"), "--config", str(TINY_CONFIG), "--tiny-target", "llama",
           "--set", f"run_dir={run}", "--set", f"target.model={run / 'target'}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 900
            while not (m := re.search(r"vLLM ready at http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
                time.sleep(1)
            port = m.group(1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text(errors="replace")
    assert "interrupted during 01b_generate_synthetic" in text
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).count(f"--port {port}")]
    assert left == [], [_cmdline(p) for p in left]
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", int(port))) != 0  # nothing listens on the port any more


def _cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ----------------------------------------------------------------------------- fast: run_pipeline's own behaviour


def test_missing_target_without_tiny_flag_is_a_clear_error(tmp_path):
    run = tmp_path / "run"
    code, out = run_pipeline(run, timeout=120)
    assert code == 2
    assert "target.model" in out and "--tiny-target llama" in out


def test_failing_stage_is_named_with_its_log(tmp_path):
    run = tmp_path / "run"
    (run / "target").mkdir(parents=True)  # exists, so the pipeline gets to stage 01
    code, out = run_pipeline(run, "--set", f"data.source={tmp_path / 'no-such-data.jsonl'}", timeout=120)
    log = run / "logs" / "01_prepare_data.log"
    assert code == 2, out
    assert f"stage 01_prepare_data failed (exit code 2); log: {log}" in out
    assert "no-such-data.jsonl" in log.read_text()


def test_a_foreign_server_on_server_port_stops_the_pipeline(tmp_path):
    """Another HTTP server on server.port (one that answers like vLLM) is never taken
    for the server run_pipeline starts: exit 2, one error line, nothing sent to it, no generation."""
    run = tmp_path / "run"
    with FaultServer(model=str(run / "target")) as other:
        cmd = [sys.executable, str(REPO / "run_pipeline.py"), "--config", str(TINY_CONFIG), "--tiny-target", "llama",
               "--set", f"run_dir={run}", "--set", f"target.model={run / 'target'}", "--set", f"server.port={other.port}"]
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        line = error_line(res, f"port {other.port} on 127.0.0.1 is already in use by another process", "server.port: 0")
        assert other.stats.chat_requests == 0, line
    assert "run_pipeline: stopped in 01b_generate_synthetic" in res.stderr
    assert not (run / "data" / "raw_responses.jsonl").exists() and not (run / "data" / "train.jsonl").exists()


def test_checks_that_need_no_server_come_before_vllm_starts(tmp_path, tiny_target_dir):
    """Issue 33, cases 5-7: what 01b and 05 would refuse without a server (the chat template, prompts longer than
    server.max_model_len, the prompt sets) is said before run_pipeline spends ~100 s starting vLLM."""
    run = tmp_path / "run"
    code, out = run_pipeline(run, "--tiny-target", "llama", "--set", "server.max_model_len=32", timeout=300)
    assert code == 2, out[-3000:]  # every request would be a 400: asking for more tokens than the context holds
    assert out.splitlines()[-1] == ("error: generate.max_tokens=256 is more than server.max_model_len=32: vLLM refuses every "
                                    "such request (400); lower generate.max_tokens or raise server.max_model_len")
    sets = [a for s in ("server.max_model_len=8", "generate.max_tokens=8", "evaluate.max_tokens=8") for a in ("--set", s)]
    code, out = run_pipeline(run, "--tiny-target", "llama", *sets, timeout=300)
    assert code == 2, out[-3000:]
    assert "are too long for the server (server.max_model_len=8 tokens" in out.splitlines()[-1]
    assert "run_pipeline: stopped in 01b_generate_synthetic" in out and "starting a vLLM server" not in out
    assert not (run / "data" / "raw_responses.jsonl").exists()


def alive(pid: int) -> bool:
    """True if pid is a running process (a zombie awaiting its reaper counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_interrupt_stops_the_stage_process_group(tmp_path):
    """Ctrl-C during a stage: the stage and a grandchild it started are gone, exit 130."""
    pidfile = tmp_path / "grandchild.pid"
    stage = tmp_path / "stage.py"
    stage.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pidfile)!r}, "w").write(str(p.pid))
        print("stage running", flush=True)
        try:
            time.sleep(600)
        except KeyboardInterrupt:
            print("stage saved its work", flush=True)
            raise
    """))
    driver = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        import run_pipeline
        try:
            run_pipeline.run_logged("stage", [sys.executable, {str(stage)!r}], __import__("pathlib").Path({str(tmp_path / "stage.log")!r}))
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    log = tmp_path / "stage.log"
    while not (pidfile.exists() and pidfile.read_text() and log.exists() and "stage running" in log.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    grandchild = int(pidfile.read_text())
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in out
    assert "stage saved its work" in log.read_text()  # what the stage said while stopping is kept
    deadline = time.monotonic() + 10
    while alive(grandchild):
        assert time.monotonic() < deadline, f"grandchild {grandchild} survived the interrupt"
        time.sleep(0.1)
