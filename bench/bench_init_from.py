"""Starting from a published draft: fine-tune, fine-tune with an anchor, or train from scratch?

The demo's trained draft (run A: configs/tiny.yaml, the tiny Llama, data/sample_prompts.jsonl) plays the
published draft. Run B is the same target on another kind of prompts (common/demo/other_prompts.py:
cooking, travel, JSON, tables, role play...), answered by the target through vLLM (01b), extracted (02)
and given its own vocab map (03). On B's training split, for each seed, 04 trains for --steps steps:
  init        A's draft as it is (no training; one row, no seed dependence)
  finetune    train.init_from = A's draft (its own vocab: train.init_vocab own)
  anchor=L    the same with train.anchor_weight = L (L2-SP towards A's draft), for each --anchors value
  scratch     from scratch on B (train.init_lm_head target, like the demo), the same steps
Each draft is then scored on both distributions by 04's offline replay of vLLM's rounds (the acceptance
length 05 measures, predicted within ~1% on the demo) at k = 3 on A's eval split (the init's
distribution) and on B's eval split (the new one). Printed: mean, min and max over the seeds.

    python bench/bench_init_from.py                            # seeds 0 1 2, 100 steps: ~10 min on 2 cores
    python bench/bench_init_from.py --seeds 0 --steps 40 --root /tmp/eagle3-bench-init
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

K = 3  # the served number of speculative tokens (configs/tiny.yaml evaluate.num_speculative_tokens)


def run(args: list[str], log: Path) -> None:
    """A pipeline script with its output in `log`; stops the bench on a failure."""
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{args[0]} failed (exit {done.returncode}); log: {log}")


def base_sets(run_dir: Path, target: Path) -> list[str]:
    return ["--config", str(ROOT / "configs" / "tiny.yaml"), "--set", f"run_dir={run_dir}", "--set", f"target.model={target}"]


def build_runs(root: Path, other_prompts: int) -> tuple[Path, Path, Path]:
    """(run A with its trained draft, run B with hidden states and vocab, the target); each step skipped when done."""
    from common.demo.other_prompts import other_prompt_rows
    from common.core.io import write_jsonl_atomic

    a, b = root / "a", root / "b"
    target = a / "target"
    if not (a / "train" / "final" / "model.safetensors").is_file():
        run(["run_pipeline.py", *base_sets(a, target), "--tiny-target", "llama", "--stop-after", "04_train"], root / "a.log")
    source = root / "other_prompts.jsonl"
    if not source.is_file():  # another seed than data/other_prompts.jsonl's: not the prompts 05 measures as "other"
        write_jsonl_atomic(source, other_prompt_rows(other_prompts, seed=4321))
    if not (b / "vocab" / "vocab_map.safetensors").is_file():
        # evaluate.other_prompts off: the demo's other-kind prompts are this run's training kind
        run(["run_pipeline.py", *base_sets(b, target), "--set", f"data.source={source}", "--set", "data.eval_fraction=0.2",
             "--set", "evaluate.other_prompts=null", "--stop-after", "03_build_vocab_map"], root / "b.log")
    return a, b, target


def train_variant(root: Path, b: Path, target: Path, name: str, seed: int, steps: int, sets: dict[str, str]) -> Path:
    """04 on a copy of B's inputs; returns the exported draft (kept: a rerun of the bench reuses it)."""
    run_dir = root / "runs" / f"{name}-seed{seed}"
    final = run_dir / "train" / "final"
    if (final / "model.safetensors").is_file():
        return final
    shutil.rmtree(run_dir, ignore_errors=True)
    for sub in ("data", "hidden", "vocab"):
        shutil.copytree(b / sub, run_dir / sub)
    extra = [a for key, value in {"train.seed": seed, "train.max_steps": steps, **sets}.items() for a in ("--set", f"{key}={value}")]
    run(["04_train.py", *base_sets(run_dir, target), *extra], root / "runs" / f"{name}-seed{seed}.log")
    return final


def replay_acceptance(draft_dir: Path, run_dir: Path, target: Path) -> float:
    """04's offline replay of vLLM's rounds for an exported draft on run_dir's eval split, at k = K."""
    from common.core.config import load_config
    from common.train.offline_eval import evaluate_export

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"run_dir={run_dir}", f"target.model={target}"])
    return float(evaluate_export(draft_dir, cfg)["replay"][str(K)]["acceptance_length"])


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("/tmp/eagle3-bench-init-from"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--anchors", type=float, nargs="+", default=[0.001, 0.1])
    ap.add_argument("--other-prompts", type=int, default=200)
    args = ap.parse_args()
    root = args.root.resolve()
    (root / "runs").mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    a, b, target = build_runs(root, args.other_prompts)
    print(f"runs ready ({time.monotonic() - t0:.0f} s): A {a}, B {b}", flush=True)
    init = a / "train" / "final"
    variants = {"finetune": {"train.init_from": init}}
    variants |= {f"anchor={w:g}": {"train.init_from": init, "train.anchor_weight": w} for w in args.anchors}
    variants["scratch"] = {}
    rows = {"init": {"A": [replay_acceptance(init, a, target)], "B": [replay_acceptance(init, b, target)]}}
    for name, sets in variants.items():
        rows[name] = {"A": [], "B": []}
        for seed in args.seeds:
            draft = train_variant(root, b, target, name, seed, args.steps, sets)
            rows[name]["A"].append(replay_acceptance(draft, a, target))
            rows[name]["B"].append(replay_acceptance(draft, b, target))
            print(f"{name} seed {seed}: A {rows[name]['A'][-1]:.3f}  B {rows[name]['B'][-1]:.3f}", flush=True)
    print(f"\nreplayed acceptance length at k={K} (mean (min-max) over seeds {args.seeds}; {args.steps} steps on B's "
          f"train split; {time.monotonic() - t0:.0f} s in all)")
    print(f"{'draft':<14}{'on A (init data)':>26}{'on B (new data)':>26}")
    for name, r in rows.items():
        print(f"{name:<14}{spread(r['A']):>26}{spread(r['B']):>26}")
    (root / "results.json").write_text(json.dumps({"seeds": args.seeds, "steps": args.steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
