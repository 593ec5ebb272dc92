"""The vLLM server manager (common/serving/vllm_server.py): its command line and settings on CPU,
startup failures and timeouts with stand-in processes (a dying server, one that ignores SIGTERM),
the Prometheus metrics it reads, and the attention backend it asks for on CPU."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from common.core.errors import PipelineError
from common.serving.vllm_server import (VllmServer, cpu_attention_backend, cuda_available, metrics_delta, parse_prometheus,
                                        spec_decode_metrics)


METRICS_TEXT = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 200.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="tiny"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 600.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 150.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 90.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 45.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="2"} 15.0
vllm:generation_tokens_total{engine="0",model_name="ti\\"ny"} 1234.0
"""


def test_parse_prometheus_and_spec_decode_metrics():
    samples = parse_prometheus(METRICS_TEXT)
    assert "vllm:spec_decode_num_drafts_created" not in samples
    assert samples["vllm:generation_tokens_total"] == [({"engine": "0", "model_name": 'ti"ny'}, 1234.0)]
    m = spec_decode_metrics(samples)
    assert m["num_drafts"] == 200 and m["num_draft_tokens"] == 600 and m["num_accepted_tokens"] == 150
    assert m["num_accepted_tokens_per_pos"] == {0: 90.0, 1: 45.0, 2: 15.0}
    assert m["acceptance_length"] == 1.75 and m["draft_acceptance_rate"] == 0.25
    assert m["acceptance_rate_per_pos"] == {0: 0.45, 1: 0.225, 2: 0.075}
    empty = spec_decode_metrics({})
    assert empty["acceptance_length"] is None and empty["num_drafts"] == 0
    d = metrics_delta(m, spec_decode_metrics(parse_prometheus(METRICS_TEXT.replace("200.0", "100.0").replace(" 90.0", " 40.0"))))
    assert d["num_drafts"] == 100 and d["num_accepted_tokens_per_pos"][0] == 50.0


