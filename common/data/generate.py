"""Stage 01b: regenerate the assistant turns with the target itself, then tokenize them.

Training an EAGLE-3 draft on the target's own outputs (not the dataset's answers) is what
makes the draft agree with the target at serving time. This module drives an
OpenAI-compatible server (vLLM) with many concurrent requests and turns the results into
tokenized training samples. The clients, the request body and the response parsing are
common.serving.chat's (05 sends its requests through the same code).

Guarantees (docs/design.md#resume-rules):
- every prompt id ends in data/raw_responses.jsonl exactly once, or in data/failed.jsonl
  with a reason; a rerun skips the done ids and retries the failed ones;
- a line is appended once per id and only in one synchronous write, so a kill at any
  moment leaves at most a torn last line (cut off on the next start), never a duplicate;
- SIGINT/SIGTERM stop new requests, cancel the in-flight ones, flush, and exit 130;
- retries with exponential backoff and full jitter for timeouts, connection errors, 429,
  5xx and malformed responses; other 4xx fail at once (retrying cannot fix them).

Token ids (tokenize.token_ids_from):
- "template" (default): samples are the stored conversation re-rendered with the target's
  chat template. Checked before the first request: a template that cannot reproduce a
  generated turn (e.g. Kimi-K2.5's, which strips the reasoning it renders) fails at once.
- "server": every request asks vLLM for `return_token_ids`; each turn stores the server's
  `prompt_token_ids` and `completion_token_ids`, and a sample is the last turn's prompt ids
  (loss 0; earlier turns of a multi-turn conversation sit inside it as the template renders
  them) + its completion ids (loss 1). Token-exact whatever the template does (what
  speculators does). A response without ids is a non-retryable failure.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from common.core.config import Config, GenerateConfig
from common.core.errors import DataError, PipelineError
from common.core.run_folder import Layout, StageManifest
from common.core.io import (
    JsonlAppender,
    atomic_write_json,
    iter_jsonl,
    jsonl_writer_atomic,
    truncate_torn_tail,
    write_jsonl_atomic,
)
from common.serving.chat import (
    MalformedResponse,
    api_key,
    chat_request,
    has_token_ids,
    make_client,
    make_clients,
    parse_completion,
    server_root,
)
from common.serving.sizing import concurrency_line, kv_cache_tokens
from common.serving.vllm_server import scrape_metrics

log = logging.getLogger("generate")

# A string whose tokenization must agree between our tokenizer and the served model's.
TOKENIZER_PROBE = "Hello, world! 12345 <think>\nLet me think: ünïcödé, 漢字, emoji 🙂.\n</think>\n\nDone.<|im_end|>"


# ----------------------------------------------------------------------------- loading


def load_prompts(path: Path, skipped: Counter | None = None) -> tuple[list[dict], int]:
    """prompts.jsonl -> (prompts in file order with unique ids, number of duplicate ids dropped).

    Messages pass stage 01's rules (common.data.prepare.row_messages + keep_prompt): a row that 01
    would drop (a message without a role, an unknown role, no non-empty user turn) is never sent;
    it is counted in `skipped` under 01's reason.
    """
    from common.data.prepare import BadFields, keep_prompt, row_messages

    if not path.is_file():
        raise DataError(f"prompts file not found: {path}; run 01_prepare_data.py with the same config first")
    skipped = Counter() if skipped is None else skipped
    prompts, seen, dupes = [], set(), 0
    for row in iter_jsonl(path):
        pid = row.get("id")
        if not isinstance(pid, str) or not pid:
            raise DataError(f"{path}: a row lacks a string 'id' (id={pid!r}); rerun 01_prepare_data.py --overwrite")
        try:
            messages, reason = keep_prompt(row_messages(row), None, max_user_turns=len(row.get("messages") or []) or 1)
        except BadFields:
            messages, reason = None, "bad_fields"
        if reason is not None:
            skipped[reason] += 1
            continue
        if pid in seen:
            dupes += 1
            continue
        seen.add(pid)
        prompts.append({**row, "messages": messages})
    if not prompts:
        why = f" (skipped as stage 01 would: {', '.join(f'{k} {v}' for k, v in skipped.most_common())})" if skipped else ""
        raise DataError(f"{path} holds no usable prompts{why}; check data.source and rerun 01_prepare_data.py --overwrite")
    return prompts, dupes


def load_done(path: Path) -> tuple[dict[str, dict], int]:
    """raw_responses.jsonl -> ({id: row} keeping the first row per id, duplicate rows seen).

    Cut a torn tail first: a complete JSON object without its newline would otherwise be
    read as done here and then removed by the appender.
    """
    if not path.exists():
        return {}, 0
    truncate_torn_tail(path)
    done, dupes = {}, 0
    for row in iter_jsonl(path, tolerate_torn_tail=True, strict=False):
        pid = row.get("id")
        if not isinstance(pid, str):
            continue
        if pid in done:
            dupes += 1
            continue
        done[pid] = row
    return done, dupes


def load_failed(path: Path) -> dict[str, dict]:
    """failed.jsonl -> {id: the latest failure record}."""
    if not path.exists():
        return {}
    return {r["id"]: r for r in iter_jsonl(path, tolerate_torn_tail=True, strict=False) if isinstance(r.get("id"), str)}


# ----------------------------------------------------------------------------- requests


MISSING_TOKEN_IDS = (
    "server did not return token ids (prompt_token_ids / choices[0].token_ids for return_token_ids=true); "
    "needs vLLM >= 0.10 or set tokenize.token_ids_from=template"
)


class MissingTokenIds(Exception):
    """tokenize.token_ids_from=server, and the response has no token ids: retrying cannot help."""


@dataclass
class Failure:
    reason: str
    error_type: str
    status_code: Optional[int]
    retryable: bool
    retry_after: Optional[float] = None


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


def last_turn(row: dict) -> Any:
    turns = row.get("turns")
    return turns[-1] if isinstance(turns, list) and turns else None


def normalize_turn(reasoning: str, content: str) -> tuple[str, str]:
    """The reasoning and content to store in the conversation.

    Reasoning parsers hand back the text between <think> and </think> verbatim, so the
    template's own newlines around it come back too ("\\nR\\n", "\\n\\nC"). Templates add
    them again when rendering, so strip them here (as Qwen's templates do) to make the
    rendered conversation reproduce the generated text.
    """
    return reasoning.strip("\n"), content.lstrip("\n") if reasoning else content


# ----------------------------------------------------------------------------- the run


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
                self.stats.retry_reasons[failure.error_type if failure.status_code is None else str(failure.status_code)] += 1
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
        self.stats.failure_reasons[failure.error_type if failure.status_code is None else str(failure.status_code)] += 1
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


AUTH_STATUS = (401, 403)


def auth_error(g: GenerateConfig, failure: Failure) -> str:
    return (f"the server at {g.base_url} refused a chat request with {failure.status_code} ({failure.reason[:160]}); "
            f"check the API key in the environment variable {g.api_key_env} (generate.api_key_env) and its permissions, "
            f"then rerun: the run stopped at once and recorded no prompt as failed")


class _Failed(Exception):
    def __init__(self, failure: Failure, attempts: int):
        super().__init__(failure.reason)
        self.failure, self.attempts = failure, attempts


# ----------------------------------------------------------------------------- server checks


def _unreachable(cfg: Config, exc: BaseException) -> PipelineError:
    return PipelineError(
        f"cannot reach the generation server at {cfg.generate.base_url} ({type(exc).__name__}); start one with "
        f"`python -m vllm.entrypoints.openai.api_server --model {cfg.target.model or 'TARGET_DIR'} --port 8000` "
        "or set generate.base_url"
    )


def check_timeout(g: GenerateConfig) -> float:
    """The deadline of one of 01b's start-up calls (/v1/models, /tokenize, /metrics): generate.timeout_s, at most
    30 s (a healthy server answers them at once; a generation request may take the whole timeout_s)."""
    return min(g.timeout_s, 30.0)


async def resolve_model(client, cfg: Config) -> str:
    """Check the server answers and pick the model: generate.model, or the first one it serves."""
    import openai

    g = cfg.generate
    timeout = check_timeout(g)
    try:
        page = await client.with_options(timeout=timeout).models.list()
    except openai.APITimeoutError:
        raise PipelineError(f"the server at {g.base_url} did not answer GET /models in full within {timeout:g}s "
                            f"(generate.timeout_s, at most 30 s for this check); check that it is a healthy vLLM server "
                            f"and not overloaded, then rerun") from None
    except (openai.AuthenticationError, openai.PermissionDeniedError) as e:
        raise PipelineError(
            f"the server at {g.base_url} rejected the API key ({e.status_code}); put the key in the environment variable "
            f"{g.api_key_env}"
        ) from None
    except openai.APIStatusError as e:
        raise PipelineError(f"the server at {g.base_url} answered {e.status_code} to GET /models; is it an OpenAI-compatible server?") from None
    except (openai.APIConnectionError, ValueError) as e:
        raise _unreachable(cfg, e) from None
    except (AttributeError, TypeError):  # openai's parser on a 200 that is not JSON (an HTML page)
        raise PipelineError(f"the server at {g.base_url} answered GET /models with something that is not an OpenAI model "
                            f"list (an HTML page?); point generate.base_url at an OpenAI-compatible server such as vLLM "
                            f"(its URL ends in /v1)") from None
    served = [m.id for m in getattr(page, "data", None) or [] if isinstance(getattr(m, "id", None), str)]
    if g.model:
        if g.model not in served:
            raise PipelineError(f"generate.model '{g.model}' is not served at {g.base_url} (it serves {served}); fix generate.model or set it to null")
        return g.model
    if not served:
        raise PipelineError(f"the server at {g.base_url} lists no models; set generate.model")
    return served[0]


async def check_tokenizer_matches(client, cfg: Config, model: str, tokenizer) -> str:
    """Compare our tokenizer with the served model's on a probe string via vLLM's /tokenize.

    Returns "match" or "unchecked (...)"; raises DataError on a mismatch.
    """
    import openai

    url = server_root(cfg.generate.base_url) + "/tokenize"
    try:
        resp = await client.with_options(timeout=check_timeout(cfg.generate)).post(
            url, cast_to=object, body={"model": model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False}
        )
    except openai.APIStatusError as e:
        return f"unchecked (/tokenize answered {e.status_code})"
    except (openai.APIConnectionError, ValueError) as e:
        return f"unchecked ({type(e).__name__} on /tokenize)"
    served = resp.get("tokens") if isinstance(resp, dict) else None
    if not isinstance(served, list):
        return "unchecked (/tokenize gave no token list)"
    ours = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    if list(served) != list(ours):
        raise DataError(
            f"the target tokenizer ({cfg.target.tokenizer or cfg.target.model}) does not match the served model '{model}': "
            f"a probe string gives {len(ours)} tokens {ours[:6]}... here and {len(served)} tokens {served[:6]}... on the server; "
            "point target.model/target.tokenizer at the model the server runs"
        )
    return "match"


# ----------------------------------------------------------------------------- tokenization


def tokenizer_path(cfg: Config) -> str:
    path = cfg.target.tokenizer or cfg.target.model
    if not path:
        raise PipelineError("target.model is not set; 01b needs the target's tokenizer (set target.model or target.tokenizer)")
    return path


def template_kwargs_of(g: GenerateConfig) -> dict:
    return {} if g.enable_thinking is None else {"enable_thinking": g.enable_thinking}


# A generated turn as the stage stores it; the fail-fast check renders it before any request.
PROBE_TURNS = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "Hello! How can I help?", "reasoning": "The user greets me; reply briefly."},
    {"role": "user", "content": "Tell me more."},
    {"role": "assistant", "content": "Sure, here is more.", "reasoning": "They want more detail."},
]


def check_token_ids_source(cfg: Config, tokenizer, multi_turn: bool) -> None:
    """Fail fast, before any request: with token_ids_from=template the chat template must
    reproduce a generated turn (reasoning included), or tokenization would fail only after
    the whole generation. Probes one turn, and two when some prompt has several user turns."""
    if cfg.tokenize.token_ids_from != "template":
        return
    from common.target.tokenization import stop_token_ids, tokenize_conversation

    probe = PROBE_TURNS if multi_turn else PROBE_TURNS[:2]
    try:
        tokenize_conversation(tokenizer, probe, 1 << 30, stop_ids=stop_token_ids(tokenizer, tokenizer_path(cfg)),
                              template_kwargs=template_kwargs_of(cfg.generate))
    except DataError as e:
        raise DataError(f"{e}; checked before generating: set tokenize.token_ids_from=server to take token ids "
                        "from vLLM instead") from None


def tokenize_outputs(cfg: Config, layout: Layout, prompts: list[dict], done: dict[str, dict], tokenizer) -> dict:
    """raw responses -> data/train.jsonl + data/eval.jsonl. Returns the counts. Each sample is
    written as soon as it is tokenized (50k long samples held as Python lists would take GBs);
    both files appear, complete, only when every sample is done (atomic).

    token_ids_from=template re-renders each conversation with the chat template (every
    assistant turn learned); =server takes the last turn's ids as vLLM reported them.
    """
    from tqdm import tqdm

    from common.target.tokenization import TokenBoundaryError, stop_token_ids, tokenize_conversation, tokenize_server_ids

    from_server = cfg.tokenize.token_ids_from == "server"
    stop_ids = None if from_server else stop_token_ids(tokenizer, tokenizer_path(cfg))
    template_kwargs = template_kwargs_of(cfg.generate)
    stats: Counter = Counter()

    def tokenize(row: dict) -> Optional[dict]:
        """{"input_ids", "loss_mask"} of one finished conversation, or None (counted in stats)."""
        messages = row.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            stats["malformed"] += 1
            return None
        if from_server:
            last = last_turn(row)
            if not has_token_ids(last):
                stats["missing_token_ids"] += 1
                return None
            answer = next((m for m in reversed(messages) if m.get("role") == "assistant"), {})
            if not (answer.get("content") or "").strip() and not (answer.get("reasoning") or "").strip():
                stats["empty_assistant"] += 1  # as in template mode: nothing but a stop token
                return None
            return tokenize_server_ids(last["prompt_token_ids"], last["completion_token_ids"],
                                       cfg.tokenize.max_seq_len, cfg.tokenize.overlong, stats=stats)
        try:
            return tokenize_conversation(tokenizer, messages, cfg.tokenize.max_seq_len, cfg.tokenize.overlong,
                                         stop_ids=stop_ids, template_kwargs=template_kwargs, stats=stats)
        except TokenBoundaryError:  # this sample's text, not the template: skip it, counted
            stats["token_boundary_merge"] += 1
            return None

    kept = {"train": 0, "eval": 0}
    t0 = time.monotonic()
    tokens = loss_tokens = 0
    with jsonl_writer_atomic(layout.eval_jsonl) as write_eval, jsonl_writer_atomic(layout.train_jsonl) as write_train:
        for prompt in tqdm(prompts, desc="tokenize", unit="sample", file=sys.stderr, dynamic_ncols=True):
            row = done.get(prompt["id"])
            sample = tokenize(row) if row is not None else None
            if sample is None:
                continue
            split = "eval" if prompt.get("split") == "eval" else "train"
            (write_eval if split == "eval" else write_train)({"id": prompt["id"], **sample})
            kept[split] += 1
            tokens += len(sample["input_ids"])
            loss_tokens += sum(sample["loss_mask"])
    skipped = {k: v for k, v in stats.items() if k not in ("kept", "truncated")}
    return {
        "train": kept["train"],
        "eval": kept["eval"],
        "truncated": stats.get("truncated", 0),
        "skipped": skipped,
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "seconds": round(time.monotonic() - t0, 3),
        "max_seq_len": cfg.tokenize.max_seq_len,
        "overlong": cfg.tokenize.overlong,
        "token_ids_from": cfg.tokenize.token_ids_from,
    }


# ----------------------------------------------------------------------------- stage


def finalize_failed(layout: Layout, prompt_ids: set[str], done_ids: set[str]) -> dict[str, dict]:
    """Rewrite failed.jsonl atomically with only the ids that are still not done."""
    still = {pid: r for pid, r in load_failed(layout.failed).items() if pid in prompt_ids and pid not in done_ids}
    if layout.failed.exists() or still:
        write_jsonl_atomic(layout.failed, still.values())
    return still


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_stage(cfg: Config, overwrite: bool = False) -> int:
    """The whole stage; returns the exit code (0, or 130 when stopped by a signal)."""
    # Outside the event loop SIGTERM behaves like Ctrl-C: atomic writes finish or vanish.
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        return _run_stage(cfg, overwrite)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_stage(cfg: Config, overwrite: bool) -> int:
    layout = Layout.of(cfg)
    prompts, report = read_prompts(layout)
    # Before any request: the tokenizer loads (an error here costs seconds, not a generation run).
    tokenizer = load_tokenizer_of(cfg)
    manifest = stage_manifest(cfg, layout, tokenizer)
    server = None  # (model, tokenizer check) once the server passed check_server
    if overwrite:
        # Every refusal comes before the previous outputs go: a refused --overwrite leaves them as they were.
        check_token_sources(cfg, layout, tokenizer, prompts, {})
        server = check_server(cfg, prompts, tokenizer)
        for p in layout.generate_outputs():
            p.unlink(missing_ok=True)
    status = manifest.begin(overwrite, outputs=[layout.raw_responses, layout.train_jsonl, layout.eval_jsonl])
    recorded = manifest.result.get("raw_responses_bytes")
    if status == "complete" and recorded is not None and layout.raw_responses.stat().st_size != recorded:
        # damaged or cut after it was complete (a disk error, a bad copy): re-read it, redo what is lost
        print(f"01b_generate_synthetic: {layout.raw_responses} has {layout.raw_responses.stat().st_size} bytes, "
              f"{recorded} when 01b completed; checking it again and regenerating what is missing")
        status = "resume"
    if status == "complete":
        r = manifest.result
        print(f"01b_generate_synthetic: already complete ({r.get('num_done')} samples generated; train {r.get('train')}, "
              f"eval {r.get('eval')}) in {layout.data}; use --overwrite to redo")
        manifest.record("already_complete")
        return 0
    done, todo = read_done(layout, prompts, report)
    if not overwrite:  # with --overwrite, checked before the outputs were deleted
        check_token_sources(cfg, layout, tokenizer, prompts, done)
    interrupted = False
    if todo:
        server = server or check_server(cfg, todo, tokenizer)
        done, interrupted = generate_missing(cfg, layout, todo, server, report, manifest)
    still_failed = account_results(layout, prompts, done, report, interrupted)
    if interrupted:
        atomic_write_json(layout.generate_report, report | {"complete": False})
        print(f"01b_generate_synthetic: interrupted: {generation_line(report)}{report['num_done']}/{len(prompts)} done, "
              f"{len(still_failed)} failed; rerun the same command to resume", file=sys.stderr)
        return 130
    check_failure_share(cfg, layout, report, still_failed, manifest)
    tok = tokenize_outputs(cfg, layout, prompts, done, tokenizer)
    report |= {"tokenize": tok, "complete": not still_failed}
    atomic_write_json(layout.generate_report, report)
    result = {"num_done": report["num_done"], "num_failed": len(still_failed), "train": tok["train"], "eval": tok["eval"],
              "raw_responses_bytes": layout.raw_responses.stat().st_size if layout.raw_responses.exists() else 0}
    # Complete only with no failures left: a rerun retries them (with a server).
    manifest.complete(result) if not still_failed else manifest.partial(result)
    print(f"01b_generate_synthetic: {generation_line(report)}{report['num_done']}/{len(prompts)} done, {len(still_failed)} failed"
          f"{failed_advice(layout, still_failed)}; "
          f"tokenized train {tok['train']}, eval {tok['eval']}, {tok['tokens']} tokens ({tok['loss_tokens']} with loss), "
          f"{tok['truncated']} truncated, skipped {tok['skipped'] or 0}")
    return 0


def read_prompts(layout: Layout) -> tuple[list[dict], dict]:
    """The prompts to answer, and the report's first counts (duplicates, rows 01 would have dropped)."""
    skipped: Counter = Counter()
    prompts, dup_prompts = load_prompts(layout.prompts, skipped)
    if skipped:
        log.warning("%s: skipped %d prompt row(s) that stage 01 would drop (%s)", layout.prompts, sum(skipped.values()),
                    ", ".join(f"{k} {v}" for k, v in skipped.most_common()))
    return prompts, {"num_prompts": len(prompts), "duplicate_prompt_ids": dup_prompts, "skipped_prompts": dict(skipped)}


def load_tokenizer_of(cfg: Config):
    from common.target.tokenization import load_tokenizer

    return load_tokenizer(tokenizer_path(cfg), cfg.target.trust_remote_code,
                          require_chat_template=cfg.tokenize.token_ids_from != "server")


def stage_manifest(cfg: Config, layout: Layout, tokenizer) -> StageManifest:
    """01b's record (common.core.run_folder). Sampling settings must stay the same to resume: two
    generations are never mixed in one data set. New prompts are simply generated, and changed
    tokenization settings (or tokenizer) retokenize everything from the raw responses."""
    g, t = cfg.generate, cfg.tokenize
    template = getattr(tokenizer, "chat_template", None) or ""
    return StageManifest(
        layout, "01b_generate_synthetic",
        inputs=layout.named(layout.prompts),
        settings={
            "sampling": {"model": g.model, "max_tokens": g.max_tokens, "temperature": g.temperature, "top_p": g.top_p,
                         "enable_thinking": g.enable_thinking, "extra_body": g.extra_body},
            "tokenize": {"max_seq_len": t.max_seq_len, "overlong": t.overlong, "token_ids_from": t.token_ids_from,
                         "tokenizer": tokenizer_path(cfg),
                         "chat_template_sha256": hashlib.sha256(str(template).encode()).hexdigest()},
        },
        redo_on={layout.name(layout.prompts), "tokenize"},
    )


def read_done(layout: Layout, prompts: list[dict], report: dict) -> tuple[dict[str, dict], list[dict]]:
    """(finished rows by id, prompts still to answer)."""
    prompt_ids = {p["id"] for p in prompts}
    done, dup_raw = load_done(layout.raw_responses)
    if dup_raw:
        log.warning("%s holds %d duplicate id(s); using the first row of each", layout.raw_responses, dup_raw)
    report |= {"duplicates_in_raw": dup_raw, "done_before": sum(1 for pid in done if pid in prompt_ids)}
    return done, [p for p in prompts if p["id"] not in done]


def check_token_sources(cfg: Config, layout: Layout, tokenizer, prompts: list[dict], done: dict[str, dict]) -> None:
    """Before any request, the chosen source of token ids can work: the template reproduces a
    generated turn, or (server) the rows already generated carry ids."""
    multi_turn = any(sum(m.get("role") == "user" for m in p["messages"]) > 1 for p in prompts)
    check_token_ids_source(cfg, tokenizer, multi_turn)
    if cfg.tokenize.token_ids_from == "server":
        prompt_ids = {p["id"] for p in prompts}
        lacking = sum(1 for pid, row in done.items() if pid in prompt_ids and not has_token_ids(last_turn(row)))
        if lacking:
            raise DataError(
                f"{lacking} finished row(s) in {layout.raw_responses} have no token ids (generated with tokenize.token_ids_from="
                "template); rerun with --overwrite to regenerate them with ids, or set tokenize.token_ids_from=template"
            )


def generate_missing(cfg: Config, layout: Layout, todo: list[dict], server: tuple[str, str], report: dict,
                     manifest: StageManifest) -> tuple[dict[str, dict], bool]:
    """Answer the prompts in `todo` with the server check_server passed, (model, tokenizer check);
    returns (all finished rows, interrupted). A failure every request shares (a rejected API key)
    stops the run at once with one error line."""
    model, tok_check = server
    report |= {"base_url": cfg.generate.base_url, "concurrency": cfg.generate.concurrency}
    generator, interrupted = asyncio.run(_generate(cfg, layout, todo, model))
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # asyncio restored the default
    report |= {"model": model, "tokenizer_check": tok_check, "this_run": run_stats(generator.stats, len(todo))}
    if generator.fatal is not None:
        fail(layout, report, manifest, generator.fatal)
    done, _ = load_done(layout.raw_responses)
    return done, interrupted


def run_stats(s: RunStats, num_prompts: int) -> dict:
    el = s.elapsed()
    return {
        "prompts": num_prompts, "done": s.done, "failed": s.failed, "requests": s.requests, "retries": s.retries,
        "retry_reasons": dict(s.retry_reasons), "failure_reasons": dict(s.failure_reasons),
        "finish_reasons": dict(s.finish_reasons), "turn_flags": dict(s.turn_flags), "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens, "elapsed_s": round(el, 3),
        "requests_per_s": round(s.requests / el, 3), "samples_per_s": round(s.done / el, 3),
        "completion_tokens_per_s": round(s.completion_tokens / el, 1),
        "max_in_flight": s.max_in_flight, "avg_in_flight": round(s.avg_in_flight(), 2),
    }


def generation_line(report: dict) -> str:
    r = report.get("this_run")
    if r is None:
        return ""
    return (f"{r['done']} generated, {r['failed']} failed, {r['retries']} retries in {r['elapsed_s']:.1f}s "
            f"({r['requests_per_s']:.2f} req/s, {r['completion_tokens_per_s']:.0f} tok/s); ")


def account_results(layout: Layout, prompts: list[dict], done: dict[str, dict], report: dict, interrupted: bool) -> dict[str, dict]:
    """Rewrite failed.jsonl with the ids still not done; returns them."""
    prompt_ids = {p["id"] for p in prompts}
    done_ids = {pid for pid in done if pid in prompt_ids}
    still_failed = finalize_failed(layout, prompt_ids, done_ids)
    report |= {"num_done": len(done_ids), "num_failed": len(still_failed), "interrupted": interrupted}
    return still_failed


def failed_advice(layout: Layout, still_failed: dict[str, dict]) -> str:
    """What to do about the failed prompts: a rerun retries them, which helps only for transient trouble."""
    if not still_failed:
        return ""
    final = sum(r.get("retryable") is False for r in still_failed.values())
    if not final:
        return f" (rerun to retry them; reasons in {layout.failed})"
    transient = len(still_failed) - final
    return (f" ({final} rejected as invalid or not encodable, which a rerun repeats: fix or remove those prompts"
            f"{f'; {transient} for transient reasons, which a rerun retries' if transient else ''}; reasons in {layout.failed})")


def check_failure_share(cfg: Config, layout: Layout, report: dict, still_failed: dict[str, dict], manifest: StageManifest) -> None:
    """No sample at all, or more failures than generate.max_failure_fraction: an error, and no
    train.jsonl is written (later stages must not train on a broken generation)."""
    n, failed = report["num_prompts"], len(still_failed)
    if not failed:
        return
    causes = Counter(str(r.get("status_code") or r.get("error_type") or "unknown") for r in still_failed.values())
    why = ", ".join(f"{cause} x{count}" for cause, count in causes.most_common(3))
    todo = f"reasons per id in {layout.failed}; fix the server or the prompts and rerun (finished samples are kept, failed ones retried)"
    limit = cfg.generate.max_failure_fraction
    if report["num_done"] == 0:
        fail(layout, report, manifest, f"no prompt got an answer: all {failed} of {n} failed every retry ({why}); {todo}")
    if failed / n > limit:
        fail(layout, report, manifest, f"{failed} of {n} prompts ({failed / n:.0%}) failed every retry, more than "
                                      f"generate.max_failure_fraction={limit:g} ({why}); {todo}")


def fail(layout: Layout, report: dict, manifest: StageManifest, message: str) -> None:
    """Record why the run failed in generate_report.json and the manifest, then stop with one line."""
    atomic_write_json(layout.generate_report, report | {"complete": False, "error": message})
    manifest.partial(manifest.result, outcome="failed")
    raise PipelineError(message)


async def check_server_token_ids(client, g: GenerateConfig, model: str) -> None:
    """token_ids_from=server: one 1-token request must come back with token ids, or every
    request of the run would (after generating in full). Transient trouble only warns: each
    real request is checked again."""
    import openai

    try:
        resp = await client.with_options(timeout=min(g.timeout_s, 60.0)).chat.completions.create(
            **chat_request(g, model, [{"role": "user", "content": "hi"}], max_tokens=1, temperature=0.0,
                           return_token_ids=True))
        turn = parse_completion(resp)
    except openai.BadRequestError as e:
        raise PipelineError(f"the server at {g.base_url} rejected a request with return_token_ids=true "
                            f"({' '.join(str(e).split())[:200]}); {MISSING_TOKEN_IDS}") from None
    except Exception as e:  # noqa: BLE001 - transient: the per-request check still applies
        log.warning("could not check that the server returns token ids (%s); each request is checked", type(e).__name__)
        return
    if not has_token_ids(turn):
        raise PipelineError(f"the server at {g.base_url}: {MISSING_TOKEN_IDS}")


def report_server_capacity(g: GenerateConfig, todo: list[dict], tokenizer, sample: int = 32) -> Optional[int]:
    """Print how many requests the server's KV cache holds at once (vLLM's /metrics), beside
    generate.concurrency, and warn when the concurrency is far above it; returns the KV tokens (None when
    the server does not say: best effort, generation does not depend on it)."""
    try:
        kv_tokens = kv_cache_tokens(scrape_metrics(g.base_url, timeout=check_timeout(g), api_key=api_key(g)))
    except PipelineError as e:
        log.info("not reporting the server's KV capacity: %s", e)
        return None
    if not kv_tokens:
        return None
    # a prompt's length, from a few prompts' text (a template adds a few tokens each turn)
    lengths = [len(tokenizer(" ".join(str(m.get("content") or "") for m in p["messages"]))["input_ids"]) + 8
               for p in todo[:sample]]
    prompt_tokens = sum(lengths) // max(1, len(lengths))
    line, too_many = concurrency_line(kv_tokens, prompt_tokens + g.max_tokens, g.concurrency)
    print(f"01b_generate_synthetic: {line}", flush=True)
    if too_many:
        log.warning("generate.concurrency %d is over 4x what the server's KV cache holds at full length; the rest wait in "
                    "vLLM's queue and that wait counts against generate.timeout_s (%gs): lower the concurrency or raise "
                    "timeout_s (README: sizing the server)", g.concurrency, g.timeout_s)
    return kv_tokens


def check_server(cfg: Config, todo: list[dict], tokenizer) -> tuple[str, str]:
    """Before any generation request (and before --overwrite deletes anything): the server answers,
    serves the model, tokenizes as our tokenizer does and (token_ids_from=server) returns token ids;
    its KV capacity is printed. Every call within generate.timeout_s in all. Returns (model,
    tokenizer check)."""
    model, tok_check = asyncio.run(_check_server(cfg, tokenizer))
    report_server_capacity(cfg.generate, todo, tokenizer)
    return model, tok_check


async def _check_server(cfg: Config, tokenizer) -> tuple[str, str]:
    client = make_client(cfg.generate)
    try:
        model = await resolve_model(client, cfg)  # first request: an unreachable server fails in a second
        tok_check = await check_tokenizer_matches(client, cfg, model, tokenizer)
        if tok_check != "match":
            log.warning("could not verify the tokenizer against the server: %s", tok_check)
        if cfg.tokenize.token_ids_from == "server":
            await check_server_token_ids(client, cfg.generate, model)
        return model, tok_check
    finally:
        await client.close()


async def _generate(cfg: Config, layout: Layout, todo: list[dict], model: str):
    pool = make_clients(cfg.generate)
    try:
        with JsonlAppender(layout.raw_responses, cfg.generate.fsync_every) as raw, JsonlAppender(layout.failed, 1) as failed:
            generator = Generator(cfg, pool, model, raw, failed, seed=cfg.data.seed)
            completed = await generator.run(todo)
    finally:
        for c in pool:
            await c.close()
    return generator, not completed
