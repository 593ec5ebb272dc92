"""01b's files under data/: reading the prompts, and the finished and failed records of a run.

- prompts.jsonl (written by 01): {"id", "messages", "split"}; read here under 01's own rules.
- raw_responses.jsonl: one row per finished id, appended by common.data.generate_requests:
  {"id", "messages" (the conversation with the generated turns), "reasoning", "content",
  "finish_reason", "usage", "turns" (the server's raw answer per user turn), "model"};
  a prompt that came with the source's answers (data.answers dataset | fill) is copied in as
  {"id", "messages", "reasoning": "", "content", "answers": "dataset"} (copy_dataset_answers).
- failed.jsonl: one record per failed attempt at an id, {"id", "reason", "error_type",
  "status_code", "attempts", "turn", "retryable", "time"}; at the end of a run it is rewritten
  with only the ids still not done (finalize_failed).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from common.core.errors import DataError
from common.core.io import JsonlAppender, iter_jsonl, truncate_torn_tail, write_jsonl_atomic
from common.core.run_folder import Layout


def load_prompts(path: Path, skipped: Counter | None = None) -> tuple[list[dict], int]:
    """prompts.jsonl -> (prompts in file order with unique ids, number of duplicate ids dropped).

    Messages pass stage 01's rules (common.core.sources: row_messages + keep_prompt): a row that 01
    would drop (a message without a role, an unknown role, no non-empty user turn) is never sent;
    it is counted in `skipped` under 01's reason.
    """
    from common.core.sources import BadFields, keep_answered, keep_prompt, row_messages

    if not path.is_file():
        raise DataError(f"prompts file not found: {path}; run 01_prepare_data.py with the same config first")
    skipped = Counter() if skipped is None else skipped
    prompts, seen, dupes = [], set(), 0
    for row in iter_jsonl(path):
        pid = row.get("id")
        if not isinstance(pid, str) or not pid:
            raise DataError(f"{path}: a row lacks a string 'id' (id={pid!r}); rerun 01_prepare_data.py --overwrite")
        try:
            messages = row_messages(row)
            turns = len(messages) or 1
            if any(m["role"] == "assistant" for m in messages):  # data.answers dataset | fill: the source's answers
                messages, reason = keep_answered(messages, None, max_user_turns=turns, fill=True)
            else:
                messages, reason = keep_prompt(messages, None, max_user_turns=turns)
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


def has_answers(prompt: dict) -> bool:
    """A prompt that comes with the source's answer to every user turn (data.answers dataset | fill): 01b sends
    nothing for it."""
    return prompt["messages"][-1]["role"] == "assistant"


def copy_dataset_answers(path: Path, prompts: list[dict]) -> list[dict]:
    """Append the prompts that come answered to raw_responses.jsonl as finished rows (one place holds every
    finished conversation, so resume and tokenization treat both kinds alike). Returns the rows written."""
    rows = [{"id": p["id"], "messages": p["messages"], "reasoning": "", "content": p["messages"][-1]["content"],
             "answers": "dataset"} for p in prompts if has_answers(p)]
    if rows:
        with JsonlAppender(path, fsync_every=len(rows)) as out:
            for row in rows:
                out.write(row)
    return rows


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


def last_turn(row: dict) -> Any:
    """The server's answer to the last user turn of a raw row (None when the row has none)."""
    turns = row.get("turns")
    return turns[-1] if isinstance(turns, list) and turns else None


def load_failed(path: Path) -> dict[str, dict]:
    """failed.jsonl -> {id: the latest failure record}."""
    if not path.exists():
        return {}
    return {r["id"]: r for r in iter_jsonl(path, tolerate_torn_tail=True, strict=False) if isinstance(r.get("id"), str)}


def finalize_failed(layout: Layout, prompt_ids: set[str], done_ids: set[str]) -> dict[str, dict]:
    """Rewrite failed.jsonl atomically with only the ids that are still not done; returns them."""
    still = {pid: r for pid, r in load_failed(layout.failed).items() if pid in prompt_ids and pid not in done_ids}
    if layout.failed.exists() or still:
        write_jsonl_atomic(layout.failed, still.values())
    return still
