"""Chat-template tokenization with a loss mask on what the model generated.

`tokenize_conversation` renders a whole conversation with the target tokenizer's own chat
template and marks with loss_mask=1 exactly the tokens the model produced in its assistant
turns: the reasoning with its <think>/</think> delimiters, the content and the end-of-turn
token. System, user and template tokens (role headers, the newline after the end-of-turn
token) get 0.

It is template-agnostic. For assistant turn i:
    prefix  = render(messages[:i], add_generation_prompt=True)   # what the model was given
    through = render(messages[:i + 1])                           # ... plus what it produced
The assistant span is the characters between the two. Both must be prefixes of the full
rendering (templates that rewrite earlier turns, e.g. drop old reasoning, break this and get
a DataError). Characters map to tokens through the fast tokenizer's offset mapping; a slow
tokenizer (no offsets, e.g. Kimi's TikToken one) tokenizes prefix and through separately
instead, and the first must be a token prefix of the second. Within the span, everything
after the last stop token (eos / generation_config eos ids) is template text (Qwen's "\\n"
after <|im_end|>) and gets 0.

Text from a dataset (data.answers dataset | fill) is not the model's output: an answer that spells the
tokenizer's control tokens (pasted chat-template text such as `<|im_end|>\\n<|im_start|>user`, or `<think>`)
would otherwise become those tokens, a forged turn boundary with loss 1. With literal_answers such content
is encoded as the plain text it is (the tokenizer's added tokens not recognised inside it), and counted.
A generated answer keeps the default: a marker in the target's own output is the token it generated.

`tokenize_server_ids` is the other source of samples (tokenize.token_ids_from=server): the
exact ids vLLM reports for the last turn, prompt (loss 0) + completion (loss 1). It needs no
template round trip, so it works for templates that rewrite what the model generated.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional

from common.core.errors import DataError

# Message keys templates use for an assistant's reasoning: current vLLM and our templates
# read `reasoning`, Qwen3/DeepSeek/Kimi templates read `reasoning_content`. We set both,
# like vLLM's own chat renderer does.
REASONING_KEYS = ("reasoning", "reasoning_content")


class TokenBoundaryError(DataError):
    """One conversation's reply merges into a token with the text before or after it, so its
    tokens cannot be located. Depends on the sample (e.g. a reply starting with whitespace the
    generation prompt ends with): 01b counts it as a skip instead of stopping."""


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, require_chat_template: bool = True):
    """The target's tokenizer, fast or slow (slow ones, like Kimi's TikToken tokenizer, need
    trust_remote_code and take the token-prefix path in tokenize_conversation)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        hint = "" if trust_remote_code else " (if the model ships its own tokenizer code, set target.trust_remote_code=true)"
        raise DataError(
            f"cannot load the target tokenizer from '{name_or_path}' ({(str(e).splitlines() or [type(e).__name__])[0]}); "
            f"set target.tokenizer or target.model to a local model directory{hint}"
        ) from None
    if require_chat_template and not getattr(tok, "chat_template", None):
        raise DataError(f"the tokenizer at '{name_or_path}' has no chat_template; the target must ship one")
    return tok


def stop_token_ids(tokenizer, model_dir: Optional[str] = None) -> set[int]:
    """Token ids that end an assistant turn: the tokenizer's eos plus generation_config's eos ids."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir is not None:
        gen_cfg = Path(model_dir) / "generation_config.json"
        if gen_cfg.is_file():
            try:
                eos = json.loads(gen_cfg.read_text(encoding="utf-8")).get("eos_token_id")
            except (OSError, ValueError):
                eos = None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(i) for i in eos if isinstance(i, int))
    return ids


def _reasoning_of(message: dict) -> str:
    return next((message[k] for k in REASONING_KEYS if message.get(k)), "") or ""


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as the template sees them: content never None, reasoning under every key templates use."""
    out = []
    for m in messages:
        t = {k: v for k, v in m.items() if k not in REASONING_KEYS}
        t["content"] = m.get("content") or ""
        reasoning = _reasoning_of(m)
        if m.get("role") == "assistant" and reasoning:
            for k in REASONING_KEYS:
                t[k] = reasoning
        out.append(t)
    return out


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except Exception as e:  # jinja errors (raise_exception in templates) come in many types
        raise DataError(f"the target's chat template failed to render a conversation: {type(e).__name__}: {e}") from None
    if not isinstance(text, str):
        raise DataError(f"the chat template returned {type(text).__name__}, expected a string")
    return text


