"""File I/O every stage shares: JSONL reading/appending and atomic writes.

Rules (docs/design.md#resume-rules): a file is either written atomically (temp file in the same directory,
fsync, rename) or append-only, where a torn last line left by a crash is tolerated on read
and cut off before appending again.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from tqdm import tqdm

from common.core.errors import DataError


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path next to `final`; rename it over `final` only if the block succeeds.

    A crash leaves at most a `.tmp-*` file, never a half-written file under the final name.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    # A run killed mid-write left its temp file behind (for train.jsonl, GBs); each final file has
    # one writer at a time, so any earlier temp file of the same name is stale.
    for stale in final.parent.glob(f".tmp-{glob.escape(final.name)}.*"):
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{final.name}.", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, final)
        fsync_dir(final.parent)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def atomic_write_text(final: str | os.PathLike, text: str) -> None:
    with atomic_path(final) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_json(final: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(final, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


@contextlib.contextmanager
def jsonl_writer_atomic(final: str | os.PathLike) -> Iterator[Callable[[dict], None]]:
    """Yield write(row): rows go to a temp file as they come (nothing is held in memory), which
    becomes `final` only if the block succeeds."""
    with atomic_path(final) as tmp, open(tmp, "w", encoding="utf-8") as f:  # closed before the rename
        yield lambda row: f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_jsonl_atomic(final: str | os.PathLike, rows) -> int:
    """Write all rows to `final` atomically; returns the row count."""
    n = 0
    with jsonl_writer_atomic(final) as write:
        for row in rows:
            write(row)
            n += 1
    return n


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); delete it or rerun the stage that writes it with --overwrite") from None


def _has_lone_surrogate(obj: Any) -> bool:
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(obj, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_lone_surrogate(v) for v in obj)
    return False


def parse_json(data: bytes | str) -> Any:
    """json.loads for user data, every failure a ValueError with the reason: a UTF-8 BOM is skipped
    (editors on Windows write one), invalid UTF-8, nesting too deep for Python's parser, and a lone
    UTF-16 surrogate escape ("\\ud800", valid JSON but not text: it breaks every later write) are
    refused."""
    try:
        text = data.decode("utf-8-sig") if isinstance(data, bytes) else data.removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8: {e}") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    # "\ud800".."\udfff" escapes are the only way JSON text yields a str that is not valid Unicode
    if ("\\ud" in text or "\\uD" in text) and _has_lone_surrogate(obj):
        raise ValueError("a lone UTF-16 surrogate escape (e.g. \\ud800) is not text")
    return obj


def iter_jsonl(path: str | os.PathLike, *, tolerate_torn_tail: bool = False, strict: bool = True) -> Iterator[dict]:
    """Yield the JSON objects of a JSONL file.

    tolerate_torn_tail: a last line without a newline that does not parse is ignored (a crash
    while appending). strict: any other malformed line raises DataError naming file and line;
    with strict=False such lines are skipped (callers count them).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"file not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    ends_with_newline = data.endswith(b"\n")
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        is_tail = lineno == len(lines) and not ends_with_newline
        try:
            obj = parse_json(raw)
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        except ValueError as e:
            if is_tail and tolerate_torn_tail:
                return
            if strict:
                raise DataError(f"{path}:{lineno}: malformed JSONL line ({e}); fix or remove that line") from None
            continue
        yield obj


def truncate_torn_tail(path: str | os.PathLike) -> int:
    """Cut a trailing partial line (no final newline) off an append-only file.

    Returns the number of bytes removed. Call before reopening a file for append.
    """
    path = Path(path)
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return 0
        # Find the last newline; everything after it is the torn line.
        pos = size - 1
        chunk = 65536
        keep = 0
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            buf = f.read(pos - start)
            idx = buf.rfind(b"\n")
            if idx >= 0:
                keep = start + idx + 1
                break
            pos = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
        return size - keep


class JsonlAppender:
    """Append-only JSONL writer that fsyncs every `fsync_every` rows and on close.

    Opening cuts a torn last line left by a previous crash, so appends start on a clean line.
    """

    def __init__(self, path: str | os.PathLike, fsync_every: int = 32):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_torn_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        self._fsync_every = max(1, fsync_every)
        self._pending = 0

    def write(self, row: dict) -> None:
        # One write call per line keeps lines whole even if we are killed between rows.
        self._f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._f.flush()  # hand the line to the OS now: a killed process loses nothing it wrote
        self._pending += 1
        if self._pending >= self._fsync_every:
            self.sync()

    def sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._pending = 0

    def close(self) -> None:
        if not self._f.closed:
            self.sync()
            self._f.close()

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22, progress: Callable[[int], Any] | None = None) -> str:
    """sha256 of a file, read in chunks (shards are GBs); `progress(n)` after each chunk of n bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if progress is not None:
                progress(len(block))
    return h.hexdigest()


def bytes_bar(total: int, desc: str) -> tqdm:
    """A progress bar over bytes (a pass over big files) on stderr. It shows only once the pass has
    taken a few seconds, so quick runs stay quiet. Use it as a context manager, so that an error
    closes it before the one-line error is printed."""
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, delay=3, disable=total == 0, file=sys.stderr,
                dynamic_ncols=True)


def folder_bytes(folder: Path) -> int:
    """What the files directly in a folder weigh now; a file deleted while we look (a streaming partner's) counts 0."""
    total = 0
    for path in Path(folder).iterdir():
        try:
            total += path.stat().st_size if path.is_file() else 0
        except FileNotFoundError:
            continue
    return total


def format_bytes(n: float) -> str:
    """A byte count for people, in decimal units: 512 B, 3.80 GB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
