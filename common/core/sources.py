"""Reading prompt sources: 01's data.source and 05's evaluate.prompt_sets.

A source is a local .jsonl/.json/.parquet file, a directory of them, or a `datasets` hub name. Each
reader yields (where, row, skip_reason, detail): row is a dict, or None with a skip reason
(malformed_json, invalid_utf8) when the raw record itself is unusable; one bad line never aborts
the read. A file that starts with '[' is a JSON array, read record by record: one cut short (a
download that stopped) yields its complete records, then one truncated_json_tail skip whose detail
says where it ends (with no complete record it is an error, as is any other break of the array).
`row_messages` reads a ShareGPT (`conversations`: [{"from", "value"}]) or OpenAI (`messages`:
[{"role", "content"}]) row, content given as a list of parts joined; `keep_prompt` is 01's rule for
what of it is a prompt. `key` names the config key the source came from in the errors.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

from common.core.errors import ConfigError, DataError
from common.core.io import _has_lone_surrogate, parse_json

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
    """A .json file that is not an array (iter_source reads those): an object holding one list of rows, one row,
    or JSONL in disguise."""
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


# A JSON array, record by record ----------------------------------------------------------------

_WINDOW = 1 << 22  # characters decoded at a time: an array (GBs for some chat sets) is never held whole
_CUT = 8  # a decode error this close to the end of the text may only mean the text ends (mid-number, mid-escape)
_SPACE = re.compile(r"[ \t\n\r]*")


def _starts_array(path: Path) -> bool:
    """Whether the file's first character, past a UTF-8 BOM and whitespace, is '['."""
    with open(path, "rb") as f:
        chunk = f.read(1 << 16).removeprefix(codecs.BOM_UTF8)
        while chunk and not chunk.lstrip():
            chunk = f.read(1 << 16)
    return chunk.lstrip()[:1] == b"["


_CUT_SHORT = object()  # _Window.value: the file ends inside the value


class _Window:
    """The part of a file being decoded: `text`, read on from character `pos`; text[0] is byte `base` of the
    file (positions are said in bytes: what `head -c` and `truncate -s` take)."""

    def __init__(self, path: Path, f):
        self.path, self.f = path, f
        self.base = len(codecs.BOM_UTF8) if f.read(3) == codecs.BOM_UTF8 else 0
        f.seek(self.base)
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.text, self.pos, self.eof = "", 0, False

    def more(self) -> bool:
        """Drop the text before pos and read at least as much again as is left (a long record is decoded a
        few times, not once per chunk); False at the end of the file."""
        if self.eof:
            return False
        self.base, self.text, self.pos = self.byte(self.pos), self.text[self.pos:], 0
        data = self.f.read(max(_WINDOW, len(self.text)))
        self.eof = not data
        pending = len(self.utf8.getstate()[0])  # bytes of a character split by the previous read
        try:
            self.text += self.utf8.decode(data, final=self.eof)
        except UnicodeDecodeError as e:
            if self.eof and e.reason == "unexpected end of data":
                return True  # the file ends inside a character: cut short, as the caller finds
            at = self.f.tell() - len(data) - pending + e.start
            raise DataError(f"{self.path} is not UTF-8 at byte {at} ({e.reason}); convert the file to UTF-8") from None
        return True

    def peek(self) -> str:
        """The next character past whitespace, "" at the end of the file."""
        while True:
            self.pos = _SPACE.match(self.text, self.pos).end()
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.more():
                return ""

    def value(self, decoder: json.JSONDecoder) -> Any:
        """The JSON value at pos, pos moved past it; _CUT_SHORT (pos at its start) when the file ends inside it.
        Raises JSONDecodeError (positions in text) when it is not JSON."""
        while True:
            self.start = self.pos
            try:
                value, end = decoder.raw_decode(self.text, self.pos)
            except json.JSONDecodeError as e:
                if not (e.msg.startswith("Unterminated string") or len(self.text) - e.pos <= _CUT):
                    raise
                if not self.more():
                    return _CUT_SHORT
                continue  # only the window ended: decode the value again with more text
            if end < len(self.text) or not self.more():  # a number or literal may go on past the window
                self.pos = end
                return value

    def escapes_surrogate(self) -> bool:
        """Whether the last value's text holds an escape of a UTF-16 surrogate (\\ud800..\\udfff)."""
        return self.text.find("\\ud", self.start, self.pos) >= 0 or self.text.find("\\uD", self.start, self.pos) >= 0

    def byte(self, i: int) -> int:
        return self.base + len(self.text[:i].encode("utf-8"))


def _records(k: int) -> str:
    return f"{k} complete record{'' if k == 1 else 's'}"


def _iter_json_array(path: Path) -> Iterator[tuple[str, Any, str | None, str]]:
    """A file that starts with '[', one record at a time (raw_decode over a window sliding along the file).

    A file cut short (a download that stopped) yields its complete records, then one truncated_json_tail skip
    saying where it ends; with no complete record, or anything else that is not one JSON array, it is a
    DataError naming the byte and the record."""
    decoder = json.JSONDecoder()
    fix = "fix the file there, or write it as JSONL (one object per line: a bad line is skipped and counted)"
    with open(path, "rb") as f:
        w = _Window(path, f)
        w.peek()
        w.pos += 1  # the '['
        k, torn = 0, None  # complete records so far; where the file ends, when it ends inside the array
        while w.peek() != "]":  # here: the array is empty, or ends in a trailing comma as JavaScript writes it
            if not w.peek():
                torn = f"after record {k}, without the array's closing ']'" if k else "before its first record"
                break
            try:
                row = w.value(decoder)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} is not a valid JSON array: {e.msg} at byte {w.byte(e.pos)}, in record "
                                f"{k + 1} (after {_records(k)}); {fix}") from None
            except RecursionError:
                raise DataError(f"{path}: record {k + 1} of the JSON array (at byte {w.byte(w.pos)}) is nested "
                                f"too deeply to read; remove it") from None
            if row is _CUT_SHORT:
                torn = f"inside record {k + 1} (which starts at byte {w.byte(w.pos)})"
                break
            if w.escapes_surrogate() and _has_lone_surrogate(row):  # as parse_json refuses it
                yield f"{path}[{k}]", None, "malformed_json", "a lone UTF-16 surrogate escape (e.g. \\ud800) is not text"
            else:
                yield f"{path}[{k}]", row, None, ""
            k += 1
            c = w.peek()
            if c == ",":
                w.pos += 1
            elif c not in ("]", ""):
                raise DataError(f"{path} is not a valid JSON array: expected ',' or ']' after record {k} at byte "
                                f"{w.byte(w.pos)}, found {w.text[w.pos:w.pos + 20]!r}; {fix}")
        if torn is not None:
            detail = (f"{path}: the JSON array ends at byte {path.stat().st_size} {torn}: the file is cut short, with "
                      f"{_records(k)} before it")
            if not k:
                raise DataError(f"{detail}; download or copy the file again")
            yield f"{path}[{k}]", None, "truncated_json_tail", detail
            return
        w.pos += 1  # the ']'
        end = w.byte(w.pos)
        if w.peek():
            raise DataError(f"{path}: the JSON array ends at byte {end} ({_records(k)}), but the file goes on "
                            f"({w.text[w.pos:w.pos + 20]!r}...); the array must be the whole file: remove what "
                            f"follows it")


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
        if path.suffix.lower() != ".parquet" and _starts_array(path):  # a JSON array, whatever the name says
            yield from _iter_json_array(path)
        else:
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


