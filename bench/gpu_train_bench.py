"""Stage-04 training throughput on a GPU: tokens/s, MFU and peak memory of 04's own training step.

What runs is 04's step itself, built by common.train.step.build_step as 04 builds it (not a copy): the EAGLE-3
draft with fp32 master weights and a bf16 compute copy, frozen target embedding inside, the TTT loss with the
target lm_head in bf16 as the teacher, backward, grad-norm clipping and the AdamW step (foreach on GPU), the
attention ("auto": flex_attention where its start-up check passes on this GPU, else chunked) and torch.compile
(on CUDA) resolved as 04 resolves them, and printed. The inputs are synthetic (random hidden states of the right
shapes: the speed does not depend on their values): one packed row per micro-batch holding `--samples`
samples (default one) of seq_len / samples tokens, ttt_steps 7.

Draft sizes (one decoder layer, draft vocab 32000):
  llama8b   target Llama-3.1-8B: hidden 4096, 32 heads / 8 kv, head_dim 128, intermediate 14336, vocab 128256
  kimi      target Kimi-K2.5:    hidden 7168, 64 heads / 64 kv, head_dim 128, intermediate 12288, vocab 163840
            (configs/kimi-k2.5.yaml: the sizes of lightseekorg/kimi-k2.5-eagle3)

FLOPs per optimizer step (model FLOPs, printed per config; recomputation by checkpointing is not
counted, so this is MFU, not hardware utilisation). T tokens, K TTT steps, c_i positions counted at
step i (those with a target inside the sample and loss_mask 1), one sample of length L = T:
  per token and step, trained (x3 = forward + backward):
      2*(2H)*(nh+2*nkv)*hd  q/k/v of the first layer (input [embedding, hidden] = 2H wide)
    + 2*nh*hd*H             o_proj
    + 2*3*H*I               MLP
  attention, step i (x3): 4*nh*hd * (L(L+1)/2 + i*L)   (causal step-0 context + i own earlier steps)
  draft lm_head (x3):     2*H*V_d per counted position, sum over steps of c_i
  fc, step 0 only (x2: no input gradient): 2 * 2*(3*H_t)*H per token
  teacher (forward only, once per micro-batch): 2*H_t*V per token
MFU = FLOPs per step / step time / peak dense bf16 FLOP/s of the device (table below or
--peak-tflops). --smoke checks the formula against torch.utils.flop_counter (exact, CPU).

    python bench/gpu_train_bench.py                      # both drafts, seq 2048 and 4096 (GPU)
    python bench/gpu_train_bench.py --smoke              # tiny sizes on CPU (checks the script)
    python bench/gpu_train_bench.py --count-ops          # aten ops per optimizer step at 4 x 512, 7 TTT steps (CPU or
                                                         # GPU, eager, fp32 and bf16) and the compiled regions' graph breaks
Writes <out>/gpu_train_bench.json (after every config, so a timeout keeps what was measured).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

CONFIGS = {
    "llama8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, draft_vocab=32000),
    "kimi": dict(hidden=7168, heads=64, kv_heads=64, head_dim=128, intermediate=12288, vocab=163840, draft_vocab=32000),
    # --smoke: the same code path at sizes a CPU runs in seconds
    "smoke-a": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1000, draft_vocab=200),
    "smoke-b": dict(hidden=96, heads=6, kv_heads=2, head_dim=16, intermediate=192, vocab=1200, draft_vocab=300),
}

# Dense bf16 tensor-core peak, FLOP/s (no sparsity), by device-name substring.
# RTX PRO 6000 Blackwell: 4 PFLOPS FP4 with sparsity = 0.5 PFLOPS dense bf16 (fp32 accumulate).
PEAK_BF16 = [("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12), ("B200", 2250e12),
             ("RTX PRO 6000", 500e12),
             ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("A10", 125e12)]


def step_flops(spec: dict, sample_len: int, samples: int, ttt_steps: int, counted: list[int]) -> dict:
    H, Ht, nh, nkv, hd, inter = spec["hidden"], spec["hidden"], spec["heads"], spec["kv_heads"], spec["head_dim"], spec["intermediate"]
    V, Vd, L, K = spec["vocab"], spec["draft_vocab"], sample_len, ttt_steps
    T = L * samples
    per_token_step = 2 * (2 * H) * (nh + 2 * nkv) * hd + 2 * nh * hd * H + 2 * 3 * H * inter
    parts = {
        "layer": 3 * K * T * per_token_step,
        "attention": 3 * samples * sum(4 * nh * hd * (L * (L + 1) / 2 + i * L) for i in range(K)),
        "draft_lm_head": 3 * 2 * H * Vd * sum(counted),
        "fc": 2 * 2 * (3 * Ht) * H * T,
        "teacher": 2 * Ht * V * T,
    }
    parts["total"] = sum(parts.values())
    return parts


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((p for key, p in PEAK_BF16 if key in name), None)


def synthetic_batch(spec: dict, seq_len: int, device, gen: torch.Generator, samples: int = 1, dtype=torch.bfloat16):
    """One packed row of `samples` samples of seq_len / samples tokens (position ids restart per sample): what
    common.train.data hands the trainer (states in the compute dtype)."""
    from common.train.data import MicroBatch

    H, V = spec["hidden"], spec["vocab"]
    if seq_len % samples:
        raise SystemExit(f"--seq-len {seq_len} is not a multiple of --samples {samples}")
    n = seq_len // samples
    aux = torch.randn(seq_len, 3 * H, generator=gen, device=device).to(dtype)
    final = torch.randn(seq_len, H, generator=gen, device=device).to(dtype)
    ids = torch.randint(0, V, (seq_len,), generator=gen, device=device)
    mask = torch.ones(seq_len, dtype=torch.long, device=device)
    for s in range(samples):
        mask[s * n: s * n + n // 10] = 0  # a prompt part without loss
    positions = torch.arange(n, device=device).repeat(samples)
    return MicroBatch(ids, mask, aux, final, positions, [n] * samples, [f"synthetic-{s}" for s in range(samples)])


def build_bench_step(spec: dict, device, gen: torch.Generator, *, ttt_steps: int = 7, attention: str = "auto",
                     gradient_checkpointing: bool = False, compile: bool | None = None, dtype=torch.bfloat16,
                     max_len: int = 4096):
    """04's training step (common.train.step.build_step) over a draft of these sizes, built as 04 builds it: fp32
    master weights, frozen embedding, a vocab map, the bf16 teacher lm_head, 04's AdamW (foreach on GPU), the
    attention and torch.compile resolved as 04 resolves them. Returns (step, trainable params)."""
    from common.model.draft import DEFAULT_ARCHITECTURE, DRAFT_FAMILIES, choose_attention
    from common.train.step import StepSettings, build_step, resolve_compile

    H, V, Vd = spec["hidden"], spec["vocab"], spec["draft_vocab"]
    family = DRAFT_FAMILIES[DEFAULT_ARCHITECTURE]  # the default (Llama) draft family
    cfg = family.config_class(hidden_size=H, intermediate_size=spec["intermediate"], num_attention_heads=spec["heads"],
                              num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"], num_hidden_layers=1,
                              max_position_embeddings=max(4096, max_len + 16), vocab_size=V, draft_vocab_size=Vd,
                              target_hidden_size=H, aux_layer_ids=[2, 30, 58], rope_theta=500000.0)
    attention, attention_why = choose_attention(attention, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, device,
                                               cfg.value_head_dim)
    torch.manual_seed(0)
    with torch.device(device):
        draft = family.build(cfg, attention=attention, gradient_checkpointing=gradient_checkpointing)
    draft.attention_why = attention_why  # reported by the bench
    draft_ids = torch.sort(torch.randperm(V, generator=gen, device=device)[:Vd]).values.cpu()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    draft.set_vocab_map(draft_ids - torch.arange(Vd), t2d)
    lm_head = (torch.randn(V, H, generator=gen, device=device) * H ** -0.5).to(dtype)
    compile_on, _ = resolve_compile(compile, device)
    settings = StepSettings(ttt_steps=ttt_steps, loss_decay=0.8, grad_clip=0.5, dtype=dtype, compile=compile_on,
                            lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    return build_step(draft, lm_head, settings), sum(p.numel() for p in draft.parameters() if p.requires_grad)


def bench_one(name: str, spec: dict, seq_len: int, args, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t_build = time.perf_counter()
    step_fn, n_params = build_bench_step(spec, device, gen, ttt_steps=args.ttt_steps, attention=args.attention,
                                         gradient_checkpointing=args.gradient_checkpointing, compile=args.compile,
                                         dtype=args.dtype, max_len=seq_len)
    batch = synthetic_batch(spec, seq_len, device, gen, args.samples, args.dtype)
    build_s = time.perf_counter() - t_build

    def step():
        result = step_fn.run([(batch, True)], 1, denominator=None)
        return result.outputs[0][0]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t_first = time.perf_counter()
    out = step()  # the first step compiles (torch.compile, flex_attention)
    sync()
    first_s = time.perf_counter() - t_first
    for _ in range(args.warmup - 1):
        out = step()
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = step()
        sync()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]  # median: robust to a stray slow step
    flops = step_flops(spec, seq_len // args.samples, args.samples, args.ttt_steps, out.step_counts)
    peak = peak_flops(device, args.peak_tflops)
    if device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated(device)
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # process high-water mark (RSS)
    # 04's memory planner for the same step (common/train/memory_plan.py): its GPU-only terms (the compute copy,
    # foreach temporaries) are checked here and nowhere else; the bench's embedding stays fp32
    from types import SimpleNamespace

    from common.train.memory_plan import plan_memory

    settings = SimpleNamespace(batch_max_tokens=seq_len, ttt_steps=args.ttt_steps, grad_accum=1, parallel="ddp",
                               gradient_checkpointing=args.gradient_checkpointing,
                               precision="bf16" if args.dtype == torch.bfloat16 else "fp32")
    planned = plan_memory(step_fn.loss.draft.config, settings, world_size=1, device_type=device.type, embed_bf16=False,
                          max_sample_len=seq_len // args.samples).peak
    result = {
        "config": name, **spec, "seq_len": seq_len, "samples": args.samples, "ttt_steps": args.ttt_steps,
        "attention": step_fn.loss.draft.attention_impl, "attention_why": step_fn.loss.draft.attention_why,
        "compile": step_fn.s.compile, "precision": step_fn.loss.describe_precision(),
        "planned_peak_memory_gb": planned / 1e9, "planned_over_measured": planned / peak_mem if peak_mem else None,
        "gradient_checkpointing": args.gradient_checkpointing, "trainable_params": n_params,
        "first_step_s": first_s, "step_s_median": step_s, "step_s_all": times, "tokens_per_s": seq_len / step_s,
        "flops_per_step": flops["total"], "flops_breakdown": flops, "achieved_tflops": flops["total"] / step_s / 1e12,
        "mfu": flops["total"] / step_s / peak if peak else None, "peak_tflops": peak / 1e12 if peak else None,
        "peak_memory_gb": peak_mem / 1e9, "peak_memory_kind": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "RSS",
        "build_s": build_s, "loss": float(out.loss.detach()), "step_counts": out.step_counts,
    }
    del step_fn, batch, out
    return result


def count_ops(args, device) -> dict:
    """--count-ops: the host's work per optimizer step at the bench layout, after a warm-up step, at small widths
    (the counts do not depend on the widths): aten ops seen by a TorchDispatchMode (eager only: the method of
    the first GPU measurement, 13,059 then), top-level aten ops in torch.profiler's record, eager and with
    torch.compile (inductor), in fp32 and bf16; and the compiled regions' graph breaks (torch._dynamo.explain)."""
    import torch._dynamo

    from bench.step_instruments import count_dispatched_ops, count_top_level_ops, explain_regions

    spec = CONFIGS["smoke-a"]
    report = {"layout": f"{args.samples} x {args.seq_len // args.samples} tokens, ttt_steps {args.ttt_steps}", "device": device.type}
    for dtype in (torch.float32, torch.bfloat16):
        row = {}
        for compiled in (False, True):
            gen = torch.Generator(device=device).manual_seed(0)
            step_fn, _ = build_bench_step(spec, device, gen, ttt_steps=args.ttt_steps, attention="chunked",
                                          compile=compiled, dtype=dtype, max_len=args.seq_len)
            batch = synthetic_batch(spec, args.seq_len, device, gen, args.samples, dtype)
            run = lambda: step_fn.run([(batch, True)], 1, denominator=None)  # noqa: E731
            run()  # warm-up: compiles; AdamW's state, lazy buffers
            run()
            if not compiled:
                total, by_op = count_dispatched_ops(run)
                row["dispatched"] = total
                row["dispatched_top"] = dict(by_op.most_common(8))
            row["top_level_compiled" if compiled else "top_level_eager"] = count_top_level_ops(run)
            torch._dynamo.reset()
        report[str(dtype).replace("torch.", "")] = row
    gen = torch.Generator(device=device).manual_seed(0)
    step_fn, _ = build_bench_step(spec, device, gen, ttt_steps=args.ttt_steps, attention="chunked", compile=False,
                                  max_len=args.seq_len)
    report["graph_breaks"] = explain_regions(step_fn.loss.compute, synthetic_batch(spec, args.seq_len, device, gen, args.samples))
    return report


