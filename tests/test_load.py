"""01b under load: the real vLLM CPU server, 512 requests in flight, far more than it can run at once.

What must hold: every prompt answered exactly once, nothing failed, no retries (so no timeout
caused by the client itself, e.g. a connection-pool wait counted against the request timeout),
and the client actually keeps the configured 512 requests at the server while it has work:
measured on the server side from vLLM's /metrics (vllm:num_requests_running + _waiting, sampled
every 0.2 s during the run), and on the client side from the generate report (max / average in
flight). The time series is printed (run with -s to see it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, stage_env

from common.io import iter_jsonl
from common.vllm_server import scrape_metrics

pytestmark = pytest.mark.vllm

CONCURRENCY = 512
NUM_PROMPTS = 768
TOPICS = ["the moon", "prime numbers", "rivers", "Python lists", "the French capital", "gravity", "a haiku", "sorting"]


def gauge(samples: dict, name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


class MetricsSampler(threading.Thread):
    """Samples (t, running, waiting, finished requests) from the server's /metrics."""

    def __init__(self, url: str, period: float = 0.2):
        super().__init__(daemon=True)
        self.url, self.period = url, period
        self.rows: list[tuple[float, float, float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.is_set():
            try:
                m = scrape_metrics(self.url, timeout=5.0)
                self.rows.append((time.monotonic() - t0, gauge(m, "vllm:num_requests_running"),
                                  gauge(m, "vllm:num_requests_waiting"), gauge(m, "vllm:request_success_total")))
            except Exception:  # noqa: BLE001 - a missed sample is not a failure
                pass
            self.stop.wait(self.period)


def test_01b_keeps_512_in_flight_on_real_vllm_and_loses_nothing(vllm_server, tiny_target_dir, run_dir, write_config):
    prompts = [{"id": f"load-{i:04d}", "messages": [{"role": "user", "content": f"Tell me one fact about {TOPICS[i % 8]} ({i})."}],
                "split": "eval" if i % 10 == 0 else "train"} for i in range(NUM_PROMPTS)]
    data = run_dir / "data"
    data.mkdir(parents=True)
    (data / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    cfg = write_config({
        "target": {"model": str(tiny_target_dir)},
        "generate": {"base_url": vllm_server.base_url, "concurrency": CONCURRENCY, "timeout_s": 600, "max_retries": 3,
                     "max_tokens": 8, "temperature": 0.0, "fsync_every": 64},
        "tokenize": {"max_seq_len": 512},
    })

    before = scrape_metrics(vllm_server.url)
    finished_before = gauge(before, "vllm:request_success_total")
    sampler = MetricsSampler(vllm_server.url)
    sampler.start()
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(REPO / "01b_generate_synthetic.py"), "--config", str(cfg)], cwd=REPO,
                              env=stage_env(), capture_output=True, text=True, timeout=600)
    finally:
        sampler.stop.set()
        sampler.join(10)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]

    # Nothing lost, nothing duplicated, nothing failed or retried.
    raw = list(iter_jsonl(data / "raw_responses.jsonl"))
    assert sorted(r["id"] for r in raw) == sorted(p["id"] for p in prompts)
    assert not (data / "failed.jsonl").exists() or list(iter_jsonl(data / "failed.jsonl")) == []
    report = json.loads((data / "generate_report.json").read_text())
    run = report["this_run"]
    assert report["num_done"] == NUM_PROMPTS and report["num_failed"] == 0 and report["complete"] is True
    assert run["retries"] == 0 and run["retry_reasons"] == {} and run["failure_reasons"] == {}, run
    assert run["requests"] == NUM_PROMPTS
    samples = [*iter_jsonl(data / "train.jsonl"), *iter_jsonl(data / "eval.jsonl")]
    assert len(samples) + sum(report["tokenize"]["skipped"].values()) == NUM_PROMPTS

    # In flight, client side: the configured concurrency was reached.
    assert run["max_in_flight"] == CONCURRENCY

    # In flight, server side, over time. "Sustained" = while the client still had prompts to send
    # (fewer than NUM_PROMPTS - CONCURRENCY finished), after the first wave arrived.
    rows = [(t, run_, wait, fin - finished_before) for t, run_, wait, fin in sampler.rows]
    print(f"\n01b load: {NUM_PROMPTS} prompts, concurrency {CONCURRENCY}, {wall:.1f}s wall; client: max in flight "
          f"{run['max_in_flight']}, avg {run['avg_in_flight']}, {run['requests_per_s']} req/s, "
          f"{run['completion_tokens_per_s']} tok/s")
    print("   t(s)  running  waiting  in_flight  finished")
    for t, running, waiting, fin in rows[:: max(1, len(rows) // 40)]:
        print(f"  {t:5.1f}  {running:7.0f}  {waiting:7.0f}  {running + waiting:9.0f}  {fin:8.0f}")
    arrived = next(i for i, r in enumerate(rows) if r[1] + r[2] >= 0.9 * CONCURRENCY)
    sustained = [r[1] + r[2] for r in rows[arrived:] if r[3] < NUM_PROMPTS - CONCURRENCY]
    assert len(sustained) >= 5, f"too few samples in the sustained phase ({len(sustained)}); raise NUM_PROMPTS"
    mean = sum(sustained) / len(sustained)
    print(f"  sustained phase: {len(sustained)} samples, server-side in flight mean {mean:.1f} "
          f"({mean / CONCURRENCY:.1%} of {CONCURRENCY}), min {min(sustained):.0f}, max {max(sustained):.0f}")
    assert max(r[1] + r[2] for r in rows) >= CONCURRENCY * 0.99
    assert mean >= 0.95 * CONCURRENCY, f"the client kept only {mean:.0f} of {CONCURRENCY} requests in flight"
