#!/usr/bin/env bash
# Two GPU jobs at once on a 2-GPU host, one per GPU, so one device call measures twice as much:
#
#   source /tmp/site/env.sh
#   bash tests/gpu/streams.sh NAME "STEPS for GPU 0" "STEPS for GPU 1" [SECONDS=560]
#   bash tests/gpu/streams.sh NAME "STEPS=one BENCH_PRESET=qwen3-30b-a3b-L12 ..." "STEPS=one ONE_ARGS='...'"
#
# A stream given as shell assignments (it holds '=') sets run.sh's variables for that stream alone (STEPS among
# them; quoting as in a shell); otherwise it is the STEPS words, and both streams share the caller's variables.
# Each stream is `tests/gpu/run.sh` with CUDA_VISIBLE_DEVICES set to its GPU, SHARED_HOST=1 (a failed step
# leaves the other stream's Ray alone), its own RUN_ROOT and log folder. A STEPS word `fam:F1,F2` runs
# tests/gpu/families.sh for those families after run.sh's steps. Both streams' logs come back as one archive,
# $OUT/NAME.tgz (a device call returns at most 8 files); their run.sh summaries go to stdout.
# Timings of the two streams are each of one GPU, but host CPU and memory are shared: figures that depend on
# the host (engine start, onload) can be slower than on a host running one stream.
set -u
cd "$(dirname "$0")/../.."
name=$1; total=${4:-560}
OUT=${OUT:-/tmp/colo-gpu-out}
work=/tmp/streams-$name
mkdir -p "$work" "$OUT"
stream() {  # stream GPU STEPS|ASSIGNMENTS
  local gpu=$1 steps=$2 fams="" run_steps="" w
  if [[ $steps == *=* ]]; then eval "export $steps"; steps=$STEPS; fi  # this stream's own variables
  for w in $steps; do case $w in fam:*) fams="$fams ${w#fam:}";; *) run_steps="$run_steps $w";; esac; done
  local dir=$work/gpu$gpu start=$SECONDS
  mkdir -p "$dir"
  export CUDA_VISIBLE_DEVICES=$gpu SHARED_HOST=1 OUT=$dir RUN_ROOT=/tmp/run-gpu$gpu
  if [ -n "${run_steps// /}" ]; then STEPS="$run_steps" bash tests/gpu/run.sh "$total"; fi
  if [ -n "$fams" ]; then
    left=$((total - (SECONDS - start)))
    FAMILY_LIMIT=${FAMILY_LIMIT:-360} CKPT_ROOT=/tmp/fams-gpu$gpu timeout -k 10 "$left" \
        bash tests/gpu/families.sh $(echo $fams | tr ',' ' ')
  fi
}
stream 0 "$2" >"$work/gpu0.txt" 2>&1 &
stream 1 "$3" >"$work/gpu1.txt" 2>&1 &
wait
for g in 0 1; do echo "===== GPU $g: $( [ $g = 0 ] && echo "$2" || echo "$3")"; grep -a -v "^\[gpu-mem\]" "$work/gpu$g.txt" | tail -n 60; done
tar -czf "$OUT/$name.tgz" -C /tmp "streams-$name"
ls -la "$OUT"
