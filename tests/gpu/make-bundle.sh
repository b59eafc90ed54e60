#!/usr/bin/env bash
# Builds the offline GPU bundle for vLLM 0.32.0: downloads the wheels pinned in bundle-requirements.txt (CPython
# 3.12, manylinux x86_64, no dependencies: the list is the whole set), slims the vLLM wheel, compiles the NCCL
# shim, and cuts the lot into chunk folders of at most CHUNK_MB MiB that a host without network receives one
# per device call and installs with tests/gpu/device-install.sh (tests/gpu/README.md: what travels and why).
#
#   bash tests/gpu/make-bundle.sh [OUT_DIR=.gpu] [CHUNK_MB=60]       # from the repo root; .gpu/ is git-ignored
#   WHEEL_CACHE=/tmp/gpuwheels/cache   downloaded wheels are kept here and reused (outside the repo)
#   SLIM=0                             keep the wheels whole (see the slimming below: +4 chunks)
#   WITH_NCCL=1                        ship nvidia-nccl-cu13 2.32.3 (+291 MiB) instead of the NCCL shim
# Another bundle (tools/peers/verl/make-bundle.sh: verl's, on the host's own torch) sets:
#   REQS=FILE                          the pinned list instead of bundle-requirements.txt
#   SLIM_SPEC=FILE                     the slimming list instead of colo's below ("wheel-prefix|path path ...", one a line)
#   SDIST="pkg==ver ..."               pure-Python pins the registry has as sdists only: built into wheels here first
#   NCCL_SHIM=0                        no NCCL shim (a bundle that keeps the host's torch needs none)
#   LABEL="..."                        what the last lines name the bundle; INSTALL_HINT: the install command they print
#
# Each device call carries the working tree (~1 MiB) plus one chunk within 64 MiB: keep CHUNK_MB at 60 or less.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(mkdir -p "${1:-.gpu}" && cd "${1:-.gpu}" && pwd)
chunk_mb=${2:-60}
cache=${WHEEL_CACHE:-/tmp/gpuwheels/cache}
mkdir -p "$cache"
rm -rf "$out/payload" "$out"/c[0-9][0-9] "$out"/part.*
mkdir -p "$out/payload/wheels" "$out/payload/extra"

reqs_file=${REQS:-$here/bundle-requirements.txt}
reqs=$(grep -v '^#' "$reqs_file" | sed '/^\s*$/d')
if [ "${WITH_NCCL:-0}" = 1 ]; then reqs="$reqs nvidia-nccl-cu13==2.32.3"; fi
plat=()
# the 0.26 bundle's order (pip prefers earlier tags): glibc 2.28 wheels first; llguidance exists only for 2.31
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 any; do
  plat+=(--platform "$p")
done
for r in ${SDIST:-}; do  # pure Python: the wheel built here is the one any host would build
  python3 -m pip wheel -q --no-deps --no-binary=:all: -w "$cache" "$r" 2>&1 | grep -v "is ignored: it is neither" || true
done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" --find-links "$cache" -d "$cache" $reqs 2>&1 | grep -v "is ignored: it is neither" || true

