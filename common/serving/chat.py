"""The one chat client: how every stage talks to an OpenAI-compatible server (vLLM).

01b (common.data.generate) generates the training conversations with it, 05
(common.evaluate.serve) measures the draft with it. Both build their clients, their requests and
read the answers here, so a setting such as generate.extra_body reaches every request the same way.

- `make_client` / `make_clients`: the OpenAI client (async for 01b, blocking for 05's thread
  pool), its httpx connection pool sized to the requests in flight, every call held to its timeout
  in all (common.serving.http), the API key read from the environment variable
  generate.api_key_env (never logged, never written).
- `chat_request`: the one request body: model, messages, max_tokens, sampling, and extra_body =
  generate.extra_body + enable_thinking (as chat_template_kwargs) + return_token_ids when asked.
- `parse_completion`: a chat completion -> {"reasoning", "content", "finish_reason", "usage"}
  (+ vLLM's token ids when the request asked for them); `MalformedResponse` when unusable.
- `server_root`, `served_model`: the server's root URL (/tokenize, /health, /metrics), the model it serves.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

from common.core.config import GenerateConfig
from common.core.errors import PipelineError

# httpx's pool checks every pooled connection on each request (O(pool size) syscalls), so one
# client with 512 connections makes the client CPU-bound; pools of 64 halve the CPU per request
# (bench/RESULTS.md).
CONNECTIONS_PER_CLIENT = 64


# ----------------------------------------------------------------------------- clients


def api_key(g: GenerateConfig) -> str:
    """The API key: the value of the environment variable generate.api_key_env. Never logged."""
    return os.environ.get(g.api_key_env) or "EMPTY"


def make_client(g: GenerateConfig, base_url: Optional[str] = None, *, connections: Optional[int] = None,
                blocking: bool = False, max_retries: int = 0):
    """An OpenAI client for the server at base_url (default generate.base_url).

    Timeout generate.timeout_s per request, a total deadline (common.serving.http: a server sending
    a byte a second cannot hold a request longer); a pool of `connections` (default
    generate.concurrency) + 8 connections. blocking=False gives an AsyncOpenAI (01b), True an OpenAI
    for a thread pool (05). max_retries: openai-python's own silent retries; 01b retries itself, with
    backoff and accounting, so it keeps the default 0.
    """
    import httpx2
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient, DefaultHttpxClient, OpenAI

    from common.serving.http import with_deadlines

    connections = (connections or g.concurrency) + 8
    limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
    client_cls, http_cls = (OpenAI, DefaultHttpxClient) if blocking else (AsyncOpenAI, DefaultAsyncHttpxClient)
    return client_cls(
        base_url=base_url or g.base_url,
        api_key=api_key(g),
        timeout=g.timeout_s,
        max_retries=max_retries,
        http_client=with_deadlines(http_cls(limits=limits, timeout=g.timeout_s)),
    )


def make_clients(g: GenerateConfig) -> list:
    """Enough async clients of at most CONNECTIONS_PER_CLIENT connections to keep
    generate.concurrency requests in flight (01b sends round-robin over them)."""
    n = max(1, math.ceil(g.concurrency / CONNECTIONS_PER_CLIENT))
    per_client = math.ceil(g.concurrency / n)
    return [make_client(g, connections=per_client) for _ in range(n)]


def server_root(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port (vLLM's /tokenize, /health, /metrics live there)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def served_model(client) -> str:
    """The first model a (blocking) client's server lists."""
    import openai

    try:
        models = [m.id for m in client.models.list().data]
    except openai.OpenAIError as e:  # no complete answer within the client's timeout, a refused connection, 4xx/5xx
        raise PipelineError(f"the server at {client.base_url} did not list its models (GET /v1/models: {type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]}); see the vLLM server log under run_dir/logs/") from None
    except (AttributeError, TypeError):  # openai's parser on a 200 that is not JSON (an HTML page)
        raise PipelineError("the server answered GET /v1/models with something that is not an OpenAI model list (an HTML "
                            "page?); is it the vLLM server?") from None
    if not models:
        raise PipelineError("the vLLM server lists no models")
    return models[0]


