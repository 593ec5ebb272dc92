"""EAGLE-3 against EAGLE-3.1 at equal budget, measured in vLLM (05 --compare), over seeds.

One run of the pipeline's data stages (01, 01b, 02, 03) on a tiny target; then, for each seed, 04 trains two drafts
on the same hidden states, vocab map, steps and seed: EAGLE-3 (the default) and EAGLE-3.1 (draft.fc_norm and
draft.norm_output on). 05 --compare serves both with the same server settings on the same prompt sets: the held-out
split, the other-kind prompts (llama), the long-context buckets and unseen system prompts. Printed per set (and per
long-context bucket): mean, min and max over the seeds for each draft, and the mean of the per-seed difference.

    python bench/bench_eagle31.py                               # tiny Llama, seeds 0 1 2: ~30 min on 2 cores
    python bench/bench_eagle31.py --family deepseek_v3          # the Kimi-shaped proxy with the MLA draft
    python bench/bench_eagle31.py --family smollm2              # SmolLM2 on MT-bench: ~25 min of 04 per draft
    python bench/bench_eagle31.py --seeds 0 --root /tmp/eagle3-bench-31

Each step is skipped when its output is there, so a rerun after a crash goes on where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"llama": "tiny.yaml", "deepseek_v3": "tiny-deepseek.yaml", "smollm2": "smollm2.yaml"}
# How run_pipeline.py puts each family's target in place: a tiny target built here, or the real one from its package.
PREPARE = {"llama": "--tiny-target", "deepseek_v3": "--tiny-target", "smollm2": "--real-target"}
# SmolLM2: the 300 steps (of 2048 tokens: 614k tokens, so 1200 conversations, ~640k tokens, are one pass
# and 02 extracts no more than 04 reads), and the server's context at the target's 8192 positions so the
# long-context buckets reach it (512 ... 4096, 7936). Every stage sees the same settings.
FAMILY_SETS = {"smollm2": ["train.max_steps=300", "data.max_samples=1200", "server.max_model_len=8192"]}
VARIANTS = {"eagle3": [], "eagle31": ["draft.fc_norm=true", "draft.norm_output=true"]}
# Every set of the comparison: the config's own, plus unseen system prompts, another chat template than the
# target's (built_sets.CHANGED_TEMPLATE) and (where the config has none) the long-context buckets.
# throughput_repeats 1: acceptance is what is compared here, not tokens/s.
EXTRA_SETS = ["evaluate.prompt_sets.system_prompts={built: system_prompts}",
              "evaluate.prompt_sets.long_context={built: long_context}",
              "evaluate.prompt_sets.chat_template={built: chat_template}", "evaluate.throughput_repeats=1"]


def run(args: list[str], log: Path) -> None:
    """A pipeline script with its output in `log`; stops the bench on a failure."""
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{args[0]} failed (exit {done.returncode}); log: {log}")


def sets_for(family: str, run_dir: Path, target: Path, *extra: str) -> list[str]:
    sets = [f"run_dir={run_dir}", f"target.model={target}", *EXTRA_SETS, *FAMILY_SETS.get(family, []), *extra]
    return ["--config", str(ROOT / "configs" / CONFIGS[family]), *(a for s in sets for a in ("--set", s))]


def link_weights(src: str, dst: str) -> None:
    """Hard links for the safetensors files (hidden states, target, vocab map: gigabytes for SmolLM2, and no stage
    writes into one), copies for the rest."""
    if src.endswith(".safetensors"):
        os.link(src, dst)
    else:
        shutil.copy2(src, dst)


def not_carried(base: Path):
    """copytree's ignore: the base's train/ and eval/ stay behind, but for the target-alone runs run_pipeline measured
    on its generation server (eval/baseline*.json, keyed to what they measured), which each seed's 05 reuses."""
    def ignore(folder: str, names: list[str]) -> list[str]:
        if Path(folder) == base:
            return [n for n in names if n == "train"]
        if Path(folder) == base / "eval":
            return [n for n in names if not (n.startswith("baseline") and n.endswith(".json"))]
        return []
    return ignore


