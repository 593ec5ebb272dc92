"""05's prompt sets: the held-out prompts of the run, evaluate.other_prompts, and evaluate.prompt_sets.

A prompt set is read with 01's reader (common.core.sources: a local .json/.jsonl/.parquet file or a
directory of them, or a `datasets` hub name) in the shapes benchmarks publish. Each row's first user turn
is its prompt ("messages", what the held-out set sends too):

    messages / conversations   chat rows (OpenAI, ShareGPT): the system turn and the first user turn
    turns                      MT-bench (FastChat's question.jsonl): the first turn; the later ones kept
    prompt                     HumanEval, plain prompts; a list of turns (HuggingFaceH4/mt_bench_prompts): as turns
    question                   GSM8K
    problem                    MATH, MATH500
    text                       plain text

A row given as a list of turns keeps its later user turns ("later_turns"): 05 sends the second one with the
target's own answer to the first (`second_turn_prompts`, once the target-alone run answered it). A row's
`category` (MT-bench's) is kept too: 05 measures acceptance per category.

A row of none of these shapes is counted (report: "rows_skipped", by reason), not an error; a set with
no usable row is. So is a prompt the server cannot take (server.max_model_len tokens or more as the chat
template renders it: vLLM would answer 400): counted as over_max_model_len, before any request (turn 2, whose
prompt holds the target's answer, is checked when it is built). Every set but the held-out one measures
prompts the draft was not trained on, so a set that shares a prompt with the training split is refused.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from common.core.config import Config
from common.core.errors import DataError
from common.core.io import iter_jsonl
from common.core.run_folder import HELD_OUT, OTHER, Layout
from common.core.sources import BadFields, iter_source, keep_prompt, row_messages
from common.target.tokenization import ContextCheck

PROMPT_FIELDS = ("turns", "prompt", "question", "problem", "text")  # in this order, after messages/conversations
ID_FIELDS = ("id", "question_id", "task_id", "prompt_id", "unique_id")
SHAPES = ("messages or conversations with a user turn, turns (MT-bench), prompt (HumanEval), question (GSM8K), "
          "problem (MATH) or text")


@dataclass
class PromptSet:
    """One set of prompts 05 measures, and where they came from: {"id", "messages"} rows (system? + the first user
    turn), + "later_turns" (the user turns after it, when the row has any) and "category" (when the row has one)."""

    name: str
    key: str  # the config key that names it, for the messages
    source: str
    prompts: list[dict]
    rows_read: int = 0
    rows_skipped: dict = field(default_factory=dict)  # {reason: count}
    first_skipped: Optional[str] = None  # where the first skipped row is
    buckets: dict = field(default_factory=dict)  # a long-context set's {category: its bound in tokens} (built_sets)
    built: Optional[dict] = None  # a built set's kind and how it was built (common.evaluate.built_sets)

    def describe(self) -> dict:
        """Its part of the report, beside the measurements."""
        return {"source": self.source, "rows_read": self.rows_read, "rows_skipped": self.rows_skipped,
                **({"first_skipped": self.first_skipped} if self.first_skipped else {}),
                **({"built": self.built} if self.built else {})}


# ----------------------------------------------------------------------------- one row


def first_user_turn(row: dict) -> list[dict]:
    """System turns and the first user turn of a data/prompts.jsonl row; [] when there is no user turn.

    Later turns follow an answer that is not the target's own (none, or the dataset's with
    data.answers dataset | fill), so the first turn is the only one sent as it stands.
    """
    messages = []
    for m in row.get("messages") or []:
        if not isinstance(m, dict) or m.get("role") == "assistant":
            continue
        messages.append({"role": m.get("role"), "content": m.get("content")})
        if m.get("role") == "user":
            break
    return messages if messages and messages[-1]["role"] == "user" else []


def benchmark_prompt(row: Any) -> tuple[Optional[dict], str]:
    """A benchmark row's prompt and "", or (None, why not): {"messages": system? + the first user turn}, + its
    "later_turns" (a row given as a list of turns) and "category" where the row has them."""
    if not isinstance(row, dict):
        return None, "bad_fields"
    if row.get("messages") is not None or row.get("conversations") is not None:
        return _chat_prompt(row, row)
    value = next((row[f] for f in PROMPT_FIELDS if row.get(f) is not None), None)
    if isinstance(value, list) and value and isinstance(value[0], dict):  # a prompt given as chat messages
        return _chat_prompt({"messages": value}, row)
    later = []
    if isinstance(value, list):  # MT-bench's turns: the first one is the prompt
        value, later = (value[0], _later_turns(value[1:])) if value else ("", [])
    if value is None:
        return None, "no_prompt_field"
    if not isinstance(value, str):
        return None, "bad_fields"
    if not value.strip():
        return None, "empty"
    return _with_category({"messages": [{"role": "user", "content": value}], **({"later_turns": later} if later else {})}, row), ""


def _later_turns(turns: list) -> list[str]:
    """The later user turns up to the first that is not a non-empty text (a conversation cannot skip a turn)."""
    kept = []
    for turn in turns:
        if not isinstance(turn, str) or not turn.strip():
            break
        kept.append(turn)
    return kept


def _with_category(prompt: dict, row: dict) -> dict:
    category = row.get("category")
    if isinstance(category, (str, int)) and not isinstance(category, bool) and str(category).strip():
        prompt["category"] = str(category).strip()
    return prompt


def _chat_prompt(chat: dict, row: dict) -> tuple[Optional[dict], str]:
    """A chat's system turn and first user turn, by 01's rules (common.core.sources), with the row's category."""
    try:
        kept, reason = keep_prompt(row_messages(chat), None, 1)
    except BadFields:
        return None, "bad_fields"
    return (_with_category({"messages": kept}, row), "") if kept else (None, reason or "")


