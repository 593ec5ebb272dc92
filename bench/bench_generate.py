"""Benchmark 01b's client overhead against an instant local server, side by side with a bare client.

Server: a minimal HTTP/1.1 keep-alive server (asyncio streams) in a subprocess, so it has its own
core and its CPU is not charged to the client. Every chat completion gets the same canned body,
at once (latency 0) or after a seeded uniform [0.5, 1.5] x latency seconds (generation times
vary; a fixed latency would make every wave of answers arrive at the same instant). It
timestamps every arrival and answer, which gives the number of requests it holds over time.

Clients, for each concurrency (default 128 and 512), one after the other against the same server:
  bare   the reference: httpx2.AsyncClient, `concurrency` tasks POSTing the same JSON body and
         parsing the JSON answer, nothing else;
  01b    common.data.generate_requests.Generator, the stage's own loop (openai-python AsyncOpenAI with our
         connection limits, retry accounting, one JSONL append per sample, the progress bar).
Two measurements per client:
  instant   latency 0: requests/s, client CPU time per request (this process's user+sys CPU over
            the run / requests), and the ratio 01b / bare.
  in flight latency L (a stand-in for generation time, default 5 s): the time-average number of
            requests the server holds while the client still has prompts queued (from the
            concurrency-th arrival to the last arrival), as a fraction of the configured
            concurrency. Target: >= 95%, i.e. the client is never the bottleneck.
  L_min = concurrency x client CPU per request is the mean generation time at which one client
  core is fully busy with `concurrency` requests in flight (utilisation 1); the client keeps up
  when the real mean generation time is well above it (real generations take seconds to minutes).

    python bench/bench_generate.py                          # 128 and 512, latency 5 s
    python bench/bench_generate.py --concurrency 512 --latency 0.5 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ANSWER = {
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench-model",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "reasoning": "The user asks for a fact. " * 8, "content": "Here is a short answer. " * 8}}],
    "usage": {"prompt_tokens": 24, "completion_tokens": 96, "total_tokens": 120},
}


# ============================================================================ the server (subprocess)


class InstantServer:
    def __init__(self):
        self.latency = 0.0
        self.body = json.dumps(ANSWER).encode()
        self.reset()

    def reset(self) -> None:
        self.rng = random.Random(0)
        self.events: list[tuple[float, int]] = []  # (monotonic time, +1 arrival / -1 answer)
        self.cpu0 = self._cpu()

    @staticmethod
    def _cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode("latin-1").split(" ", 2)
                length = 0
                while True:
                    h = await reader.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                    if h[:15].lower() == b"content-length:":
                        length = int(h[15:])
                body = await reader.readexactly(length) if length else b""
                if path.startswith("/v1/chat/completions"):
                    self.events.append((time.monotonic(), 1))
                    if self.latency:  # generation times vary: uniform in [0.5, 1.5] x latency
                        await asyncio.sleep(self.latency * (0.5 + self.rng.random()))
                    self.events.append((time.monotonic(), -1))
                    out = self.body
                elif path.startswith("/control"):
                    req = json.loads(body)
                    self.latency = float(req.get("latency", self.latency))
                    self.reset()
                    out = b"{}"
                elif path.startswith("/stats"):
                    out = json.dumps({"events": self.events, "cpu_s": self._cpu() - self.cpu0}).encode()
                else:  # /v1/models and anything else
                    out = json.dumps({"object": "list", "data": [{"id": "bench-model", "object": "model"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(out)).encode() + b"\r\nConnection: keep-alive\r\n\r\n" + out)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def serve(self, port: int) -> None:
        server = await asyncio.start_server(self.handle, "127.0.0.1", port, backlog=4096)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()


def serve_main(port: int) -> None:
    asyncio.run(InstantServer().serve(port))


# ============================================================================ the clients


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(self.port)], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        self.url = f"http://127.0.0.1:{self.port}"

    def _post(self, path: str, obj: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(obj).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    def reset(self, latency: float) -> None:
        self._post("/control", {"latency": latency})

    def stats(self) -> dict:
        return self._post("/stats", {})

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def prompts(n: int) -> list[dict]:
    return [{"id": f"b{i:06d}", "split": "train",
             "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Tell me fact number {i}."}]}
            for i in range(n)]


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run_bare(base_url: str, items: list[dict], concurrency: int) -> None:
    import httpx2

    limits = httpx2.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx2.AsyncClient(limits=limits, timeout=600) as client:
        queue: asyncio.Queue = asyncio.Queue()
        for p in items:
            queue.put_nowait(p)

        async def worker():
            while not queue.empty():
                p = queue.get_nowait()
                resp = await client.post(base_url + "/chat/completions", json={
                    "model": "bench-model", "messages": p["messages"], "max_tokens": 256, "temperature": 0.6, "top_p": 0.95})
                resp.raise_for_status()
                data = resp.json()
                assert data["choices"][0]["message"]["content"]

        await asyncio.gather(*[worker() for _ in range(min(concurrency, len(items)))])


async def run_01b(base_url: str, items: list[dict], concurrency: int, out_dir: Path) -> dict:
    from common.core.config import config_from_dict
    from common.core.io import JsonlAppender
    from common.data.generate_requests import Generator
    from common.serving.chat import make_clients

    cfg = config_from_dict({"run_dir": str(out_dir), "generate": {
        "base_url": base_url, "concurrency": concurrency, "timeout_s": 600, "max_retries": 0, "max_tokens": 256}})
    clients = make_clients(cfg.generate)  # exactly what 01b uses
    raw_path = out_dir / "raw_responses.jsonl"
    raw_path.unlink(missing_ok=True)
    try:
        with JsonlAppender(raw_path, cfg.generate.fsync_every) as raw, JsonlAppender(out_dir / "failed.jsonl", 1) as failed:
            gen = Generator(cfg, clients, "bench-model", raw, failed)
            await gen.run(items)
    finally:
        for c in clients:
            await c.close()
    s = gen.stats
    assert s.done == len(items) and s.failed == 0, (s.done, s.failed)
    return {"client_max_in_flight": s.max_in_flight, "client_avg_in_flight": round(s.avg_in_flight(), 1)}


def in_flight(events: list, concurrency: int) -> dict:
    """Requests the server held over time. 'Sustained' = from the concurrency-th arrival (the first
    wave is in) to the last arrival (after it the client has nothing left to send)."""
    events = sorted(events)
    arrivals = [t for t, d in events if d > 0]
    start, end = arrivals[min(concurrency, len(arrivals)) - 1], arrivals[-1]
    level, area, peak, prev = 0, 0.0, 0, events[0][0]
    for t, d in events:
        lo, hi = max(prev, start), min(t, end)  # `level` requests were held during [prev, t)
        if hi > lo:
            area += level * (hi - lo)
        level += d
        peak = max(peak, level)
        prev = t
    return {"sustained_avg": area / max(end - start, 1e-9), "sustained_window_s": end - start, "peak": peak}


def measure(server: ServerProcess, client: str, concurrency: int, n: int, latency: float, out_dir: Path) -> dict:
    server.reset(latency)
    items = prompts(n)
    base_url = server.url + "/v1"
    cpu0, t0 = cpu_now(), time.perf_counter()
    extra = asyncio.run(run_bare(base_url, items, concurrency) if client == "bare" else run_01b(base_url, items, concurrency, out_dir))
    wall, cpu = time.perf_counter() - t0, cpu_now() - cpu0
    stats = server.stats()
    flight = in_flight(stats["events"], concurrency)
    return {"client": client, "concurrency": concurrency, "latency_s": latency, "requests": n, "wall_s": wall,
            "requests_per_s": n / wall, "client_cpu_ms_per_request": 1000 * cpu / n,
            "server_cpu_ms_per_request": 1000 * stats["cpu_s"] / n, **flight,
            "in_flight_fraction": flight["sustained_avg"] / concurrency, **(extra or {})}


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return f"{os.cpu_count()} CPUs ({model}), load average {os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--requests", type=int, default=3000, help="requests per instant-server run")
    parser.add_argument("--latency", type=float, default=5.0, help="server latency (s) for the in-flight runs")
    parser.add_argument("--waves", type=int, default=3, help="in-flight runs send waves x concurrency requests")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.serve:
        serve_main(args.serve)
        return

    import logging

    logging.disable(logging.WARNING)
    server = ServerProcess()
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
            for c in args.concurrency:
                for client in ("bare", "01b"):
                    measure(server, client, c, min(200, args.requests), 0.0, Path(tmp))  # warm-up (imports, connections)
                    results.append(measure(server, client, c, args.requests, 0.0, Path(tmp)))
                    results.append(measure(server, client, c, args.waves * c, args.latency, Path(tmp)))
    finally:
        server.close()

    print(f"\nmachine: {machine()}")
    print(f"{'client':6} {'conc':>5} {'latency':>7} {'requests':>8} {'req/s':>8} {'cpu ms/req':>10} {'vs bare':>7} "
          f"{'srv ms/req':>10} {'in flight':>9} {'of conc':>7} {'L_min s':>7}")
    by_key = {(r["client"], r["concurrency"], r["latency_s"]): r for r in results}
    for r in results:
        bare = by_key[("bare", r["concurrency"], r["latency_s"])]
        instant = by_key[(r["client"], r["concurrency"], 0.0)]
        r["cpu_vs_bare"] = r["client_cpu_ms_per_request"] / bare["client_cpu_ms_per_request"]
        r["l_min_s"] = r["concurrency"] * instant["client_cpu_ms_per_request"] / 1000
        flight = f"{r['sustained_avg']:>9.1f} {r['in_flight_fraction']:>7.1%}" if r["latency_s"] else f"{'-':>9} {'-':>7}"
        print(f"{r['client']:6} {r['concurrency']:>5} {r['latency_s']:>7.2f} {r['requests']:>8} {r['requests_per_s']:>8.0f} "
              f"{r['client_cpu_ms_per_request']:>10.3f} {r['cpu_vs_bare']:>7.2f} {r['server_cpu_ms_per_request']:>10.3f} "
              f"{flight} {r['l_min_s']:>7.2f}")
    for c in args.concurrency:
        r = by_key[("01b", c, args.latency)]
        verdict = "OK" if r["in_flight_fraction"] >= 0.95 else "BELOW TARGET"
        print(f"01b at concurrency {c}: {r['in_flight_fraction']:.1%} of the configured requests in flight at {args.latency:g} s "
              f"latency (target >= 95%: {verdict}); client CPU {by_key[('01b', c, 0.0)]['client_cpu_ms_per_request']:.2f} ms/request "
              f"= {by_key[('01b', c, 0.0)]['cpu_vs_bare']:.2f}x the bare httpx client")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
