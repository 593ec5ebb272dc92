#!/usr/bin/env python3
"""The KV cache a tensor-parallel vLLM server of the target keeps per GPU, and how many requests it holds,
on paper (common/serving/sizing.py). README "Sizing the server" is this script's output.

  python scripts/plan_serving.py --target /models/Kimi-K2.5 --gpu rtx-pro-6000 --max-model-len 32768
  python scripts/plan_serving.py --target configs/targets/kimi-k2.5.json --gpu h200 --kv-cache-dtype fp8
  python scripts/plan_serving.py --target configs/targets/kimi-k2.5.json --gpu h200 --max-model-len 32768 \
      --draft configs/kimi-k2.5.yaml

--target: the model directory (config.json + *.safetensors, summed for the weights) or a JSON of its text
config's sizes with "weights_gib" (configs/targets/kimi-k2.5.json). Once the server runs, 01b prints the
figure vLLM itself measured.
--draft: served with an EAGLE draft, whose layers take KV cache from the same blocks: a draft directory or its
config.json (vLLM's or speculators' format, ours or a published one), or a pipeline config whose draft: section
04 would build for this target (configs/kimi-k2.5.yaml: the MLA draft of lightseekorg/kimi-k2.5-eagle3-mla's sizes,
its 576-value latent on every rank). It prints the target's and the draft's bytes per token and the capacity with
and without the draft. Given more than once, the drafts side by side:

  python scripts/plan_serving.py --target configs/targets/kimi-k2.5.json --gpu rtx-pro-6000 --max-model-len 32768 \
      --draft configs/kimi-k2.5.yaml --draft configs/drafts/kimi-k2.5-eagle3.json      # MLA vs Llama-style
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.core.cli import OneLineArgumentParser  # noqa: E402
from common.core.config import GpuMemoryGB, MemoryUtilization, ModelLen, Range, TensorParallel  # noqa: E402
from common.core.errors import ConfigError, PipelineError, printable  # noqa: E402
from common.model.sizes import check_model_sizes  # noqa: E402
from common.serving.sizing import (GIB, GPU_MEMORY_GIB, KV_DTYPE_BYTES, draft_architecture,  # noqa: E402
                                   draft_comparison_lines, kv_bytes_per_token, plan_serving)


WEIGHTS_GIB = Range(gt=0, le=10**7)  # on all GPUs together: Kimi-K2.5's are ~570 GiB
DRAFT_FORMS = "a draft directory, its config.json, or a pipeline config like configs/kimi-k2.5.yaml"


def read_target(path: Path, weights_gib: float | None) -> tuple[dict, float]:
    """(text config as a dict, weights in GiB on all GPUs together)."""
    config_file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the target's config {config_file}: {e}; pass a model directory or a JSON like "
                          f"configs/targets/kimi-k2.5.json") from None
    # multimodal wrappers (Kimi-K2.5) keep the language model in text_config
    text = (config.get("text_config") or config) if isinstance(config, dict) else config
    check_sizes(config_file, text, "a model directory or a JSON like configs/targets/kimi-k2.5.json")
    if weights_gib is None:
        weights_gib = config.get("weights_gib")
    if weights_gib is None and path.is_dir():
        try:
            weights_gib = sum(f.stat().st_size for f in path.glob("*.safetensors")) / GIB or None
        except OSError as e:  # a symlink loop or a dangling link among the weights
            raise ConfigError(f"cannot size the target's weights in {path} ({e}); fix the file or pass --weights-gib") from None
    if weights_gib is None:
        raise ConfigError(f"{path}: no *.safetensors to size the weights from; pass --weights-gib")
    try:
        weights = float(weights_gib)
    except (TypeError, ValueError):
        weights = math.nan
    if not math.isfinite(weights) or not WEIGHTS_GIB.holds(weights):  # a JSON's "weights_gib" (the flag is checked)
        raise ConfigError(f"{config_file}: weights_gib must be a finite number {WEIGHTS_GIB.describe()}, got {weights_gib!r}")
    return text, weights


def check_sizes(config_file: Path, config, what: str) -> None:
    """A config that cannot be sized (not a dict, a size missing, negative, zero or not an integer) is one line
    naming the file."""
    try:
        if not isinstance(config, dict):
            raise ConfigError(f"it holds a JSON {type(config).__name__}, not a config object")
        check_model_sizes(config)  # every size it gives: also those only a pipeline config's draft build reads
        kv_bytes_per_token(config)
    except ConfigError as e:
        raise ConfigError(f"{config_file}: {e}; pass {what}") from None


def read_draft(path: Path, target: dict, target_path: Path):
    """The draft's config: a dict from a draft directory or its config.json, or the DraftModelConfig 04 builds
    from a pipeline config's draft: section for this target (nulls take the target's sizes)."""
    config_file = path / "config.json" if path.is_dir() else path
    if path.suffix in (".yaml", ".yml") and path.is_file():
        from common.core.config import load_config
        from common.train.memory_plan import draft_config_from  # imports torch (as sizing a known draft family does)

        return draft_config_from(load_config(path), target, str(target_path))
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the draft's config {config_file}: {e}; pass {DRAFT_FORMS}") from None
    check_sizes(config_file, config, DRAFT_FORMS)
    return config


def main(argv=None) -> int:
    # a bad flag is one error line naming the value and the allowed range (nan, inf, TP 0, a negative length)
    ap = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--gpu", choices=sorted(GPU_MEMORY_GIB), help="a card's memory (or --gpu-memory-gib)")
    ap.add_argument("--gpu-memory-gib", type=GpuMemoryGB.argument())
    ap.add_argument("--tp", type=TensorParallel.argument(int), default=8, help="tensor parallel size (default 8)")
    ap.add_argument("--utilization", type=MemoryUtilization.argument(), default=0.9,
                    help="--gpu-memory-utilization (default 0.9)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=sorted(KV_DTYPE_BYTES))
    ap.add_argument("--max-model-len", type=ModelLen.argument(int), required=True)
    ap.add_argument("--tokens-per-request", type=ModelLen.argument(int), default=4096,
                    help="a typical prompt + answer (default 4096)")
    ap.add_argument("--activation-gib", type=Range(ge=0, le=GpuMemoryGB.le).argument(), default=5.0,
                    help="activations, CUDA graphs and buffers per GPU (default 5; vLLM measures it at start)")
    ap.add_argument("--weights-gib", type=WEIGHTS_GIB.argument(), help="the weights on all GPUs together (default: from --target)")
    ap.add_argument("--draft", type=Path, action="append", default=[],
                    help=f"served with this EAGLE draft: {DRAFT_FORMS}; more than once: the drafts side by side")
    args = ap.parse_args(argv)
    memory = args.gpu_memory_gib if args.gpu_memory_gib is not None else GPU_MEMORY_GIB[args.gpu] if args.gpu else None
    if memory is None:
        raise ConfigError("give --gpu or --gpu-memory-gib")
    text, weights = read_target(args.target, args.weights_gib)
    drafts = [(path, read_draft(path, text, args.target)) for path in args.draft] or [(None, None)]
    plans = [plan_serving(text, gpu_memory_gib=memory, weights_gib_total=weights, tensor_parallel_size=args.tp,
                          utilization=args.utilization, kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
                          tokens_per_request=args.tokens_per_request, activation_gib=args.activation_gib, draft_config=draft)
             for _, draft in drafts]
    names = " + draft " + " | ".join(path.name for path, _ in drafts) if args.draft else ""
    print(f"{args.target.name}{names}: TP {args.tp} on {args.gpu or f'{memory:g} GiB cards'}, KV cache {args.kv_cache_dtype}")
    if len(plans) > 1:
        lines = draft_comparison_lines([(path.name, draft_architecture(draft), plan)
                                        for (path, draft), plan in zip(drafts, plans)])
    else:
        lines = plans[0].lines()
    for line in lines:
        print("  " + line)
    return 0 if all(plan.fits_one_full_request for plan in plans) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PipelineError as e:
        print(f"error: {printable(str(e))}", file=sys.stderr)
        sys.exit(2)
