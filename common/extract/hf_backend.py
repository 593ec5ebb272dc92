"""02's hf backend: the target in transformers, hooks on its decoder stack, right-padded batches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from common.target.hf_forward import HiddenStateCapture, choose_device, find_decoder_stack, forward_batch, load_target_model

if TYPE_CHECKING:
    from common.core.distributed import DistEnv


def make_batches(lengths: list[int], batch_max_tokens: int) -> list[tuple[int, int]]:
    """[start, end) row ranges over samples sorted longest first, rows * max_len <= budget."""
    batches, i = [], 0
    while i < len(lengths):
        rows = max(1, batch_max_tokens // lengths[i])
        batches.append((i, min(len(lengths), i + rows)))
        i += rows
    return batches


class HfExtractor:
    """The hf backend: the target in transformers, hooks on its decoder stack, right-padded batches."""

    def __init__(self, cfg, info, env: DistEnv, out_dtype):
        device = choose_device(cfg.extract.device)
        model, self.placement = load_target_model(cfg.target, device, env.local_rank, env.world_size)
        self.stack = find_decoder_stack(model, info.num_layers)
        self.capture = HiddenStateCapture(self.stack, info.aux_layer_ids, out_dtype)
        self.batch_max_tokens = cfg.extract.batch_max_tokens

    def extract(self, samples: list[dict], on_tokens: Callable[[int], Any]) -> list[dict]:
        """The states of `samples` (shard order) as a list of batches, each {"aux", "final"} on CPU."""
        lengths = [len(s["input_ids"]) for s in samples]
        batches = []
        for lo, hi in make_batches(lengths, self.batch_max_tokens):
            batches.append(forward_batch(self.stack, self.capture, samples[lo:hi]))
            on_tokens(sum(lengths[lo:hi]))
        return batches

    def idle_round(self) -> None:
        pass  # hf ranks are independent: nothing to step together

    def close(self) -> None:
        self.capture.remove()