def _row_id(row: dict) -> Optional[str]:
    value = next((row[f] for f in ID_FIELDS if row.get(f) is not None), None)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    return str(value).strip() or None


# ----------------------------------------------------------------------------- one set


def context_check(cfg: Config) -> ContextCheck:
    """What decides whether the server takes a prompt: the target's tokenizer and server.max_model_len."""
    from common.serving.chat import template_kwargs_of
    from common.target.tokenization import load_tokenizer

    tokenizer = load_tokenizer(cfg.target.tokenizer or cfg.target.model, cfg.target.trust_remote_code,
                               require_chat_template=False)
    return ContextCheck(tokenizer, cfg.server.max_model_len, template_kwargs_of(cfg.generate),
                        ("evaluate.max_tokens", cfg.evaluate.max_tokens))


def _no_prompt_left(key: str, source: str, n_read: int, skipped: Counter, first_skipped: Optional[str]) -> DataError:
    why = ", ".join(f"{r} {n}" for r, n in skipped.most_common()) or "the source is empty"
    fix = (" or raise server.max_model_len" if skipped.get("over_max_model_len") else "")
    return DataError(f"{key} ({source}) has no usable prompt ({n_read} rows read; skipped: {why}"
                     f"{f'; first: {first_skipped}' if first_skipped else ''}); each row needs {SHAPES}{fix}")


def read_prompt_set(name: str, key: str, spec: dict, limit: int, check: Optional[ContextCheck]) -> PromptSet:
    """The first `limit` usable prompts of a source (spec: {"source", "subset", "split"}); ids are the rows' own
    (id, question_id, task_id, ...) when every used row has a distinct one, else NAME-ROW."""
    rows, skipped, first_skipped, n_read = [], Counter(), None, 0
    for where, row, reason, _ in iter_source(spec["source"], spec["subset"], spec["split"], key):
        n_read += 1
        prompt, reason = (None, reason) if reason else benchmark_prompt(row)
        if prompt is not None and check is not None and (too_long := check.reason(prompt["messages"])):
            prompt, reason = None, too_long
        if prompt is None:
            skipped[reason] += 1
            first_skipped = first_skipped or f"{where} ({reason})"
            continue
        rows.append((n_read, _row_id(row), prompt))
        if len(rows) >= limit:
            break
    if not rows:
        raise _no_prompt_left(key, spec["source"], n_read, skipped, first_skipped)
    ids = [rid for _, rid, _ in rows]
    if None in ids or len(set(ids)) < len(ids):
        ids = [f"{name}-{n}" for n, _, _ in rows]
    return PromptSet(name, key, spec["source"], [{"id": i, **p} for i, (_, _, p) in zip(ids, rows)], n_read,
                     dict(skipped), first_skipped)


def held_out_set(cfg: Config, check: ContextCheck) -> PromptSet:
    """The first evaluate.num_prompts prompts of the eval split that the server takes, cut to their first user turn."""
    path = Layout.of(cfg).prompts
    if not path.is_file():
        raise DataError(f"prompts file not found: {path}; run 01_prepare_data.py with the same config first")
    prompts, n_read, skipped, n_eval = [], 0, Counter(), 0
    for row in iter_jsonl(path):
        n_read += 1
        if row.get("split") != "eval":
            continue
        n_eval += 1
        messages = first_user_turn(row)
        if messages and (too_long := check.reason(messages)):
            skipped[too_long] += 1
        elif messages:
            prompts.append({"id": row["id"], "messages": messages})
        if len(prompts) >= cfg.evaluate.num_prompts:
            break
    if not prompts and skipped:
        raise _no_prompt_left("the eval split", str(path), n_eval, skipped, None)
    if not prompts:
        raise DataError(
            f"{path} has no eval-split prompts; set data.eval_fraction > 0 and rerun 01_prepare_data.py --overwrite"
        )
    return PromptSet(HELD_OUT, "the eval split", str(path), prompts, n_read, dict(skipped))


