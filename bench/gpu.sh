#!/usr/bin/env bash
# Stage-04 training throughput on a GPU machine (tokens/s, MFU, peak memory) for a Llama-3.1-8B-sized
# and a Kimi-K2.5-sized EAGLE-3 draft: bench/gpu_train_bench.py with synthetic hidden states.
# Needs only this repository and a Python with CUDA torch (installs nothing, no network).
# Takes a few minutes on an H100/H200. Results: $OUT/gpu_train_bench.json (or ./bench_out/), plus the
# log and nvidia-smi output next to it.
#
#   bash bench/gpu.sh                         # llama8b and kimi, seq 2048 and 4096, ttt_steps 7
#   bash bench/gpu.sh --configs kimi --seq-lens 4096 --gradient-checkpointing
#   PYTHON=/path/to/python BENCH_TIMEOUT=300 bash bench/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./bench_out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
for candidate in /root/.cache/eagle3-pipeline/venv/bin/python .venv/bin/python; do
    if [ -z "${PYTHON:-}" ] && [ -x "$candidate" ] && "$candidate" -c "import torch" 2>/dev/null; then PY="$candidate"; break; fi
done
{ nvidia-smi || true; } > "$OUT_DIR/nvidia-smi.txt" 2>&1
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# One bad config must not cost the others: the script writes its JSON after every config.
timeout "${BENCH_TIMEOUT:-540}" "$PY" bench/gpu_train_bench.py --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu_train_bench.log"
