"""Where each token of a packed row sits (samples concatenated back to back), and the row helpers the attention
and the modules share."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.core.errors import DataError


@dataclass
class PackedLayout:
    """Where each token of a packed row sits: samples are concatenated back to back."""

    seq_lens: list[int]
    sample: torch.Tensor  # [T] int64, index of the token's sample
    start: torch.Tensor  # [T] int64, row index of the first token of the token's sample
    offset: torch.Tensor  # [T] int64, index within the sample
    length: torch.Tensor  # [T] int64, length of the token's sample
    starts: list[int] = field(default_factory=list)  # python copy of each sample's start

    @property
    def num_tokens(self) -> int:
        return int(sum(self.seq_lens))

    @classmethod
    def build(cls, seq_lens, num_tokens: int, device) -> "PackedLayout":
        seq_lens = [int(n) for n in seq_lens]
        if any(n < 1 for n in seq_lens) or sum(seq_lens) != num_tokens:
            raise DataError(f"seq_lens {seq_lens} must be positive and sum to the row length {num_tokens}")
        starts, acc = [], 0
        for n in seq_lens:
            starts.append(acc)
            acc += n
        lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
        sample = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens)
        start = torch.tensor(starts, dtype=torch.long, device=device)[sample]
        offset = torch.arange(num_tokens, device=device) - start
        return cls(seq_lens, sample, start, offset, lens[sample], starts)

    def shifted(self, k: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index of the token k places later, clamped into the row; whether it is in the same sample): [T] each,
        or [K, T] for a column of K shifts k [K, 1]."""
        T = self.num_tokens
        idx = (torch.arange(T, device=self.sample.device) + k).clamp_(max=T - 1)
        return idx, self.offset + k <= self.length - 1

    def step_valid(self, step: int | torch.Tensor) -> torch.Tensor:
        """[T] bool: step `step` at t has a target inside the sample (t + 2 + step <= L - 1); [K, T] for a
        column of steps [K, 1]."""
        return self.offset + 2 + step <= self.length - 1


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 for softmax-grade arithmetic; float64 stays float64 (the exactness tests run in it)."""
    return x if x.dtype == torch.float64 else x.float()


def squeeze_row(x: torch.Tensor, dims: int) -> torch.Tensor:
    """Accept [T, ...] or a batch of one row [1, T, ...]."""
    if x.dim() == dims + 1:
        if x.shape[0] != 1:
            raise DataError(f"expected one packed row, got a batch of {x.shape[0]}; pack samples into one row")
        x = x[0]
    return x
