"""Entry point: arguments -> prepare (config, checks, one resolve, plans) -> run dir -> colo.loop.run, inside one
RunLife (signals, Ray, shut-down, and how each failure ends the run).

    python -m colo.launch                                       # configs/tiny-cpu.yaml, CPU, ~minutes
    python -m colo.launch --dry-run                             # resolved config + placement, starts nothing
    python -m colo.launch --config configs/qwen3-30b-a3b-4xh200.yaml trainer.lr=1e-6 loop.steps=50
    COLO_TRAIN_GPU_FRACTION=0.3 COLO_VLLM_GPU_FRACTION=0.6 python -m colo.launch --config ...
    python -m colo.launch --resume                              # continue the newest run of the config
                                                                # (its saved config; env + overrides on top)
    python -m colo.launch run.ray_address=10.0.0.1:6379 ...     # join a Ray cluster (also: RAY_ADDRESS)

Arguments are parsed and the config is checked before torch, Ray or vLLM is imported, so `--help`
and config mistakes answer in well under a second. A config mistake prints one line and exits 2,
before anything is written or started (`--debug` shows the traceback).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from colo.runlife import Clusters, RunLife


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from colo.run.commands import python  # stdlib only: --help stays fast

    ap = argparse.ArgumentParser(
        prog=f"{python()} -m colo.launch",  # .venv/bin/python from a checkout's root: runs as shown
        description="Colocated RL on Mixture-of-Experts LMs (FSDP2 trainer + vLLM on each GPU).",
        epilog="Precedence: defaults < --config YAML < COLO_* env vars < key=value. "
               "Keys and env vars: docs/config.md.")
    ap.add_argument("--config", default=None,
                    help="YAML config (default: configs/tiny-cpu.yaml, colo.prepare.DEFAULT_CONFIG)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the resolved config and the per-GPU placement plan, start nothing")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in run.dir (its newest match) from its newest checkpoint, with "
                         "its saved config; env vars and key=value apply on top (same as run.resume=true)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks for config errors")
    ap.add_argument("--verbose", action="store_true",
                    help="show every actor's, vLLM's and Ray's output here (default: in <run.dir>/logs/)")
    ap.add_argument("overrides", nargs="*", metavar="key=value",
                    help="dotted overrides, e.g. trainer.lr=1e-6 placement.num_gpus=4")
    return ap.parse_intermixed_args(argv)  # key=value may follow --dry-run / --resume, as users write it


def main(argv: list[str] | None = None, clusters: Clusters | None = None) -> int:
    """`python -m colo.launch ARGV`; returns the exit status. `clusters`: where the job's cluster comes from and goes
    (colo.runlife.Clusters; by default the job starts its own and ends it; the test suite hands its warm clusters,
    tests/warm_clusters.py, so its short CPU jobs run in turn on the same processes)."""
    args = parse_args(argv)
    from colo.runlife import RunLife  # light: the signals and the table of endings (a config error: exit 2)

    with RunLife(clusters, debug=args.debug) as life:
        life.status = _run(args, life)
    return life.status


def _run(args: argparse.Namespace, life: RunLife) -> int:
    """The job: prepared (nothing written yet), then --dry-run's report, or the run dir and the run."""
    from colo.prepare import prepare

    overrides = (list(args.overrides) + (["run.resume=true"] if args.resume else [])
                 + (["run.verbose=true"] if args.verbose else []))
    prepared = prepare(args.config, overrides, dry_run=args.dry_run)
    if args.dry_run:
        print(prepared.report())
        prepared.check()  # printed first: the plan table shows why
        print("\n(dry run: nothing was written or started)")
        return 0
    prepared.check()  # a job that cannot fit its GPUs or its disk is refused before anything is written or started
    life.clusters.check(prepared.cfg)
    from colo.host.procs import sweep as sweep_processes
    from colo.materialize import make_run_dir
    from colo.plan.preflight import check_host
    from colo.run.terminal import Phases

    check_host(prepared.spec)  # $HOME, TMPDIR and /dev/shm as Ray, vLLM and the sync need them
    sweep_processes()  # what a run killed with SIGKILL left running on this host, by pid (colo.host.procs)
    phases = Phases()  # the start-up phase begins here: the run dir, then Ray, the actors and their imports
    cfg = make_run_dir(prepared)
    life.run_dir = Path(cfg.run.dir)  # its logs kept and its lock given up however the run ends
    print("\n".join(prepared.start_lines()), flush=True)
    phases.begin("start-up", prepared.start_up(), at=phases.started)
    from colo import loop  # heavy: torch, Ray, vLLM

    return loop.run(cfg, life, phases)


if __name__ == "__main__":
    sys.exit(main())
