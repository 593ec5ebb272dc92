#!/usr/bin/env bash
# Idempotent environment setup. Creates (or reuses) a virtualenv and installs the
# pipeline's dependencies; prints the venv's python path on the last line.
#
#   EAGLE3_VENV    where the venv lives (default: $HOME/.cache/eagle3-pipeline/venv)
#   EAGLE3_VLLM    cpu | gpu | none  (default: gpu if nvidia-smi works, else cpu)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EAGLE3_VENV:-$HOME/.cache/eagle3-pipeline/venv}"
flavour="${EAGLE3_VLLM:-}"
if [ -z "$flavour" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=gpu; else flavour=cpu; fi
fi
case "$flavour" in
  cpu) reqs=("$root/requirements-cpu.txt") ;;
  gpu) reqs=("$root/requirements-gpu.txt") ;;
  none) reqs=("$root/requirements.txt") ;;
  *) echo "setup.sh: EAGLE3_VLLM must be cpu, gpu or none, got '$flavour'" >&2; exit 2 ;;
esac
# The stamp is the hash of every requirements file: unchanged requirements = nothing to do.
stamp_value="$flavour $(cat "$root"/requirements*.txt | sha256sum | cut -c1-16)"
stamp="$venv/.eagle3-setup-stamp"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_value" ]; then
  echo "setup: environment up to date ($venv, vllm=$flavour)" >&2
  echo "$venv/bin/python"; exit 0
fi
echo "setup: installing into $venv (vllm=$flavour); the first time takes several minutes" >&2
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet --upgrade pip >&2
if [ "$flavour" = cpu ]; then
  # Take the CPU torch wheel first so nothing pulls a multi-GB CUDA build.
  "$py" -m pip install --quiet "torch==2.13.0" >&2 || true
fi
"$py" -m pip install --quiet "${reqs[@]/#/-r}" >&2
if [ "$flavour" = cpu ]; then
  # PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch build and make
  # `import transformers` fail (operator torchvision::nms does not exist).
  "$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
fi
"$py" -c "import torch, transformers, safetensors, openai, yaml, datasets" >&2
if [ "$flavour" != none ]; then
  # the one vLLM release the pipeline is tested with (common/serving/vllm_version.py); one line if another is there
  (cd "$root" && "$py" -c "from common.serving.vllm_version import check_vllm_version as c; print('setup: vllm', c())") >&2 \
    || { echo "setup: the installed vLLM is not the tested release (see the line above)" >&2; exit 2; }
fi
echo "$stamp_value" > "$stamp"
echo "setup: done" >&2
echo "$py"
