#!/usr/bin/env bash
# The one command a GPU host runs: colo's GPU tests, then the weight-sync benchmark, each step under its
# own `timeout` so one hang cannot eat the others, logs written to $OUT (default /tmp/colo-gpu-out).
#
#   source /tmp/site/env.sh       # vLLM 0.32 and Ray from the offline bundle (tests/gpu/README.md)
#   bash tests/gpu/run.sh [TOTAL_SECONDS=540]
#   STEPS="bench loop" bash tests/gpu/run.sh 580    # a subset (a device call runs at most 10 minutes)
#
# Every 1-GPU test, in two calls:
#   STEPS="colocated ipc routing lora attention" bash tests/gpu/run.sh 590
#   STEPS="fp8 optim" bash tests/gpu/run.sh 590
#
# Steps (STEPS, default all, in this order): attention (only when named) = test_attention_gpu.py, then
# tools.experiments.packed_attention (packed-row kernels; its JSON line ends attention.log); colocated = test_colocated.py (1 GPU); ipc =
# test_ipc_alloc.py (CUDA IPC under expandable segments); dpep = test_dpep.py (2 GPUs, skips with
# fewer); bench = python -m colo.bench.sync over every GPU: the full qwen3-30b-a3b on 4 or more,
# else qwen3-30b-a3b-L12 on up to 2 (BENCH_ARGS replaces the arguments; vLLM's own IPC engine is timed
# in the same run); loop = a few RL steps of the 2-layer Qwen3-30B-A3B shape (random weights) on every
# GPU, with per-phase times and memory (LOOP_ARGS are added to colo.launch's arguments; the run dir is
# $RUN_ROOT/colo-loop, default /tmp, outside $OUT; its metrics.jsonl is copied to $OUT/loop-metrics.jsonl);
# routing = test_routing_gpu.py (1 GPU: routing mismatch and log-prob gap with and without R3 on
# qwen3-30b-a3b-L2, vLLM's capture and colo's (rollout.routing_capture=colo) on one engine with CUDA graphs, their rows
# compared); lora = test_lora_gpu.py (1 GPU: LoRA's merged sync, vLLM serving the adapter);
# rollout = colo.bench.rollout, colo's rollout phase against vLLM alone on the same requests, its JSON line (vs_vllm,
# where) in $OUT/rollout.json (only when named: ROLLOUT_PRESET, default qwen3-30b-a3b-L4; ROLLOUT_PROMPTS x ROLLOUT_N,
# default 16 x 8; ROLLOUT_MAX_TOKENS, default 2048; ROLLOUT_ARGS more arguments, e.g. --toggles none, or --config
# configs/qwen3-30b-a3b-lora-1xh200.yaml for the whole model); step = colo.bench.step, whole RL steps of qwen3-30b-a3b-L4 at
# 4k-token long-tail responses, packed vs padded (only when named: `STEPS=step bash tests/gpu/run.sh 600`;
# STEP_ARGS adds config overrides, e.g. trainer.gradient_checkpointing=true); async = colo.bench.step
# --compare=loop.mode=async,sync, loop.mode=async against sync on the same workload (only when named; ASYNC_ARGS
# adds overrides). Both: BENCH_STEPS measured steps (2), BENCH_MAX_TOKENS (4096), BENCH_PROMPTS (16 per step), BENCH_FLAGS more bench flags
# (--profile: the warm-up's kernel table).
# gather = colo.bench.step --compare=trainer.gather_once=true,false (trainer.gather_once on, then off; GATHER_ARGS adds
# overrides).
# decode = colo.bench.decode: vLLM's decode step time against batch size, sampling variants DECODE_VARIANTS
# (default colo,detok,bare), DECODE_ARGS adds arguments; the JSON line lands in $OUT/decode.json (only when named).
# compile = colo.bench.step --compare=trainer.compile=true,false (trainer.compile on, then off; COMPILE_ARGS adds
# overrides, e.g. trainer.gather_once=true; BENCH_WARMUP warm-up steps, 1 by default: the compile runs in them).
# optim = tools.experiments.optimizer: StreamedAdamW's host-state step (by pieces, copies overlapped) against the serial loop
# and against each parameter stepped whole,
# bit-identical first (OPTIM_ARGS replaces the arguments; default the L12 slice's parameters, bf16 state), then
# tests/gpu/test_optim_gpu.py (only when named).
# one = colo.bench.step with no comparison: one variant alone, ONE_ARGS its overrides (only when named), for a slice
# whose two variants do not fit one call. BENCH_PRESET picks the slice of step/async/gather/compile/one (default
# qwen3-30b-a3b-L4; qwen3-30b-a3b-L12 fits one H200 with trainer.optimizer_offload=true, and with gather_once too
# when trainer.offload=false: docs/benchmarks.md, "Step throughput and MFU"). Every bench_step run starts from
# BENCH_BASE (default `trainer.optimizer_dtype=bfloat16 trainer.max_tokens_per_micro_batch=8192`, the figures' base
# since 2026-11-25); BENCH_BASE=trainer.optimizer_dtype=bfloat16 leaves the micro-batch, like the other trainer
# settings that take auto, to colo.plan.auto (the L12 slice on one H200 then runs the hand-tuned fast path).
# fp8 = tests/gpu/test_fp8_gpu.py and test_fp8_loop_gpu.py: FP8 rollout (quantization against vLLM's on CUDA, a real
# FP8 engine synced both ways, the loop with R3/TIS, async, multi-turn, and disaggregated on 2 GPUs) (only when named).
# fp8step = colo.bench.step --compare=rollout.quantization=fp8,none: FP8 rollout against bf16, one cluster each, on
# BENCH_PRESET (FP8STEP_ARGS adds overrides) (only when named).
# checksum = the sync's checksum kernel (test_checksum_gpu.py), then colo.bench.sync --checksum-ratio on CHECKSUM_ARGS
# (default the L4 slice on one GPU); its JSON line lands in $OUT/checksum.json (only when named).
# fp8sync = the fused FP8 packing kernel (test_fp8_gpu.py -k fused: bit for bit quantize_blocks, its `[gpu] fp8 pack`
# cost against bf16's copy), then colo.bench.sync --fp8-ratio on FP8SYNC_ARGS (default the L4 slice, one GPU): syncs
# into a bf16 engine, then a block-FP8 one; JSON line ($OUT/fp8sync.json) with fp8_ratio (only when named; ~5 min).
# moecfg = colo.bench.rollout, vLLM alone on a rollout's requests (MOECFG_PRESET, default qwen3-30b-a3b-L4;
# MOECFG_PROMPTS x 8, default 64; 2k tokens) at every combination of MOECFG_COMPARE (default rollout.quantization=fp8,none
# and rollout.moe_configs=colo,vllm: FP8 against bf16, colo's fused-MoE tiles against vLLM's defaults); JSON line
# ($OUT/moecfg.json) with `compare` (only when named; ~8-9 min for the four engines of the default).
# layers = the functional check on GPU, test_layercheck_gpu.py: noise, a compiled engine, seconds (only when named).
# CUDA_VISIBLE_DEVICES limits the GPUs it counts and uses; SHARED_HOST=1 leaves Ray running after a failed step
# (tests/gpu/streams.sh runs two of these at once, one per GPU).
# Everything this script leaves in $OUT is at most 8 files, one level deep: what a device call brings back.
# Exit status: 0 when every step passed. A step that failed or timed out leaves Ray daemons and vLLM
# workers behind (holding GPU memory); `ray stop --force` clears them before the next step (this host runs
# nothing but this script). After every step, /dev/shm is cleaned: colo's sweep (its colo_* segments and the
# vLLM queues its engines registered), then the psm_* segments no live process maps (vLLM's own, e.g. from
# Ray-placed workers): the tests' shared-memory check counts only colo's (tests/conftest.py).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/colo-gpu-out}
mkdir -p "$OUT"
TOTAL=${1:-540}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}  # hosts may lack a bare `python`
start=$SECONDS
status=0
left() { echo $((TOTAL - (SECONDS - start))); }

