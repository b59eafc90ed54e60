#!/usr/bin/env bash
# Start one node of a Ray cluster for colo: the head, or a worker that joins it. Run it on every host.
#
#   bash launch/ray-cluster.sh head                    # on the head host: prints the address to join
#   bash launch/ray-cluster.sh worker 10.0.0.1:6379    # on every other host
#   bash launch/ray-cluster.sh stop                    # on each host, when done (stops this host's Ray)
#
# then, from the head host (or anywhere that reaches it):
#   RAY_ADDRESS=10.0.0.1:6379 .venv/bin/python -m colo.launch --config configs/qwen3-30b-a3b-8xh200.yaml placement.num_gpus=16
#
# Every host needs the same colo checkout and .venv at the same path (bash launch/setup.sh gpu) and
# the run directory (run.dir) on a filesystem all hosts share: each node's ranks write their checkpoint
# shards and logs there and read the model from there. Ray counts each host's GPUs itself.
#
# Environment: RAY_PORT (6379), NODE_IP (this host's address the others reach: Ray's guess otherwise),
# NUM_GPUS / NUM_CPUS (Ray's detection otherwise), RAY_TMPDIR (/tmp/ray), BLOCK=1 (stay in the
# foreground: for Slurm steps and tests, which stop the node by this process's pid), DASHBOARD=0 (no
# dashboard: `ray job submit` needs it), RAY_BIN (.venv/bin/ray). tests/e2e/twonodes.py starts both nodes of
# the multi-node test with this script. Ray 2.60 asks clients for
# the cluster's token: the head writes it to ~/.ray/auth_token; copy that file to the workers (a shared
# home does it) or export RAY_AUTH_TOKEN on every host.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ray="${RAY_BIN:-$root/.venv/bin/ray}"
role="${1:-}"
args=(--disable-usage-stats)
[[ -n "${NODE_IP:-}" ]] && args+=(--node-ip-address="$NODE_IP")
[[ -n "${NUM_GPUS:-}" ]] && args+=(--num-gpus="$NUM_GPUS")
[[ -n "${NUM_CPUS:-}" ]] && args+=(--num-cpus="$NUM_CPUS")
[[ "${BLOCK:-0}" == 1 ]] && args+=(--block)

case "$role" in
  head)
    if [[ "${DASHBOARD:-1}" == 0 ]]; then args+=(--include-dashboard=false); else args+=(--dashboard-host=0.0.0.0); fi
    [[ -n "${RAY_TMPDIR:-}" ]] && args+=(--temp-dir="$RAY_TMPDIR")
    exec "$ray" start --head --port="${RAY_PORT:-6379}" "${args[@]}"
    ;;
  worker)
    [[ -n "${2:-}" ]] || { echo "usage: bash launch/ray-cluster.sh worker <head ip>:<port>" >&2; exit 2; }
    exec "$ray" start --address="$2" "${args[@]}"
    ;;
  stop)
    exec "$ray" stop
    ;;
  *)
    echo "usage: bash launch/ray-cluster.sh head | worker <head ip>:<port> | stop" >&2
    exit 2
    ;;
esac
