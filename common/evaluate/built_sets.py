"""05's built prompt sets: sets 05 makes from the run's own held-out data, to measure where a draft trained on short
chats may not carry over (what EAGLE-3.1 claims to fix: acceptance on long contexts and under unseen system prompts).

Configured like every set, under evaluate.prompt_sets (docs: README's config reference):

    evaluate:
      prompt_sets:
        long_context: {built: long_context}                  # buckets up to the target's context
        long_context: {built: long_context, buckets: [512, 1024, 2048], prompts_per_bucket: 4}
        system_prompts: {built: system_prompts}
        chat_template: {built: chat_template}                # or {built: chat_template, template: "{% for ... %}"}

long_context    each prompt is a long pasted document, then a question about it, built to a length (in tokens, as
                the chat template renders it) in each bucket: a bucket's bound B takes prompts of more than the
                previous bound and at most B tokens, near B. The default bounds double from 512 up to the target's
                context: min(its max_position_embeddings, server.max_model_len) less evaluate.max_tokens (the answer's
                room). Each bucket is its own category, so vLLM's counters give acceptance per bucket.
                The documents are the held-out conversations' text: the eval split of data/prompts.jsonl in file
                order, each conversation with the target's own answers (data/raw_responses.jsonl) where 01b has
                answered it, else as 01 wrote it. Nothing of the training split is pasted; where that text is
                shorter than a document, it repeats (the report's document_pool_tokens says how much there is).
                Each prompt starts at another conversation.
system_prompts  the held-out prompts (the first evaluate.num_prompts, as the held-out set sends them), each under a
                system prompt from SYSTEM_PROMPTS in turn (it replaces a prompt's own); one the training split has
                (a system turn of data/prompts.jsonl's train rows) is left out and counted. Against the held-out set,
                the same questions: the difference is the system prompt's.
chat_template   the held-out prompts (as the held-out set sends them), each request carrying another chat template
                than the target's: `template` (Jinja, the variables of a Hugging Face template), or CHANGED_TEMPLATE,
                plain "### Role:" headers without the target's special tokens. vLLM renders it, and takes a request's
                template only from a server started with --trust-request-chat-template: every server the pipeline
                starts for a config with this set has it (evaluate/serve.py's target_server); a server of your own
                (05 --base-url) needs it too. A template the same as the target's own is refused (nothing changes).

A built set is made from the eval split, never the training split, so it is not checked against the training prompts
the way a file set is (the held-out set is not either).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Optional

from common.core.config import Config
from common.core.errors import ConfigError, DataError
from common.core.io import iter_jsonl
from common.core.run_folder import Layout
from common.evaluate.prompt_sets import PromptSet, first_user_turn, held_out_set
from common.target.tokenization import ContextCheck

FIRST_BUCKET = 512  # the default bounds: 512, 1024, ... below the context, then the context itself

# System prompts of other wording, roles and lengths than a chat dataset's usual "You are a helpful assistant."
SYSTEM_PROMPTS = [
    "You are Ada, the support assistant of a small bookshop. Be warm, and never invent stock or prices.",
    "Answer as a patient maths teacher would: state the idea first, then work through it.",
    "Reply in plain English suitable for a twelve-year-old reader.",
    "You are a terse command-line tool. Output only what was asked for, with no greeting or sign-off.",
    "The current date is 3 March 2031. You are an assistant for a city library's help desk.",
    "Think about edge cases before answering. If a question is ambiguous, say which reading you chose.",
    "You are a travel agent's assistant. Prefer trains to flights where the journey is under six hours.",
    "Format every answer as a short list of bullet points.",
    "You write for a hospital's patient leaflets: calm, clear, and without medical jargon.",
    "You are a code reviewer. Point out bugs first, style second, and keep each remark to one sentence.",
    "Role: a museum guide. Audience: visitors on a one-hour tour. Keep the tone light.",
    "Be precise about units and numbers, and round only at the end.",
]

DOCUMENT_QUESTIONS = [
    "Summarize the document above in a few sentences.",
    "What is the main topic of the document above?",
    "List three things the document above says.",
    "Which question in the document above is answered in the most detail, and how?",
]


# A template of another kind than a chat model's own: plain role headers, none of its special tokens.
CHANGED_TEMPLATE = ("{% for message in messages %}{{ '### ' ~ (message['role'] | capitalize) ~ ':\\n' ~ message['content'] ~ "
                    "'\\n\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '### Assistant:\\n' }}{% endif %}")


def build_prompt_set(cfg: Config, name: str, key: str, spec: dict, check: ContextCheck) -> PromptSet:
    if spec["built"] == "long_context":
        return long_context_set(cfg, name, key, spec, check)
    if spec["built"] == "chat_template":
        return chat_template_set(cfg, name, key, spec, check)
    return system_prompt_set(cfg, name, key, check)


# ----------------------------------------------------------------------------- long context


def bucket_label(bound: int) -> str:
    return f"<={bound} tokens"


def target_context(cfg: Config) -> Optional[int]:
    """The target's max_position_embeddings (its language model's), or None where its config has none."""
    from common.target.loading import load_target_info

    value = getattr(load_target_info(cfg.target).text_config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def context_limit(cfg: Config) -> tuple[int, str]:
    """The longest prompt a long-context bucket may hold, and what sets it: the target's context or
    server.max_model_len, whichever is smaller, less evaluate.max_tokens (the answer must fit after it)."""
    positions = target_context(cfg)
    if positions is not None and positions <= cfg.server.max_model_len:
        context, what = positions, f"the target's max_position_embeddings {positions}"
    else:
        context, what = cfg.server.max_model_len, f"server.max_model_len {cfg.server.max_model_len}"
    return context - cfg.evaluate.max_tokens, f"{what} less evaluate.max_tokens {cfg.evaluate.max_tokens}"


def default_buckets(limit: int) -> list[int]:
    bounds, b = [], FIRST_BUCKET
    while b < limit:
        bounds.append(b)
        b *= 2
    return bounds + [limit]


def document_pieces(cfg: Config) -> list[str]:
    """The held-out conversations' text, one piece per eval-split row of data/prompts.jsonl in file order: its
    messages' contents, with the target's own answers where 01b has them (data/raw_responses.jsonl)."""
    layout = Layout.of(cfg)
    if not layout.prompts.is_file():
        raise DataError(f"prompts file not found: {layout.prompts}; run 01_prepare_data.py with the same config first")
    rows = [r for r in iter_jsonl(layout.prompts) if r.get("split") == "eval" and isinstance(r.get("id"), str)]
    answered: dict[str, list] = {}
    if layout.raw_responses.is_file():  # read only: 01b may still be appending (a torn last line is skipped)
        eval_ids = {r["id"] for r in rows}
        for row in iter_jsonl(layout.raw_responses, tolerate_torn_tail=True, strict=False):
            if row.get("id") in eval_ids and isinstance(row.get("messages"), list):
                answered.setdefault(row["id"], row["messages"])
    pieces = []
    for r in rows:
        messages = answered.get(r["id"]) or r.get("messages") or []
        text = "\n\n".join(m["content"].strip() for m in messages
                           if isinstance(m, dict) and isinstance(m.get("content"), str) and m["content"].strip())
        if text:
            pieces.append(text)
    return pieces


def long_context_prompt(document: str, question: str) -> list[dict]:
    return [{"role": "user", "content": f"Read the document below, then answer the question after it.\n\n"
                                        f"<document>\n{document}\n</document>\n\n{question}"}]


def fit_prompt(check: ContextCheck, pool: str, start: int, question: str, low: int, bound: int,
               chars_per_token: float) -> tuple[list[dict], int]:
    """The prompt whose document is pool[start:] (repeated where short) cut to a length that renders to more than
    `low` and at most `bound` tokens, near `bound`; (messages, its length in tokens). A few renders: the cut is
    corrected by the measured length each time."""
    overhead = check.length(long_context_prompt("", question))
    aim = bound - max(1, (bound - low) // 16)
    if aim - overhead < 1:
        raise DataError(f"a long-context prompt needs more than {bound} tokens: its question and markup alone take {overhead}")
    n = max(1, int((aim - overhead) * chars_per_token))
    for _ in range(16):
        text = (pool * (1 + (start + n) // len(pool)))[start:start + n]
        messages = long_context_prompt(text, question)
        length = check.length(messages)
        if low < length <= bound:
            return messages, length
        n = max(1, n + int((aim - length) * chars_per_token) - (1 if length > bound else 0))
    raise DataError(f"could not build a long-context prompt of {low + 1} to {bound} tokens (last try: {length}); "
                    f"widen the bucket in evaluate.prompt_sets")


def _running_total(values) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def long_context_set(cfg: Config, name: str, key: str, spec: dict, check: ContextCheck) -> PromptSet:
    """prompts_per_bucket prompts per bucket, each a held-out document and a question, in bucket order."""
    limit, why = context_limit(cfg)
    if limit < FIRST_BUCKET // 2:
        raise ConfigError(f"{key}: a long-context prompt has at most {limit} tokens ({why}); raise server.max_model_len "
                          f"or lower evaluate.max_tokens")
    bounds = spec["buckets"] or default_buckets(limit)
    if bounds[-1] > limit:
        raise ConfigError(f"config key '{key}.buckets': {bounds[-1]} tokens leave no room for the answer: at most {limit} "
                          f"({why}); lower the bucket, or raise server.max_model_len where the target has the positions")
    pieces = document_pieces(cfg)
    if not pieces:
        raise DataError(f"{key}: the eval split of {Layout.of(cfg).prompts} has no text to build documents from; "
                        f"set data.eval_fraction > 0 and rerun 01_prepare_data.py --overwrite")
    budget = 64 * bounds[-1]  # characters: several documents' worth (a token is a few characters); tokenized once
    kept = [piece for n, piece in zip(_running_total(len(p) + 2 for p in pieces), pieces) if n - len(piece) - 2 < budget]
    pieces = kept
    pool = "\n\n".join(pieces) + "\n\n"
    starts = [0]
    for piece in pieces[:-1]:
        starts.append(starts[-1] + len(piece) + 2)
    pool_tokens = check.length([{"role": "user", "content": pool}])
    chars_per_token = len(pool) / max(1, pool_tokens)
    prompts, low = [], 0
    for bound in bounds:
        for j in range(spec["prompts_per_bucket"]):
            i = len(prompts)
            question = DOCUMENT_QUESTIONS[i % len(DOCUMENT_QUESTIONS)]
            messages, length = fit_prompt(check, pool, starts[(i * 7) % len(starts)], question, low, bound, chars_per_token)
            prompts.append({"id": f"{name}-{bound}-{j}", "messages": messages, "category": bucket_label(bound),
                            "prompt_tokens": length})
        low = bound
    source = f"built: documents from the eval split of {Layout.of(cfg).prompts}"
    return PromptSet(name, key, source, prompts, rows_read=len(pieces), buckets={bucket_label(b): b for b in bounds},
                     built={"kind": "long_context", "document_pool_tokens": pool_tokens, "limit_tokens": limit,
                            "limit": why})


# ----------------------------------------------------------------------------- system prompts


def training_system_prompts(cfg: Config) -> set[str]:
    """The system turns of the run's training split (data/prompts.jsonl's train rows)."""
    path = Layout.of(cfg).prompts
    return {m["content"] for r in iter_jsonl(path) if r.get("split") == "train"
            for m in (r.get("messages") or []) if isinstance(m, dict) and m.get("role") == "system"
            and isinstance(m.get("content"), str)} if path.is_file() else set()


def system_prompt_set(cfg: Config, name: str, key: str, check: ContextCheck) -> PromptSet:
    held = held_out_set(cfg, check)
    seen = training_system_prompts(cfg)
    unseen = [s for s in SYSTEM_PROMPTS if s.strip() not in {t.strip() for t in seen}]
    if not unseen:
        raise DataError(f"{key}: every system prompt of {__name__}.SYSTEM_PROMPTS is in the training split; "
                        f"this set measures unseen ones: add others to the list")
    prompts, skipped = [], Counter()
    for p in held.prompts:
        messages = [{"role": "system", "content": unseen[len(prompts) % len(unseen)]},
                    *(m for m in first_user_turn(p) if m["role"] != "system")]
        if too_long := check.reason(messages):
            skipped[too_long] += 1
        else:
            prompts.append({"id": f"{name}-{p['id']}", "messages": messages})
    if not prompts:
        raise DataError(f"{key}: no held-out prompt fits server.max_model_len with a system prompt ({dict(skipped)})")
    left_out = len(SYSTEM_PROMPTS) - len(unseen)
    return PromptSet(name, key, f"built: the held-out prompts of {held.source} under unseen system prompts", prompts,
                     rows_read=len(held.prompts), rows_skipped=dict(skipped),
                     built={"kind": "system_prompts", "system_prompts": len(unseen),
                            **({"system_prompts_in_training_left_out": left_out} if left_out else {})})


# ----------------------------------------------------------------------------- a changed chat template


def chat_template_set(cfg: Config, name: str, key: str, spec: dict, check: ContextCheck) -> PromptSet:
    """The held-out prompts, each carrying `template` ("chat_template": the request sends it, and the prompt is
    counted as it renders)."""
    template = spec["template"] or CHANGED_TEMPLATE
    own = getattr(check.tokenizer, "chat_template", None)
    if isinstance(own, str) and own.strip() == template.strip():
        raise ConfigError(f"config key '{key}.template' is the target's own chat template: the set would measure "
                          f"nothing the held-out set does not; give another, or leave it out for the built-in one")
    held = held_out_set(cfg, check)
    prompts, skipped = [], Counter()
    for p in held.prompts:
        messages = first_user_turn(p)
        if too_long := check.reason(messages, chat_template=template):
            skipped[too_long] += 1
        else:
            prompts.append({"id": f"{name}-{p['id']}", "messages": messages, "chat_template": template})
    if not prompts:
        raise DataError(f"{key}: no held-out prompt fits server.max_model_len as the template renders it ({dict(skipped)})")
    return PromptSet(name, key, f"built: the held-out prompts of {held.source} under another chat template", prompts,
                     rows_read=len(held.prompts), rows_skipped=dict(skipped),
                     built={"kind": "chat_template", "template": "built-in" if spec["template"] is None else "config",
                            "template_sha256": hashlib.sha256(template.encode()).hexdigest()[:16]})
