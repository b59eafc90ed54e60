"""Rollout throughput of a colocated engine against the same engine alone on the GPU, in one run.

    python -m colo.bench.rollout --preset qwen3-30b-a3b-L12 --device cuda --json      # 1 GPU
    python -m colo.bench.rollout --preset tiny --device cpu --prompts 8 --max-tokens 16   # CPU: the script runs

    standalone  a RolloutEngine alone on the GPU (no trainer), gpu_memory_utilization = --standalone-fraction
    colocated   start_cluster as the loop does: trainer + engine in one placement group per GPU, then one
                weight-update cycle (sleep 2 -> wake weights -> sync -> trainer offload -> wake KV cache),
                so the engine generates in the state it is in during an RL step, at placement.vllm_gpu_fraction

Both phases send the same prompts (random token ids, fixed seed), n samples each, at temperature 1 with
the same per-request seeds, through the same RolloutEngine.generate and vLLM settings; only placement and
memory fraction differ. Throughput is output tokens (counted, not assumed) per second of wall time of the
timed generate calls, best of --reps after one warm-up call. Each phase runs in a child process of its
own, so the first one's GPU memory is certainly free when the second starts (a vLLM engine killed inside
a live Ray session can leave its engine-core process behind).

Arguments are parsed before torch/Ray/vLLM are imported, so --help answers at once.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PRESETS = ("tiny", "qwen3-30b-a3b-L2", "qwen3-30b-a3b-L12", "qwen3-30b-a3b")
TOKEN_ID_LIMIT = 512  # the presets' tokenizer vocabulary: every id below it is a real token


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m colo.bench.rollout", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, default="qwen3-30b-a3b-L12")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--ranks", type=int, default=1, help="GPUs (colocated: one trainer + engine on each)")
    ap.add_argument("--prompts", type=int, default=256, help="prompts per timed call (over all engines)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--max-tokens", type=int, default=512, help="max output tokens per sample")
    ap.add_argument("--reps", type=int, default=2, help="timed calls per phase (after one warm-up call)")
    ap.add_argument("--standalone-fraction", type=float, default=0.9,
                    help="gpu_memory_utilization of the standalone engine (the whole GPU, as vLLM's default)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the GPU configs use them)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (last stdout line)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "colo-bench"))
    ap.add_argument("--phase", choices=("standalone", "colocated"), help=argparse.SUPPRESS)  # child process
    args = ap.parse_args(argv)
    if min(args.ranks, args.prompts, args.n, args.prompt_len, args.max_tokens, args.reps) < 1:
        ap.error("--ranks, --prompts, --n, --prompt-len, --max-tokens and --reps must be >= 1")
    if not 0 < args.standalone_fraction <= 1:
        ap.error("--standalone-fraction must be in (0, 1]")
    return args


def prompts(args: argparse.Namespace) -> list[list[int]]:
    import random

    rng = random.Random(1234)
    return [[rng.randrange(3, TOKEN_ID_LIMIT) for _ in range(args.prompt_len)] for _ in range(args.prompts)]


def make_config(args: argparse.Namespace, model_dir: str, standalone: bool) -> Any:
    from colo.config import load_config, validate
    from colo.plan.resolve import resolve

    cfg = load_config(None, [])  # defaults + COLO_* env: COLO_TRAIN_GPU_FRACTION / COLO_VLLM_GPU_FRACTION apply
    cfg.model.path, cfg.model.dummy_weights = model_dir, args.preset != "tiny"
    cfg.placement.device, cfg.placement.num_gpus = args.device, args.ranks
    cfg.rollout.max_model_len = args.prompt_len + args.max_tokens
    cfg.rollout.max_tokens, cfg.rollout.n = args.max_tokens, args.n
    cfg.rollout.enforce_eager = args.enforce_eager or args.device == "cpu"
    cfg.rollout.kv_cache_mb = 1024
    if standalone:  # one engine on whole GPUs of its own: the disaggregated engine, with no trainer started
        cfg.placement.mode, cfg.placement.num_gpus, cfg.placement.trainer_gpus = "disaggregated", args.ranks + 1, 1
        cfg.placement.vllm_gpu_fraction = args.standalone_fraction
    cfg.run.dir = str(Path(args.workdir) / f"rollout-run-{args.phase}")  # the engines' logs (colo.run.logs)
    validate(cfg, check_resources=False)
    return resolve(cfg).cfg  # as colo.launch hands it to the actors: no `auto` left


def timed_generate(engines: list, ids: list[list[int]], args: argparse.Namespace) -> dict:
    """One warm-up call, then --reps timed calls; prompts are spread over the engines as the loop does."""
    import ray

    from colo.rollout.generation import Generation

    def call(seed: int) -> tuple[float, int]:
        w = len(engines)
        t0 = time.perf_counter()
        outs = ray.get([e.generate.remote(Generation([ids[i] for i in range(r, len(ids), w)], args.n, args.max_tokens,
                                                     1.0, 1.0, seed + r)) for r, e in enumerate(engines)])
        return time.perf_counter() - t0, sum(len(s["response_ids"]) for out, _ in outs for s in out)

    call(0)
    runs = [call(1 + k) for k in range(args.reps)]
    best = min(runs, key=lambda r: r[0] / max(r[1], 1))
    return {"seconds": best[0], "output_tokens": best[1], "tokens_per_s": best[1] / best[0],
            "all_tokens_per_s": [t / s for s, t in runs]}


def run_phase(args: argparse.Namespace) -> dict:
    """One phase in this (child) process: its own Ray session, engines, timed calls."""
    import ray

    from colo.cluster.actors import start_cluster
    from colo.host.net import free_port
    from colo.models.tiny import make_tiny_model
    from ray.util.placement_group import placement_group

    from colo.config import to_dict
    from colo.cluster.placement import init_ray, plan_placement, scheduling

    model_dir = str(make_tiny_model(Path(args.workdir) / f"{args.preset}-s0", args.preset, 0))
    standalone = args.phase == "standalone"
    cfg = make_config(args, model_dir, standalone)
    plan = plan_placement(cfg)
    init_ray(plan, log_to_driver=not args.json)
    ids = prompts(args)
    out: dict[str, Any] = {"phase": args.phase, "vllm_fraction": cfg.placement.vllm_gpu_fraction}
    try:
        t0 = time.perf_counter()
        if standalone:
            from colo.rollout.engine import RolloutEngine

            # the engines' groups only: the plan's trainer GPU is never asked for (no trainer is started)
            engine_pgs = [placement_group([plan.bundle()], strategy="STRICT_PACK") for _ in range(args.ranks)]
            ray.get([pg.ready() for pg in engine_pgs], timeout=300)
            engines = [RolloutEngine.options(num_gpus=0 if args.device == "cuda" else 1, num_cpus=0,
                                             scheduling_strategy=scheduling(pg)).remote(to_dict(cfg), e, 1, free_port())
                       for e, pg in enumerate(engine_pgs)]
            ray.get([e.ready.remote() for e in engines])
        else:
            c = start_cluster(cfg, plan)
            engines = c.engines
            cycle = {}
            t = time.perf_counter()
            ray.get([e.sleep.remote(2) for e in engines])
            ray.get([e.wake_up.remote(["weights"]) for e in engines])
            reports = c.trainer_group.sync_weights()
            ray.get([tr.offload.remote() for tr in c.trainers])
            ray.get([e.wake_up.remote(["kv_cache", "scheduling"]) for e in engines])
            cycle["weight_cycle_s"] = time.perf_counter() - t
            cycle["sync_verified"] = all(r["verified"] for r in reports)
            cycle["memory_after_offload"] = ray.get(c.trainers[0].memory.remote())
            out.update(cycle)
        out["start_s"] = time.perf_counter() - t0
        out.update(timed_generate(engines, ids, args))
    finally:
        ray.shutdown()
    return out


def run_child(args: argparse.Namespace, phase: str, argv: list[str]) -> dict:
    """Run one phase in a child process (own process group, killed afterwards); its last stdout line."""
    cmd = [sys.executable, "-m", "colo.bench.rollout", *argv, "--phase", phase, "--json"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, _ = p.communicate()
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever the phase left behind (engine-core, raylet)
        except ProcessLookupError:
            pass
    lines = [x for x in stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"colo.bench.rollout: the {phase} phase failed (exit {p.returncode}); its stderr is above")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.phase:
        print(json.dumps(run_phase(args), sort_keys=True), flush=True)
        return 0
    alone = run_child(args, "standalone", argv)
    colo = run_child(args, "colocated", argv)
    ratio = colo["tokens_per_s"] / alone["tokens_per_s"]
    result = {"ratio": ratio, "colocated": colo, "standalone": alone, "preset": args.preset,
              "device": args.device, "ranks": args.ranks, "prompts": args.prompts, "n": args.n,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "enforce_eager": args.enforce_eager,
              "date": time.strftime("%Y-%m-%d")}
    if args.json:
        print(json.dumps(result, sort_keys=True), flush=True)
    else:
        print(f"colo.bench.rollout {args.preset} on {args.ranks} {args.device} GPU(s): {args.prompts} prompts x "
              f"n={args.n}, {args.prompt_len}+{args.max_tokens} tokens\n"
              f"standalone (vLLM fraction {alone['vllm_fraction']:g}): {alone['tokens_per_s']:.0f} output tok/s\n"
              f"colocated  (vLLM fraction {colo['vllm_fraction']:g}, trainer offloaded beside it): "
              f"{colo['tokens_per_s']:.0f} output tok/s\n"
              f"ratio colocated/standalone: {ratio:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
