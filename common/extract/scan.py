"""Stage 02's inputs: data/train.jsonl and data/eval.jsonl (from 01b), scanned once and read back per shard.

- scan_split: one pass over a split that validates every sample (tokens in the target's vocab, not longer than
  its max_position_embeddings, not empty) and records each sample's length and byte range; the plan
  (common.extract.planning) is made of these scans, and their sha256 goes into plan.json's "inputs".
- read_shard_samples: a planned shard's samples from its input file, in shard order (shard_order: longest
  first), checked against the sample ids the plan lists (a changed input file is an error that suggests
  --overwrite).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from common.core.errors import DataError
from common.core.io import bytes_bar
from common.core.run_folder import Layout
from common.core.tokenized import check_token_range, parse_tokenized_line


@dataclass
class InputSample:
    """One tokenized sample of data/{split}.jsonl as the scan saw it (the plan is made of these)."""

    id: str
    length: int  # tokens
    position: int  # line order within its split


@dataclass
class SplitScan:
    split: str
    path: Path
    sha256: str
    samples: list[InputSample]
    line_offsets: list[int]  # byte offset of each sample's line, plus the file size at the end


def input_paths(layout: Layout) -> dict[str, Path]:
    """The tokenized inputs by split: train (required), and eval where 01b wrote one."""
    train = layout.train_jsonl
    if not train.is_file():
        raise DataError(f"{train} not found; run 01b_generate_synthetic.py first (it writes data/train.jsonl and data/eval.jsonl)")
    paths = {"train": train}
    if layout.eval_jsonl.is_file():
        paths["eval"] = layout.eval_jsonl
    return paths


def parse_sample(line: bytes, path: Path, lineno: int) -> dict:
    """Parse and check one tokenized line; 02 additionally refuses empty samples."""
    sample = parse_tokenized_line(line, path, lineno)
    if not sample["input_ids"]:
        raise DataError(f"sample '{sample['id']}' ({path}:{lineno}) has no tokens; remove it or rerun 01b_generate_synthetic.py")
    return sample


def check_sample(sample: dict, vocab_size: int, max_positions: int | None, model: str) -> None:
    sid, ids = sample["id"], sample["input_ids"]
    check_token_range(sample, vocab_size, f"'{model}'")
    if max_positions is not None and len(ids) > max_positions:
        raise DataError(
            f"sample '{sid}' has {len(ids)} tokens, more than the target's max_position_embeddings {max_positions}; "
            f"lower tokenize.max_seq_len and rerun 01b_generate_synthetic.py"
        )


def scan_split(path: Path, split: str, vocab_size: int, max_positions: int | None, model: str) -> SplitScan:
    h = hashlib.sha256()
    samples, offsets = [], []
    pos = 0
    with open(path, "rb") as f, bytes_bar(path.stat().st_size, f"02 scan {path.name}") as bar:
        for lineno, line in enumerate(f, start=1):
            h.update(line)
            bar.update(len(line))
            start, pos = pos, pos + len(line)
            if not line.strip():
                continue
            row = parse_sample(line, path, lineno)
            check_sample(row, vocab_size, max_positions, model)
            offsets.append(start)
            samples.append(InputSample(row["id"], len(row["input_ids"]), len(samples)))
    offsets.append(pos)
    return SplitScan(split, path, h.hexdigest(), samples, offsets)


def shard_order(samples: list[InputSample]) -> list[InputSample]:
    """The order of samples within a shard: longest first (padding is limited and the largest batch, the likeliest
    OOM, comes first), ties in input order."""
    return sorted(samples, key=lambda s: (-s.length, s.position))


def read_shard_samples(path: Path, shard: dict) -> list[dict]:
    """The shard's samples from the input file, in shard order (as the plan lists them)."""
    if "lines" in shard:  # rounds mode: a random share of the file, one byte range per sample
        with open(path, "rb") as f:
            rows = []
            for start, end in shard["lines"]:
                f.seek(start)
                rows.append(parse_sample(f.read(end - start), path, 0))
        if [r["id"] for r in rows] != shard["sample_ids"]:
            raise DataError(f"{path} changed since hidden/plan.json was made; rerun 02_extract_hidden.py with --overwrite")
        return rows
    with open(path, "rb") as f:
        f.seek(shard["byte_start"])
        data = f.read(shard["byte_end"] - shard["byte_start"])
    rows = [parse_sample(line, path, 0) for line in data.split(b"\n") if line.strip()]
    refs = shard_order([InputSample(r["id"], len(r["input_ids"]), i) for i, r in enumerate(rows)])
    ordered = [rows[r.position] for r in refs]
    if [r["id"] for r in ordered] != shard["sample_ids"]:
        raise DataError(f"{path} changed since hidden/plan.json was made; rerun 02_extract_hidden.py with --overwrite")
    return ordered
