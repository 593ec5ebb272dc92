"""01b's requests: many prompts answered concurrently, each with retries, each result one JSONL line.

Generator runs `generate.concurrency` workers over a queue of prompts. A worker answers a
prompt's user turns one by one (the request carries the regenerated history) and appends one
row to raw_responses.jsonl, or one record to failed.jsonl (formats: common.data.generate_files).

- classify decides what a failed request is worth: timeouts, connection errors, 429, 5xx and
  malformed responses are retried with exponential backoff and full jitter (backoff_delay,
  stretched to the server's Retry-After); other 4xx, an unencodable request and a response
  without the token ids the run needs fail at once (retrying cannot fix them).
- A 401/403 is every request's fate: the run stops at once (Generator.abort) and records nothing.
- A line is appended once per id in one synchronous write, so cancelling (SIGINT/SIGTERM,
  Generator.request_stop) never leaves half a row.
- RunStats counts the run as it goes; RunStats.summary is the report's `this_run`.
answer_prompts is the stage's entry: the clients, the two appenders and one Generator run.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from common.core.config import Config, GenerateConfig
from common.core.io import JsonlAppender
from common.core.run_folder import Layout
from common.serving.chat import MalformedResponse, chat_request, has_token_ids, make_clients, parse_completion

MISSING_TOKEN_IDS = (
    "server did not return token ids (prompt_token_ids / choices[0].token_ids for return_token_ids=true); "
    "needs vLLM >= 0.10 or set tokenize.token_ids_from=template"
)

AUTH_STATUS = (401, 403)  # a rejected API key: no request of the run can succeed


class MissingTokenIds(Exception):
    """tokenize.token_ids_from=server, and the response has no token ids: retrying cannot help."""


# ----------------------------------------------------------------------------- failures


@dataclass
class Failure:
    reason: str
    error_type: str
    status_code: Optional[int]
    retryable: bool
    retry_after: Optional[float] = None

    def cause(self) -> str:
        """The key it is counted under: the status code, or the error type when there is none."""
        return self.error_type if self.status_code is None else str(self.status_code)


def classify(exc: BaseException) -> Failure:
    """Which errors are worth retrying: transient server or network trouble, yes; a request
    the server rejects as invalid (400, 401, 404, ...), no."""
    import openai

    msg = " ".join(str(exc).split())[:500]
    name = type(exc).__name__
    if isinstance(exc, openai.APIStatusError):
        code = exc.status_code
        retry_after = None
        try:
            retry_after = float(exc.response.headers.get("retry-after"))
        except (TypeError, ValueError):
            pass
        retryable = code == 429 or code >= 500
        return Failure(f"{name}: {msg}", name, code, retryable, retry_after)
    if isinstance(exc, MissingTokenIds):
        return Failure(f"{name}: {msg}", name, None, False)
    if isinstance(exc, (TimeoutError, openai.APITimeoutError)):  # the request's deadline (common.serving.http)
        return Failure("TimeoutError: no complete answer within generate.timeout_s", "TimeoutError", None, True)
    if isinstance(exc, (UnicodeError, TypeError)):  # raised building the request: it will never be sent
        return Failure(f"the request cannot be encoded ({name}: {msg})", name, None, False)
    if isinstance(exc, (openai.APIConnectionError, MalformedResponse, ValueError, openai.APIResponseValidationError)):
        # ValueError covers bodies that are not JSON.
        return Failure(f"{name}: {msg}", name, None, True)
    # Anything else is unexpected: retry it too, and record it if it persists.
    return Failure(f"{name}: {msg}", name, None, True)


def backoff_delay(attempt: int, initial: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with full jitter: uniform(0, min(cap, initial * 2**(attempt-1)))."""
    return rng.uniform(0.0, min(cap, initial * (2 ** (attempt - 1))))


