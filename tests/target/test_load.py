"""01b under load: the real vLLM CPU server, 512 requests in flight, far more than it can run at once.

What must hold: every prompt answered exactly once, nothing failed, no timeout (the client never
gives up on a request the server is still working on), and the client really puts the configured
512 requests on the wire. Measured two ways, sampled over time and printed (run with -s):
  wire    a counting TCP proxy between 01b and vLLM: a request is in flight from its first byte
          to the first byte of its answer (httpx does not pipeline), i.e. what the client has
          outstanding;
  engine  vLLM's /metrics vllm:num_requests_running + vllm:num_requests_waiting, sampled every
          0.2 s: what reached the engine (requests still in vLLM's HTTP front end are not counted).
vLLM's gauges are updated only now and then (they often read 0 while hundreds of requests are
on the wire), so the engine series is printed for information and only used to check that vLLM
queued requests (the load exceeded what it runs at once).
On this 2-core machine the vLLM server and the client share the cores, so the wire-level average
in the sustained phase stays well below 512 (49-66% in the runs so far: the client does not get enough CPU
to turn answers into new requests as fast as the engine finishes them); the test guards against
gross regressions there (>= 25%, e.g. a connection limit below the concurrency) and against
stalls: while prompts are still queued, fewer than 1% of the requests in flight for 3 s or more
means the server idles because of the client alone. The >= 95%
target is measured where it means something, with the client on its own core:
bench/bench_generate.py (bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest

from common.core.io import iter_jsonl
from common.serving.vllm_server import scrape_metrics
from tests.helpers import REPO, stage_env

pytestmark = pytest.mark.vllm

CONCURRENCY = 512
NUM_PROMPTS = 3 * CONCURRENCY
MAX_TOKENS = 32


def gauge(samples: dict, name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


class MetricsSampler(threading.Thread):
    """Samples (t, running, waiting) from the server's /metrics."""

    def __init__(self, url: str, period: float = 0.2):
        super().__init__(daemon=True)
        self.url, self.period = url, period
        self.rows: list[tuple[float, float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                m = scrape_metrics(self.url, timeout=5.0)
                self.rows.append((time.monotonic(), gauge(m, "vllm:num_requests_running"), gauge(m, "vllm:num_requests_waiting")))
            except Exception:  # noqa: BLE001 - a missed sample is not a failure
                pass
            self.stop.wait(self.period)


class CountingProxy:
    """A TCP proxy in front of the server that records (time, requests in flight) on every change."""

    def __init__(self, host: str, port: int):
        self.upstream = (host, port)
        self.in_flight = 0
        self.events: list[tuple[float, int, int]] = []  # (t, +1 request sent / -1 answer started, level)
        self.port = 0
        self._ready = threading.Event()

    def _change(self, delta: int) -> None:
        self.in_flight += delta
        self.events.append((time.monotonic(), delta, self.in_flight))

    async def _pipe(self, reader, writer, conn: dict, from_client: bool) -> None:
        try:
            while data := await reader.read(65536):
                if from_client and not conn["busy"]:
                    conn["busy"] = True
                    self._change(+1)
                elif not from_client and conn["busy"]:
                    conn["busy"] = False
                    self._change(-1)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, client_reader, client_writer) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        conn = {"busy": False}
        await asyncio.gather(self._pipe(client_reader, up_writer, conn, True), self._pipe(up_reader, client_writer, conn, False))
        if conn["busy"]:  # closed while a request was outstanding
            self._change(-1)

    def start(self) -> "CountingProxy":
        def serve():
            self.loop = asyncio.new_event_loop()
            server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=4096))
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            self.loop.run_forever()

        threading.Thread(target=serve, daemon=True).start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def level_at(events: list[tuple[float, int, int]], t: float) -> int:
    level = 0
    for te, _, lv in events:
        if te > t:
            break
        level = lv
    return level


def time_average(events: list[tuple[float, int, int]], start: float, end: float) -> float:
    area, level, prev = 0.0, level_at(events, start), start
    for t, _, lv in events:
        if start < t <= end:
            area += level * (t - prev)
            level, prev = lv, t
    area += level * (end - prev)
    return area / max(end - start, 1e-9)


def longest_stall(events: list[tuple[float, int, int]], start: float, end: float, threshold: int) -> float:
    """Longest time in [start, end] with fewer than `threshold` requests in flight."""
    longest, since, level = 0.0, None, level_at(events, start)
    if level < threshold:
        since = start
    for t, _, lv in events:
        if not start < t <= end:
            continue
        if lv < threshold and since is None:
            since = t
        elif lv >= threshold and since is not None:
            longest, since = max(longest, t - since), None
    if since is not None:
        longest = max(longest, end - since)
    return longest


