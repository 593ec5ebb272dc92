#!/usr/bin/env bash
# One prepared GPU check, under 8 minutes on one GPU (each part has its own timeout; every script writes its
# JSON as it goes, so a timeout keeps what was measured):
# (the host's work per step, aten ops per optimizer step, is counted on CPU: bench/gpu_train_bench.py --count-ops)
# 1. stage-04 training throughput (tokens/s, MFU, peak memory beside 04's memory plan) of 04's own step
#    (common.train.step: bf16 compute copy, attention and torch.compile resolved as 04 resolves them, printed)
#    for a Llama-3.1-8B-sized and a Kimi-K2.5-sized EAGLE-3 draft, one sample of 2048 and of 4096 tokens;
# 2. the same step beside SpecForge 0.2.0's (sdpa and flex_attention backends) at 4 x 512 tokens, from the
#    same initial weights and inputs: time ratio, tokens/s, peak memory, first-forward logit difference
#    (bench/peer_bench.py; needs the peer venv: bench/peer_setup.sh, else skipped and said so);
# 3. stage 02 on a small MLA + MoE target through vLLM and transformers (bench/gpu_extract_bench.py; needs
#    vLLM 0.32.0, else the transformers backend only), if time is left.
# Needs this repository and a Python with CUDA torch (installs nothing, no network).
# Results: $OUT (or ./bench_out/): gpu_train_bench.json, peer_bench.json, gpu_extract_bench.json,
# the logs and nvidia-smi output.
#
#   bash bench/gpu.sh                                 # everything above
#   bash bench/gpu.sh --configs kimi --seq-lens 4096  # extra arguments go to gpu_train_bench.py
#   PYTHON=/path/to/python PEER_PYTHON=/path/to/peer-venv/bin/python bash bench/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./bench_out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
for candidate in /root/.cache/eagle3-pipeline/venv/bin/python .venv/bin/python; do
    if [ -z "${PYTHON:-}" ] && [ -x "$candidate" ] && "$candidate" -c "import torch" 2>/dev/null; then PY="$candidate"; break; fi
done
PEER_PY="${PEER_PYTHON:-$HOME/.cache/eagle3-pipeline/peer-venv/bin/python}"
{ nvidia-smi || true; } > "$OUT_DIR/nvidia-smi.txt" 2>&1
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
timeout "${BENCH_TIMEOUT:-270}" "$PY" bench/gpu_train_bench.py --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu_train_bench.log" || true
if [ -x "$PEER_PY" ] && "$PEER_PY" -c "import specforge" 2>/dev/null; then
    timeout "${PEER_TIMEOUT:-150}" "$PEER_PY" bench/peer_bench.py --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/peer_bench.log" || true
else
    echo "peer_bench: skipped: no SpecForge venv at $PEER_PY (bash bench/peer_setup.sh, or PEER_PYTHON=...)" | tee "$OUT_DIR/peer_bench.log"
fi
timeout "${EXTRACT_TIMEOUT:-60}" "$PY" bench/gpu_extract_bench.py --size small --out "$OUT_DIR" 2>&1 \
    | grep -v " INFO \| DEBUG " | tee "$OUT_DIR/gpu_extract_bench.log" || true
