"""Stage 03: the draft vocabulary: the target ids the draft's lm_head can predict.

Counts how often each token id occurs at loss-masked (assistant) positions of data/train.jsonl
(eval is never counted: its coverage must stay an honest estimate), keeps the
vocab.draft_vocab_size most frequent ids (ties broken by the lower id), pads with the lowest
unused ids when fewer distinct ids were seen, and sorts them ascending. As in official EAGLE-3,
SpecForge and speculators (docs/design.md#vocabulary-map):

    d2t int64 [V_d]   offsets: target id = i + d2t[i]   (vLLM reads this; draft_id_to_target_id)
    t2d bool  [V]     t2d[j] = j is in the draft vocab, exactly V_d True entries

Because the ids are sorted, target_logits[..., t2d] lists the draft vocab in draft-index order.
Outputs (under run_dir/vocab/, atomic): vocab_map.safetensors and report.json (draft/target
vocab sizes, distinct ids seen, coverage = share of loss-masked training tokens inside the draft
vocab, number of padded ids, and the input fingerprint used to decide "already complete").
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np

from common.core.errors import DataError
from common.core.io import atomic_path, atomic_write_json, bytes_bar, read_json
from common.core.run_folder import Layout, StageManifest
from common.core.tokenized import check_token_range, parse_tokenized_line
from common.model.draft_vocab import build_mappings

log = logging.getLogger("vocab_map")


def count_masked_tokens(path: Path, vocab_size: int, flush_every: int = 1 << 20) -> tuple[np.ndarray, int, str]:
    """Per-id counts over loss-masked positions of a tokenized jsonl; also (num_samples, sha256)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    pending: list[int] = []
    digest = hashlib.sha256()
    num_samples = 0
    with open(path, "rb") as f, bytes_bar(path.stat().st_size, f"03 count {path.name}") as bar:
        for lineno, line in enumerate(f, start=1):
            digest.update(line)
            bar.update(len(line))
            if not line.strip():
                continue
            sample = parse_tokenized_line(line, path, lineno)
            check_token_range(sample, vocab_size)
            ids, mask = sample["input_ids"], sample["loss_mask"]
            pending.extend(t for t, m in zip(ids, mask) if m)
            num_samples += 1
            if len(pending) >= flush_every:  # bincount in big blocks: fast, bounded memory
                counts += np.bincount(np.asarray(pending, dtype=np.int64), minlength=vocab_size)
                pending = []
    if pending:
        counts += np.bincount(np.asarray(pending, dtype=np.int64), minlength=vocab_size)
    return counts, num_samples, digest.hexdigest()


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """The draft vocab as sorted target ids: top-V_d by count, ties by lower id, then unused ids by id."""
    order = np.lexsort((np.arange(len(counts)), -counts))  # primary: count desc; secondary: id asc
    return np.sort(order[:draft_vocab_size])


def run_vocab_map(cfg, overwrite: bool = False) -> dict:
    """Build (or find complete) vocab/vocab_map.safetensors and vocab/report.json. Returns the report."""
    from safetensors.torch import save_file

    from common.target.loading import load_target_info

    layout = Layout.of(cfg)
    train = layout.train_jsonl
    if not train.is_file():
        raise DataError(f"{train} not found; run 01b_generate_synthetic.py first (it writes data/train.jsonl)")
    out_dir, map_path, report_path = layout.vocab, layout.vocab_map, layout.vocab_report
    info = load_target_info(cfg.target)
    vocab_size = info.vocab_size
    requested = cfg.vocab.draft_vocab_size

    manifest = StageManifest(layout, "03_build_vocab_map", inputs=layout.named(train),
                             settings={"vocab.draft_vocab_size": requested, "target_vocab_size": vocab_size})
    if manifest.begin(overwrite, outputs=[map_path, report_path]) == "complete":
        report = read_json(report_path)
        manifest.record("already_complete")
        print(f"03_build_vocab_map: already complete ({report['draft_vocab_size']} draft ids, coverage "
              f"{report['coverage']:.4f}) in {out_dir}; use --overwrite to redo")
        return report

    draft_vocab_size = requested
    if requested > vocab_size:
        log.warning("vocab.draft_vocab_size=%d exceeds the target vocab %d; using %d (the full vocab)", requested, vocab_size, vocab_size)
        draft_vocab_size = vocab_size

    counts, num_samples, sha = count_masked_tokens(train, vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise DataError(f"{train} has no loss-masked tokens ({num_samples} samples); check the loss masks written by 01b")
    used = select_draft_vocab(counts, draft_vocab_size)
    d2t, t2d = build_mappings(used, vocab_size)
    distinct = int((counts > 0).sum())
    padded = int((counts[used] == 0).sum())
    report = {
        "draft_vocab_size": int(draft_vocab_size),
        "requested_draft_vocab_size": int(requested),
        "target_vocab_size": int(vocab_size),
        "distinct_tokens_seen": distinct,
        "num_loss_tokens": total,
        "num_samples": num_samples,
        "coverage": float(counts[used].sum() / total),
        "padded": padded,
        "train_sha256": sha,
        "target_model": cfg.target.model,
    }
    # Rebuilding (all refusals are behind us): the old report goes first, never next to a new map.
    report_path.unlink(missing_ok=True)
    with atomic_path(map_path) as tmp:
        save_file({"d2t": d2t, "t2d": t2d}, str(tmp))
    atomic_write_json(report_path, report)
    manifest.complete({"draft_vocab_size": int(draft_vocab_size), "coverage": report["coverage"]})
    print(f"03_build_vocab_map: {draft_vocab_size} draft ids of {vocab_size} from {total:,} loss-masked tokens in "
          f"{num_samples} samples ({distinct} distinct, {padded} padded); coverage {report['coverage']:.4f} -> {out_dir}")
    return report