def auth_error(g: GenerateConfig, failure: Failure) -> str:
    return (f"the server at {g.base_url} refused a chat request with {failure.status_code} ({failure.reason[:160]}); "
            f"check the API key in the environment variable {g.api_key_env} (generate.api_key_env) and its permissions, "
            f"then rerun: the run stopped at once and recorded no prompt as failed")


class _Failed(Exception):
    """A request that failed for good: its last failure and the attempts it took."""

    def __init__(self, failure: Failure, attempts: int):
        super().__init__(failure.reason)
        self.failure, self.attempts = failure, attempts


def normalize_turn(reasoning: str, content: str) -> tuple[str, str]:
    """The reasoning and content to store in the conversation.

    Reasoning parsers hand back the text between <think> and </think> verbatim, so the
    template's own newlines around it come back too ("\\nR\\n", "\\n\\nC"). Templates add
    them again when rendering, so strip them here (as Qwen's templates do) to make the
    rendered conversation reproduce the generated text.
    """
    return reasoning.strip("\n"), content.lstrip("\n") if reasoning else content


# ----------------------------------------------------------------------------- counters


@dataclass
class RunSummary:
    """One run's counts and rates: generate_report.json's `this_run` (field order = key order)."""

    prompts: int
    done: int
    failed: int
    requests: int
    retries: int
    retry_reasons: dict[str, int]
    failure_reasons: dict[str, int]
    finish_reasons: dict[str, int]
    turn_flags: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float
    requests_per_s: float
    samples_per_s: float
    completion_tokens_per_s: float
    max_in_flight: int
    avg_in_flight: float

    def line(self) -> str:
        """The summary line's part about this run."""
        return (f"{self.done} generated, {self.failed} failed, {self.retries} retries in {self.elapsed_s:.1f}s "
                f"({self.requests_per_s:.2f} req/s, {self.completion_tokens_per_s:.0f} tok/s); ")


@dataclass
class RunStats:
    started: float = field(default_factory=time.monotonic)
    done: int = 0
    failed: int = 0
    requests: int = 0
    retries: int = 0
    retry_reasons: Counter = field(default_factory=Counter)
    failure_reasons: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    # Turns the chat template cannot reproduce exactly: cut by max_tokens ("length"), or
    # reasoning never closed with </think> (the template closes it when rendering).
    turn_flags: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    _in_flight_area: float = 0.0
    _last_change: float = field(default_factory=time.monotonic)

    def change_in_flight(self, delta: int) -> None:
        now = time.monotonic()
        self._in_flight_area += self.in_flight * (now - self._last_change)
        self._last_change = now
        self.in_flight += delta
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def elapsed(self) -> float:
        return max(1e-9, time.monotonic() - self.started)

    def avg_in_flight(self) -> float:
        self.change_in_flight(0)
        return self._in_flight_area / self.elapsed()

    def summary(self, num_prompts: int) -> RunSummary:
        el = self.elapsed()
        return RunSummary(
            prompts=num_prompts, done=self.done, failed=self.failed, requests=self.requests, retries=self.retries,
            retry_reasons=dict(self.retry_reasons), failure_reasons=dict(self.failure_reasons),
            finish_reasons=dict(self.finish_reasons), turn_flags=dict(self.turn_flags), prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, elapsed_s=round(el, 3),
            requests_per_s=round(self.requests / el, 3), samples_per_s=round(self.done / el, 3),
            completion_tokens_per_s=round(self.completion_tokens / el, 1),
            max_in_flight=self.max_in_flight, avg_in_flight=round(self.avg_in_flight(), 2),
        )


# ----------------------------------------------------------------------------- the generator


