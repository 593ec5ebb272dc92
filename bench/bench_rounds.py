"""What a disk budget costs: the tiny default in rounds vs one extraction, side by side.

From one base run of the demo (run_pipeline.py, configs/tiny.yaml: the data, the vocab map and the
target-alone baselines; reused from bench_fp8_storage.py's --root when there), the draft is trained
for 2 epochs (train.max_steps null) twice per seed:
  whole    no budget: 02 extracts once, 04 trains both epochs on it;
  rounds   extract.max_disk_gb = the eval shards + a quarter of the train shards: run_pipeline.py
           alternates 02 (a vLLM engine start each) and 04, 4+ rounds per epoch, each deleted once trained;
  stream   the same budget with extract.stream: run_pipeline.py runs 02 (one engine, kept up) in the
           background and 04 beside it, rounds of half the budget (here both share the same 2 cores).
Printed per run: rounds, vLLM acceptance length at k = 3 (05), the largest size of hidden/ seen by a
sampler every 0.5 s against the budget + one shard, the ledger, and the wall time of run_pipeline.py;
then the acceptance-length difference beside the seed-to-seed spread and the wall-time ratio.

    python bench/bench_rounds.py                     # llama, seeds 0 1, all three modes: ~40 min on 2 cores
    python bench/bench_rounds.py --seeds 0 --modes whole stream --root /tmp/eagle3-bench-fp8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8_storage import figures, pipeline, variant_from  # noqa: E402  (same bench folder)

EPOCHS = 2
MODES = ("whole", "rounds", "stream")


def hidden_bytes(hidden: Path) -> int:
    total = 0
    for p in list(hidden.glob("*shard-*")) if hidden.is_dir() else []:
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def run_sampled(run: Path, family: str, sets: dict[str, str]) -> tuple[float, int]:
    """run_pipeline.py on `run` with a disk sampler on its hidden/ (every 0.5 s): (seconds, peak bytes)."""
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], hidden_bytes(run / "hidden"))
            time.sleep(0.5)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.monotonic()
    try:
        pipeline(run, family, sets)
    finally:
        stop.set()
        thread.join()
    return time.monotonic() - t0, peak[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--root", type=Path, default=Path("/tmp/eagle3-bench-fp8"))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    base = args.root / f"{args.family}-base"
    pipeline(base, args.family, {})
    index = json.loads((base / "hidden" / "index.json").read_text())
    train = sum(s["bytes"] for s in index["shards"] if s["split"] == "train")
    evals = sum(s["bytes"] for s in index["shards"] if s["split"] == "eval")
    largest = max(s["bytes"] for s in index["shards"])
    budget = evals + train / 4
    print(f"[{args.family}] full shards: train {train / 1e6:.1f} MB + eval {evals / 1e6:.1f} MB; budget {budget / 1e6:.1f} MB "
          f"(eval + a quarter of train); largest shard {largest / 1e6:.1f} MB", flush=True)
    rows = []
    for seed in args.seeds:
        for mode in args.modes:
            run = args.root / f"{args.family}-{mode}-seed{seed}"
            variant_from(base, run)
            sets = {"train.epochs": str(EPOCHS), "train.max_steps": "null", "train.seed": str(seed)}
            if mode != "whole":
                sets["extract.max_disk_gb"] = repr(budget / 1e9)
            if mode == "stream":
                sets["extract.stream"] = "true"
            seconds, peak = run_sampled(run, args.family, sets)
            plan = json.loads((run / "hidden" / "plan.json").read_text())
            written = json.loads((run / "hidden" / "index.json").read_text())["shards"]
            bound = (budget if mode != "whole" else train + evals) + max(e["bytes"] for e in written)
            summary = json.loads((run / "train" / "final" / "training_summary.json").read_text())
            row = {"mode": mode, "seed": seed, "rounds": len(plan.get("rounds", [])), "seconds": seconds, "peak": peak,
                   "steps": summary["total_steps"], "ledger": summary["ledger"], **figures(run)}
            rows.append(row)
            print(f"[{args.family}] {mode} seed {seed}: {row['rounds']} rounds, {row['steps']} steps, acceptance length "
                  f"{row['acceptance_length']:.3f}, hidden/ peak {peak / 1e6:.1f} MB (budget + its largest shard "
                  f"{bound / 1e6:.1f} MB), ledger {row['ledger']['min_times']}-{row['ledger']['max_times']} "
                  f"times per sample, {seconds:.0f} s", flush=True)
    print("\nmode    rounds  steps  acceptance length per seed   mean   spread  peak MB  wall s per seed")
    means, spreads = {}, []
    for mode in args.modes:
        mine = [r for r in rows if r["mode"] == mode]
        als = [r["acceptance_length"] for r in mine]
        means[mode] = statistics.mean(als)
        spreads.append(max(als) - min(als))
        per_seed = " ".join(f"{a:.3f}" for a in als)
        walls = " ".join(f"{r['seconds']:.0f}" for r in mine)
        print(f"{mode:7} {mine[0]['rounds']:>6} {mine[0]['steps']:>6}  {per_seed:26} {means[mode]:.3f}  "
              f"{spreads[-1]:.3f}  {max(r['peak'] for r in mine) / 1e6:7.1f}  {walls}")
    wall = {m: statistics.mean(r["seconds"] for r in rows if r["mode"] == m) for m in args.modes}
    for mode in args.modes:
        if mode != "whole" and "whole" in means:
            print(f"{mode} - whole mean acceptance length {means[mode] - means['whole']:+.3f} (seed-to-seed spread up to "
                  f"{max(spreads):.3f}); wall time {mode} / whole {wall[mode] / wall['whole']:.2f}x "
                  f"({wall[mode]:.0f} s vs {wall['whole']:.0f} s)")


if __name__ == "__main__":
    main()
