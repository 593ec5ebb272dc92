"""01b's tokenization: the finished conversations -> data/train.jsonl + data/eval.jsonl.

Where the token ids come from (tokenize.token_ids_from):
- "template" (default): the stored conversation re-rendered with the target's chat template
  (every assistant turn learned). check_token_sources proves, before the first request, that the
  template reproduces a generated turn (Kimi-K2.5's, which strips the reasoning it renders,
  does not: that fails at once rather than after the whole generation).
- "server": the last turn's `prompt_token_ids` (loss 0; earlier turns of a multi-turn
  conversation sit inside it as the template renders them) + its `completion_token_ids`
  (loss 1), as vLLM reported them. Token-exact whatever the template does.
A sample that cannot be tokenized is a counted skip (TokenizeCounts.skipped), not an error.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from common.core.config import Config
from common.core.errors import DataError, PipelineError
from common.core.tokenized import tokenized_writer
from common.core.run_folder import Layout
from common.data.generate_files import last_turn
from common.serving.chat import has_token_ids, template_kwargs_of


def tokenizer_path(cfg: Config) -> str:
    path = cfg.target.tokenizer or cfg.target.model
    if not path:
        raise PipelineError("target.model is not set; 01b needs the target's tokenizer (set target.model or target.tokenizer)")
    return path


def load_target_tokenizer(cfg: Config):
    """The target's tokenizer; with token_ids_from=template it must have a chat template."""
    from common.target.tokenization import load_tokenizer

    return load_tokenizer(tokenizer_path(cfg), cfg.target.trust_remote_code,
                          require_chat_template=cfg.tokenize.token_ids_from != "server")


# ----------------------------------------------------------------------------- before any request


# A generated turn as the stage stores it; the fail-fast check renders it before any request.
PROBE_TURNS = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "Hello! How can I help?", "reasoning": "The user greets me; reply briefly."},
    {"role": "user", "content": "Tell me more."},
    {"role": "assistant", "content": "Sure, here is more.", "reasoning": "They want more detail."},
]


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


def check_token_ids_source(cfg: Config, tokenizer, multi_turn: bool) -> None:
    """Fail fast, before any request: with token_ids_from=template the chat template must
    reproduce a generated turn, or tokenization would fail only after the whole generation.
    Probes one turn, and two when some prompt has several user turns. The probe carries reasoning
    unless the model has none: a template without a reasoning part, a tokenizer without <think>, and
    no server.reasoning_parser (Llama-3.1, Mistral, SmolLM2: vLLM returns no reasoning field for them)."""
    if cfg.tokenize.token_ids_from != "template":
        return
    from common.target.tokenization import renders_reasoning, stop_token_ids, tokenize_conversation

    kwargs = template_kwargs_of(cfg.generate)
    probe = PROBE_TURNS if multi_turn else PROBE_TURNS[:2]
    try:
        if not renders_reasoning(tokenizer, kwargs) and not thinks(cfg, tokenizer):
            probe = [{k: v for k, v in m.items() if k != "reasoning"} for m in probe]
        tokenize_conversation(tokenizer, probe, 1 << 30, stop_ids=stop_token_ids(tokenizer, tokenizer_path(cfg)),
                              template_kwargs=kwargs)
    except DataError as e:
        raise DataError(f"{e}; checked before generating: set tokenize.token_ids_from=server to take token ids "
                        "from vLLM instead") from None


def thinks(cfg: Config, tokenizer) -> bool:
    """Whether the server can return reasoning apart from the content: a reasoning parser is set, or the
    tokenizer knows a think marker (Qwen3, DeepSeek-R1, Kimi-K2.5)."""
    vocab = tokenizer.get_vocab()
    return bool(cfg.server.reasoning_parser) or any(t in vocab for t in ("<think>", "</think>"))


def leave_out_overlong(cfg: Config, tokenizer, prompts: list[dict], skipped: Counter) -> list[dict]:
    """The prompts the server can take: one of server.max_model_len tokens or more (as the chat template
    renders it) would come back 400, one round trip each. The others are counted in `skipped`, by reason."""
    from common.target.tokenization import ContextCheck

    check = ContextCheck(tokenizer, cfg.server.max_model_len, template_kwargs_of(cfg.generate),
                         ("generate.max_tokens", cfg.generate.max_tokens))
    kept = []
    for p in prompts:
        reason = check.reason(p["messages"])
        if reason:
            skipped[reason] += 1
        else:
            kept.append(p)
    if not kept and prompts:
        raise DataError(f"all {len(prompts)} prompts of {Layout.of(cfg).prompts} are too long for the server "
                        f"(server.max_model_len={cfg.server.max_model_len} tokens, the prompt as the chat template "
                        f"renders it included; {dict(skipped)}); raise server.max_model_len or shorten the prompts "
                        f"(data.max_user_turns)")
    return kept


# ----------------------------------------------------------------------------- the samples


@dataclass
class TokenizeCounts:
    """What tokenize_outputs wrote: generate_report.json's `tokenize` (field order = key order)."""

    train: int
    eval: int
    truncated: int
    skipped: dict[str, int]  # samples left out, by reason (malformed, missing_token_ids, token_boundary_merge, ...)
    # samples whose dataset answer spells the tokenizer's control tokens (pasted chat-template text: <|im_end|>,
    # <think>, ...): written with that text as plain text, never as the tokens (a forged turn with loss 1)
    answers_with_control_text: int
    tokens: int
    loss_tokens: int
    seconds: float
    max_seq_len: int
    overlong: str
    token_ids_from: str


def tokenize_outputs(cfg: Config, layout: Layout, prompts: list[dict], done: dict[str, dict], tokenizer) -> TokenizeCounts:
    """raw responses -> data/train.jsonl + data/eval.jsonl. Each sample is written as soon as it is
    tokenized (50k long samples held as Python lists would take GBs); both files appear, complete,
    only when every sample is done (atomic).

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
                                         stop_ids=stop_ids, template_kwargs=template_kwargs, stats=stats,
                                         literal_answers=row.get("answers") == "dataset")
        except TokenBoundaryError:  # this sample's text, not the template: skip it, counted
            stats["token_boundary_merge"] += 1
            return None

    kept = {"train": 0, "eval": 0}
    t0 = time.monotonic()
    tokens = loss_tokens = 0
    with tokenized_writer(layout) as write:
        for prompt in tqdm(prompts, desc="tokenize", unit="sample", file=sys.stderr, dynamic_ncols=True):
            row = done.get(prompt["id"])
            sample = tokenize(row) if row is not None else None
            if sample is None:
                continue
            split = "eval" if prompt.get("split") == "eval" else "train"
            write(split, prompt["id"], sample)
            kept[split] += 1
            tokens += len(sample["input_ids"])
            loss_tokens += sum(sample["loss_mask"])
    return TokenizeCounts(
        train=kept["train"],
        eval=kept["eval"],
        truncated=stats.get("truncated", 0),
        skipped={k: v for k, v in stats.items() if k not in ("kept", "truncated", "answers_with_control_text")},
        answers_with_control_text=stats.get("answers_with_control_text", 0),
        tokens=tokens,
        loss_tokens=loss_tokens,
        seconds=round(time.monotonic() - t0, 3),
        max_seq_len=cfg.tokenize.max_seq_len,
        overlong=cfg.tokenize.overlong,
        token_ids_from=cfg.tokenize.token_ids_from,
    )
