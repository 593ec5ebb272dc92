"""04's optimizer and learning-rate schedule.

AdamW with two parameter groups: weight matrices decay, 1-D weights (norms) never do; multi-tensor
(foreach) updates on GPU. The schedule is linear warmup over warmup_ratio * total steps, then a
cosine from lr down to min_lr; it is a pure function of the step, which checkpoints store.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(model: nn.Module, lr: float, betas, weight_decay: float, foreach: bool) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of `model` (the frozen target embedding is left out)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},  # norms: no decay
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), foreach=foreach)


def lr_at(step: int, total: int, t) -> float:
    """Linear warmup over warmup_ratio * total steps, then cosine from lr down to min_lr (t: the train section)."""
    warmup = int(math.ceil(t.warmup_ratio * total))
    if step < warmup:
        return t.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))