def test_server_command_on_cpu(tmp_path):
    server = VllmServer("/models/x", port=0, max_model_len=1024, reasoning_parser="deepseek_r1",
                        speculative_config={"method": "eagle3", "model": "/d", "num_speculative_tokens": 3},
                        extra_args=["--seed", "1"], log_path=tmp_path / "s.log")
    cmd = server.command()
    assert cmd[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/x"]
    assert server.port > 0 and cmd[cmd.index("--port") + 1] == str(server.port)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--max-model-len") + 1] == "1024"
    assert cmd[cmd.index("--reasoning-parser") + 1] == "deepseek_r1"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    assert cmd[-2:] == ["--seed", "1"]
    if not server.on_gpu:  # docs/design.md#vllm-on-cpu-machines
        assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.3" and "--enforce-eager" in cmd
        assert server._env()["VLLM_CPU_KVCACHE_SPACE"] == os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    assert server.base_url == f"http://127.0.0.1:{server.port}/v1"


def fake_python(tmp_path, body: str):
    """A stand-in for `python` that ignores `-m vllm...` and runs a shell body instead."""
    path = tmp_path / "fake-python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_server_dying_at_startup_raises_with_log_tail(tmp_path):
    python = fake_python(tmp_path, 'echo "loading model"; echo "ValueError: no config.json in /nope" >&2; exit 3')
    server = VllmServer("/nope", python=python, log_path=tmp_path / "server.log", startup_timeout_s=30)
    with pytest.raises(PipelineError, match="exited with code 3 during startup") as err:
        server.start()
    assert "ValueError: no config.json in /nope" in str(err.value) and str(tmp_path / "server.log") in str(err.value)
    assert server.process is None


def test_server_startup_timeout_kills_the_process_group(tmp_path):
    # The stand-in starts a child (like vLLM's engine core) and ignores SIGTERM: stop() must SIGKILL the group.
    python = fake_python(tmp_path, "trap '' TERM; sleep 300 & echo $! > " + str(tmp_path / "child.pid") + "; wait")
    server = VllmServer("/m", python=python, log_path=tmp_path / "server.log", startup_timeout_s=1.5, stop_grace_s=1.0)
    stopped = []  # the process stop() found: how it ended tells whether start() waited for it to end by itself
    stop = server.stop
    server.stop = lambda: (stopped.append(server.process), stop())
    with pytest.raises(PipelineError, match="not ready after 2s"):  # ended by the startup deadline
        server.start()
    # SIGKILLed, not waited for: the stand-in ignores SIGTERM and would exit on its own only after its child's 300 s
    # (an outcome, not a wall-clock bound, which the machine's load would decide)
    assert stopped[0].returncode == -signal.SIGKILL and server.process is None
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 30  # a SIGKILL lands at once, but a loaded machine may run the child late
    while process_state(child) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process_state(child) in (None, "Z")  # gone, or a zombie waiting for init to reap it


def process_state(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_cpu_attention_backend_for_a_float32_mla_target(tmp_path):
    """vLLM-CPU 0.32 picks AMX_MLA for MLA targets where AMX exists, and AMX_MLA cannot pack float32
    weights ("expect weight to be bfloat16, ..."): a float32 MLA target asks for CPU_MLA instead."""
    mla, dense, wrapped = tmp_path / "mla", tmp_path / "dense", tmp_path / "wrapped"
    for path, config in ((mla, {"model_type": "deepseek_v3", "kv_lora_rank": 32}),
                         (dense, {"model_type": "llama", "hidden_size": 128}),
                         (wrapped, {"model_type": "kimi_k25", "text_config": {"kv_lora_rank": 512}})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    expected = None if cuda_available() else "CPU_MLA"
    assert cpu_attention_backend(mla, "float32") == expected
    assert cpu_attention_backend(wrapped, "float32") == expected
    assert cpu_attention_backend(mla, "bfloat16") is None  # AMX_MLA (or CPU_MLA) runs bf16: vLLM chooses
    assert cpu_attention_backend(dense, "float32") is None
    assert cpu_attention_backend("moonshotai/Kimi-K2.5", "float32") is None  # a hub id: nothing to read


# ---- a foreign server is never taken for ours


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    from tests.fault_server import FaultServer

    with FaultServer(model="/m") as other:  # answers /health and /v1/models like vLLM would
        python = fake_python(tmp_path, "touch " + str(tmp_path / "started") + "; sleep 300")
        server = VllmServer("/m", port=other.port, python=python, log_path=tmp_path / "server.log", startup_timeout_s=30)
        with pytest.raises(PipelineError, match=f"port {other.port} on 127.0.0.1 is already in use by another process"):
            server.start()
    assert not (tmp_path / "started").exists() and server.process is None


def test_readiness_needs_our_process_listening_and_our_model(tmp_path):
    from tests.fault_server import FaultServer

    python = fake_python(tmp_path, "sleep 300")  # alive, never listens (a vLLM that lost the race for the port)
    with FaultServer(model="/m") as other:
        server = VllmServer("/m", python=python, log_path=tmp_path / "server.log", startup_timeout_s=30, stop_grace_s=1.0)
        server.port = other.port  # the other server took the port between our check and our bind
        with pytest.raises(PipelineError, match="is not the vLLM server this run started"):
            server.start()
        # refused at the first poll that found it ready (GET /health, GET /v1/models), not at startup_timeout_s:
        # counted, not timed
        assert other.stats.requests == 2 and server.process is None
    with FaultServer(model="another-model") as other:
        server = VllmServer("/m", python=python, log_path=tmp_path / "server.log", startup_timeout_s=2, stop_grace_s=1.0)
        server.port = other.port
        assert not server.is_ready()  # it answers, but serves another model


def test_cpu_thread_binding_splits_the_allowed_cores_per_rank(monkeypatch):
    """vLLM-CPU binds rank N to NUMA node N and refuses TP 2 on one node; 02 and the server split the cores."""
    import common.serving.vllm_server as vs
    from common.core.errors import PipelineError

    monkeypatch.setattr(vs, "cuda_available", lambda: False)
    monkeypatch.setattr(vs.os, "sched_getaffinity", lambda pid: {4, 5, 6, 7, 9})
    assert vs.cpu_thread_binding(1) is None
    assert vs.cpu_thread_binding(2) == "4,5|6,7"
    assert vs.cpu_thread_binding(5) == "4|5|6|7|9"
    with pytest.raises(PipelineError, match="tensor parallel 6 on vLLM-CPU needs a core per rank"):
        vs.cpu_thread_binding(6)
