#!/usr/bin/env bash
# Builds verl's offline bundle beside colo's: tests/gpu/make-bundle.sh with verl's pins (requirements.txt: verl 0.9.1,
# vLLM 0.24.0, Ray, transformers 5.9.0 on the host's own torch 2.11.0), its slimming list (slim.txt), no NCCL shim,
# chunks of at most CHUNK_MB MiB in OUT_DIR (default .gpu/verl, git-ignored with .gpu/). Then, on the GPU host, one
# chunk per device call:
#   bash tests/gpu/device-install.sh .gpu/verl /tmp/gpu-bundle-verl /tmp/site-verl   # its own stash and site
#   source /tmp/site-verl/env.sh                                                    # never beside /tmp/site/env.sh
#
#   bash tools/peers/verl/make-bundle.sh [OUT_DIR=.gpu/verl] [CHUNK_MB=58]   # from the repo root, with network
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
REQS="$here/requirements.txt" SLIM_SPEC="$here/slim.txt" NCCL_SHIM=0 SDIST="antlr4-python3-runtime==4.9.3" \
  LABEL="verl 0.9.1, vllm 0.24.0, ray 2.60.0 on the host's torch 2.11.0" \
  INSTALL_HINT="bash tests/gpu/device-install.sh ${1:-.gpu/verl} /tmp/gpu-bundle-verl /tmp/site-verl" \
  bash "$root/tests/gpu/make-bundle.sh" "${1:-.gpu/verl}" "${2:-58}"
