"""What fp8 hidden-state storage costs: disk per token, teacher fidelity, and vLLM acceptance length.

For each tiny target family it runs the whole demo pipeline once (run_pipeline.py, configs/tiny.yaml:
the data, the target-alone baselines and a float32 reference draft), then retrains the draft from the
same generated data and vocab map with the hidden states stored two ways:
  bf16   extract.dtype bfloat16, extract.storage full (what a bf16 target gives: the usual storage)
  fp8    extract.dtype float32,  extract.storage fp8  (e4m3 + one float32 scale per token per tensor)
for each seed (train.seed: the draft's init and the data order), and measures each draft in vLLM (05,
k = 3, the same 31 held-out prompts). It prints bytes per token (the planner's figure and what is on
disk), acceptance length per run, the mean per storage, the seed-to-seed spread beside the fp8-bf16
difference, and how close the lm_head's teacher distribution stays when the final state is rounded
(KL to the float32 teacher, top-1 agreement), which is what decides whether final_hidden may be fp8.

    python bench/bench_fp8_storage.py                         # llama + qwen3, seeds 0 1: ~25 min on 2 cores
    python bench/bench_fp8_storage.py --families llama --seeds 0 --root /tmp/fp8bench
Rerunning with the same --root reuses finished runs (every stage resumes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STORAGES = {"bf16": {"extract.dtype": "bfloat16", "extract.storage": "full"},
            "fp8": {"extract.dtype": "float32", "extract.storage": "fp8"}}
# what a variant does not copy from the family's base run: it extracts, trains and evaluates anew
REDO = ("hidden", "train", "eval/outputs.jsonl", "eval/outputs-other.jsonl", "eval/report.json", "eval/report.png",
        "stages/02_extract_hidden.json", "stages/04_train.json", "stages/05_evaluate.json")


def pipeline(run_dir: Path, family: str, sets: dict[str, str]) -> None:
    args = [sys.executable, str(ROOT / "run_pipeline.py"), "--config", str(ROOT / "configs" / "tiny.yaml"),
            "--tiny-target", family, "--set", f"run_dir={run_dir}", "--set", f"target.model={run_dir / 'target'}"]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as f:
        done = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"run_pipeline failed for {run_dir} (exit {done.returncode}); log: {log}")


def variant_from(base: Path, dest: Path) -> None:
    """A copy of the base run without what the variant redoes (02, 04, 05's draft measurement)."""
    if dest.exists():
        return
    shutil.copytree(base, dest, ignore=shutil.ignore_patterns("*.lock"))
    for rel in REDO:
        p = dest / rel
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)


def figures(run_dir: Path) -> dict:
    index = json.loads((run_dir / "hidden" / "index.json").read_text())
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    on_disk = sum(p.stat().st_size for p in (run_dir / "hidden").glob("shard-*.safetensors"))
    return {"bytes_per_token": index["bytes_per_token"], "disk_per_token": on_disk / index["num_tokens"],
            "acceptance_length": report["acceptance_length"]}


def teacher_fidelity(base: Path) -> dict:
    """The lm_head's distribution from the float32 final states vs from the same states rounded to bf16
    and through the fp8 codec: mean KL(p_f32 || p_rounded) in nats and top-1 agreement, every token."""
    import torch
    from safetensors.torch import load_file

    from common.hidden.shards import fp8_decode, fp8_encode

    lm_head = load_file(str(base / "target" / "model.safetensors"))["lm_head.weight"].float()
    sums = {"bf16": [0.0, 0], "fp8": [0.0, 0]}
    tokens = 0
    for shard in sorted((base / "hidden").glob("shard-*.safetensors")):
        final = load_file(str(shard))["final_hidden"].float()
        ref = torch.log_softmax(final @ lm_head.T, -1)
        rounded = {"bf16": final.bfloat16().float(), "fp8": fp8_decode(*fp8_encode(final, 1), torch.float32)}
        for name, x in rounded.items():
            logp = torch.log_softmax(x @ lm_head.T, -1)
            sums[name][0] += float((ref.exp() * (ref - logp)).sum())
            sums[name][1] += int((logp.argmax(-1) == ref.argmax(-1)).sum())
        tokens += final.shape[0]
    return {name: {"kl": kl / tokens, "top1": same / tokens} for name, (kl, same) in sums.items()} | {"tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["llama", "qwen3"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--root", type=Path, default=Path("/tmp/eagle3-bench-fp8"))
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in args.families:
        base = args.root / f"{family}-base"
        print(f"[{family}] base run (float32 states, the data and baselines) in {base}", flush=True)
        pipeline(base, family, {})
        fid = teacher_fidelity(base)
        print(f"[{family}] teacher from rounded final states over {fid['tokens']:,} tokens: "
              + ", ".join(f"{k} KL {fid[k]['kl']:.2e} nats top-1 {fid[k]['top1']:.4f}" for k in STORAGES), flush=True)
        for storage, sets in STORAGES.items():
            for seed in args.seeds:
                run = args.root / f"{family}-{storage}-seed{seed}"
                variant_from(base, run)
                pipeline(run, family, {**sets, "train.seed": str(seed)})
                row = {"family": family, "storage": storage, "seed": seed, **figures(run)}
                rows.append(row)
                print(f"[{family}] {storage} seed {seed}: {row['bytes_per_token']:,} B/token planned, "
                      f"{row['disk_per_token']:,.1f} on disk, acceptance length {row['acceptance_length']:.3f}", flush=True)
    print("\nfamily  storage  B/token  on disk  acceptance length per seed      mean   spread")
    for family in args.families:
        means = {}
        for storage in STORAGES:
            mine = [r for r in rows if r["family"] == family and r["storage"] == storage]
            als = [r["acceptance_length"] for r in mine]
            means[storage] = statistics.mean(als)
            print(f"{family:7} {storage:7} {mine[0]['bytes_per_token']:>8,} {mine[0]['disk_per_token']:>8,.1f}  "
                  f"{' '.join(f'{a:.3f}' for a in als):30} {means[storage]:.3f}  {max(als) - min(als):.3f}")
        spread = max(max(r["acceptance_length"] for r in rows if r["family"] == family and r["storage"] == s)
                     - min(r["acceptance_length"] for r in rows if r["family"] == family and r["storage"] == s)
                     for s in STORAGES)
        bf16, fp8 = [r for r in rows if r["family"] == family and r["storage"] in ("bf16", "fp8") and r["seed"] == args.seeds[0]]
        print(f"{family:7} fp8 - bf16 mean acceptance length {means['fp8'] - means['bf16']:+.3f} (seed-to-seed spread up to "
              f"{spread:.3f}); fp8 / bf16 disk per token {fp8['disk_per_token'] / bf16['disk_per_token']:.3f}")


if __name__ == "__main__":
    main()
