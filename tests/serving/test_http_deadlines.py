"""Every HTTP call has a total deadline (common/serving/http.py), not only a per-read
timeout. Against a server that sends its answers one byte a second (tests/fault_server.py,
Faults.drip_s): the vLLM server's readiness polls end at server.startup_timeout_s, a /metrics scrape
at its timeout, and 05's calls (GET /v1/models, the chat requests) at generate.timeout_s per attempt,
each as a one-line PipelineError. 01b's calls: tests/data/test_generate_deadlines.py."""

from __future__ import annotations

import time

import pytest

from common.core.config import config_from_dict
from common.core.errors import PipelineError
from common.serving.http import http_get, with_deadlines
from common.serving.vllm_server import VllmServer, scrape_metrics
from tests.fault_server import METRICS_KV_TOKENS, Faults, FaultServer
from tests.serving.test_vllm_server import fake_python

ONE_BYTE_A_SECOND = 1.0
TIMEOUT_S = 2.0


def dripping(*paths: str, **kwargs) -> FaultServer:
    return FaultServer(Faults(drip_s=ONE_BYTE_A_SECOND, drip_paths=paths), **kwargs)


def test_a_get_ends_at_its_deadline():
    with dripping("/health", "/metrics") as server:
        root = f"http://127.0.0.1:{server.port}"
        for path in ("/health", "/metrics"):
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="no complete answer within 2s"):
                http_get(root + path, timeout=TIMEOUT_S)
            assert TIMEOUT_S - 0.1 < time.monotonic() - t0 < TIMEOUT_S + 1
        t0 = time.monotonic()
        with pytest.raises(PipelineError, match=f"cannot read metrics from {root}/metrics .*no complete answer within 2s"):
            scrape_metrics(server.base_url, timeout=TIMEOUT_S)
        assert time.monotonic() - t0 < TIMEOUT_S + 5
        code, body = http_get(root + "/v1/models", timeout=TIMEOUT_S)  # a route that does not drip: answered
        assert code == 200 and '"fault-model"' in body
    with FaultServer(Faults()) as server:
        labels = scrape_metrics(server.base_url, timeout=TIMEOUT_S)["vllm:cache_config_info"][0][0]
        assert int(labels["num_gpu_blocks"]) * int(labels["block_size"]) == METRICS_KV_TOKENS


@pytest.mark.parametrize("path", ["/health", "/v1/models"])
def test_readiness_polls_end_at_the_startup_deadline(tmp_path, path):
    """A server answering /health or /v1/models a byte a second held wait_ready's polls past
    server.startup_timeout_s; the start now fails at it, and the process group is stopped."""
    python = fake_python(tmp_path, "sleep 300")  # alive, never listens itself
    with dripping(path, model="/m") as other:
        server = VllmServer("/m", python=python, log_path=tmp_path / "server.log", startup_timeout_s=3, stop_grace_s=1.0)
        server.port = other.port  # the dripping server answers where ours would
        t0 = time.monotonic()
        with pytest.raises(PipelineError, match=r"vLLM server for /m not ready after 3s \(server.startup_timeout_s"):
            server.start()
        assert time.monotonic() - t0 < 3 + 5 and server.process is None
        assert other.stats.faults["drip"] >= 1


# ----------------------------------------------------------------------------- 05's calls


EVAL_TIMEOUT_S = 1.0  # three attempts per call: keep each short


def eval_config(base_url: str):
    return config_from_dict({"generate": {"base_url": base_url, "timeout_s": EVAL_TIMEOUT_S},
                             "evaluate": {"concurrency": 2, "max_tokens": 8}})


PROMPTS = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]} for i in range(2)]


def test_05_requests_end_at_their_deadline():
    """05's client (openai-python's 2 retries) gives each attempt generate.timeout_s in all, then stops
    with one line: the warm-up request, the timed requests, and the model list it asks first."""
    from common.evaluate.serve import run_prompts, warm_up

    attempts = 3  # the first try and openai-python's 2 retries (0.5 s and 1 s apart, jittered down)
    bound = attempts * EVAL_TIMEOUT_S + 1.5 + 5
    with dripping("/v1/chat/completions") as server:
        cfg = eval_config(server.base_url)
        t0 = time.monotonic()
        with pytest.raises(PipelineError, match=r"failed its warm-up request \(APITimeoutError"):
            warm_up(cfg, server.base_url, PROMPTS)
        assert time.monotonic() - t0 < bound and server.stats.chat_requests == attempts
        t0 = time.monotonic()
        with pytest.raises(PipelineError, match=r"request for prompt q[01] to .* failed \(APITimeoutError"):
            run_prompts(cfg, server.base_url, PROMPTS)
        assert time.monotonic() - t0 < bound
    with dripping("/v1/models") as server:
        t0 = time.monotonic()
        with pytest.raises(PipelineError, match=r"did not list its models \(GET /v1/models: APITimeoutError"):
            run_prompts(eval_config(server.base_url), server.base_url, PROMPTS)
        assert time.monotonic() - t0 < bound and server.stats.chat_requests == 0


@pytest.mark.parametrize("package", ["httpx2", "httpx"])
def test_either_httpx_generation_is_held_to_the_deadline(package):
    """openai-python 3 builds on httpx2, older releases on httpx (requirements allow both): each client is
    wrapped with its own httpcore's errors, sync and async."""
    import asyncio
    import importlib

    httpx_mod = importlib.import_module(package)  # both are installed with the pinned vLLM's dependencies
    with dripping("/health") as server:
        url = f"http://127.0.0.1:{server.port}/health"
        t0 = time.monotonic()
        with pytest.raises(httpx_mod.TimeoutException):
            with with_deadlines(httpx_mod.Client(timeout=TIMEOUT_S)) as client:
                client.get(url)

        async def get() -> None:
            async with with_deadlines(httpx_mod.AsyncClient(timeout=TIMEOUT_S)) as client:
                await client.get(url)

        with pytest.raises(httpx_mod.TimeoutException):
            asyncio.run(get())
        assert time.monotonic() - t0 < 2 * TIMEOUT_S + 2
