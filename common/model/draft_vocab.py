"""The draft vocabulary map, as 03 writes it and 04 and the export read it (docs/design.md#vocabulary-map):

    d2t int64 [V_d]   offsets: target id = i + d2t[i]   (vLLM reads this; draft_id_to_target_id)
    t2d bool  [V]     t2d[j] = j is in the draft vocab, exactly V_d True entries
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.core.errors import DataError


def build_mappings(used_ids: np.ndarray, vocab_size: int):
    """d2t offsets [V_d] (target = i + d2t[i]) and t2d mask [V] from sorted draft ids."""
    import torch

    used = torch.as_tensor(np.asarray(used_ids), dtype=torch.int64)
    d2t = used - torch.arange(len(used), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


RERUN_03 = "rerun 03_build_vocab_map.py --overwrite"


def load_vocab_map(path: str | Path, target_vocab: int | None = None, draft_vocab_size: int | None = None):
    """(d2t int64 [V_d], t2d bool [V]) from vocab_map.safetensors, checked to be a consistent map
    (d2t lands exactly on the ids t2d marks) and, when given, to fit the target vocab and
    vocab.draft_vocab_size. Every problem is a DataError naming the file and the fix."""
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise DataError(f"no draft vocab map at {path}; run 03_build_vocab_map.py first")
    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise DataError(f"vocab map {path} is unreadable ({e}); {RERUN_03}") from None
    if "d2t" not in tensors or "t2d" not in tensors:
        raise DataError(f"vocab map {path} lacks 'd2t' or 't2d'; {RERUN_03}")
    d2t, t2d = tensors["d2t"].long(), tensors["t2d"].bool()
    if target_vocab is not None and t2d.numel() != target_vocab:
        raise DataError(f"vocab map {path} is for a target vocab of {t2d.numel()} tokens but the target has {target_vocab}; "
                        f"{RERUN_03}")
    # 03 caps a draft vocab larger than the target's at the target vocab (with a warning).
    if draft_vocab_size is not None and d2t.numel() != min(draft_vocab_size, t2d.numel()):
        raise DataError(
            f"vocab map {path} has {d2t.numel()} draft tokens but vocab.draft_vocab_size={draft_vocab_size}; "
            f"{RERUN_03} (or set vocab.draft_vocab_size={d2t.numel()})"
        )
    targets = torch.arange(d2t.numel()) + d2t
    if int(t2d.sum()) != d2t.numel() or targets.min() < 0 or targets.max() >= t2d.numel() or not bool(t2d[targets].all()):
        raise DataError(f"vocab map {path} is inconsistent (d2t does not map onto the ids marked in t2d); {RERUN_03}")
    return d2t, t2d
