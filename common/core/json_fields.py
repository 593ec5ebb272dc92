"""The JSON types of a file's fields, checked before code relies on them.

The pipeline's own files between stages (hidden/index.json, hidden/plan.json, a draft's prediction.json) are read
by code that trusts their types. One edited by hand, or made by another program, would stop a stage with a
TypeError deep inside it; check_fields turns a field of another type into one DataError line that names the file,
the field, the value and what to do.

    check_fields(doc, {"step": INTEGER, "step_acc": NUMBERS}, path, fix="re-export the draft", where="eval.")
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from common.core.errors import DataError, printable


@dataclass(frozen=True)
class Kind:
    """A JSON type as an error line names it ("an integer") and the test of a value."""

    what: str
    accepts: Callable[[Any], bool]


def _integer(v) -> bool:
    return type(v) is int  # not bool, which JSON's true would be


def _number(v) -> bool:
    return type(v) in (int, float)


INTEGER = Kind("an integer", _integer)
NUMBER = Kind("a number", _number)
STRING = Kind("a string", lambda v: isinstance(v, str))
BOOLEAN = Kind("true or false", lambda v: type(v) is bool)
OBJECT = Kind("an object", lambda v: isinstance(v, dict))
INTEGERS = Kind("a list of integers", lambda v: isinstance(v, list) and all(map(_integer, v)))
NUMBERS = Kind("a list of numbers", lambda v: isinstance(v, list) and all(map(_number, v)))
STRINGS = Kind("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
OBJECTS = Kind("a list of objects", lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v))


def or_null(kind: Kind) -> Kind:
    return Kind(f"{kind.what} or null", lambda v: v is None or kind.accepts(v))


def shown(value: Any, limit: int = 60) -> str:
    """A value as the error line quotes it: its JSON, cut short, without terminal control characters."""
    text = json.dumps(value, ensure_ascii=False)
    return printable(text if len(text) <= limit else text[:limit] + "...")


def check_fields(doc: dict, fields: dict[str, Kind], path: Path, fix: str, where: str = "",
                 required: Iterable[str] = ()) -> None:
    """Each of `fields` that `doc` has is of its kind, and each of `required` is there; else one DataError:
    "{path}: {where}{name} is {value}, expected {kind}; {fix}". where: the field's place in the file
    ("shards[3]."). Fields not listed are not checked."""
    required = set(required)
    for name, kind in fields.items():
        if name not in doc:
            if name in required:
                raise DataError(f"{path}: {where}{name} is missing, expected {kind.what}; {fix}")
            continue
        if not kind.accepts(doc[name]):
            raise DataError(f"{path}: {where}{name} is {shown(doc[name])}, expected {kind.what}; {fix}")
