"""Every HTTP call has a total deadline (common/serving/http.py), not only a per-read
timeout. Against a server that sends its answers one byte a second (tests/fault_server.py,
Faults.drip_s): the vLLM server's readiness polls end at server.startup_timeout_s, a /metrics scrape
at its timeout, and 05's calls (GET /v1/models, the chat requests) at generate.timeout_s per attempt,
each as a one-line PipelineError. 01b's calls: tests/data/test_generate_deadlines.py.

Where a call ends is measured without timing it (the machine's load would decide a wall-clock window):
against the real server, the call fails with a timeout and the server never finished a dripped answer
(stats.faults["drip_done"] == 0: no call waited for the peer); against a dripping peer in virtual time
(with_deadlines' clock), the call ends exactly at its deadline, neither before nor after."""

from __future__ import annotations

import asyncio
import importlib
import time

import pytest

from common.core.config import config_from_dict
from common.core.errors import PipelineError
from common.serving.http import _PAIRS, http_get, with_deadlines
from common.serving.vllm_server import VllmServer, scrape_metrics
from tests.fault_server import METRICS_KV_TOKENS, Faults, FaultServer
from tests.serving.test_vllm_server import fake_python

ONE_BYTE_A_SECOND = 1.0  # every dripped answer is tens of bytes or more: without a deadline a call takes a minute or more
TIMEOUT_S = 2.0


def dripping(*paths: str, **kwargs) -> FaultServer:
    return FaultServer(Faults(drip_s=ONE_BYTE_A_SECOND, drip_paths=paths), **kwargs)


def no_dripped_answer_finished(server: FaultServer) -> bool:
    """Every call ended before its dripped answer did: by its own deadline, not by the peer finishing."""
    return server.stats.faults["drip"] >= 1 and server.stats.faults["drip_done"] == 0


def test_a_get_ends_at_its_deadline():
    with dripping("/health", "/metrics") as server:
        root = f"http://127.0.0.1:{server.port}"
        for path in ("/health", "/metrics"):
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="no complete answer within 2s"):
                http_get(root + path, timeout=TIMEOUT_S)
            assert time.monotonic() - t0 > TIMEOUT_S - 0.1  # not before its deadline (a loaded machine only adds)
        with pytest.raises(PipelineError, match=f"cannot read metrics from {root}/metrics .*no complete answer within 2s"):
            scrape_metrics(server.base_url, timeout=TIMEOUT_S)
        assert no_dripped_answer_finished(server) and server.stats.faults["drip"] == 3
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
        with pytest.raises(PipelineError, match=r"vLLM server for /m not ready after 3s \(server.startup_timeout_s"):
            server.start()
        assert server.process is None
        assert no_dripped_answer_finished(other)  # each poll was cut at the deadline, none waited for the answer


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
    with dripping("/v1/chat/completions") as server:
        cfg = eval_config(server.base_url)
        with pytest.raises(PipelineError, match=r"failed its warm-up request \(APITimeoutError"):
            warm_up(cfg, server.base_url, PROMPTS)
        assert server.stats.chat_requests == attempts and no_dripped_answer_finished(server)
        with pytest.raises(PipelineError, match=r"request for prompt q[01] to .* failed \(APITimeoutError"):
            run_prompts(cfg, server.base_url, PROMPTS)
        assert no_dripped_answer_finished(server)
    with dripping("/v1/models") as server:
        with pytest.raises(PipelineError, match=r"did not list its models \(GET /v1/models: APITimeoutError"):
            run_prompts(eval_config(server.base_url), server.base_url, PROMPTS)
        assert server.stats.chat_requests == 0 and no_dripped_answer_finished(server)


@pytest.mark.parametrize("package", ["httpx2", "httpx"])
def test_either_httpx_generation_is_held_to_the_deadline(package):
    """openai-python 3 builds on httpx2, older releases on httpx (requirements allow both): each client is
    wrapped with its own httpcore's errors, sync and async."""
    httpx_mod = importlib.import_module(package)  # both are installed with the pinned vLLM's dependencies
    with dripping("/health") as server:
        url = f"http://127.0.0.1:{server.port}/health"
        with pytest.raises(httpx_mod.TimeoutException):
            with with_deadlines(httpx_mod.Client(timeout=TIMEOUT_S)) as client:
                client.get(url)

        async def get() -> None:
            async with with_deadlines(httpx_mod.AsyncClient(timeout=TIMEOUT_S)) as client:
                await client.get(url)

        with pytest.raises(httpx_mod.TimeoutException):
            asyncio.run(get())
        assert no_dripped_answer_finished(server) and server.stats.faults["drip"] == 2


# ----------------------------------------------------------------------------- in virtual time


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class DrippingPeer:
    """httpcore's network backend and its one connection, to a server that sends `answer` one byte per `seconds`
    of `clock` (virtual: a read advances it by what the wait would take). A read given less time than the next
    byte needs uses it up and raises ReadTimeout, as a socket does. Sync or async (`is_async`)."""

    def __init__(self, clock: VirtualClock, core, answer: bytes, seconds: float, is_async: bool):
        self.clock, self.core, self.answer, self.seconds, self.sent = clock, core, answer, seconds, 0
        if is_async:
            async def connect_tcp(*args, **kwargs):
                return self

            async def read(max_bytes, timeout=None):
                return self._read(timeout)

            async def write(buffer, timeout=None):
                pass

            async def aclose():
                pass

            self.connect_tcp, self.read, self.write, self.aclose = connect_tcp, read, write, aclose
        else:
            self.connect_tcp, self.read = (lambda *args, **kwargs: self), lambda max_bytes, timeout=None: self._read(timeout)
            self.write, self.close = (lambda buffer, timeout=None: None), (lambda: None)

    def _read(self, timeout):
        if self.sent == len(self.answer):
            return b""
        if timeout is not None and timeout < self.seconds:
            self.clock.now += timeout
            raise self.core.ReadTimeout("timed out")
        self.clock.now += self.seconds
        self.sent += 1
        return self.answer[self.sent - 1:self.sent]

    def get_extra_info(self, info):
        return None


@pytest.mark.parametrize("package", ["httpx2", "httpx"])
@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("seconds", [ONE_BYTE_A_SECOND, 0.75])
def test_a_call_ends_exactly_at_its_deadline_in_virtual_time(package, is_async, seconds):
    """Against a peer that drips its answer (each byte well inside the per-read timeout, the whole far beyond it),
    a call with its deadline on a virtual clock fails with a timeout exactly when the clock reaches the deadline:
    with a byte due at the deadline (1 s a byte), or between two bytes (0.75 s: the last read waits what is left).
    Without the deadline it would read all 40 bytes, one every `seconds`, and succeed."""
    httpx_mod, core = importlib.import_module(package), importlib.import_module(_PAIRS[package])
    clock = VirtualClock()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    peer = DrippingPeer(clock, core, answer, seconds, is_async)
    client = (httpx_mod.AsyncClient if is_async else httpx_mod.Client)(timeout=TIMEOUT_S)
    client._transport._pool._network_backend = peer  # what with_deadlines wraps: the pool's network backend
    client = with_deadlines(client, clock=clock)

    async def get_async():
        async with client:
            await client.get("http://127.0.0.1:1/health")

    with pytest.raises(httpx_mod.ReadTimeout):
        if is_async:
            asyncio.run(get_async())
        else:
            with client:
                client.get("http://127.0.0.1:1/health")
    assert clock.now == TIMEOUT_S  # the call took its timeout in all: not a moment less, not one more
    assert peer.sent == int(TIMEOUT_S // seconds) < len(answer)  # the bytes that came by then; the rest never waited for
