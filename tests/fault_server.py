"""A fake OpenAI-compatible chat server that misbehaves on purpose, for the 01b tests.

Plain asyncio streams (a tiny HTTP/1.1 server with keep-alive) so that it can also do what a
well-behaved framework would not: reset a connection halfway through a response, or send a
truncated JSON body with a matching Content-Length.

Everything is deterministic. The answer to a request is a function of its conversation
(`expected_reply`), so tests can check the exact values 01b stored. Whether a request is
faulted, and how, is drawn from random.Random(f"{seed}:{conversation hash}:{attempt}"),
so the same run sees the same faults regardless of the order requests arrive in.

    with FaultServer(Faults(seed=1, p_500=0.2, p_hang=0.05, hang_s=5)) as server:
        ... generate.base_url = server.base_url ...
        server.stats.requests_by_prompt[...]

Requests with `return_token_ids: true` get vLLM's token-id fields (`prompt_token_ids` at the
top level, `token_ids` in the choice), deterministic too (`expected_token_ids`), unless the
server plays an old vLLM (token_ids=False) or the last user message holds NO_TOKEN_IDS_MARKER.

Besides the chat route it serves GET /health, GET /v1/models, POST /tokenize (with a tokenize_fn) and
GET /metrics (a KV cache of METRICS_KV_TOKENS tokens, as vLLM's `vllm:cache_config_info` says it);
Faults.drip_s sends the answers of the routes in Faults.drip_paths one byte at a time (stats.faults["drip"]
counts those answers begun, stats.faults["drip_done"] those sent to their last byte).

CLI (manual experiments): python tests/fault_server.py --port 8001 --p-500 0.1
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

BAD_REQUEST_MARKER = "[[BAD REQUEST]]"  # prompts containing this always get a 400
ALWAYS_FAIL_MARKER = "[[ALWAYS 503]]"  # prompts containing this always get a 503
NO_TOKEN_IDS_MARKER = "[[NO TOKEN IDS]]"  # prompts containing this get no token ids even when asked

# What /metrics says the KV cache holds: far above what the tests' concurrency needs (no warning).
METRICS_KV_TOKENS = 65536 * 16
METRICS_TEXT = ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                "# TYPE vllm:cache_config_info gauge\n"
                'vllm:cache_config_info{block_size="16",num_gpu_blocks="65536"} 1.0\n')

FAULT_KINDS = ("hang", "500", "503", "429", "reset", "torn", "non_json", "empty_choices")


@dataclass
class Faults:
    seed: int = 0
    p_delay: float = 0.0  # chance of a random delay in [0, max_delay_s] before answering
    max_delay_s: float = 0.05
    p_hang: float = 0.0  # chance of sleeping hang_s (beyond the client timeout) before answering
    hang_s: float = 30.0
    p_500: float = 0.0
    p_503: float = 0.0
    p_429: float = 0.0
    p_reset: float = 0.0  # connection reset halfway through the response body
    p_torn: float = 0.0  # truncated JSON body, Content-Length matching the truncation
    p_non_json: float = 0.0  # 200 with an HTML body
    p_empty_choices: float = 0.0  # 200 with "choices": []
    max_faults_per_request: Optional[int] = None  # afterwards a request always succeeds
    latency_s: float = 0.0  # fixed latency added to every chat completion
    chat_status: Optional[int] = None  # answer every chat completion with this error status (401: a rejected key)
    drip_s: float = 0.0  # > 0: send every answer on drip_paths one byte per drip_s seconds (each read is quick, the whole is not)
    drip_paths: tuple[str, ...] = ("/v1/chat/completions",)  # of /v1/chat/completions, /v1/models, /tokenize, /metrics, /health
    reasoning: bool = True  # False: a model without reasoning (Llama-3.1, SmolLM2): answers carry content only


@dataclass
class Stats:
    requests: int = 0
    chat_requests: int = 0
    faults: Counter = field(default_factory=Counter)
    requests_by_prompt: Counter = field(default_factory=Counter)  # keyed by the first user message
    auth_headers: set = field(default_factory=set)
    max_in_flight: int = 0
    in_flight: int = 0
    bodies: list = field(default_factory=list)  # parsed chat request bodies (record_bodies=True)


def conversation_key(messages: list[dict]) -> str:
    """Hash of what identifies a conversation: roles, contents and reasoning, in order."""
    canon = [[m.get("role"), m.get("content"), m.get("reasoning") or m.get("reasoning_content") or ""] for m in messages]
    return hashlib.sha256(json.dumps(canon, ensure_ascii=False).encode()).hexdigest()


def expected_reply(messages: list[dict]) -> dict:
    """The answer the server gives to `messages`: {"reasoning", "content", "reasoning_field"}.

    reasoning_field is "reasoning" (current vLLM), "reasoning_content" (older vLLM) or None
    (no reasoning), chosen by the hash so that a run sees all three.
    """
    key = conversation_key(messages)
    user = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "") or ""
    turn = sum(1 for m in messages if m.get("role") == "user")
    content = f"Answer {key[:8]} to turn {turn}: {user[:40]}"
    style = int(key[8:10], 16) % 3
    if style == 2:
        return {"reasoning": "", "content": content, "reasoning_field": None}
    reasoning = f"Thinking {key[10:18]} about: {user[:24]}"
    return {"reasoning": reasoning, "content": content, "reasoning_field": "reasoning" if style == 0 else "reasoning_content"}


# Ids of the fake tokenizer behind expected_token_ids: a Kimi-like layout where the generation
# prompt ends with <think> and history is rendered without its reasoning.
ROLE_IDS = {"system": 1, "user": 2, "assistant": 3}
END_OF_TURN_ID, THINK_ID, END_THINK_ID = 5, 6, 7


def _word_ids(text: str) -> list[int]:
    return [100 + int(hashlib.sha256(w.encode()).hexdigest()[:6], 16) % 400 for w in text.split()]


def expected_token_ids(messages: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt_token_ids, completion token_ids) the server reports for `messages`."""
    prompt: list[int] = []
    for m in messages:
        prompt += [ROLE_IDS.get(m.get("role"), 0)] + _word_ids(str(m.get("content") or "")) + [END_OF_TURN_ID]
    prompt += [ROLE_IDS["assistant"], THINK_ID]
    reply = expected_reply(messages)
    completion = _word_ids(reply["reasoning"]) + [END_THINK_ID] + _word_ids(reply["content"]) + [END_OF_TURN_ID]
    return prompt, completion


