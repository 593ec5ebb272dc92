"""Reading prompt sources: 01's data.source and 05's evaluate.prompt_sets.

A source is a local .jsonl/.json/.parquet file, a directory of them, or a `datasets` hub name. Each
reader yields (where, row, skip_reason, detail): row is a dict, or None with a skip reason
(malformed_json, invalid_utf8) when the raw record itself is unusable; one bad line never aborts
the read. `row_messages` reads a ShareGPT (`conversations`: [{"from", "value"}]) or OpenAI
(`messages`: [{"role", "content"}]) row, content given as a list of parts joined; `keep_prompt` is
01's rule for what of it is a prompt. `key` names the config key the source came from in the errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

from common.core.errors import ConfigError, DataError
from common.core.io import parse_json

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bot": "assistant", "model": "assistant",
    "system": "system",
    # Tool traffic carries no prompt text of its own; it is dropped like assistant turns.
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
}


class BadFields(ValueError):
    """A row whose fields have the wrong shape or type."""


# ---------------------------------------------------------------------------------------------
# Reading sources
# ---------------------------------------------------------------------------------------------

def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any, str | None, str]]:
    # Line by line ourselves: `datasets` would abort the whole load on one bad line.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, None, "invalid_utf8", str(e)
                continue
            try:
                row = parse_json(raw)
            except ValueError as e:
                yield where, None, "malformed_json", str(e)
                continue
            if not isinstance(row, dict):
                yield where, None, "malformed_json", f"expected a JSON object, got {type(row).__name__}"
                continue
            yield where, row, None, ""


def _iter_json(path: Path) -> Iterator[tuple[str, Any, str | None, str]]:
    """A .json file: a JSON array of rows, an object holding one list of rows, or JSONL in disguise."""
    try:
        data = parse_json(path.read_bytes())
    except ValueError:
        yield from _iter_jsonl(path)  # many datasets ship JSONL under a .json name
        return
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if "conversations" in data or "messages" in data or len(lists) != 1:
            data = [data]
        else:
            data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of conversations, got {type(data).__name__}; "
                        f"use a .jsonl file with one conversation per line")
    for i, row in enumerate(data):
        yield f"{path}[{i}]", row, None, ""


def _iter_parquet(path: Path, key: str = "data.source") -> Iterator[tuple[str, Any, str | None, str]]:
    import datasets

    with open(path, "rb") as f:  # a parquet file starts and ends with the magic "PAR1"
        head = f.read(4)
        f.seek(max(0, path.stat().st_size - 4))
        tail = f.read(4)
    if head != b"PAR1" or tail != b"PAR1":
        raise DataError(f"{path} is named .parquet but is not a parquet file (no PAR1 magic at its start and end: "
                        f"truncated, or another format renamed); rewrite it, or name it after its real format "
                        f"(.jsonl, .json)")
    ds = datasets.load_dataset("parquet", data_files=[str(path)], split="train", streaming=True)
    try:
        for i, row in enumerate(ds):
            yield f"{path}[{i}]", row, None, ""
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError: a damaged footer or page
        raise DataError(f"{path} is not a readable parquet file ({type(e).__name__}: {str(e)[:200]}); rewrite it "
                        f"or remove it from {key}") from None


def _iter_hub(name: str, subset: str | None, split: str, key: str = "data.source") -> Iterator[tuple[str, Any, str | None, str]]:
    import datasets

    what = f"dataset '{name}' (subset={subset}, split={split})"
    try:
        # Streaming: rows arrive in source order without converting the whole dataset first.
        ds = datasets.load_dataset(name, subset, split=split, streaming=True)
        for i, row in enumerate(ds):
            yield f"{name}[{i}]", row, None, ""
    except (DataError, KeyboardInterrupt):
        raise
    except Exception as e:  # datasets raises many types (network, missing config, bad split)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise DataError(f"could not load {what}: {type(e).__name__}: {first}; check {key} (the name, its subset and split), "
                        f"or point {key} at a local .jsonl/.json/.parquet file or directory") from None


def _looks_like_path(source: str) -> bool:
    s = os.path.expanduser(source)
    return (os.path.isabs(s) or s.startswith(".") or s.lower().endswith(LOCAL_SUFFIXES + (".csv", ".txt"))
            or s.count("/") > 1 or os.sep != "/" and os.sep in s)


def local_source_files(source: str, key: str = "data.source") -> list[Path] | None:
    """The files of a local source (sorted), or None if `source` is a hub name."""
    if not source:
        raise ConfigError(f"{key} is not set; set it to a .jsonl/.json/.parquet file, a directory of them, "
                          f"or a datasets hub name (e.g. --set {key}=data/sample_prompts.jsonl)")
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in LOCAL_SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise DataError(f"{key} directory {path} holds no .jsonl, .json or .parquet files; "
                            f"point {key} at a directory with data files")
        return files
    if path.is_file():
        if path.suffix.lower() not in LOCAL_SUFFIXES:
            raise DataError(f"{key} {path} has suffix '{path.suffix}'; supported: .jsonl, .json, .parquet")
        return [path]
    if _looks_like_path(source):
        raise DataError(f"{key} file not found: {source}; check {key} (in a config file, relative paths are relative to the file)")
    return None


def iter_source(source: str, subset: str | None, split: str, key: str = "data.source") -> Iterator[tuple[str, Any, str | None, str]]:
    """Every row of a source, in order (a directory: its files sorted by name)."""
    files = local_source_files(source, key)
    if files is None:
        yield from _iter_hub(source, subset, split, key)
        return
    readers = {".jsonl": _iter_jsonl, ".json": _iter_json, ".parquet": lambda path: _iter_parquet(path, key)}
    for path in files:
        yield from readers[path.suffix.lower()](path)


# ---------------------------------------------------------------------------------------------
# Normalising one row
# ---------------------------------------------------------------------------------------------

def _content_text(content: Any) -> str:
    """A message's text: a string, None (no text), or a list of parts ({"type": "text", "text"} or strings)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict):
                if part.get("type", "text") == "text":
                    if not isinstance(part.get("text"), str):
                        raise BadFields("a text part has no string 'text'")
                    texts.append(part["text"])
                # Other part types (images, audio) carry no prompt text.
            else:
                raise BadFields(f"content part of type {type(part).__name__}")
        return "\n".join(texts)
    raise BadFields(f"content of type {type(content).__name__}")


