"""What a cache entry of common/demo holds, recorded when it was built and checked on every use (issue 42).

An entry is a directory in the cache: a built target (tiny or real), or the folder a packaged file is unpacked
into. Its manifest, `<entry>.manifest.json` beside it, lists every file of the entry with its size, mtime_ns and
sha256. The manifest is written last, atomically, so an entry without one was never completed and is built again.

The check on use is cheap: every file's size, always; its sha256 only when its size or mtime is not the recorded
one (a copy that kept its size, an edit in place). A file whose sha256 is the recorded one after all gets its new
mtime recorded, so the next use hashes nothing.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from common.core.io import atomic_write_json, file_sha256

MANIFEST_SUFFIX = ".manifest.json"


@dataclass(frozen=True)
class Damage:
    """A file of an entry that is not what was recorded."""

    path: Path
    what: str  # e.g. "5,000,000 bytes, recorded 125,004,361"

    def __str__(self) -> str:
        return f"{self.path} is damaged ({self.what})"


def _sizes(size: int, recorded: int) -> str:
    return f"{size:,} bytes, recorded {recorded:,}"


def manifest_path(entry: Path) -> Path:
    return entry.with_name(entry.name + MANIFEST_SUFFIX)


def is_recorded(entry: Path) -> bool:
    """Whether the entry was completed (its manifest was written)."""
    return manifest_path(entry).is_file()


def forget(entry: Path) -> None:
    """Remove the entry's manifest before it is rebuilt: a rebuild that stops half-way leaves an unrecorded entry."""
    manifest_path(entry).unlink(missing_ok=True)


def _record(path: Path) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": file_sha256(path)}


def write_manifest(entry: Path) -> None:
    """Record every file under entry (hashing each once); the last step of building it."""
    files = {p.relative_to(entry).as_posix(): _record(p) for p in sorted(entry.rglob("*")) if p.is_file()}
    atomic_write_json(manifest_path(entry), {"files": files})


def find_damage(entry: Path) -> Damage | None:
    """The first file of a recorded entry that is missing, of another size or (size or mtime changed) of another
    sha256; None when the entry is whole."""
    manifest = manifest_path(entry)
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        recorded = {name: (int(f["size"]), int(f["mtime_ns"]), str(f["sha256"])) for name, f in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return Damage(manifest, f"unreadable: {type(e).__name__}")
    rehashed = False
    for name, (size, mtime_ns, sha256) in recorded.items():
        path = entry / name
        try:
            stat = path.stat()
        except OSError:
            return Damage(path, "missing")
        if stat.st_size != size:
            return Damage(path, _sizes(stat.st_size, size))
        if stat.st_mtime_ns != mtime_ns:
            if file_sha256(path) != sha256:
                return Damage(path, "its sha256 is not the one recorded when it was written")
            files[name]["mtime_ns"] = stat.st_mtime_ns
            rehashed = True
    if rehashed:  # the same bytes with a new mtime: record it, so the next check hashes nothing
        try:
            atomic_write_json(manifest, {"files": files})
        except OSError:
            pass  # a read-only cache is still whole; it is hashed again next time
    return None


def reusable(entry: Path, then: str | None) -> bool:
    """Whether a built entry can be used: completed (recorded) and whole. A damaged one is said in one line on
    stderr, naming the file and `then` (what the caller does instead); then=None says nothing."""
    if not is_recorded(entry):
        return False
    damage = find_damage(entry)
    if damage is not None and then is not None:
        print(f"cache: {damage}; {then}", file=sys.stderr)
    return damage is None


def file_record(path: Path) -> dict:
    """{size, sha256} of a file: what build.json of a shipped build records (an mtime means nothing in git)."""
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def same_file(path: Path, recorded: dict) -> str | None:
    """None when path has the recorded size and sha256; else what differs."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != recorded["size"]:
        return _sizes(size, recorded["size"])
    if file_sha256(path) != recorded["sha256"]:
        return "its sha256 is not the one recorded in build.json"
    return None