def assistant_char_spans(
    tokenizer, messages: list[dict], template_kwargs: Optional[dict] = None
) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; return (text, [(start, end) char span of each assistant turn]).

    Raises DataError when the template breaks the prefix property or drops an assistant's
    reasoning or content.
    """
    template_kwargs = template_kwargs or {}
    msgs = _template_messages(messages)
    full = _render(tokenizer, msgs, False, template_kwargs)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prefix = _render(tokenizer, msgs[:i], True, template_kwargs)
        through = _render(tokenizer, msgs[: i + 1], False, template_kwargs)
        if not (through.startswith(prefix) and full.startswith(through)):
            raise DataError(
                "the target's chat template is not prefix-stable: rendering the conversation up to assistant "
                f"turn {i} (with add_generation_prompt=True, then through that turn) is not a prefix of the full "
                "rendering, so the tokens the model generated cannot be located (templates that rewrite earlier "
                "turns, e.g. drop old reasoning, do this); use data.max_user_turns=1 or a template that renders "
                "history verbatim"
            )
        start, end = len(prefix), len(through)
        span = full[start:end]
        reasoning = _reasoning_of(m)
        if reasoning and reasoning not in span:
            raise DataError(
                f"the target's chat template does not render assistant reasoning (message keys {REASONING_KEYS}); "
                "the mask would miss the reasoning tokens: use a template that renders `reasoning` or "
                "`reasoning_content`"
            )
        if m["content"] and m["content"] not in span:
            raise DataError("the target's chat template changes the assistant content when rendering it; cannot mask it")
        spans.append((start, end))
    return full, spans


def renders_reasoning(tokenizer, template_kwargs: Optional[dict] = None) -> bool:
    """Whether the chat template writes an assistant turn's reasoning into the text at all (Qwen3, DeepSeek,
    Kimi do; Llama-3.1, Mistral, SmolLM2 have no reasoning part and drop it)."""
    marker = "reasoning-probe-5f1c"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello.", "reasoning": marker}]
    return marker in _render(tokenizer, _template_messages(turns), False, template_kwargs or {})


class ContextCheck:
    """Whether a chat prompt fits a server of max_model_len tokens: vLLM refuses (400) a prompt of
    max_model_len tokens or more, and needs one free position for the first generated token. The prompt
    is counted as the server renders it (the chat template with the generation prompt, no special tokens
    added); a tokenizer without a template counts the turns' text alone, a lower bound."""

    def __init__(self, tokenizer, max_model_len: int, template_kwargs: Optional[dict] = None,
                 max_tokens: Optional[tuple[str, int]] = None):
        """max_tokens: (its config key, value): vLLM refuses every request asking for more than max_model_len."""
        self.tokenizer, self.max_model_len, self.template_kwargs = tokenizer, max_model_len, template_kwargs or {}
        if max_tokens is not None and max_tokens[1] > max_model_len:
            raise DataError(f"{max_tokens[0]}={max_tokens[1]} is more than server.max_model_len={max_model_len}: vLLM refuses "
                            f"every such request (400); lower {max_tokens[0]} or raise server.max_model_len")

    def length(self, messages: list[dict], chat_template: Optional[str] = None) -> int:
        """chat_template: the one the request carries, in place of the target's."""
        if chat_template or getattr(self.tokenizer, "chat_template", None):
            kwargs = self.template_kwargs | ({"chat_template": chat_template} if chat_template else {})
            text = _render(self.tokenizer, _template_messages(messages), True, kwargs)
            return len(_encode(self.tokenizer, text))
        return sum(len(_encode(self.tokenizer, str(m.get("content") or ""))) for m in messages)

    def reason(self, messages: list[dict], chat_template: Optional[str] = None) -> Optional[str]:
        """None when the prompt fits; else the counted reason it is left out."""
        try:
            n = self.length(messages, chat_template)
        except DataError:  # the template refuses this conversation (raise_exception): so would the server
            return "chat_template_error"
        return None if n < self.max_model_len else "over_max_model_len"


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    max_seq_len: int,
    overlong: str = "truncate",
    *,
    stop_ids: Optional[Iterable[int]] = None,
    template_kwargs: Optional[dict] = None,
    stats: Optional[Counter] = None,
    literal_answers: bool = False,
) -> Optional[dict]:
    """Tokenize one conversation -> {"input_ids", "loss_mask"}, or None when it is skipped.

    overlong: "truncate" keeps the first max_seq_len tokens, "drop" skips the sample.
    literal_answers: the assistant turns are a dataset's text, not the model's output: control text in their
    content (the tokenizer's added tokens spelled out) is encoded as plain text, and the sample is counted
    in `stats` under answers_with_control_text.
    Raises DataError when the template cannot reproduce the turns, TokenBoundaryError (a
    DataError) when a token straddles a reply's start or end.
    Skips (None) are counted in `stats` (a Counter) under a reason key:
    empty_assistant (an assistant turn with neither content nor reasoning), no_assistant,
    dropped_overlong, no_loss_tokens (nothing left to learn after truncation), control_text_not_plain
    (literal_answers, and the tokenizer still makes control tokens of the control text).
    """
    stats = stats if stats is not None else Counter()
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    assistants = [m for m in messages if m.get("role") == "assistant"]
    if not assistants:
        stats["no_assistant"] += 1
        return None
    if any(not (m.get("content") or "").strip() and not _reasoning_of(m).strip() for m in assistants):
        stats["empty_assistant"] += 1
        return None

    text, spans = assistant_char_spans(tokenizer, messages, template_kwargs)
    literal = control_text_ranges(tokenizer, text, spans, assistants) if literal_answers else []
    try:
        if getattr(tokenizer, "is_fast", False):
            input_ids, token_spans = _token_spans_from_offsets(tokenizer, text, spans, literal)
        else:
            input_ids, token_spans = _token_spans_from_prefixes(tokenizer, text, spans, literal)
    except _ControlTokensInPlainText:
        stats["control_text_not_plain"] += 1
        return None
    if literal:
        stats["answers_with_control_text"] += 1
    stop_ids = set(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer)

    loss_mask = [0] * len(input_ids)
    for idx in token_spans:
        # Everything after the last stop token is template text the model never generated.
        last_stop = max((j for j, t in enumerate(idx) if input_ids[t] in stop_ids), default=None)
        if last_stop is not None:
            idx = idx[: last_stop + 1]
        for t in idx:
            loss_mask[t] = 1
    return _fit(input_ids, loss_mask, max_seq_len, overlong, stats)


