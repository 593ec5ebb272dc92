"""04's memory plan for a config, without a GPU and without the weights (common/train/memory_plan.py;
docs/design.md#memory-planner-04). 04 prints the same estimate at its start and refuses to start
when it does not fit.

    python scripts/plan_memory.py --config configs/kimi-k2.5.yaml --world-size 8 --gpu-memory-gb 96 \\
        --target-config configs/targets/kimi-k2.5.json
    python scripts/plan_memory.py --config configs/tiny.yaml --device cpu     # target.model a local directory

The target's sizes come from target.model/config.json when it is a local directory; otherwise (a hub id) from
--target-config (its config.json, or a JSON of its sizes: an MLA draft reads the target's MLA sizes there) or
--target-hidden-size / --target-vocab-size / --target-num-layers (enough for a Llama-style draft), which override
it. Exit 0 when it fits (or no capacity is known), 2 with the one-line error 04 would print when it does not.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.core.cli import OneLineArgumentParser  # noqa: E402
from common.core.config import GpuMemoryGB, ModelLen, Range, TorchDtype  # noqa: E402
from common.model.sizes import SIZES  # noqa: E402


def main() -> int:
    # a bad flag is one error line naming the value and the allowed range (nan, inf, -3 ranks, an unknown dtype)
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--world-size", type=Range(ge=1, le=65536).argument(int), default=os.environ.get("WORLD_SIZE", "1"),
                        help="ranks of 04 (torchrun nproc_per_node x nnodes); default $WORLD_SIZE or 1")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="what 04 runs on (precision auto follows it)")
    parser.add_argument("--gpu-memory-gb", type=GpuMemoryGB.argument(), default=None,
                        help="memory per GPU to check against (default train.gpu_memory_gb; none: only print)")
    parser.add_argument("--max-sample-len", type=ModelLen.argument(int), default=None,
                        help="longest sample (default tokenize.max_seq_len)")
    # the ranges a local config.json's sizes are checked against (common/model/sizes.py)
    parser.add_argument("--target-config", type=Path, help="the target's config.json or a JSON of its sizes "
                        "(configs/targets/kimi-k2.5.json), when target.model is not a local directory")
    parser.add_argument("--target-hidden-size", type=SIZES["hidden_size"].argument(int))
    parser.add_argument("--target-vocab-size", type=SIZES["vocab_size"].argument(int))
    parser.add_argument("--target-num-layers", type=SIZES["num_hidden_layers"].argument(int))
    parser.add_argument("--target-dtype", choices=typing.get_args(TorchDtype), default="bfloat16")
    args = parser.parse_args()

    from common.core.config import load_config
    from common.core.errors import ConfigError, PipelineError, printable
    from common.core.io import format_bytes
    from common.train.memory_plan import (check_fits, draft_config_from, plan_for_capacity, target_sizes_from_config_json,
                                          target_sizes_from_json)

    try:
        cfg = load_config(args.config, args.overrides)
        given = {"hidden_size": args.target_hidden_size, "vocab_size": args.target_vocab_size,
                 "num_hidden_layers": args.target_num_layers}
        local = target_sizes_from_config_json(cfg.target.model)
        if local is None and args.target_config is not None:
            local = target_sizes_from_json(args.target_config, "fix --target-config")
        target = local or {}
        target = {**target, **{k: v for k, v in given.items() if v is not None}}
        missing = [k for k in given if k not in target]
        if missing:
            raise PipelineError(f"target.model {cfg.target.model} has no local config.json: give --target-config or "
                                + ", ".join(f"--target-{k.replace('_', '-').replace('hidden-layers', 'layers')}" for k in missing))
        target.setdefault("torch_dtype", args.target_dtype)
        # its sizes are range-checked there, as the flags are (a flag overrides the config's value)
        source = (f"{cfg.target.model}/config.json" if target_sizes_from_config_json(cfg.target.model) is not None
                  else str(args.target_config) if args.target_config is not None else f"the hub target {cfg.target.model}")
        try:
            d = draft_config_from(cfg, target, source)
        except ConfigError as e:
            if local is not None:
                raise
            raise ConfigError(f"{e} (only --target-hidden-size, --target-vocab-size and --target-num-layers were given: "
                              f"pass the target's config.json or configs/targets/kimi-k2.5.json as --target-config)") from None
        kw = dict(world_size=args.world_size, device_type=args.device, embed_bf16="bfloat16" in str(target["torch_dtype"]),
                  max_sample_len=args.max_sample_len if args.max_sample_len is not None else cfg.tokenize.max_seq_len)
        gb = args.gpu_memory_gb if args.gpu_memory_gb is not None else cfg.train.gpu_memory_gb
        capacity = int(gb * 1e9) if gb is not None else None
        plan, replan = plan_for_capacity(d, cfg.train, capacity, **kw)  # as 04 plans (checkpointing null: chosen here)
        print(f"04_train: memory plan: {plan.describe()}" + (f"; GPU capacity {format_bytes(capacity)}" if capacity else ""))
        check_fits(plan, capacity, replan)
    except PipelineError as e:
        print(f"error: {printable(str(e))}", file=sys.stderr)
        return 2
    if capacity:
        print(f"fits: {format_bytes(plan.peak)} of {format_bytes(capacity)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