def test_01b_puts_512_requests_in_flight_on_real_vllm_and_loses_nothing(vllm_server, tiny_target_dir, run_dir, write_config):
    prompts = [{"id": f"load-{i:04d}", "messages": [{"role": "user", "content": f"Tell me one fact about topic number {i}."}],
                "split": "eval" if i % 10 == 0 else "train"} for i in range(NUM_PROMPTS)]
    data = run_dir / "data"
    data.mkdir(parents=True)
    (data / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    proxy = CountingProxy(vllm_server.host, vllm_server.port).start()
    cfg = write_config({
        "target": {"model": str(tiny_target_dir)},
        "generate": {"base_url": f"http://127.0.0.1:{proxy.port}/v1", "concurrency": CONCURRENCY, "timeout_s": 600,
                     "max_retries": 3, "max_tokens": MAX_TOKENS, "temperature": 0.0, "fsync_every": 64},
        "tokenize": {"max_seq_len": 512},
    })
    sampler = MetricsSampler(vllm_server.url)
    sampler.start()
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(REPO / "01b_generate_synthetic.py"), "--config", str(cfg)], cwd=REPO,
                              env=stage_env(), capture_output=True, text=True, timeout=600)
    finally:
        sampler.stop.set()
        sampler.join(10)
        proxy.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]

    # Nothing lost, nothing duplicated, nothing failed, no timeout.
    raw = list(iter_jsonl(data / "raw_responses.jsonl"))
    assert sorted(r["id"] for r in raw) == sorted(p["id"] for p in prompts)
    assert not (data / "failed.jsonl").exists() or list(iter_jsonl(data / "failed.jsonl")) == []
    report = json.loads((data / "generate_report.json").read_text())
    run = report["this_run"]
    assert report["num_done"] == NUM_PROMPTS and report["num_failed"] == 0 and report["complete"] is True
    assert run["failure_reasons"] == {} and "TimeoutError" not in run["retry_reasons"], run
    samples = [*iter_jsonl(data / "train.jsonl"), *iter_jsonl(data / "eval.jsonl")]
    assert len(samples) + sum(report["tokenize"]["skipped"].values()) == NUM_PROMPTS

    # The series, every 0.5 s from the first request on.
    events = proxy.events
    sent = [t for t, d, _ in events if d > 0]
    first, last = sent[0], events[-1][0]
    engine = sampler.rows
    print(f"\n01b load: {NUM_PROMPTS} prompts x {MAX_TOKENS} tokens, concurrency {CONCURRENCY}, {time.monotonic() - t0:.1f}s "
          f"wall; report: max in flight {run['max_in_flight']}, avg {run['avg_in_flight']}, {run['requests_per_s']} req/s, "
          f"{run['completion_tokens_per_s']} tok/s, retries {run['retry_reasons'] or 0}")
    print("   t(s)  wire  engine (running+waiting)")
    t = first
    while t <= last:
        eng = [r for r in engine if r[0] <= t]
        print(f"  {t - first:5.1f}  {level_at(events, t):4d}  {eng[-1][1] + eng[-1][2] if eng else 0:6.0f}")
        t += 0.5

    # 512 on the wire at once, more than the server runs at once (it queued some).
    assert run["max_in_flight"] == CONCURRENCY
    assert max(lv for _, _, lv in events) == CONCURRENCY
    assert max(r[2] for r in engine) > 0, "vLLM never had a request waiting: the load did not exceed what it serves"
    # Sustained phase: from the moment 512 were out to the last new request (the client had work queued).
    start = next(t for t, _, lv in events if lv >= CONCURRENCY)
    end = sent[NUM_PROMPTS - 1] if len(sent) >= NUM_PROMPTS else sent[-1]
    mean = time_average(events, start, end)
    stall = longest_stall(events, start, end, threshold=CONCURRENCY // 100)
    print(f"  sustained phase {end - start:.1f}s: on the wire {mean:.0f} of {CONCURRENCY} on average ({mean / CONCURRENCY:.0%}); "
          f"longest stretch with fewer than {CONCURRENCY // 100} in flight: {stall:.2f}s")
    # With prompts still queued, nothing on the wire means the server idles because of the client alone.
    # (Stalls of 1-2 s happen now and then on this 2-core machine: httpcore scans its whole 512-connection
    # pool, with a syscall per connection, for every request; sharding the pool removes them.)
    assert stall < 3.0, f"the client had prompts to send but (almost) no request in flight for {stall:.1f}s"
    assert mean >= 0.25 * CONCURRENCY, f"the client kept only {mean:.0f} of {CONCURRENCY} requests in flight"
