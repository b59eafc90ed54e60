#!/usr/bin/env bash
# Installs the offline GPU bundle (tests/gpu/make-bundle.sh) on a host without network. Run it from the repo
# root after every device call that carried a chunk folder (.gpu/cNN): the chunk's part is moved into a stash
# that lives as long as the host; once every part listed in parts.sha256 is there, the parts are verified,
# joined, every wheel checked against SHA256SUMS and installed into SITE with --no-deps --no-index. It then
# writes SITE/env.sh and imports torch and vLLM through it. Idempotent: a later call only reprints the status.
#
#   bash tests/gpu/device-install.sh [CHUNK_DIR=.gpu] [STASH=/tmp/gpu-bundle] [SITE=/tmp/site]
#   bash tests/gpu/device-install.sh --host     # what the host image has (no chunk needed; cheap)
#   a package the bundle lacks: pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 -d .gpu/extra PKG==VER here, carry .gpu/extra, run this again
#   source /tmp/site/env.sh                     # then: python3 tests/gpu/bundle_check.py
set -euo pipefail
PY=${PYTHON:-python3}
if [ "${1:-}" = "--host" ]; then
  nvidia-smi -L || true
  "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|tokenizers|safetensors|huggingface|numpy|nvidia|cuda|vllm|ray|pillow|numba|regex|typer|aiohttp) ' || true
  "$PY" - <<'EOF'
import glob, os, site, sys, ctypes
for p in sys.path:
    for lib in glob.glob(os.path.join(p, "nvidia", "*", "lib", "libnccl.so.2")):
        l = ctypes.CDLL(lib)
        print("libnccl", lib, "has ncclCommSuspend:", hasattr(l, "ncclCommSuspend"))
EOF
  exit 0
fi
src=${1:-.gpu}
stash=${2:-/tmp/gpu-bundle}
site=${3:-/tmp/site}
mkdir -p "$stash"
for d in "$src"/c[0-9][0-9]; do
  [ -d "$d" ] || continue
  mv -f "$d"/part.* "$stash"/ 2>/dev/null || true
  cp -f "$d/parts.sha256" "$stash"/
done
if [ -f "$site/.bundle-installed" ]; then
  echo "bundle: installed (source $site/env.sh)"
else
  [ -f "$stash/parts.sha256" ] || { echo "bundle: no chunk has arrived yet"; exit 0; }
  missing=$(cd "$stash" && awk '{print $2}' parts.sha256 | while read -r p; do [ -f "$p" ] || echo "$p"; done)
  if [ -n "$missing" ]; then
    echo "bundle: have $(( $(wc -l < "$stash/parts.sha256") - $(echo "$missing" | wc -l) ))/$(wc -l < "$stash/parts.sha256") parts; missing $(echo $missing)"
    exit 0
  fi
  t0=$SECONDS
  (cd "$stash" && sha256sum -c --quiet parts.sha256)
  rm -rf "$stash/payload"; mkdir -p "$stash/payload"
  cat "$stash"/part.* | tar -C "$stash/payload" -xf -
  (cd "$stash/payload" && sha256sum -c --quiet SHA256SUMS)
  rm -f "$stash"/part.*  # the payload is verified: free the disk
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$stash"/payload/wheels/*.whl 2>&1 | grep -v -e "^WARNING: Target directory" -e "^WARNING: Running pip as" || true
  cp -f "$stash"/payload/extra/* "$site"/ 2>/dev/null || true
  # env.sh: what every process on this host needs to use the bundle (Ray workers and vLLM inherit it)
  {
    echo "export PYTHONPATH=$site:\$PWD\${PYTHONPATH:+:\$PYTHONPATH}  # source it from the repo root"
    echo "export VLLM_USE_FLASHINFER_SAMPLER=0  # FlashInfer is not in the bundle: vLLM's own sampler"
    echo "# torch 2.13 was built against cuDNN 9.20, the host has 9.19 (torch 2.11's); nothing colo runs uses cuDNN"
    echo "export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1"
  } > "$site/env.sh"
  if [ -f "$site/libcolo_nccl_shim.so" ]; then
    need=$("$PY" - <<'EOF'
import ctypes, glob, os, sys
libs = [l for p in sys.path for l in glob.glob(os.path.join(p, "nvidia", "*", "lib", "libnccl.so.2"))]
names = ["ncclCommSuspend", "ncclCommResume", "ncclCommMemStats", "ncclGetLsaMultimemDevicePointer",
         "ncclGetPeerDevicePointer", "ncclPutSignal", "ncclSignal", "ncclWaitSignal"]
lib = ctypes.CDLL(libs[0]) if libs else None
print(" ".join(n for n in names if lib is None or not hasattr(lib, n)) or "none")
EOF
)
    echo "bundle: host libnccl lacks: $need"
    if [ "$need" != none ]; then
      echo "# the host's NCCL (2.28.9) lacks NCCL 2.29 symbols torch 2.13 links: tests/gpu/nccl_shim.c" >> "$site/env.sh"
      echo "export LD_PRELOAD=$site/libcolo_nccl_shim.so\${LD_PRELOAD:+:\$LD_PRELOAD}" >> "$site/env.sh"
    fi
  fi
  rm -rf "$stash/payload"
  touch "$site/.bundle-installed"
  echo "bundle: installed in $((SECONDS - t0))s (source $site/env.sh)"
fi
# A wheel the bundle lacks (a host turned out to miss a package): carry .gpu/extra/*.whl in any later call
if ls "$src"/extra/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$src"/extra/*.whl 2>&1 | grep -v -e "^WARNING: Target directory" -e "^WARNING: Running pip as" || true
  echo "bundle: added $(ls "$src"/extra/*.whl | xargs -n1 basename | tr '\n' ' ')"
fi
# shellcheck disable=SC1091
source "$site/env.sh"
"$PY" -c "import torch, vllm; print('torch.__version__', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('vllm.__version__', vllm.__version__)"
