"""Benchmark stage 04's training step: the efficient TTT attention vs the naive full-mask reference.

One training step = ttt_loss (teacher from final hidden + unrolled TTT forward) + backward +
AdamW step, on one packed row of synthetic hidden states, exactly as common.train.trainer runs it.
Two draft attention implementations (common.model.draft):
  chunked  the default: block-causal scores against the step-0 keys plus one elementwise
           "diagonal" score per earlier TTT step, query chunks checkpointed;
  naive    the reference: plain attention over the concatenated [k_0 | k_1 | ... | k_i] with the
           full (steps*T) x (steps*T) mask.
Each implementation runs in its own subprocess so that peak memory (ru_maxrss minus the resident
size after setup) is its own. Both must give the same loss (checked, printed).

    python bench/bench_train.py                                  # defaults below, CPU
    python bench/bench_train.py --tokens 4096 --ttt-steps 7 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args) -> dict:
    import torch

    from common.model.draft import DEFAULT_ARCHITECTURE, DRAFT_FAMILIES
    from common.train.data import MicroBatch
    from common.train.step import StepSettings, build_step

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    H, Ht, V, Vd, T = args.hidden, args.hidden, args.vocab, args.draft_vocab, args.tokens
    family = DRAFT_FAMILIES[DEFAULT_ARCHITECTURE]  # the default (Llama) draft family
    cfg = family.config_class(hidden_size=H, intermediate_size=3 * H, num_attention_heads=args.heads,
                              num_key_value_heads=max(1, args.heads // 2), head_dim=H // args.heads,
                              vocab_size=V, draft_vocab_size=Vd, target_hidden_size=Ht, aux_layer_ids=[1, 2, 3],
                              max_position_embeddings=max(4096, T + args.ttt_steps),
                              initializer_range=0.1)  # larger than the default 0.02: non-uniform attention, a real comparison
    draft = family.build(cfg, attention=args.worker)
    d2t = torch.zeros(Vd, dtype=torch.long)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:Vd] = True
    draft.set_vocab_map(d2t, t2d)
    lm_head = torch.randn(V, Ht) * 0.5
    # one packed row: samples of sample_len tokens back to back
    n = max(1, T // args.sample_len)
    seq_lens = [args.sample_len] * n
    seq_lens[-1] += T - sum(seq_lens)
    aux = torch.randn(T, 3 * Ht)
    final = torch.randn(T, Ht)
    ids = torch.randint(0, V, (T,))
    mask = torch.ones(T, dtype=torch.long)
    pos = torch.cat([torch.arange(s) for s in seq_lens])
    # 04's own training step (common.train.step.build_step): fp32 on CPU, 04's AdamW, no clipping; betas and weight
    # decay are torch's AdamW defaults, as in bench/RESULTS.md's figures (taken when the norms decayed too)
    step_fn = build_step(draft, lm_head, StepSettings(ttt_steps=args.ttt_steps, loss_decay=0.8, grad_clip=0.0, lr=1e-4,
                                                      betas=(0.9, 0.999), weight_decay=0.01))
    mb = MicroBatch(ids, mask, aux, final, pos, seq_lens, [str(i) for i in range(len(seq_lens))])

    def step():
        return step_fn.run([(mb, True)], 1, denominator=None).outputs[0][0]

    first = step()  # warm-up (allocator, lazy init); its loss is the comparison value
    base = rss_bytes()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        last = step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    best = min(times)
    return {"impl": args.worker, "tokens": T, "step_s_best": best, "step_s_median": sorted(times)[len(times) // 2],
            "tokens_per_s": T / best, "peak_extra_bytes": max(0, peak - base), "first_loss": float(first.loss.detach()), "last_loss": float(last.loss.detach())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per packed micro-batch (T)")
    ap.add_argument("--sample-len", type=int, default=512, help="tokens per sample inside the packed row")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--draft-vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (the best one is reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = stable on a shared machine)")
    ap.add_argument("--impls", default="chunked,naive")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    results = {}
    for impl in args.impls.split(","):
        cmd = [sys.executable, __file__, "--worker", impl] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker", "impls")]
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if res.returncode != 0:
            sys.exit(f"{impl} failed:\n{res.stderr[-3000:]}")
        results[impl] = json.loads(res.stdout.strip().splitlines()[-1])

    print(f"training step, CPU, {args.threads} thread(s): T={args.tokens} tokens/row (samples of {args.sample_len}), "
          f"ttt_steps={args.ttt_steps}, hidden={args.hidden}, heads={args.heads}, V={args.vocab}, V_d={args.draft_vocab}")
    print(f"{'impl':<10}{'step s':>10}{'tokens/s':>12}{'peak MB':>10}{'loss step 1':>14}{'loss last':>14}")
    for impl, r in results.items():
        print(f"{impl:<10}{r['step_s_best']:>10.3f}{r['tokens_per_s']:>12.0f}{r['peak_extra_bytes'] / 2**20:>10.0f}"
              f"{r['first_loss']:>14.7f}{r['last_loss']:>14.7f}")
    if {"chunked", "naive"} <= results.keys():
        c, n = results["chunked"], results["naive"]
        print(f"chunked / naive: {c['tokens_per_s'] / n['tokens_per_s']:.2f}x tokens/s, "
              f"{c['peak_extra_bytes'] / max(1, n['peak_extra_bytes']):.2f}x peak memory; "
              f"loss difference {abs(c['first_loss'] - n['first_loss']):.1e} (step 1), "
              f"{abs(c['last_loss'] - n['last_loss']):.1e} (after {args.steps + 1} AdamW steps)")


if __name__ == "__main__":
    main()