clean_after() {  # $1 = exit status of the step just run
  if [ "$1" -ne 0 ]; then
    # SHARED_HOST=1 (tests/gpu/streams.sh: another stream runs on the host's other GPU): its Ray stays up
    [ "${SHARED_HOST:-0}" = 1 ] || "$PY" -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true
    status=1
  fi
  "$PY" - <<'EOF' || true
import os
from colo.host.shm import SHM, mapped_segments, sweep
swept = sweep()
live = {n for p in os.listdir("/proc") if p.isdigit() for n in mapped_segments(int(p), children=False)}
orphans = [e for e in SHM.iterdir() if e.name.startswith("psm_") and e.name not in live]
for e in orphans:
    e.unlink(missing_ok=True)
print(f"[shm] colo's sweep removed {len(swept)}; removed {len(orphans)} psm_* no live process maps")
EOF
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | sed 's/^/[gpu-mem] /'
}

step() {  # step NAME MAX_SECONDS CMD...
  local name=$1 max=$2; shift 2
  local t=$(left); [ "$t" -lt "$max" ] && max=$t
  if [ "$max" -lt 30 ]; then echo "[run.sh] $name: SKIPPED (only ${max}s left)"; status=1; return; fi
  echo "[run.sh] $name: start (limit ${max}s, $(left)s left)"
  local t0=$SECONDS
  timeout -k 15 "$max" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "[run.sh] $name: rc=$rc in $((SECONDS - t0))s"
  grep -a "^\[gpu\]" "$OUT/$name.log"; tail -n 12 "$OUT/$name.log"
  clean_after $rc
}

