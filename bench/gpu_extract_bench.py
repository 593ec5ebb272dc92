"""Stage 02 on an MLA + MoE target (DeepSeek-V3 / Kimi-K2.5's architecture, random weights) through both
backends: vLLM (extract_hidden_states + our connector: what 02 runs on Kimi-K2.5) and transformers.

Prints, per backend, the shard loop's tokens/s and the wall time with model load / engine start, and the
largest relative difference per stored tensor between the two backends' shards (the same samples, the same
plan). Part of bench/gpu.sh; runs on CPU too (--device cpu, the tiny size) to check the script.

  tiny    tiny_target.py's deepseek_v3 family: hidden 128, 4 layers, 8 experts (seconds)
  small   hidden 1024, 8 layers (1 dense), 64 routed experts top-6 + 1 shared, MLA 512 + 64, vocab 32000 (~1B)

    python bench/gpu_extract_bench.py --size small --out bench_out
    python bench/gpu_extract_bench.py --device cpu --size tiny
Writes <out>/gpu_extract_bench.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMALL = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, intermediate_size=2816,
             moe_intermediate_size=512, n_shared_experts=1, n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1,
             first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
             qk_nope_head_dim=128, v_head_dim=128, vocab_size=32000, topk_method="noaux_tc", scoring_func="sigmoid",
             max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False)


def build_target(root: Path, size: str) -> Path:
    import torch
    import transformers

    out = root / f"{size}-mla-moe"
    if size == "tiny":
        from common.demo.tiny_target import build_tiny_target

        build_tiny_target(out, family="deepseek_v3", train=False, dtype="bfloat16", progress=False)
        return out
    cfg = transformers.DeepseekV3Config(**SMALL)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def write_samples(run: Path, vocab: int, samples: int, lengths: tuple[int, int]) -> None:
    rng = random.Random(0)
    (run / "data").mkdir(parents=True, exist_ok=True)
    with open(run / "data" / "train.jsonl", "w") as f:
        for i in range(samples):
            n = rng.randint(*lengths)
            f.write(json.dumps({"id": f"s{i}", "input_ids": [rng.randrange(vocab) for _ in range(n)], "loss_mask": [1] * n}) + "\n")


def max_relative_error(run_a: Path, run_b: Path, n_aux: int) -> dict[str, float]:
    from safetensors.torch import load_file

    index = json.loads((run_a / "hidden" / "index.json").read_text())
    worst = {f"aux[{j}]": 0.0 for j in range(n_aux)} | {"final": 0.0}
    for shard in index["shards"]:
        a, b = load_file(run_a / "hidden" / shard["file"]), load_file(run_b / "hidden" / shard["file"])
        size = a["final_hidden"].shape[1]
        blocks = [(f"aux[{j}]", slice(j * size, (j + 1) * size)) for j in range(n_aux)]
        for key, cols in blocks:
            x, y = a["aux_hidden"][:, cols].float(), b["aux_hidden"][:, cols].float()
            worst[key] = max(worst[key], float((x - y).norm() / y.norm()))
        x, y = a["final_hidden"].float(), b["final_hidden"].float()
        worst["final"] = max(worst["final"], float((x - y).norm() / y.norm()))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--samples", type=int, default=None, help="default: 256 on cuda, 8 on cpu")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    from common.core.config import config_from_dict
    from common.extract.stage import run_extraction
    from common.extract.vllm_backend import vllm_installed

    args.out.mkdir(parents=True, exist_ok=True)
    samples = args.samples or (256 if args.device == "cuda" else 8)
    result = {"size": args.size, "device": args.device, "samples": samples}
    with tempfile.TemporaryDirectory(prefix="gpu-extract-") as tmp:
        root = Path(tmp)
        target = build_target(root, args.size)
        config = json.loads((target / "config.json").read_text())
        layers, vocab = config["num_hidden_layers"], config["vocab_size"]
        aux = [1, layers // 2, layers - 1]  # id 0 is not capturable on vLLM's DeepSeek stack
        lengths = (256, 2048) if args.device == "cuda" else (64, 256)
        backends = ["hf"] + (["vllm"] if vllm_installed() else [])
        if not vllm_installed():
            result["vllm"] = "not installed: EAGLE3_VLLM=gpu bash scripts/setup.sh"
        for backend in backends:
            run = root / f"run-{backend}"
            write_samples(run, vocab, samples, lengths)
            cfg = config_from_dict({
                "run_dir": str(run), "target": {"model": str(target), "aux_layer_ids": aux, "dtype": "bfloat16"},
                "tokenize": {"max_seq_len": lengths[1]},
                "extract": {"device": args.device, "dtype": "bfloat16", "backend": backend, "batch_max_tokens": 8192,
                            "shard_max_tokens": 65536, "gpu_memory_utilization": 0.5}})
            start = time.perf_counter()
            summary = run_extraction(cfg)
            result[backend] = {"tokens": summary["tokens"], "loop_s": round(summary["seconds"], 2),
                               "tok_per_s": round(summary["tokens_per_s"], 1), "wall_s": round(time.perf_counter() - start, 1)}
            print(f"{backend}: {result[backend]}", flush=True)
        if len(backends) == 2:
            result["vllm_vs_hf_max_rel_error"] = max_relative_error(root / "run-vllm", root / "run-hf", len(aux))
            result["vllm_over_hf_tok_per_s"] = round(result["vllm"]["tok_per_s"] / result["hf"]["tok_per_s"], 2)
            print("vllm vs hf, max relative error per tensor:", result["vllm_vs_hf_max_rel_error"],
                  f"| vllm/hf tokens/s {result['vllm_over_hf_tok_per_s']}x", flush=True)
    (args.out / "gpu_extract_bench.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
