"""JSONL and atomic-write helpers: torn tails, malformed lines, crash safety."""

import json
import os

import pytest

from common.core.errors import DataError
from common.core.io import JsonlAppender, atomic_path, atomic_write_json, iter_jsonl, truncate_torn_tail


def test_torn_tail_tolerated_and_truncated(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"id": "1"}\n{"id": "2"}\n{"id": "3", "te')
    assert [r["id"] for r in iter_jsonl(path, tolerate_torn_tail=True)] == ["1", "2"]
    with pytest.raises(DataError, match=r"a.jsonl:3: malformed JSONL line"):
        list(iter_jsonl(path))
    assert truncate_torn_tail(path) == len(b'{"id": "3", "te')
    assert path.read_bytes() == b'{"id": "1"}\n{"id": "2"}\n'


def test_appender_cuts_torn_tail_before_appending(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"id": "1"}\n{"id": "2", "x"')
    with JsonlAppender(path, fsync_every=1) as out:
        out.write({"id": "3"})
    assert [r["id"] for r in iter_jsonl(path)] == ["1", "3"]


def test_malformed_middle_line_strict_and_lenient(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"id": "1"}\nnot json\n[1, 2]\n\xff\xfe\n{"id": "5"}\n')
    with pytest.raises(DataError, match="a.jsonl:2"):
        list(iter_jsonl(path))
    assert [r["id"] for r in iter_jsonl(path, strict=False)] == ["1", "5"]


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "out.json"
    atomic_write_json(final, {"a": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(final) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash")
    assert json.loads(final.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["out.json"]


def test_missing_file_is_data_error(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        list(iter_jsonl(tmp_path / "missing.jsonl"))
