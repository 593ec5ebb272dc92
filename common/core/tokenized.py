"""The tokenized-sample format: data/train.jsonl and data/eval.jsonl (Layout.train_jsonl, Layout.eval_jsonl), one
owner for its writer and its reader (docs/design.md#artifact-formats).

    {"id": "...", "input_ids": [int, ...], "loss_mask": [0|1, ...]}    one sample per line, same lengths

01b writes them (common.data.generate_tokenize, through tokenized_writer); 02 and 03 read them (common.extract.scan,
common.vocab.vocab_map, through parse_tokenized_line), so a bad line gives the same one-line error wherever it is
found. How a conversation becomes input_ids and loss_mask is common.target.tokenization's.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from common.core.errors import DataError
from common.core.io import jsonl_writer_atomic, parse_json

SPLITS = ("train", "eval")


@contextlib.contextmanager
def tokenized_writer(layout) -> Iterator[Callable[[str, str, dict], None]]:
    """write(split, sample_id, {"input_ids", "loss_mask"}) into data/train.jsonl or data/eval.jsonl, both written
    atomically: on success both files are whole, on an exception neither changes."""
    with jsonl_writer_atomic(layout.eval_jsonl) as write_eval, jsonl_writer_atomic(layout.train_jsonl) as write_train:
        def write(split: str, sample_id: str, sample: dict) -> None:
            if split not in SPLITS:
                raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
            row = {"id": sample_id, "input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"]}
            (write_eval if split == "eval" else write_train)(row)

        yield write


def parse_tokenized_line(line: bytes, path, lineno: int) -> dict:
    """Parse and check one line of data/train.jsonl or eval.jsonl: {"id", "input_ids", "loss_mask"}.

    Every reader of tokenized samples (02, 03) goes through here, so a bad line gives the
    same one-line error naming file, line and sample id wherever it is found.
    """
    where = f"{path}:{lineno}"
    try:
        row = parse_json(line)
    except ValueError as e:
        raise DataError(f"{where}: malformed JSONL line ({e}); rerun 01b_generate_synthetic.py --overwrite") from None
    if not isinstance(row, dict) or not all(k in row for k in ("id", "input_ids", "loss_mask")):
        raise DataError(f"{where}: expected an object with id, input_ids and loss_mask; rerun 01b_generate_synthetic.py --overwrite")
    sid, ids, mask = str(row["id"]), row["input_ids"], row["loss_mask"]
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise DataError(f"{where}: sample '{sid}': input_ids and loss_mask must be lists of the same length")
    if not all(type(t) is int for t in ids):
        raise DataError(f"{where}: sample '{sid}': input_ids must be integers; rerun 01b_generate_synthetic.py --overwrite")
    if not all(m in (0, 1) and type(m) is int for m in mask):
        raise DataError(f"{where}: sample '{sid}': loss_mask must contain only 0 and 1")
    return {"id": sid, "input_ids": ids, "loss_mask": mask}


def check_token_range(sample: dict, vocab_size: int, model: str = "the target") -> None:
    """Token ids outside the target vocab mean the data was tokenized with another tokenizer."""
    ids = sample["input_ids"]
    if not ids:
        return
    hi, lo = max(ids), min(ids)
    if hi >= vocab_size or lo < 0:
        bad = hi if hi >= vocab_size else lo
        raise DataError(
            f"sample '{sample['id']}' has token id {bad}, outside the target vocab [0, {vocab_size}) of {model}: "
            f"the data was tokenized with a different tokenizer; rerun 01b_generate_synthetic.py with the target's tokenizer"
        )
