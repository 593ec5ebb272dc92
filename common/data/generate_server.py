"""01b's start-up checks of the generation server, before any generation request.

check_server runs them in order (and before --overwrite deletes anything, so a refused start
keeps the previous outputs): the server answers and serves the model (resolve_model), it
tokenizes as our tokenizer does (check_tokenizer_matches, via vLLM's /tokenize), and it answers a
1-token chat request (probe_chat: with tokenize.token_ids_from=server always, as that request must
come back with token ids; otherwise under --overwrite, where a server that lists models but refuses
chat would fail only after the old outputs were deleted). Then it prints how many requests the
server's KV cache holds beside generate.concurrency (report_server_capacity). Each of these calls
has a deadline of generate.timeout_s, at most 30 s (check_timeout; 60 s for the chat probe).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Optional

from common.core.config import Config, GenerateConfig
from common.core.errors import DataError, PipelineError
from common.data.generate_requests import MISSING_TOKEN_IDS
from common.serving.chat import api_key, chat_request, has_token_ids, make_client, parse_completion, server_root
from common.serving.sizing import concurrency_line, kv_cache_tokens
from common.serving.vllm_server import scrape_metrics

log = logging.getLogger("generate")

# A string whose tokenization must agree between our tokenizer and the served model's.
TOKENIZER_PROBE = "Hello, world! 12345 <think>\nLet me think: ünïcödé, 漢字, emoji 🙂.\n</think>\n\nDone.<|im_end|>"


@dataclass(frozen=True)
class ServerCheck:
    """What check_server found: the model to request, and "match" or why the tokenizer went unchecked."""

    model: str
    tokenizer_check: str


def check_server(cfg: Config, todo: list[dict], tokenizer, overwrite: bool = False) -> ServerCheck:
    """Before any generation request (and before --overwrite deletes anything): the server answers,
    serves the model, tokenizes as our tokenizer does and answers a 1-token chat request (with token
    ids under token_ids_from=server; under --overwrite in any mode); its KV capacity is printed."""
    server = asyncio.run(_check_server(cfg, tokenizer, overwrite))
    report_server_capacity(cfg.generate, todo, tokenizer)
    return server


async def _check_server(cfg: Config, tokenizer, overwrite: bool) -> ServerCheck:
    client = make_client(cfg.generate)
    try:
        model = await resolve_model(client, cfg)  # first request: an unreachable server fails in a second
        tok_check = await check_tokenizer_matches(client, cfg, model, tokenizer)
        if tok_check != "match":
            log.warning("could not verify the tokenizer against the server: %s", tok_check)
        server_ids = cfg.tokenize.token_ids_from == "server"
        if server_ids or overwrite:
            await probe_chat(client, cfg.generate, model, return_token_ids=server_ids)
        return ServerCheck(model, tok_check)
    finally:
        await client.close()


def check_timeout(g: GenerateConfig) -> float:
    """The deadline of one of 01b's start-up calls (/v1/models, /tokenize, /metrics): generate.timeout_s, at most
    30 s (a healthy server answers them at once; a generation request may take the whole timeout_s)."""
    return min(g.timeout_s, 30.0)


def _unreachable(cfg: Config, exc: BaseException) -> PipelineError:
    return PipelineError(
        f"cannot reach the generation server at {cfg.generate.base_url} ({type(exc).__name__}); start one with "
        f"`python -m vllm.entrypoints.openai.api_server --model {cfg.target.model or 'TARGET_DIR'} --port 8000` "
        "or set generate.base_url"
    )


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


async def probe_chat(client, g: GenerateConfig, model: str, return_token_ids: bool) -> None:
    """One 1-token chat request, as every request of the run will be. A refusal that every request would
    meet is one error line now: the key (401/403; a proxy may list models without one), the request
    (400/404/422: say a model without a chat template) or, with return_token_ids, a server that returns
    no token ids (vLLM < 0.10). Transient trouble (timeouts, 5xx, resets) only warns: each real request
    is retried and checked."""
    import openai

    try:
        resp = await client.with_options(timeout=min(g.timeout_s, 60.0)).chat.completions.create(
            **chat_request(g, model, [{"role": "user", "content": "hi"}], max_tokens=1, temperature=0.0,
                           return_token_ids=return_token_ids))
        turn = parse_completion(resp)
    except (openai.AuthenticationError, openai.PermissionDeniedError) as e:
        raise PipelineError(f"the server at {g.base_url} refused a 1-token chat request with {e.status_code} "
                            f"({_server_message(e)}); check the API key in the environment variable {g.api_key_env} "
                            f"(generate.api_key_env) and its permissions, then rerun: nothing was generated or deleted") from None
    except openai.BadRequestError as e:
        if return_token_ids:
            raise PipelineError(f"the server at {g.base_url} rejected a request with return_token_ids=true "
                                f"({_server_message(e)}); {MISSING_TOKEN_IDS}") from None
        raise _refused(g, e) from None
    except (openai.NotFoundError, openai.UnprocessableEntityError) as e:
        raise _refused(g, e) from None
    except Exception as e:  # noqa: BLE001 - transient: the per-request checks still apply
        log.warning("could not check a 1-token chat request (%s); each request is checked", type(e).__name__)
        return
    if return_token_ids and not has_token_ids(turn):
        raise PipelineError(f"the server at {g.base_url}: {MISSING_TOKEN_IDS}")


def _server_message(e) -> str:
    return " ".join(str(e).split())[:200]


def _refused(g: GenerateConfig, e) -> PipelineError:
    return PipelineError(f"the server at {g.base_url} refused a 1-token chat request with {e.status_code} "
                         f"({_server_message(e)}); every request of the run would be refused: check generate.model, "
                         f"that the served model has a chat template, and generate.extra_body, then rerun: nothing "
                         f"was generated or deleted")


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