# exactly one wheel per pinned requirement, none left over from other pins in the cache
for r in $reqs; do
  name=$(echo "${r%%==*}" | tr 'A-Z-.' 'a-z__'); ver=${r##*==}
  found=$(cd "$cache" && ls | awk -v n="$name" -v v="$ver" '{
    split($0, f, "-"); g = tolower(f[1]); gsub(/[-.]/, "_", g); if (g == n && f[2] == v) print }')
  [ "$(echo "$found" | grep -c .)" = 1 ] || { echo "make-bundle: want one wheel for $r, found: $found" >&2; exit 1; }
  ln -f "$cache/$found" "$out/payload/wheels/$found" 2>/dev/null || cp "$cache/$found" "$out/payload/wheels/"
done

# Slimming: files no colo run on Hopper loads, deleted from copies of the wheels in place (zip -d: nothing is
# recompressed; RECORD loses their lines). 203 MiB: 20 chunks become 16; SLIM=0 keeps the wheels whole.
#   vLLM: FlashAttention-2 (124 MiB of sm80/sm89 kernels; Hopper takes FA3, and vllm_flash_attn imports
#         _vllm_fa2_C inside try/except) and vllm-rs (21 MiB, the opt-in Rust frontend of `vllm serve`)
#   triton: ptxas-blackwell (only for sm100+: backends/nvidia/compiler.py) and CUPTI's static archives (a .a
#         is never loaded at run time)
#   ray: the Java worker jar (cross-language actors)
slim=(
  "vllm-0.32.0-|vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs"
  "triton-3.7.1-|triton/backends/nvidia/bin/ptxas-blackwell triton/backends/nvidia/lib/cupti/libcupti_static.a triton/backends/nvidia/lib/cupti/libnvperf_host_static.a"
  "ray-2.60.0-|ray/jars/ray_dist.jar"
)
if [ -n "${SLIM_SPEC:-}" ]; then
  mapfile -t slim < <(grep -v '^#' "$SLIM_SPEC" | sed '/^\s*$/d')
fi
if [ "${SLIM:-1}" = 1 ]; then
  for entry in "${slim[@]}"; do
    prefix=${entry%%|*}; read -r -a drop <<< "${entry#*|}"
    w=$(ls "$out"/payload/wheels/"$prefix"*.whl)
    rm -f "$w"; cp "$cache/$(basename "$w")" "$w"  # a copy: never edit the cached wheel (hard link)
    zip -q -d "$w" "${drop[@]}"
    record=$(unzip -Z1 "$w" | grep -E '^[^/]+\.dist-info/RECORD$')
    tmp=$(mktemp -d)
    # a path may end in * (zip -d takes it as a wildcard): the RECORD lines under it go too
    (cd "$tmp" && unzip -q "$w" "$record" && pat=$(printf -- '-e ^%s, ' "${drop[@]//\*/.*}") \
       && eval grep -v "$pat" "$record" > R && mv R "$record" && zip -q "$w" "$record")
    rm -rf "$tmp"
  done
fi

if [ "${WITH_NCCL:-0}" != 1 ] && [ "${NCCL_SHIM:-1}" = 1 ]; then
  gcc -shared -fPIC -nostdlib -O2 -o "$out/payload/extra/libcolo_nccl_shim.so" "$here/nccl_shim.c"
fi
(cd "$out/payload" && find wheels extra -type f | sort | xargs sha256sum > SHA256SUMS)

# one tar stream (wheels are zip-compressed already), cut into CHUNK_MB pieces, one folder per piece
tar -C "$out/payload" -cf - SHA256SUMS wheels extra | split -b "${chunk_mb}M" -d -a 2 - "$out/part."
(cd "$out" && sha256sum part.*) > "$out/parts.sha256"
n=0
for part in "$out"/part.*; do
  n=$((n + 1))
  d=$(printf '%s/c%02d' "$out" "$n")
  mkdir -p "$d"
  mv "$part" "$d/"
  cp "$out/parts.sha256" "$d/"  # every chunk knows the whole list: they may arrive in any order
done
rm -rf "$out/payload"
mib() { du -cb "$@" | tail -1 | awk '{ printf "%.1f", $1 / 1048576 }'; }
echo "bundle: $n chunks, $(mib "$out"/c[0-9][0-9]/part.*) MiB in all (${LABEL:-vllm 0.32.0, torch 2.13.0, triton 3.7.1}):"
for d in "$out"/c[0-9][0-9]; do echo "  $d $(mib "$d"/part.*) MiB"; done
echo "carry one chunk per device call, then: ${INSTALL_HINT:-bash tests/gpu/device-install.sh (tests/gpu/README.md)}"