def check_flop_formula() -> str:
    """--smoke: the formula against torch's FLOP counter on one CPU step in fp32 (naive attention, whose dense
    masked scores are counted in full; the fused lm_head + loss recomputes its logits in backward, one more
    2*H*V_d per counted position than the model FLOPs), so every other term must match exactly."""
    from torch.utils.flop_counter import FlopCounterMode

    spec, T, K = CONFIGS["smoke-a"], 96, 3
    gen = torch.Generator().manual_seed(0)
    step_fn, _ = build_bench_step(spec, torch.device("cpu"), gen, ttt_steps=K, attention="naive", dtype=torch.float32)
    batch = synthetic_batch(spec, T, torch.device("cpu"), gen, dtype=torch.float32)
    with FlopCounterMode(display=False) as counter:
        out = step_fn.loss(batch)
        out.loss.backward()
    f = step_flops(spec, T, 1, K, out.step_counts)
    dense_attention = 3 * sum(4 * spec["heads"] * spec["head_dim"] * T * (i + 1) * T for i in range(K))
    recomputed_logits = 2 * spec["hidden"] * spec["draft_vocab"] * sum(out.step_counts)
    expected = f["total"] - f["attention"] + dense_attention + recomputed_logits
    counted = counter.get_total_flops()
    if counted != expected:
        raise SystemExit(f"FLOP formula mismatch: torch counts {counted}, the formula gives {expected}")
    return f"FLOP formula checked against torch.utils.flop_counter: {counted:,} FLOPs, exact"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, CPU allowed: checks that the script runs")
    parser.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS))
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per config (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1, help="samples packed per row (seq_len / samples tokens each)")
    parser.add_argument("--attention", default="auto", choices=["auto", "chunked", "flex", "naive"],
                        help="as train.attention_impl: auto = flex where it checks out on this GPU, else chunked")
    parser.add_argument("--compile", type=lambda v: {"on": True, "off": False, "auto": None}[v], default=None,
                        metavar="{on,off,auto}", help="torch.compile the layers' dense parts (auto: on CUDA)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--count-ops", action="store_true",
                        help="count the aten ops one optimizer step dispatches (eager, CPU or GPU) and the compiled "
                             "regions' graph breaks, at --seq-len (default 2048) = --samples (default 4) x 512")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, help="device peak dense bf16 TFLOP/s, if not in the built-in table")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"))
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    if args.count_ops:
        args.seq_len = (args.seq_lens or [2048])[0]
        args.samples = args.samples if args.samples > 1 else 4
        report = count_ops(args, device)
        print(json.dumps(report, indent=2))
        return
    if device.type != "cuda" and not args.smoke:
        sys.exit("no CUDA device: run with --smoke on CPU (tiny sizes), or on a GPU machine")
    configs = args.configs or (["smoke-a", "smoke-b"] if args.smoke else ["llama8b", "kimi"])
    seq_lens = args.seq_lens or ([128, 256] if args.smoke else [2048, 4096])
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    out_path = args.out / "gpu_train_bench.json"
    doc = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "cuda": torch.version.cuda, "smoke": args.smoke, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "args": {k: str(v) for k, v in vars(args).items()}, "results": [], "errors": [],
    }
    print(f"gpu_train_bench: {doc['device']}, torch {doc['torch']}; writing {out_path}", flush=True)
    if args.smoke:
        doc["flop_check"] = check_flop_formula()
        print(doc["flop_check"], flush=True)
    for name in configs:
        for seq_len in seq_lens:
            try:
                r = bench_one(name, CONFIGS[name], seq_len, args, device)
            except torch.cuda.OutOfMemoryError as e:
                doc["errors"].append({"config": name, "seq_len": seq_len, "error": f"OOM: {str(e).splitlines()[0]}"})
                print(f"{name:8} seq {seq_len:5}: out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            doc["results"].append(r)
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
            print(f"{name:8} seq {seq_len:5}: {r['tokens_per_s']:>9,.0f} tok/s  step {r['step_s_median'] * 1e3:8.1f} ms  "
                  f"{r['flops_per_step'] / 1e12:8.4g} TFLOP/step  {r['achieved_tflops']:8.4g} TFLOP/s  MFU {mfu:>6}  "
                  f"peak mem {r['peak_memory_gb']:6.2f} GB (planned {r['planned_peak_memory_gb']:.2f})  "
                  f"({r['trainable_params'] / 1e6:.1f}M trainable params)", flush=True)
            print(f"{'':8} attention {r['attention']} ({r['attention_why']}), compile {r['compile']}, {r['precision']}, "
                  f"first step {r['first_step_s']:.1f} s", flush=True)
            f = r["flops_breakdown"]
            print(f"{'':8} FLOPs/step: " + ", ".join(f"{k} {v / 1e9:.4g}G" for k, v in f.items() if k != "total")
                  + f" = {f['total'] / 1e9:.4g} GFLOP", flush=True)
            out_path.write_text(json.dumps(doc, indent=2) + "\n")
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    out_path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"gpu_train_bench: done -> {out_path}")


if __name__ == "__main__":
    main()
