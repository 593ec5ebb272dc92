"""Measure stage 04's peak memory on CPU: run `python tests/train/memory_probe.py CONFIG STEPS` in a fresh
process; it prints one JSON line {"peak_bytes": ..., "step_peaks": [...]}.

How: torch's CPU allocator reports every allocation and free to the profiler while one is active
(c10 ProfiledCPUMemoryReporter), with the allocator's running total of live bytes. The profiler is
started before the trainer allocates anything, so that total is every tensor byte 04 holds: the
draft, the teacher lm_head, the frozen embedding, AdamW state, the micro-batch, the teacher
log-probs, the activations autograd saves, and the temporaries inside each op and its backward
(it is what torch.cuda.max_memory_allocated counts on a GPU). The peak is the largest total seen
inside a training step (setup, e.g. the target tensors read once, is left out: it is not 04's steady
state). RSS would add the interpreter, the libraries and malloc's caching, none of which the
planner models, and ru_maxrss cannot be reset between setup and the steps.
"""

from __future__ import annotations

import json
import sys


def main(config_path: str, steps: int, overrides: list[str]) -> None:
    import torch
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    from common.core.config import load_config
    from common.core.distributed import init_distributed
    from common.target.loading import load_target_tensors
    from common.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(config_path, overrides)
    env = init_distributed()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(cfg, env)
        trainer.build_model(load_target_tensors(cfg.target.model))
        trainer.init_state()
        trainer.progress.bar = type("Bar", (), {"update": lambda self, n: None})()
        trainer.model.train()
        for s in range(steps):
            with record_function(f"probe_step_{s}"):
                trainer.train_step(trainer.source.next_batch(trainer.pos, steps - s))

    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)

    # total_allocated: the CPU allocator's live bytes after each allocation or free. (The shard files
    # safetensors maps into memory are reported as allocations too, but outside that total: file
    # pages, not tensors; on a GPU run they stay on the host.)
    roots = [n for n in walk(prof.profiler.kineto_results.experimental_event_tree()) if n.name.startswith("probe_step_")]
    peaks = []
    for root in sorted(roots, key=lambda n: n.start_time_ns):
        totals = [n.extra_fields.total_allocated for n in walk([root]) if n.tag == _EventType.Allocation]
        peaks.append(max(totals, default=0))
    print(json.dumps({"peak_bytes": max(peaks), "step_peaks": peaks, "estimate_bytes": trainer.memory_plan.peak,
                      "estimate": trainer.memory_plan.describe()}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