def train_variant(family: str, base: Path, target: Path, seed: int, variant: str, steps: int | None) -> Path:
    """A copy of the base run (not_carried) where 04 trains this seed's draft of `variant`."""
    run_dir = base.parent / f"seed{seed}-{variant}"
    if not (run_dir / "train" / "final" / "model.safetensors").is_file():
        if not (run_dir / "train").is_dir():  # else 04 resumes from its last checkpoint
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.copytree(base, run_dir, copy_function=link_weights, ignore=not_carried(base))
        extra = [f"train.seed={seed}", *VARIANTS[variant], *([f"train.max_steps={steps}"] if steps else [])]
        run(["04_train.py", *sets_for(family, run_dir, target, *extra)], base.parent / f"04-seed{seed}-{variant}.log")
    return run_dir / "train" / "final"


def compare(family: str, base: Path, target: Path, seed: int, a: Path, b: Path) -> dict:
    """05 --compare of the seed's two drafts, in the seed's EAGLE-3 run folder: its eval/compare/report.json."""
    run_dir = a.parent.parent
    report = run_dir / "eval" / "compare" / "report.json"
    if not report.is_file():
        run(["05_evaluate.py", *sets_for(family, run_dir, target, f"train.seed={seed}"), "--compare", str(a), str(b)],
            base.parent / f"05-compare-seed{seed}.log")
    return json.loads(report.read_text())


def rows_of(comparison: dict) -> dict[str, dict[str, float]]:
    """{row: {"a": AL, "b": AL}}: each set, turn 2 where a set has one, and each long-context bucket."""
    rows = {name: {k: v[k] for k in ("a", "b")} for name, v in comparison["acceptance_length"].items()}
    for name, v in comparison.get("turn_2_acceptance_length", {}).items():
        rows[f"{name} turn 2"] = {k: v[k] for k in ("a", "b")}
    for name in comparison["prompt_sets"]:
        buckets = {label: {side: comparison["reports"][side]["prompt_sets"].get(name, {}).get("buckets", {}).get(label, {})
                           .get("acceptance_length") for side in ("a", "b")}
                   for label in comparison["reports"]["a"]["prompt_sets"].get(name, {}).get("buckets", {})}
        rows |= {f"{name} {label}": v for label, v in buckets.items()}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(CONFIGS), default="llama")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="train.max_steps (default: the config's)")
    parser.add_argument("--root", type=Path, default=None, help="work folder (default /tmp/eagle3-bench-31-FAMILY)")
    args = parser.parse_args()
    root = (args.root or Path(f"/tmp/eagle3-bench-31-{args.family}")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    base, target = root / "base", root / "base" / "target"
    if not (base / "vocab" / "vocab_map.safetensors").is_file():
        run(["run_pipeline.py", *sets_for(args.family, base, target), PREPARE[args.family], args.family,
             "--stop-after", "03_build_vocab_map"], root / "base.log")
    per_seed = {}
    for seed in args.seeds:
        a, b = (train_variant(args.family, base, target, seed, v, args.steps) for v in VARIANTS)
        per_seed[seed] = rows_of(compare(args.family, base, target, seed, a, b))
    print(f"EAGLE-3 (a) against EAGLE-3.1 (b, fc_norm + norm_output), {args.family}, seeds {args.seeds}; "
          f"acceptance length at k=3 in vLLM: mean [min, max]; b - a: mean of the per-seed differences [min, max]")
    for row in per_seed[args.seeds[0]]:
        values = {side: [per_seed[s][row][side] for s in args.seeds if per_seed[s].get(row, {}).get(side) is not None]
                  for side in ("a", "b")}
        if not values["a"] or len(values["a"]) != len(values["b"]):
            continue
        diffs = [b - a for a, b in zip(values["a"], values["b"])]
        cells = [f"{statistics.mean(v):.3f} [{min(v):.3f}, {max(v):.3f}]" for v in (values["a"], values["b"], diffs)]
        print(f"  {row:<32} a {cells[0]}   b {cells[1]}   b-a {cells[2]}")
    (root / "summary.json").write_text(json.dumps(per_seed, indent=1))
    print(f"per seed: {root / 'summary.json'}")


if __name__ == "__main__":
    main()