def keep_answered(messages: list[dict], system_prompt: str | None, max_user_turns: int,
                  fill: bool) -> tuple[list[dict] | None, str | None]:
    """Like keep_prompt, with the source's own answers (data.answers dataset | fill): system + the first user turns,
    each followed by the assistant answer the source gives it. A user turn without a non-empty answer right after it
    ends the conversation (what follows answered another history). When it comes before max_user_turns answered turns:
    with fill, the prompt alone is kept (01b answers all of it); without, the answered turns before it (none:
    dropped as "no_answer")."""
    prompt, reason = keep_prompt(messages, system_prompt, max_user_turns)
    if reason is not None:
        return None, reason
    turns = [m for m in messages if m["role"] != "system" and m["content"].strip()]
    kept = [m for m in prompt if m["role"] == "system"]
    answered = 0
    for i, m in enumerate(turns):
        if answered == max_user_turns or m["role"] != "user":
            continue  # an assistant turn without its user turn (or past the kept ones) is not an answer
        answer = turns[i + 1] if i + 1 < len(turns) else None
        if answer is None or answer["role"] != "assistant":
            break
        kept += [dict(m), dict(answer)]
        answered += 1
    asked = sum(1 for m in prompt if m["role"] == "user")
    if answered == asked:
        return kept, None
    if fill:
        return prompt, None
    return (kept, None) if answered else (None, "no_answer")