def configured_sets(cfg: Config) -> dict[str, tuple[str, dict]]:
    """{name: (config key, {"source", "subset", "split"})} of every set besides the held-out one."""
    e = cfg.evaluate
    other = {OTHER: ("evaluate.other_prompts", {"source": e.other_prompts, "subset": None, "split": "test"})} if e.other_prompts else {}
    return other | {name: (f"evaluate.prompt_sets.{name}", spec) for name, spec in e.prompt_set_specs().items()}


def load_prompt_set(cfg: Config, name: str, trained: Optional[set[str]] = None,
                    check: Optional[ContextCheck] = None) -> PromptSet:
    """One set by name (HELD_OUT, OTHER or an evaluate.prompt_sets name), checked against the training prompts
    (a built set is made from the eval split: common.evaluate.built_sets)."""
    check = check or context_check(cfg)
    if name == HELD_OUT:
        return held_out_set(cfg, check)
    key, spec = configured_sets(cfg)[name]
    if spec.get("built"):
        from common.evaluate.built_sets import build_prompt_set

        return build_prompt_set(cfg, name, key, spec, check)
    prompt_set = read_prompt_set(name, key, spec, cfg.evaluate.num_prompts, check)
    refuse_training_prompts(prompt_set, training_texts(cfg) if trained is None else trained)
    return prompt_set


def load_prompt_sets(cfg: Config) -> dict[str, PromptSet]:
    """The held-out set first, then evaluate.other_prompts ("other"), then evaluate.prompt_sets in name order."""
    trained, check = training_texts(cfg), context_check(cfg)
    return {name: load_prompt_set(cfg, name, trained, check) for name in (HELD_OUT, *configured_sets(cfg))}


def say_left_out(sets: dict[str, PromptSet]) -> None:
    """One line per set that lost prompts the server cannot take (the report counts them too)."""
    for name, s in sets.items():
        n = sum(v for k, v in s.rows_skipped.items() if k in ("over_max_model_len", "chat_template_error"))
        if n:
            print(f"05_evaluate: prompt set {name} ({s.key}): left out {n} prompt(s) the server cannot take "
                  f"({', '.join(f'{k} {v}' for k, v in s.rows_skipped.items())}); measuring {len(s.prompts)}", flush=True)


def has_later_turns(prompts: list[dict]) -> bool:
    return any(p.get("later_turns") for p in prompts)


def second_turn_prompts(prompts: list[dict], answers: dict[str, str], check: ContextCheck) -> tuple[list[dict], dict]:
    """Turn 2 of every prompt with a later turn: its first turn, the target's own answer to it (answers: {id:
    content}, the target-alone run's), then its second user turn; (those prompts, {reason: count} of the ones left
    out: too long for the server with the answer)."""
    kept, left_out = [], Counter()
    for p in prompts:
        if not p.get("later_turns"):
            continue
        messages = [*p["messages"], {"role": "assistant", "content": answers[p["id"]] or ""},
                    {"role": "user", "content": p["later_turns"][0]}]
        if too_long := check.reason(messages, p.get("chat_template")):
            left_out[too_long] += 1
        else:
            kept.append({"id": p["id"], "messages": messages, **{k: p[k] for k in ("category", "chat_template") if k in p}})
    return kept, dict(left_out)


def check_sets_before_training(cfg: Config, rows: list[dict]) -> None:
    """01, before it writes: every set of evaluate.other_prompts and evaluate.prompt_sets reads, has usable rows
    and shares no prompt with the training split of `rows` (01's output rows). Lengths need the target's
    tokenizer: run_pipeline.py checks them before it starts vLLM, and 05 at its start."""
    trained = {_user_text(m) for r in rows if r.get("split") == "train" and (m := first_user_turn(r))}
    for name, (key, spec) in configured_sets(cfg).items():
        if spec.get("built"):  # made from the eval split by 05 (common.evaluate.built_sets)
            continue
        refuse_training_prompts(read_prompt_set(name, key, spec, cfg.evaluate.num_prompts, None), trained)


# ----------------------------------------------------------------------------- kept apart from training


def _user_text(messages: list[dict]) -> str:
    return next(m["content"] for m in messages if m["role"] == "user")


def training_texts(cfg: Config) -> set[str]:
    """The first user turn of every train-split prompt of the run (none before 01 ran)."""
    path = Layout.of(cfg).prompts
    if not path.is_file():
        return set()
    return {_user_text(m) for r in iter_jsonl(path) if r.get("split") == "train" and (m := first_user_turn(r))}


def refuse_training_prompts(prompt_set: PromptSet, trained: set[str]) -> None:
    """A set measures prompts the draft never trained on: one that shares a prompt with the training split is refused."""
    shared = [p["id"] for p in prompt_set.prompts if _user_text(p["messages"]) in trained]
    if shared:
        raise DataError(f"{prompt_set.key} {prompt_set.source} shares {len(shared)} prompt(s) with the training data "
                        f"(first: {shared[0]}); the set must be kept apart from data.source")
