#!/usr/bin/env bash
# The embedded demo on a fresh machine: set up the environment (idempotent, cached), build the
# tiny target, and run every stage end to end with a real vLLM server (CPU build on laptops).
#   bash scripts/run_demo.sh                              tiny Llama target, runs/tiny
#   bash scripts/run_demo.sh --tiny-target qwen3 --set run_dir=runs/tiny-qwen3 --set target.model=runs/tiny-qwen3/target
#   bash scripts/run_demo.sh --set train.max_steps=200    any run_pipeline.py argument
# Rerunning continues where it stopped.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup.sh" | tail -n 1)"
cd "$root"
# A later --tiny-target in "$@" overrides this default.
exec "$py" run_pipeline.py --config configs/tiny.yaml --tiny-target llama "$@"