def completion_body(messages: list[dict], model: str, token_ids: bool = False, reasoning: bool = True) -> dict:
    reply = expected_reply(messages)
    if not reasoning:
        reply = {"reasoning": "", "content": reply["content"], "reasoning_field": None}
    message: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
    if reply["reasoning_field"]:
        message[reply["reasoning_field"]] = reply["reasoning"]
    prompt_tokens = sum(len(str(m.get("content") or "").split()) for m in messages)
    completion_tokens = len(reply["content"].split()) + len(reply["reasoning"].split())
    body = {
        "id": "chatcmpl-" + conversation_key(messages)[:12],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
    if token_ids:
        body["prompt_token_ids"], body["choices"][0]["token_ids"] = expected_token_ids(messages)
    return body


class DripWriter:
    """A StreamWriter that sends what is written one byte per `seconds`: each read of the client is
    quick, the whole answer is not."""

    def __init__(self, writer: asyncio.StreamWriter, seconds: float, stats: Optional["Stats"] = None):
        self._writer, self._seconds, self._pending, self._stats = writer, seconds, b"", stats

    def write(self, data: bytes) -> None:
        self._pending += data

    async def drain(self) -> None:
        pending, self._pending = self._pending, b""
        for i in range(len(pending)):
            if self._writer.transport.is_closing():  # the client gave up
                raise ConnectionResetError("client closed the connection")
            if i == len(pending) - 1 and self._stats is not None:  # counted before the client can have it all
                self._stats.faults["drip_done"] += 1  # an answer dripped to its end: its client could wait for all of it
            self._writer.write(pending[i:i + 1])
            await self._writer.drain()
            await asyncio.sleep(self._seconds)

    def __getattr__(self, name: str):
        return getattr(self._writer, name)


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error",
            503: "Service Unavailable"}