{ nvidia-smi -L; "$PY" -c "import torch, vllm, ray; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
  # DeepGEMM's run-time JIT (rollout.fp8_kernels=deep_gemm) compiles with nvcc (or NVRTC): is either here?
  echo "nvcc: $(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1 || true)"
  "$PY" -c "import glob, site; print('nvrtc:', [p for d in site.getsitepackages() + ['/tmp/site', '/usr/local/cuda*']
    for p in glob.glob(d + '/nvidia/*/lib/libnvrtc.so*') + glob.glob(d + '/lib64/libnvrtc.so*')][:3] or 'none')"
} 2>&1 | tee "$OUT/host.txt"
ngpu=$(nvidia-smi -L | wc -l)
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then ngpu=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .); fi

STEPS=${STEPS:-colocated ipc dpep routing lora bench loop}  # and: attention, rollout, decode, step, async, gather, compile,
# one, optim, fp8, fp8step, fp8sync, moecfg, checksum, layers
want() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }

# attention = the packed-row attention kernels against per-sample SDPA (test + tools.experiments.packed_attention; no vLLM)
want attention && step attention 150 bash -c "'$PY' -m pytest --noconftest tests/gpu/test_attention_gpu.py -q -p no:cacheprovider \
    && '$PY' -m tools.experiments.packed_attention --device cuda --json"
# optim = the optimizer step with its state on the host, overlapped against serial (no vLLM, no Ray)
want optim && step optim 240 bash -c "'$PY' -m tools.experiments.optimizer ${OPTIM_ARGS:---preset qwen3-30b-a3b-L12 --device cuda --json} \
    && '$PY' -m pytest --noconftest tests/gpu/test_optim_gpu.py -q -p no:cacheprovider"
want colocated && step pytest-colocated 420 "$PY" -m pytest tests/gpu/test_colocated.py -x -q -s -p no:cacheprovider
want ipc && step pytest-ipc 90 "$PY" -m pytest tests/gpu/test_ipc_alloc.py -x -q -s -p no:cacheprovider
want dpep && step pytest-dpep 240 "$PY" -m pytest tests/gpu/test_dpep.py -x -q -s -p no:cacheprovider
want routing && step pytest-routing 540 "$PY" -m pytest tests/gpu/test_routing_gpu.py -x -q -s -p no:cacheprovider
want lora && step pytest-lora 300 "$PY" -m pytest tests/gpu/test_lora_gpu.py -x -q -s -p no:cacheprovider
# checksum = the sync's checksum kernel (tests/gpu/test_checksum_gpu.py: exactness, its cost against copy_;
# tools.experiments.checksum_kernel: against the per-element kernel it replaced, same run), then colo.bench.sync
# --checksum-ratio on CHECKSUM_ARGS (default the L4 slice, one GPU): syncs without and with it (only when named; the
# whole model: CHECKSUM_ARGS="--preset qwen3-30b-a3b --ranks 4" on 4 GPUs)
want checksum && step checksum 540 bash -c "'$PY' -m pytest --noconftest tests/gpu/test_checksum_gpu.py -q -s \
    -p no:cacheprovider && '$PY' -m tools.experiments.checksum_kernel \
    && COLO_VLLM_GPU_FRACTION=\${COLO_VLLM_GPU_FRACTION:-0.3} '$PY' -m colo.bench.sync \
    ${CHECKSUM_ARGS:---preset qwen3-30b-a3b-L4 --ranks 1} --device cuda --reps 6 --checksum-ratio --no-vllm-ipc --json \
    | tail -n 1 > '$OUT/checksum.json'"
# layers = the functional check on GPU (tests/gpu/test_layercheck_gpu.py: its noise on the tiny and L4 models, a
# compiled engine's prefill hooks, its cost) (only when named)
want layers && step layers 540 "$PY" -m pytest tests/gpu/test_layercheck_gpu.py -x -q -s -p no:cacheprovider
want fp8 && step pytest-fp8 540 "$PY" -m pytest tests/gpu/test_fp8_gpu.py tests/gpu/test_fp8_loop_gpu.py -x -q -s \
    -p no:cacheprovider
