#!/usr/bin/env bash
# Every model family's sync on CUDA, checked: for each family, its checkpoint with the shapes vLLM's CUDA
# kernels need (colo.models.families: DeepSeek-V3 with its real MLA head dims), then
# `colo.bench.sync --model DIR --check` on one GPU (ours against the straightforward path; --check: perturbed
# weights synced, greedy tokens and log-probs equal a fresh engine loading the trainer's export).
#
#   source /tmp/site/env.sh
#   bash tests/gpu/families.sh [FAMILY ...]     # default: every family below, in this order
#   FAMILY_LIMIT=360 (seconds per family)  OUT=/tmp/colo-gpu-out (families.jsonl + families.log)
#
# One JSON line per family in $OUT/families.jsonl (the bench's --json result, or {"family", "rc"} when it
# failed); one summary line each on stdout. Exit status: 0 when every family was verified and equivalent.
# ~4.5 min per family on an H100 with vLLM 0.32 (two engine starts of ~100 s each: the synced one and the fresh
# one of --check; 268 s for qwen3_moe on 2026-11-25, on a host running a second stream).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/colo-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LIMIT=${FAMILY_LIMIT:-360}
CKPT=${CKPT_ROOT:-/tmp/colo-fams-cuda}
families=${*:-deepseek_v3 gpt_oss glm4_moe qwen3_moe qwen2_moe mixtral qwen3}
status=0
for f in $families; do
  t0=$SECONDS
  "$PY" -m colo.models.families "$CKPT/$f" --family "$f" >>"$OUT/families.log" 2>&1
  timeout -k 15 "$LIMIT" "$PY" -m colo.bench.sync --model "$CKPT/$f" --ranks 1 --device cuda --check --reps 2 \
      --no-vllm-ipc --json >"$OUT/families-$f.json" 2>>"$OUT/families.log"
  rc=$?
  line=$(tail -n 1 "$OUT/families-$f.json" 2>/dev/null)
  rm -f "$OUT/families-$f.json"
  if [ "$rc" -eq 0 ] && [ -n "$line" ]; then
    echo "$line" | "$PY" -c "import json,sys; r=json.load(sys.stdin); r['family']='$f'; print(json.dumps(r))" \
      >>"$OUT/families.jsonl"
  else
    echo "{\"family\": \"$f\", \"rc\": $rc}" >>"$OUT/families.jsonl"
  fi
  summary=$(tail -n 1 "$OUT/families.jsonl" | "$PY" -c "
import json, sys
r = json.load(sys.stdin)
ok = r.get('verified') and r.get('equivalent')
print(('ok  ' if ok else 'FAIL'), r['family'], 'rc', r.get('rc', 0), 'verified', r.get('verified'),
      'equivalent', r.get('equivalent'), 'ours_ms', round(1000 * r['seconds'], 1) if r.get('seconds') else None,
      'speedup', r.get('speedup'))")
  echo "[families] $summary (${LIMIT}s limit, took $((SECONDS - t0))s)"
  case "$summary" in ok*) ;; *) status=1; [ "${SHARED_HOST:-0}" = 1 ] || "$PY" -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true;; esac
done
exit $status