def row_messages(row: Any) -> list[dict]:
    """The messages of a ShareGPT or OpenAI row as [{"role", "content"}], roles normalised.

    Raises BadFields when the row does not have one of the two shapes.
    """
    if not isinstance(row, dict):
        raise BadFields(f"row is a {type(row).__name__}, not an object")
    if row.get("conversations") is not None:
        turns, role_key, text_key = row["conversations"], "from", "value"
    elif row.get("messages") is not None:
        turns, role_key, text_key = row["messages"], "role", "content"
    else:
        raise BadFields("no 'conversations' or 'messages' field")
    if not isinstance(turns, list):
        raise BadFields(f"'{'conversations' if role_key == 'from' else 'messages'}' is a {type(turns).__name__}, not a list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise BadFields(f"a turn is a {type(turn).__name__}, not an object")
        raw_role = turn.get(role_key)
        if not isinstance(raw_role, str):
            raise BadFields(f"a turn has no string '{role_key}'")
        role = ROLE_ALIASES.get(raw_role.strip().lower())
        if role is None:
            raise BadFields(f"unknown role '{raw_role}'")
        messages.append({"role": role, "content": _content_text(turn.get(text_key))})
    return messages


def keep_prompt(messages: list[dict], system_prompt: str | None, max_user_turns: int) -> tuple[list[dict] | None, str | None]:
    """System (the source's, else `system_prompt`) + the first non-empty user turns. Returns (kept, drop_reason)."""
    users = [m for m in messages if m["role"] == "user"]
    if not messages:
        return None, "empty"
    if not users:
        return None, "no_user_turn"
    users = [m for m in users if m["content"].strip()]
    if not users:
        return None, "empty"
    system = next((m["content"] for m in messages if m["role"] == "system" and m["content"].strip()), None)
    if system is None:
        system = system_prompt or None
    kept = [{"role": "system", "content": system}] if system else []
    kept += [{"role": "user", "content": m["content"]} for m in users[:max_user_turns]]
    return kept, None