class FaultServer:
    """Runs the fake server on a loopback port in a background thread (its own event loop)."""

    def __init__(self, faults: Faults = Faults(), model: str = "fault-model",
                 tokenize_fn: Optional[Callable[[str], list[int]]] = None, port: int = 0, record_bodies: bool = False,
                 token_ids: bool = True):
        self.faults = faults
        self.token_ids = token_ids  # False: ignore return_token_ids, like vLLM < 0.10
        self.model = model
        self.tokenize_fn = tokenize_fn
        self.port = port
        self.record_bodies = record_bodies
        self.stats = Stats()
        self._attempts: Counter = Counter()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._server: Optional[asyncio.base_events.Server] = None
        self._tasks: set = set()
        self._ready = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # ---- lifecycle
    def start(self) -> "FaultServer":
        self._thread = threading.Thread(target=self._run, name="fault-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault server did not start")
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown():
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.sleep(0)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> "FaultServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- HTTP
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    return
                method, path, _ = request_line.decode("latin-1").split(" ", 2)
                headers = {}
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b"\n", b""):
                        break
                    k, _, v = line.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                self.stats.requests += 1
                if "authorization" in headers:
                    self.stats.auth_headers.add(headers["authorization"])
                path = path.split("?")[0]
                drip = self.faults.drip_s > 0 and path in self.faults.drip_paths
                if drip:
                    self.stats.faults["drip"] += 1
                keep_open = await self._route(method, path, body, DripWriter(writer, self.faults.drip_s, self.stats) if drip else writer)
                if not keep_open:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return
        except asyncio.CancelledError:
            return
        finally:
            self._tasks.discard(task)
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                pass

    async def _send(self, writer, code: int, body: bytes, content_type: str = "application/json", extra: str = "") -> bool:
        head = (f"HTTP/1.1 {code} {_REASONS.get(code, 'X')}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n{extra}Connection: keep-alive\r\n\r\n")
        writer.write(head.encode("latin-1") + body)
        await writer.drain()
        return True

    async def _json(self, writer, code: int, obj: Any, extra: str = "") -> bool:
        return await self._send(writer, code, json.dumps(obj).encode(), extra=extra)

    async def _route(self, method: str, path: str, body: bytes, writer) -> bool:
        if method == "GET" and path == "/health":
            return await self._send(writer, 200, b"", "text/plain")
        if method == "GET" and path == "/v1/models":
            return await self._json(writer, 200, {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "fault"}]})
        if method == "POST" and path == "/tokenize" and self.tokenize_fn is not None:
            req = json.loads(body)
            tokens = self.tokenize_fn(req["prompt"])
            return await self._json(writer, 200, {"tokens": tokens, "count": len(tokens), "max_model_len": 4096})
        if method == "GET" and path == "/metrics":
            return await self._send(writer, 200, METRICS_TEXT.encode(), "text/plain; version=0.0.4")
        if method == "POST" and path == "/v1/chat/completions":
            return await self._chat(json.loads(body), writer)
        return await self._json(writer, 404, {"error": {"message": f"no route {method} {path}", "code": 404}})

    def _draw(self, key: str) -> tuple[Optional[str], float]:
        """(fault kind or None, extra delay) for this conversation's next attempt."""
        f = self.faults
        attempt = self._attempts[key]
        self._attempts[key] += 1
        rng = random.Random(f"{f.seed}:{key}:{attempt}")
        delay = rng.uniform(0, f.max_delay_s) if rng.random() < f.p_delay else 0.0
        if f.max_faults_per_request is not None and attempt >= f.max_faults_per_request:
            return None, delay
        x = rng.random()
        for kind, p in (("hang", f.p_hang), ("500", f.p_500), ("503", f.p_503), ("429", f.p_429), ("reset", f.p_reset),
                        ("torn", f.p_torn), ("non_json", f.p_non_json), ("empty_choices", f.p_empty_choices)):
            if x < p:
                return kind, delay
            x -= p
        return None, delay

    async def _chat(self, req: dict, writer) -> bool:
        messages = req.get("messages") or []
        s = self.stats
        s.chat_requests += 1
        if self.record_bodies:
            s.bodies.append(req)
        first_user = next((m.get("content") for m in messages if m.get("role") == "user"), "")
        s.requests_by_prompt[first_user] += 1
        s.in_flight += 1
        s.max_in_flight = max(s.max_in_flight, s.in_flight)
        try:
            last_user = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "") or ""
            if BAD_REQUEST_MARKER in last_user:
                s.faults["400"] += 1
                return await self._json(writer, 400, {"error": {"message": "prompt rejected: marked bad", "type": "BadRequestError", "code": 400}})
            if ALWAYS_FAIL_MARKER in last_user:
                s.faults["always_503"] += 1
                return await self._json(writer, 503, {"error": {"message": "overloaded (always)", "code": 503}})
            if not isinstance(req.get("model"), str) or not isinstance(req.get("max_tokens"), int):
                return await self._json(writer, 400, {"error": {"message": "model and max_tokens are required", "code": 400}})
            if self.faults.chat_status is not None:
                s.faults[str(self.faults.chat_status)] += 1
                return await self._json(writer, self.faults.chat_status,
                                        {"error": {"message": f"injected {self.faults.chat_status}", "code": self.faults.chat_status}})
            kind, delay = self._draw(conversation_key(messages))
            if delay or self.faults.latency_s:
                await asyncio.sleep(delay + self.faults.latency_s)
            if kind:
                s.faults[kind] += 1
            want_ids = self.token_ids and req.get("return_token_ids") is True and NO_TOKEN_IDS_MARKER not in last_user
            full = json.dumps(completion_body(messages, self.model, token_ids=want_ids, reasoning=self.faults.reasoning)).encode()
            if kind == "hang":
                await asyncio.sleep(self.faults.hang_s)
                return False
            if kind in ("500", "503", "429"):
                extra = "Retry-After: 0\r\n" if kind == "429" else ""
                return await self._json(writer, int(kind), {"error": {"message": f"injected {kind}", "code": int(kind)}}, extra)
            if kind == "reset":
                head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(full)}\r\n\r\n"
                writer.write(head.encode() + full[: len(full) // 2])
                await writer.drain()
                writer.transport.abort()
                return False
            if kind == "torn":
                return await self._send(writer, 200, full[: len(full) // 2])
            if kind == "non_json":
                return await self._send(writer, 200, b"<html><body>502 gateway hiccup</body></html>", "text/html")
            if kind == "empty_choices":
                obj = json.loads(full)
                obj["choices"] = []
                return await self._json(writer, 200, obj)
            return await self._send(writer, 200, full)
        finally:
            s.in_flight -= 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--seed", type=int, default=0)
    for kind in ("delay", "hang", "500", "503", "429", "reset", "torn", "non_json", "empty_choices"):
        parser.add_argument(f"--p-{kind.replace('_', '-')}", type=float, default=0.0)
    parser.add_argument("--hang-s", type=float, default=30.0)
    parser.add_argument("--drip-s", type=float, default=0.0, help="send answers one byte per DRIP_S seconds")
    parser.add_argument("--drip-path", action="append", help="a route to drip (repeatable; default the chat route)")
    args = parser.parse_args()
    drip_paths = {"drip_paths": tuple(args.drip_path)} if args.drip_path else {}
    faults = Faults(seed=args.seed, hang_s=args.hang_s, drip_s=args.drip_s, **drip_paths, **{f"p_{k}": getattr(args, f"p_{k}") for k in
                    ("delay", "hang", "500", "503", "429", "reset", "torn", "non_json", "empty_choices")})
    server = FaultServer(faults, port=args.port).start()
    print(f"fault server on {server.base_url} (Ctrl-C to stop)")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