# fp8sync = the fused FP8 packing (kernel test and cost), then a sync into FP8 against one into bf16 (only when named)
want fp8sync && step fp8sync 420 bash -c "'$PY' -m pytest tests/gpu/test_fp8_gpu.py -k fused -q -s -p no:cacheprovider \
    && COLO_VLLM_GPU_FRACTION=\${COLO_VLLM_GPU_FRACTION:-0.3} '$PY' -m colo.bench.sync \
    ${FP8SYNC_ARGS:---preset qwen3-30b-a3b-L4 --ranks 1} --device cuda --reps 6 --fp8-ratio --json | tail -n 1 > '$OUT/fp8sync.json'"

if [ "$ngpu" -ge 4 ]; then default_bench="--preset qwen3-30b-a3b --ranks $ngpu"  # the goal: <= 1.0 s per sync
else default_bench="--preset qwen3-30b-a3b-L12 --ranks $((ngpu < 2 ? ngpu : 2))"; fi
args=${BENCH_ARGS:-$default_bench --reps 4 --device cuda --json}
# stdout (the JSON line) and stderr apart: the last line of bench.json is the result
t=$(left)
if ! want bench; then
  :
elif [ "$t" -ge 60 ]; then
  echo "[run.sh] bench: python -m colo.bench.sync $args (limit ${t}s)"
  t0=$SECONDS
  # vLLM at 0.3: at the default 0.4 the baseline path OOMed on 2xH200 (L12 preset, 2026-11-23): trainer
  # 67.6 GiB + engine process 72.1 GiB of 139.8 GiB when it allocated its fresh 1 GiB bucket buffer
  COLO_VLLM_GPU_FRACTION=${COLO_VLLM_GPU_FRACTION:-0.3} \
  timeout -k 15 "$t" "$PY" -m colo.bench.sync $args >"$OUT/bench.json" 2>"$OUT/bench.log"
  rc=$?
  echo "[run.sh] bench: rc=$rc in $((SECONDS - t0))s"
  tail -n 15 "$OUT/bench.log"
  tail -n 1 "$OUT/bench.json"
  clean_after $rc
else
  echo "[run.sh] bench: SKIPPED (only ${t}s left)"; status=1
fi
if want loop; then
  loop_dir=${RUN_ROOT:-/tmp}/colo-loop-$$  # model, data, checkpoint (~30 GB) and export: not for $OUT
  # trainer state of 1.9B params (fp32 + Adam, ~30 GB) offloaded while vLLM (0.3) generates
  COLO_VLLM_GPU_FRACTION=${COLO_VLLM_GPU_FRACTION:-0.3} \
  step loop 420 "$PY" -m colo.launch placement.device=cuda placement.num_gpus=$ngpu \
      model.path=auto:qwen3-30b-a3b-L2 model.dummy_weights=true loop.steps=8 loop.eval_every=4 \
      loop.eval_samples=0 loop.sft_warmup_steps=2 loop.checkpoint_every=0 rollout.max_tokens=32 \
      rollout.max_model_len=256 rollout.enforce_eager=true run.dir="$loop_dir" ${LOOP_ARGS:-}
  [ -f "$loop_dir/metrics.jsonl" ] && cp "$loop_dir/metrics.jsonl" "$OUT/loop-metrics.jsonl"
fi
if want decode; then  # vLLM's decode step time against batch size and sampling variant (colo.bench.decode)
  step decode 560 bash -c "'$PY' -m colo.bench.decode --preset qwen3-30b-a3b-L4 --device cuda \
      --variants ${DECODE_VARIANTS:-colo,detok,bare} --json ${DECODE_ARGS:-} | grep '^{' > '$OUT/decode.json'"