# ----------------------------------------------------------------------------- requests


def request_extra_body(g: GenerateConfig, return_token_ids: bool = False) -> dict:
    """generate.extra_body + enable_thinking (chat_template_kwargs) + return_token_ids (vLLM >= 0.10)."""
    extra_body = dict(g.extra_body)
    if g.enable_thinking is not None:
        extra_body["chat_template_kwargs"] = dict(extra_body.get("chat_template_kwargs") or {}) | {
            "enable_thinking": g.enable_thinking}
    if return_token_ids:
        extra_body["return_token_ids"] = True
    return extra_body


def template_kwargs_of(g: GenerateConfig) -> dict:
    """The chat template's keyword arguments the requests carry (enable_thinking), for rendering them here too."""
    return {} if g.enable_thinking is None else {"enable_thinking": g.enable_thinking}


def chat_request(g: GenerateConfig, model: str, messages: list[dict], *, max_tokens: int, temperature: float,
                 top_p: Optional[float] = None, return_token_ids: bool = False, chat_template: Optional[str] = None) -> dict:
    """The keyword arguments of client.chat.completions.create: the one request body of every stage.

    top_p None leaves the server's default; extra_body is request_extra_body (None when empty), with chat_template
    where the request carries its own (vLLM: only on a server started with --trust-request-chat-template).
    """
    request = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    if top_p is not None:
        request["top_p"] = top_p
    extra_body = request_extra_body(g, return_token_ids) | ({"chat_template": chat_template} if chat_template else {})
    request["extra_body"] = extra_body or None
    return request


# ----------------------------------------------------------------------------- responses


class MalformedResponse(Exception):
    """The server answered 200 but not with a usable chat completion."""


def _field(obj: Any, name: str) -> Any:
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None) or {}
        value = extra.get(name)
    return value


def _token_id_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise MalformedResponse(f"{what} is not a list of integers")
    return value


def parse_completion(resp: Any) -> dict:
    """A chat completion -> {"reasoning", "content", "finish_reason", "usage"}; MalformedResponse if unusable.

    When the response carries vLLM's token ids (request field return_token_ids), they come
    back as "prompt_token_ids" (response top level) and "completion_token_ids" (the choice's
    `token_ids`); otherwise those keys are absent.
    """
    if isinstance(resp, (str, bytes)):
        snippet = resp[:80] if isinstance(resp, str) else resp[:80].decode("utf-8", "replace")
        raise MalformedResponse(f"response body is not JSON: {snippet!r}")
    choices = getattr(resp, "choices", None)
    if not choices:
        raise MalformedResponse("200 response with no choices")
    choice = choices[0]
    message = getattr(choice, "message", None)
    if message is None:
        raise MalformedResponse("200 response whose first choice has no message")
    # Current vLLM: `reasoning`; older vLLM and other servers: `reasoning_content`.
    reasoning = _field(message, "reasoning") or _field(message, "reasoning_content") or ""
    content = _field(message, "content") or ""
    if not isinstance(reasoning, str) or not isinstance(content, str):
        raise MalformedResponse("message reasoning/content is not a string")
    usage = getattr(resp, "usage", None)
    usage = usage.model_dump(exclude_none=True) if hasattr(usage, "model_dump") else (usage or {})
    out = {
        "reasoning": reasoning,
        "content": content,
        "finish_reason": getattr(choice, "finish_reason", None),
        "usage": {k: v for k, v in usage.items() if isinstance(v, (int, float))},
    }
    prompt_ids, completion_ids = _field(resp, "prompt_token_ids"), _field(choice, "token_ids")
    if prompt_ids is not None:
        out["prompt_token_ids"] = _token_id_list(prompt_ids, "prompt_token_ids")
    if completion_ids is not None:
        out["completion_token_ids"] = _token_id_list(completion_ids, "choices[0].token_ids")
    return out


def has_token_ids(turn: Any) -> bool:
    """A parsed completion (or a stored turn) carries both lists of vLLM's token ids."""
    return (isinstance(turn, dict) and isinstance(turn.get("prompt_token_ids"), list)
            and isinstance(turn.get("completion_token_ids"), list))
