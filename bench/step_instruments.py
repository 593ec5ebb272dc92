"""Instruments for bench/gpu_train_bench.py --count-ops and tests/train/test_step.py: what the host does per
optimizer step of 04's step (common.train.step), and whether the compiled regions break. Not used by 04."""

from __future__ import annotations

import collections

import torch
import torch._dynamo
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from common.model.draft import DraftModelContract


def count_dispatched_ops(fn) -> tuple[int, dict]:
    """(aten ops dispatched while fn() runs, by op name): what the host does per op whatever the op's size
    (bench/gpu_train_bench.py --count-ops; a test bounds it)."""
    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.by_op = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.by_op[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        fn()
    return sum(counter.by_op.values()), counter.by_op


def count_top_level_ops(fn) -> int:
    """aten ops called from Python (or from compiled code) while fn() runs, from torch.profiler's record: ops
    nested in another aten op are not counted. Unlike count_dispatched_ops it works under torch.compile (a
    dispatch mode makes dynamo fall back), where a fused kernel is no aten op at all."""
    def top_level(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and top_level(e))


def explain_regions(draft: DraftModelContract, mb) -> dict:
    """torch._dynamo.explain over each region the draft compiles (its compiled_regions: the Llama draft's
    pre_attention and post_attention of each decoder layer), on a micro-batch's step-0 inputs: {region: graph breaks}."""
    breaks = {}
    with torch.no_grad():
        for name, region, args in draft.compiled_regions(mb.aux_hidden, mb.input_ids, mb.position_ids, mb.seq_lens):
            breaks[name] = torch._dynamo.explain(region)(*args).graph_break_count
    torch._dynamo.reset()
    return breaks