def control_markers(tokenizer) -> dict[str, int]:
    """The texts the tokenizer turns into one of its control tokens wherever they stand ({text: id}): its added
    tokens (chat markers, <think>, ...) and its special tokens."""
    markers = dict(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))
    markers.update(tokenizer.get_added_vocab())
    return {text: i for text, i in markers.items() if text}


def control_text_ranges(tokenizer, text: str, spans: list[tuple[int, int]], assistants: list[dict]) -> list[tuple[int, int]]:
    """The char ranges of the rendered `text` holding an assistant turn's content that spells a control token
    (spans: assistant_char_spans', one per message of `assistants`)."""
    markers = control_markers(tokenizer)
    ranges = []
    for (start, end), m in zip(spans, assistants):
        content = m.get("content") or ""
        if any(marker in content for marker in markers):
            at = text.rfind(content, start, end)  # there: assistant_char_spans checked it
            ranges.append((at, at + len(content)))
    return ranges


class _ControlTokensInPlainText(Exception):
    """A tokenizer that makes control tokens even of text it was asked to encode as plain text."""


@functools.lru_cache(maxsize=4)
def _without_added_tokens(tokenizer):
    """The fast tokenizer's backend without its added tokens: `<|im_end|>` or `<think>` in a text is then the
    plain text it spells (split_special_tokens would still make <think>, an added token that is not special)."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))


def _encode_piece(tokenizer, piece: str, plain: bool, offsets: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """One piece of text -> (ids, char offsets, or [] when not asked); plain: control text as plain text."""
    if plain and getattr(tokenizer, "is_fast", False):
        enc = _without_added_tokens(tokenizer).encode(piece, add_special_tokens=False)
        ids, spans = list(enc.ids), list(enc.offsets)
    else:
        kwargs = {"split_special_tokens": True} if plain else {}
        enc = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=offsets, **kwargs)
        ids, spans = list(enc["input_ids"]), list(enc["offset_mapping"]) if offsets else []
    if plain and not set(ids).isdisjoint(control_markers(tokenizer).values()):
        raise _ControlTokensInPlainText
    return ids, spans


def _encode_with_offsets(tokenizer, text: str, literal: list[tuple[int, int]] = (), offsets: bool = True
                         ) -> tuple[list[int], list[tuple[int, int]]]:
    """text -> (ids, char offsets) as the tokenizer encodes it, except that control text inside the `literal`
    char ranges is plain text. Each literal range is encoded on its own (no token crosses its edges); without
    any, the text is encoded whole, as always."""
    ids, spans, at = [], [], 0
    for start, end in [*literal, (len(text), len(text))]:
        for a, b, plain in ((at, start, False), (start, end, True)):
            if a < b:
                piece_ids, piece_spans = _encode_piece(tokenizer, text[a:b], plain, offsets)
                ids += piece_ids
                spans += [(s + a, e + a) for s, e in piece_spans]
        at = end
    return ids, spans


def _encode(tokenizer, text: str, literal: list[tuple[int, int]] = ()) -> list[int]:
    """text -> ids (control text inside the `literal` char ranges as plain text); the ranges may end past text."""
    return _encode_with_offsets(tokenizer, text, [(s, min(e, len(text))) for s, e in literal if s < len(text)],
                                offsets=False)[0]


def _token_spans_from_offsets(tokenizer, text: str, spans: list[tuple[int, int]], literal: list[tuple[int, int]] = ()
                              ) -> tuple[list[int], list[list[int]]]:
    """Fast tokenizer: the tokens that begin inside each assistant char span."""
    input_ids, offsets = _encode_with_offsets(tokenizer, text, literal)
    for i, (start, end) in enumerate(spans):
        if any(s < edge < e for s, e in offsets for edge in (start, end)):
            raise TokenBoundaryError(
                f"a token of the rendered conversation straddles the start or end of assistant reply {i + 1} (a token "
                "merges across the boundary between the generation prompt and the reply), so the generated tokens "
                "cannot be located; set tokenize.token_ids_from=server to take token ids from vLLM instead"
            )
    token_spans = [[t for t, (s, e) in enumerate(offsets) if start <= s < end and e > s] for start, end in spans]
    return input_ids, token_spans


def _token_spans_from_prefixes(tokenizer, text: str, spans: list[tuple[int, int]], literal: list[tuple[int, int]] = ()
                               ) -> tuple[list[int], list[list[int]]]:
    """Slow tokenizer (no offsets): tokenize the text up to each span's start and end; both must
    be token prefixes of the full tokenization, and the span is the tokens between them."""
    input_ids = _encode(tokenizer, text, literal)
    token_spans = []
    for i, (start, end) in enumerate(spans):
        before, through = _encode(tokenizer, text[:start], literal), _encode(tokenizer, text[:end], literal)
        if through[: len(before)] != before or input_ids[: len(through)] != through:
            raise TokenBoundaryError(
                f"the target tokenizer is not a fast tokenizer (no offset mappings), and the tokens of the conversation "
                f"up to assistant reply {i + 1} are not a prefix of the tokens through it (a token merges across "
                "the boundary between the generation prompt and the reply), so the generated tokens cannot be located; "
                "set tokenize.token_ids_from=server to take token ids from vLLM instead"
            )
        token_spans.append(list(range(len(before), len(through))))
    return input_ids, token_spans


def _fit(input_ids: list[int], loss_mask: list[int], max_seq_len: int, overlong: str, stats: Counter) -> Optional[dict]:
    """Apply max_seq_len (truncate or drop) and the nothing-to-learn check; count the outcome."""
    if len(input_ids) > max_seq_len:
        if overlong == "drop":
            stats["dropped_overlong"] += 1
            return None
        input_ids, loss_mask = input_ids[:max_seq_len], loss_mask[:max_seq_len]
        stats["truncated"] += 1
    if not any(loss_mask):
        stats["no_loss_tokens"] += 1
        return None
    stats["kept"] += 1
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def tokenize_server_ids(
    prompt_token_ids: list[int],
    completion_token_ids: list[int],
    max_seq_len: int,
    overlong: str = "truncate",
    *,
    stats: Optional[Counter] = None,
) -> Optional[dict]:
    """A sample from the ids the server reported for one request (tokenize.token_ids_from=server).

    input_ids = prompt ids + completion ids, exactly what the target read and generated; loss 1
    on the completion (reasoning, </think>, content and the stop token, as sampled), 0 on the
    prompt. For a multi-turn conversation pass the LAST turn's ids: its prompt holds the earlier
    turns as the chat template re-renders them (Kimi-K2.5 strips their reasoning), which is not
    what the model generated then, so they are context with loss 0. Same truncate/drop and
    skip counting as tokenize_conversation.
    """
    stats = stats if stats is not None else Counter()
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    prompt_ids, completion_ids = [int(t) for t in prompt_token_ids], [int(t) for t in completion_token_ids]
    return _fit(prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids), max_seq_len, overlong, stats)
