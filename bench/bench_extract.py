"""Benchmark stage 02: extraction time vs a bare forward pass, and bytes written per token.

For each target config (random init, built locally) it writes tokenized data, then alternates
  bare    the target's decoder stack over exactly the batches extraction uses (same shards, same
          sort, same padding), no hooks, nothing written; and the full CausalLM forward (with the
          lm_head over the vocab) for reference;
  extract run_extraction(..., overwrite=True): hooks, copies to CPU, shard writing + sha256, index.
Each is repeated and the fastest run kept (the dev machine is shared). Reported:
  extract / bare   target: <= 1.15 (the shard loop only; model loading and the input scan excluded,
                   and printed separately as end-to-end time)
  bytes/token      written bytes / tokens vs the format's minimum ((n_aux+1)*H*dtype + 9 B ids/mask)

With --backends it instead extracts the same samples once with each backend (extract.backend hf,
then vllm: vLLM's extract_hidden_states + our connector) and reports tokens/s of the shard loop for
both, their ratio, and the wall time including model load / engine start.

    python bench/bench_extract.py                    # tiny + medium
    python bench/bench_extract.py --configs tiny --repeats 5
    python bench/bench_extract.py --backends --configs tiny medium
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab, samples, (min len, max len))
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                 vocab_size=2048, samples=64, lengths=(64, 512)),
    "medium": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                   intermediate_size=2816, vocab_size=32000, samples=16, lengths=(64, 384)),
}


def build(root: Path, name: str, spec: dict, target_dtype):
    import torch
    import transformers

    from common.core.run_folder import Layout

    model_dir = root / f"{name}-model"
    cfg = transformers.LlamaConfig(max_position_embeddings=4096, **{k: v for k, v in spec.items() if k not in ("samples", "lengths")})
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).to(target_dtype).save_pretrained(model_dir)
    run_dir = root / f"{name}-run"
    layout = Layout.of(run_dir)
    layout.data.mkdir(parents=True)
    rng = random.Random(0)
    with open(layout.train_jsonl, "w") as f:
        for i in range(spec["samples"]):
            n = rng.randint(*spec["lengths"])
            f.write(json.dumps({"id": f"s{i}", "input_ids": [rng.randrange(spec["vocab_size"]) for _ in range(n)],
                                "loss_mask": [1] * n}) + "\n")
    return model_dir, run_dir


def bare_forward_seconds(cfg, model_dir: Path, run_dir: Path, full: bool) -> float:
    """The same batches as extraction, decoder stack (or full CausalLM) only."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.core.run_folder import Layout
    from common.extract.hf_backend import make_batches
    from common.extract.scan import read_shard_samples
    from common.target.hf_forward import find_decoder_stack, pad_batch
    from common.target.loading import torch_dtype

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(cfg.target.dtype)).eval()
    stack = find_decoder_stack(model, model.config.num_hidden_layers)
    layout = Layout.of(run_dir)
    plan = json.loads(layout.hidden_plan.read_text())
    shards = []
    for shard in plan["shards"]:  # read inputs outside the timed region, like extraction's overlap
        samples = read_shard_samples(layout.split_jsonl(shard["split"]), shard)
        shards.append(samples)
    start = time.perf_counter()
    with torch.inference_mode():
        for samples in shards:
            for lo, hi in make_batches([len(s["input_ids"]) for s in samples], cfg.extract.batch_max_tokens):
                ids, mask, _ = pad_batch(samples[lo:hi])
                (model if full else stack)(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - start


def bench_one(root: Path, name: str, spec: dict, args) -> dict:
    import torch

    from common.core.config import config_from_dict
    from common.core.run_folder import Layout
    from common.extract.stage import run_extraction
    from common.hidden.shards import bytes_per_token
    from common.target.loading import torch_dtype

    model_dir, run_dir = build(root, name, spec, torch_dtype(args.target_dtype))
    cfg = config_from_dict({
        "run_dir": str(run_dir),
        "target": {"model": str(model_dir), "aux_layer_ids": [1, spec["num_hidden_layers"] // 2, spec["num_hidden_layers"] - 1],
                   "dtype": args.target_dtype},
        "extract": {"device": "cpu", "dtype": "bfloat16", "batch_max_tokens": args.batch_max_tokens,
                    "shard_max_tokens": args.shard_max_tokens, "backend": "hf"},
    })
    run_extraction(cfg)  # warm-up run; also writes the plan the bare pass reuses
    bare, full, extract, wall = [], [], [], []
    for _ in range(args.repeats):
        bare.append(bare_forward_seconds(cfg, model_dir, run_dir, full=False))
        full.append(bare_forward_seconds(cfg, model_dir, run_dir, full=True))
        start = time.perf_counter()
        summary = run_extraction(cfg, overwrite=True)
        wall.append(time.perf_counter() - start)
        extract.append(summary["seconds"])
    index = json.loads(Layout.of(run_dir).hidden_index.read_text())
    tokens, written = index["num_tokens"], index["bytes"]
    minimum = bytes_per_token(3, spec["hidden_size"], "bfloat16")
    return {
        "config": name, "hidden": spec["hidden_size"], "layers": spec["num_hidden_layers"], "tokens": tokens,
        "shards": index["num_shards"], "threads": torch.get_num_threads(),
        "bare_s": min(bare), "full_s": min(full), "extract_s": min(extract), "extract_wall_s": min(wall),
        "ratio_vs_bare": min(extract) / min(bare), "ratio_vs_full": min(extract) / min(full),
        "bytes_per_token": written / tokens, "min_bytes_per_token": minimum, "bytes_overhead": written / tokens / minimum,
        "tok_per_s": tokens / min(extract),
    }


def bench_backends(root: Path, name: str, spec: dict, args) -> dict:
    """One run of each backend over the same samples (same plan, same shards)."""
    from common.core.config import config_from_dict
    from common.extract.stage import run_extraction
    from common.target.loading import torch_dtype

    model_dir, run_dir = build(root, name, spec, torch_dtype(args.target_dtype))
    row = {"config": name, "hidden": spec["hidden_size"], "layers": spec["num_hidden_layers"]}
    for backend in ("hf", "vllm"):
        cfg = config_from_dict({
            "run_dir": str(run_dir),
            "target": {"model": str(model_dir), "aux_layer_ids": [1, spec["num_hidden_layers"] // 2, spec["num_hidden_layers"] - 1],
                       "dtype": args.target_dtype},
            "tokenize": {"max_seq_len": spec["lengths"][1]},
            "extract": {"device": "cpu", "dtype": "bfloat16", "batch_max_tokens": args.batch_max_tokens,
                        "shard_max_tokens": args.shard_max_tokens, "backend": backend},
        })
        start = time.perf_counter()
        summary = run_extraction(cfg, overwrite=True)
        row[f"{backend}_wall_s"] = time.perf_counter() - start
        row[f"{backend}_s"] = summary["seconds"]
        row[f"{backend}_tok_per_s"] = summary["tokens_per_s"]
        row["tokens"] = summary["tokens"]
    row["ratio"] = row["vllm_tok_per_s"] / row["hf_tok_per_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target-dtype", default="float32",
                        help="target compute dtype (float32 on CPU: bf16 matmuls are emulated and ~7x slower here)")
    parser.add_argument("--batch-max-tokens", type=int, default=4096)
    parser.add_argument("--shard-max-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice; 1 avoids OpenMP oversubscription on a busy machine)")
    parser.add_argument("--backends", action="store_true", help="compare the vllm and hf backends (one run each)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    import logging

    logging.disable(logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    results = []
    try:
        for name in args.configs:
            results.append((bench_backends if args.backends else bench_one)(root, name, CONFIGS[name], args))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    if args.backends:
        print(f"{'config':8} {'H':>5} {'L':>2} {'tokens':>7} {'hf tok/s':>9} {'vllm tok/s':>10} {'vllm/hf':>8} "
              f"{'hf wall s':>9} {'vllm wall s':>11}")
        for r in results:
            print(f"{r['config']:8} {r['hidden']:>5} {r['layers']:>2} {r['tokens']:>7} {r['hf_tok_per_s']:>9.0f} "
                  f"{r['vllm_tok_per_s']:>10.0f} {r['ratio']:>8.2f} {r['hf_wall_s']:>9.1f} {r['vllm_wall_s']:>11.1f}")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
        return
    print(f"{'config':8} {'H':>5} {'L':>2} {'tokens':>7} {'bare s':>8} {'full s':>8} {'extract s':>9} {'ext/bare':>8} "
          f"{'ext/full':>8} {'tok/s':>8} {'B/token':>8} {'min B/tok':>9} {'overhead':>8}")
    for r in results:
        print(f"{r['config']:8} {r['hidden']:>5} {r['layers']:>2} {r['tokens']:>7} {r['bare_s']:>8.2f} {r['full_s']:>8.2f} "
              f"{r['extract_s']:>9.2f} {r['ratio_vs_bare']:>8.3f} {r['ratio_vs_full']:>8.3f} {r['tok_per_s']:>8.0f} "
              f"{r['bytes_per_token']:>8.1f} {r['min_bytes_per_token']:>9} {r['bytes_overhead']:>8.4f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
