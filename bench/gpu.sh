#!/usr/bin/env bash
# One prepared GPU check, under 10 minutes on one GPU:
# 1. stage-04 training throughput (tokens/s, MFU, peak memory beside 04's memory plan) for a Llama-3.1-8B-sized and a Kimi-K2.5-sized
#    EAGLE-3 draft (configs/kimi-k2.5.yaml's sizes): bench/gpu_train_bench.py with synthetic hidden states;
# 2. stage 02 on a small MLA + MoE target (DeepSeek-V3 / Kimi-K2.5's architecture) through vLLM and through
#    transformers: tokens/s and how far apart their states are (bench/gpu_extract_bench.py; needs vLLM
#    0.32.0 installed, else it runs the transformers backend only and says so).
# Needs this repository and a Python with CUDA torch (installs nothing, no network).
# Results: $OUT/gpu_train_bench.json and $OUT/gpu_extract_bench.json (or ./bench_out/), plus the logs and
# nvidia-smi output next to them.
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
timeout "${BENCH_TIMEOUT:-390}" "$PY" bench/gpu_train_bench.py --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu_train_bench.log" || true
timeout "${EXTRACT_TIMEOUT:-180}" "$PY" bench/gpu_extract_bench.py --size small --out "$OUT_DIR" 2>&1 \
    | grep -v " INFO \| DEBUG " | tee "$OUT_DIR/gpu_extract_bench.log" || true