fi
if want moecfg; then  # vLLM alone, FP8 against bf16 and colo's MoE tiles against vLLM's defaults (colo.bench.rollout)
  step moecfg 580 bash -c "'$PY' -m colo.bench.rollout --preset ${MOECFG_PRESET:-qwen3-30b-a3b-L4} --device cuda \
      --prompts ${MOECFG_PROMPTS:-64} --n 8 --max-tokens 2048 --phases vllm --toggles none --json \
      ${MOECFG_COMPARE:---compare rollout.quantization=fp8,none --compare rollout.moe_configs=colo,vllm} ${MOECFG_ARGS:-} \
      | grep '^{' > '$OUT/moecfg.json'"
  [ -s "$OUT/moecfg.json" ] && "$PY" -c "import json, sys; r = json.loads(open(sys.argv[1]).read().splitlines()[-1]); \
[print('[gpu] moecfg', k, row['at'], 'ratio %.3f, per rep %.3f-%.3f' % (row['ratio'], row['per_rep']['min'], row['per_rep']['max'])) \
 for k, rows in r['compare'].items() for row in rows]; \
[print('[gpu] moecfg cell', c['settings'], '%.0f tok/s' % c['vllm']['plain']['tokens_per_s'], c['vllm']['moe_configs']) for c in r['cells']]" "$OUT/moecfg.json"
fi
if want rollout; then  # colo's rollout phase against vLLM alone on the same requests (colo.bench.rollout)
  step rollout 580 bash -c "'$PY' -m colo.bench.rollout --preset ${ROLLOUT_PRESET:-qwen3-30b-a3b-L4} --device cuda \
      --prompts ${ROLLOUT_PROMPTS:-16} --n ${ROLLOUT_N:-8} --max-tokens ${ROLLOUT_MAX_TOKENS:-2048} --json \
      ${ROLLOUT_ARGS:-} | grep '^{' > '$OUT/rollout.json'"
  [ -s "$OUT/rollout.json" ] && tail -n 1 "$OUT/rollout.json"
fi
# The whole RL step at 4k-token long-tail lengths, one run of colo.bench.step with two variants (1 GPU): 4 layers of
# Qwen3-30B-A3B (3.1B params, random weights). The memory plan (checked by the bench) fits one H100 with bf16 AdamW
# state and 8192 packed tokens per micro-batch: train phase 73.6 of 79.2 GiB. The JSON line is the last line of
# $OUT/NAME.json (docs/benchmarks.md, "Step throughput and MFU").
bench_step() {  # bench_step NAME WARMUP COMPARE_FLAG [OVERRIDES...]
  local name=$1 warmup=$2 flag=$3; shift 3
  local t=$(left); [ "$t" -gt 590 ] && t=590
  echo "[run.sh] $name: python -m colo.bench.step $flag (limit ${t}s)"
  local t0=$SECONDS
  # shellcheck disable=SC2086
  timeout -k 15 "$t" "$PY" -m colo.bench.step --preset "${BENCH_PRESET:-qwen3-30b-a3b-L4}" --device cuda --gpus 1 \
      --max-tokens "${BENCH_MAX_TOKENS:-4096}" --prompt-len 256 --prompts "${BENCH_PROMPTS:-16}" --n 8 --warmup "$warmup" \
      --steps "${BENCH_STEPS:-2}" ${flag:+"$flag"} ${BENCH_FLAGS:-} --json \
      --workdir "${RUN_ROOT:-/tmp}/colo-$name" \
      ${BENCH_BASE-trainer.optimizer_dtype=bfloat16 trainer.max_tokens_per_micro_batch=8192} "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"
  local rc=$?
  echo "[run.sh] $name: rc=$rc in $((SECONDS - t0))s"
  tail -n 15 "$OUT/$name.log"
  tail -n 1 "$OUT/$name.json"
  clean_after $rc
}
# shellcheck disable=SC2086
# BENCH_WARMUP: warm-up steps (step: 1, async: 2 by default). With trainer.compile=true give 2: the first step
# compiles with the shapes it sees, the second recompiles with dynamic token counts (2026-11-26: a measured step
# after one warm-up step recompiled, packed update 7.7 s against 1.7 s)
want step && bench_step step "${BENCH_WARMUP:-1}" --compare ${STEP_ARGS:-}           # packed against padded
# shellcheck disable=SC2086
want async && bench_step async "${BENCH_WARMUP:-2}" --compare=loop.mode=async,sync ${ASYNC_ARGS:-}  # loop.mode=async against sync
# shellcheck disable=SC2086
want gather && bench_step gather 1 --compare=trainer.gather_once=true,false ${GATHER_ARGS:-}  # trainer.gather_once against per micro-batch
# shellcheck disable=SC2086
want compile && bench_step compile "${BENCH_WARMUP:-1}" --compare=trainer.compile=true,false ${COMPILE_ARGS:-}  # compiled layers against eager
# shellcheck disable=SC2086
want fp8step && bench_step fp8step "${BENCH_WARMUP:-1}" --compare=rollout.quantization=fp8,none ${FP8STEP_ARGS:-}
# shellcheck disable=SC2086
want one && bench_step one "${BENCH_WARMUP:-1}" "" ${ONE_ARGS:-}  # one variant alone (ONE_ARGS), e.g. the L12 slice compiled
echo "[run.sh] done in $((SECONDS - start))s, status $status"
exit $status