class Generator:
    """Runs the requests for a list of prompts with `concurrency` workers."""

    def __init__(self, cfg: Config, clients, model: str, raw: JsonlAppender, failed: JsonlAppender, seed: int = 0):
        self.cfg = cfg
        self.g = cfg.generate
        # Requests go round-robin over the clients (see common.serving.chat.make_clients).
        self._clients = itertools.cycle(clients if isinstance(clients, (list, tuple)) else [clients])
        self.model = model
        self.raw = raw
        self.failed = failed
        self.rng = random.Random(seed)
        self.stats = RunStats()
        self.stopping = False
        self.workers: list[asyncio.Task] = []
        self.bar = None
        self.fatal: Optional[str] = None  # why the whole run stopped (a rejected API key), if it did

    # -- one request, with retries
    async def _request(self, messages: list[dict]) -> tuple[dict, int]:
        g = self.g
        need_ids = self.cfg.tokenize.token_ids_from == "server"
        request = chat_request(g, self.model, messages, max_tokens=g.max_tokens, temperature=g.temperature, top_p=g.top_p,
                               return_token_ids=need_ids)
        attempt = 0
        while True:
            attempt += 1
            self.stats.requests += 1
            self.stats.change_in_flight(+1)
            t0 = time.monotonic()
            try:
                # generate.timeout_s is the whole request's deadline (the clients' own, common.serving.http)
                resp = await next(self._clients).chat.completions.create(**request)
                turn = parse_completion(resp)
                if need_ids and not has_token_ids(turn):
                    raise MissingTokenIds(MISSING_TOKEN_IDS)
                turn["latency_s"] = round(time.monotonic() - t0, 3)
                return turn, attempt
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - classified below
                failure = classify(exc)
                if not failure.retryable or attempt > g.max_retries:
                    raise _Failed(failure, attempt) from None
                self.stats.retries += 1
                self.stats.retry_reasons[failure.cause()] += 1
                delay = backoff_delay(attempt, g.backoff_initial_s, g.backoff_max_s, self.rng)
                if failure.retry_after is not None:
                    delay = max(delay, min(failure.retry_after, g.backoff_max_s))
            finally:
                self.stats.change_in_flight(-1)
            await asyncio.sleep(delay)

    # -- one prompt: answer its user turns one by one
    async def _process(self, prompt: dict) -> None:
        pid = prompt["id"]
        history = [m for m in prompt["messages"] if m.get("role") != "assistant"]
        conversation: list[dict] = []
        turns: list[dict] = []
        attempts = 0
        if not any(m.get("role") == "user" for m in history):
            self._record_failure(pid, Failure("prompt has no user message", "DataError", None, False), 0, 0)
            return
        for message in history:
            conversation.append({"role": message["role"], "content": message.get("content") or ""})
            if message.get("role") != "user":
                continue
            # The request carries the regenerated history, reasoning included (vLLM passes an
            # assistant's `reasoning` to the chat template).
            try:
                turn, n = await self._request(conversation)
            except _Failed as f:
                if f.failure.status_code in AUTH_STATUS:  # every request would get it: stop, record nothing
                    self.abort(auth_error(self.g, f.failure))
                    return
                self._record_failure(pid, f.failure, attempts + f.attempts, len(turns))
                return
            attempts += n
            reasoning, content = normalize_turn(turn["reasoning"], turn["content"])
            assistant = {"role": "assistant", "content": content}
            if reasoning:
                assistant["reasoning"] = reasoning
            conversation.append(assistant)
            turns.append(turn | {"attempts": n})
            if turn["finish_reason"] == "length":
                self.stats.turn_flags["cut_by_max_tokens"] += 1
            elif reasoning and not content:
                self.stats.turn_flags["reasoning_not_closed"] += 1
        usage: Counter = Counter()
        for t in turns:
            usage.update(t["usage"])
        last = turns[-1]
        answer = next(m for m in reversed(conversation) if m["role"] == "assistant")
        row = {
            "id": pid,
            "messages": conversation,
            # The final answer as stored in the conversation; turns[] keeps the server's raw text.
            "reasoning": answer.get("reasoning", ""),
            "content": answer["content"],
            "finish_reason": last["finish_reason"],
            "usage": dict(usage),
            "turns": turns,
            "model": self.model,
        }
        self.raw.write(row)  # one synchronous write: never interleaved, never cancelled halfway
        self.stats.done += 1
        self.stats.prompt_tokens += int(usage.get("prompt_tokens", 0))
        self.stats.completion_tokens += int(usage.get("completion_tokens", 0))
        self.stats.finish_reasons[str(last["finish_reason"])] += 1
        self._progress()

    def _record_failure(self, pid: str, failure: Failure, attempts: int, turn: int) -> None:
        self.failed.write(
            {
                "id": pid,
                "reason": failure.reason,
                "error_type": failure.error_type,
                "status_code": failure.status_code,
                "attempts": attempts,
                "turn": turn,
                "retryable": failure.retryable,  # false: the same request fails the same way (400, unencodable)
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
        )
        self.failed.sync()  # failures are rare; make each durable
        self.stats.failed += 1
        self.stats.failure_reasons[failure.cause()] += 1
        self._progress()

    def _progress(self, refresh: bool = False) -> None:
        if self.bar is None:
            return
        s = self.stats
        el = s.elapsed()
        self.bar.set_postfix(
            done=s.done, failed=s.failed, in_flight=s.in_flight, req_s=f"{s.requests / el:.2f}",
            tok_s=f"{s.completion_tokens / el:.0f}", refresh=False,
        )
        self.bar.update(s.done + s.failed - self.bar.n)  # redraws at most every mininterval
        if refresh:
            self.bar.refresh()

    async def _worker(self, queue: asyncio.Queue) -> None:
        while not self.stopping:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await self._process(prompt)

    async def _ticker(self) -> None:
        while True:  # keeps rates fresh while requests hang
            await asyncio.sleep(1.0)
            self._progress(refresh=True)

    def abort(self, message: str) -> None:
        """Stop the whole run now: a failure no other request can escape."""
        if self.fatal is None:
            self.fatal = message
        self.stopping = True
        for w in self.workers:
            w.cancel()

    def request_stop(self, signame: str) -> None:
        if not self.stopping:
            print(f"\n{signame}: stopping; cancelling {self.stats.in_flight} in-flight request(s)", file=sys.stderr)
        self.stopping = True
        for w in self.workers:
            w.cancel()

    async def run(self, prompts: list[dict]) -> bool:
        """Generate for all prompts; False if stopped by a signal."""
        from tqdm import tqdm

        queue: asyncio.Queue = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop, sig.name)
        self.bar = tqdm(total=len(prompts), desc="generate", unit="sample", dynamic_ncols=True, file=sys.stderr)
        ticker = asyncio.create_task(self._ticker())
        self.stats = RunStats()
        try:
            n_workers = min(self.g.concurrency, len(prompts))
            self.workers = [asyncio.create_task(self._worker(queue)) for _ in range(n_workers)]
            finished, _ = await asyncio.wait(self.workers, return_when=asyncio.FIRST_EXCEPTION)
            for task in finished:
                if not task.cancelled() and task.exception() is not None:
                    self.request_stop("a worker failed")
                    await asyncio.wait(self.workers)
                    raise task.exception()
        finally:
            ticker.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            self._progress(refresh=True)
            self.bar.close()
        return not self.stopping


async def answer_prompts(cfg: Config, layout: Layout, todo: list[dict], model: str) -> tuple[Generator, bool]:
    """Answer `todo` with the clients common.serving.chat makes, appending to the run's raw and failed
    files; returns (the generator, with its stats and any fatal error; interrupted by a signal)."""
    pool = make_clients(cfg.generate)
    try:
        with JsonlAppender(layout.raw_responses, cfg.generate.fsync_every) as raw, JsonlAppender(layout.failed, 1) as failed:
            generator = Generator(cfg, pool, model, raw, failed, seed=cfg.data.seed)
            completed = await generator.run(todo)
    finally:
        for c in pool:
            await c.close()
    return generator, not completed
