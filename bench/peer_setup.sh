#!/usr/bin/env bash
# Separate virtualenv for bench/peer_bench.py: SpecForge 0.2.0 (the peer) beside this repository's common.* code,
# importable in ONE process. Never touches the project's venv (scripts/setup.sh); no --system-site-packages.
#
#   bash bench/peer_setup.sh                 # create/update the venv from the package index (needs network)
#   bash bench/peer_setup.sh --wheels DIR    # only download every wheel it needs into DIR (pip download)
#   bash bench/peer_setup.sh --from DIR      # create/update the venv from DIR alone (pip --no-index; no network)
#
#   PEER_VENV     where the venv lives (default: $HOME/.cache/eagle3-pipeline/peer-venv)
#   PYTHON        interpreter the venv is made from (default: python3; SpecForge needs Python >= 3.11).
#                 When PYTHON is given and already imports torch (a GPU box's CUDA torch), that torch is REUSED:
#                 nothing installs torch, and a .pth file appends the site-packages holding it to the END of the
#                 venv's sys.path (torch and its nvidia/triton libraries come from there; every package this
#                 script installs comes first). Otherwise torch is installed (TORCH_SPEC).
#   TORCH_SPEC    the torch requirement to install (default torch==2.13.0, the project's release: on this kind of
#                 CPU machine pip takes the local 2.13.0+cpu wheel; from plain PyPI it is the CUDA build, which
#                 also runs on CPU). For the small CPU wheel elsewhere: TORCH_SPEC=torch==2.13.0+cpu
#                 PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
#
# What gets installed (SpecForge with --no-deps: its pins include sglang, wandb, yunchang, tensorboard, which the
# training step never uses): specforge==0.2.0, then exactly what `import specforge.algorithms.eagle3.model,
# specforge.modeling.draft.llama3_eagle, specforge.optimizer, specforge.training.strategies.base` needs --
# transformers==5.8.1 (SpecForge's pin; it brings safetensors, huggingface-hub, numpy, pyyaml, tqdm) and triton
# (core/loss.py imports it at module top; CUDA torch brings it, with a CPU torch it is installed here and its
# kernels are never launched) -- and what this repository's common.* needs for the draft and the TTT loss:
# torch, safetensors, transformers, pyyaml, numpy, tqdm. No stubs are needed (sglang, wandb, yunchang,
# datasets, accelerate, tensorboard are never imported on this path).
#
# On an offline GPU box: here `PYTHON=python3.X bash bench/peer_setup.sh --wheels wheels/` (X = the box's Python
# minor version: the binary wheels must match it; PEER_PY_VERSION=3.X downloads for another version than PYTHON's),
# copy wheels/ over, there `PYTHON=/path/to/python-with-cuda-torch bash bench/peer_setup.sh --from wheels/`.
# --wheels downloads torch and triton only when TORCH_SPEC is set explicitly: a GPU box normally reuses its own
# CUDA torch, which brings triton.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PEER_VENV:-$HOME/.cache/eagle3-pipeline/peer-venv}"
base_py="${PYTHON:-python3}"
mode=install
wheel_dir=""
case "${1:-}" in
  --wheels) mode=download; wheel_dir="${2:?--wheels needs a directory}" ;;
  --from) mode=offline; wheel_dir="${2:?--from needs a directory}" ;;
  "") ;;
  *) echo "usage: bash bench/peer_setup.sh [--wheels DIR | --from DIR]" >&2; exit 2 ;;
esac

# --no-deps for SpecForge itself; the rest is the import closure of the training step (found by trying the imports).
specforge_spec="specforge==0.2.0"
packages=("transformers==5.8.1" "safetensors>=0.4" "huggingface-hub" "pyyaml>=6.0" "numpy" "tqdm>=4.66")

reuse_torch=""
if [ -n "${PYTHON:-}" ] && "$base_py" -c "import torch" >/dev/null 2>&1; then
  reuse_torch="$("$base_py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
fi
torch_spec="${TORCH_SPEC:-torch==2.13.0}"

if [ "$mode" = download ]; then
  mkdir -p "$wheel_dir"
  extra=()
  if [ -n "${PEER_PY_VERSION:-}" ]; then
    extra=(--python-version "$PEER_PY_VERSION" --only-binary=:all: --platform manylinux_2_28_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
  fi
  dl=("${packages[@]}")
  [ -n "${TORCH_SPEC:-}" ] && dl+=("$torch_spec" triton)  # a CPU torch does not bring triton
  "$base_py" -m pip download --quiet -d "$wheel_dir" "${extra[@]}" "${dl[@]}"
  "$base_py" -m pip download --quiet --no-deps -d "$wheel_dir" "${extra[@]}" "$specforge_spec"
  echo "peer_setup: wheels in $wheel_dir ($(ls "$wheel_dir" | wc -l) files)" >&2
  exit 0
fi

pip_src=()
[ "$mode" = offline ] && pip_src=(--no-index --find-links "$wheel_dir")

if [ ! -x "$venv/bin/python" ]; then
  echo "peer_setup: creating $venv from $base_py" >&2
  "$base_py" -m venv "$venv"   # no --system-site-packages: only what is installed below (and a reused torch)
fi
py="$venv/bin/python"
"$py" -c 'import sys; assert sys.version_info >= (3, 11), "SpecForge 0.2.0 needs Python >= 3.11"'
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
reuse_pth="$site/zz_peer_reuse_torch.pth"
rm -f "$reuse_pth"  # pip must not see (nor try to replace) the packages of a reused site-packages
if [ -z "$reuse_torch" ]; then
  "$py" -m pip install --quiet "${pip_src[@]}" "$torch_spec" >&2
fi
"$py" -m pip install --quiet "${pip_src[@]}" "${packages[@]}" >&2
# SpecForge's core/loss.py imports triton at module top. CUDA torch brings it; a CPU torch does not
# (on CPU its kernels are never launched: the bench uses the reference loss there).
triton_py="$py"
[ -n "$reuse_torch" ] && triton_py="$base_py"  # a reused torch's triton comes along with it
if ! "$triton_py" -c "import triton" >/dev/null 2>&1; then
  "$py" -m pip install --quiet "${pip_src[@]}" triton >&2
fi
# last, so that pip's resolver has nothing to say about SpecForge's unmet pins (sglang, wandb, ...)
"$py" -m pip install --quiet "${pip_src[@]}" --no-deps "$specforge_spec" >&2
if [ -n "$reuse_torch" ]; then
  # a .pth line is appended to sys.path after the venv's own site-packages: the venv's packages win
  echo "$reuse_torch" > "$reuse_pth"
  echo "peer_setup: reusing torch from $reuse_torch (PYTHON=$base_py)" >&2
fi
# the bench's imports, both sides: fails here, not in the middle of a run
(cd "$root" && "$py" -W "ignore:flash_attn is not found" -c "
import specforge.algorithms.eagle3.model, specforge.modeling.draft.llama3_eagle, specforge.optimizer
import specforge.training.strategies.base
import common.model.draft, common.model.ttt, common.train.optim
import torch; print('peer_setup: torch', torch.__version__, 'cuda', torch.cuda.is_available())
") >&2
echo "peer_setup: done" >&2
echo "$py"
