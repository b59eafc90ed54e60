"""colo's rollout phase against vLLM alone on the same requests, in one run, and where the difference goes.

    python -m colo.bench.rollout --preset qwen3-30b-a3b-L4 --device cuda --prompts 16 --n 8 --max-tokens 2048 --json
    python -m colo.bench.rollout --preset tiny --device cpu --prompts 4 --n 2 --max-tokens 16 --json   # CPU: it runs

The requests are a sync step's: --prompts random prompts of --prompt-len token ids, --n samples each at temperature
1 / top-p 1, sample j of prompt i its own request seeded seed + i*n + j (colo.rollout.generation), its length imposed
(min_tokens = max_tokens = L, ignore_eos; random weights never stop on purpose): --lengths iid is the step
benchmark's long tail at --max-tokens (colo.bench.lengths, drawn from the sample's seed), fixed is --max-tokens for
every sample. Every timed call draws new prompts (no prefix-cache hits across calls, as across RL steps); call k of
every variant draws the same ones, so both sides decode exactly the same tokens (checked: colo's lengths are vLLM's).

Phases, each in a child process of its own (its GPU memory certainly free when the next one starts):
  vllm        vllm.LLM as its docs show: the model, dtype, max_model_len, eager/graphs and KV room of colo's engine
              (gpu_memory_utilization = placement.vllm_gpu_fraction), LLM.generate with plain SamplingParams (the
              length, the seed; vLLM's defaults otherwise). The same engine then times colo's per-request choices one
              at a time (--toggles): the sampled token's log-prob (logprobs=0), no detokenization, no seeds, and
              colo's scheduling: its engine loop (colo.rollout.engine_loop: vLLM stepped by hand, one request per
              sample, outputs streamed) instead of LLM.generate, with colo's request settings both ways.
  colocated   colo's rollout phase as the loop runs it: start_cluster (trainer + engine in one placement group per
              GPU), one weight-update cycle (sleep 2 -> wake weights -> sync -> trainer offload -> wake KV cache),
              then Engine.generate through Ray with the routing every step asks for (R3 capture). --toggles also
              times it without routing, and before the weight cycle (what sleep/wake leaves behind).
  standalone  (only in --phases) colo's engine alone on the GPU at --standalone-fraction, no trainer: what
              colocation's smaller KV room costs.

--compare KEY=A,B (repeatable; config keys the engine is built with, e.g. rollout.quantization=fp8,none and
rollout.moe_configs=colo,vllm): the phases above run once per combination of the values, each in children of its
own; `compare` holds, per KEY, A over B at each setting of the other keys: `ratio`, the median of the per-rep
ratios (rep i of A over rep i of B: the same requests), their spread (`per_rep`) and the best calls' ratio
(`ratio_best`), the throughput being vllm's plain (else colocated's colo). Config
overrides (KEY=VALUE after the flags) apply to every phase.

The routing captures (rollout.routing_capture), in one run: --phases colocated --toggles routing --compare
rollout.routing_capture=colo,vllm. `compare` is colo's capture over vLLM's with routing asked; each cell's
`no_routing` calls ask none, which with vLLM's capture still pays its per-step commit (the engine runs with
enable_return_routed_experts either way) and with colo's leaves only its kernels inside the forward: the nearest to
no capture an engine that can capture gets.

Throughput: output tokens per second of wall time of a timed call, best of --reps after one warm-up call; variants
interleaved per rep, so a drift of the machine hits them alike. The JSON line's `vs_vllm` is colocated over vllm's
plain, the median over call indices of the paired ratios; `vs_vllm_best` divides the best calls, and `where` holds
each toggle's factor in best calls (its speed over its reference, so the factors multiply: vs_vllm_best =
params x scheduling x engine, params ~ logprobs x detokenize, engine = routing x wake_sleep x rest, where `rest` is
what no toggle names: the Ray actor hop, vLLM's Ray executor, sleep mode's allocator, the worker extension).
Each call index has prompts and a long tail of its own (both sides get the same), so best calls of the two sides can
be calls of different length (on an H100 one side's calls ranged 7,416-13,246 tokens/s): `vs_vllm_per_call` pairs
them, the ratio of each call index's throughputs, with its median (the headline) and spread (colo.bench.spread).

Arguments are parsed before torch/Ray/vLLM are imported, so --help answers at once.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PRESETS = ("tiny", "qwen3-30b-a3b-L2", "qwen3-30b-a3b-L4", "qwen3-30b-a3b-L12", "qwen3-30b-a3b")
TOKEN_ID_LIMIT = 512  # the presets' tokenizer vocabulary: every id below it is a real token
PHASES = ("vllm", "colocated", "standalone")
TOGGLES = ("logprobs", "detokenize", "seeds", "scheduling", "routing", "wake_sleep")
# vLLM-phase variants: (logprobs=0, detokenize, a seed per request, colo's engine loop instead of LLM.generate)
VARIANTS = {"plain": (False, True, True, False), "logprobs": (True, True, True, False),
            "no_detokenize": (False, False, True, False), "no_seeds": (False, True, False, False),
            "colo_params": (True, False, True, False), "colo_loop": (True, False, True, True)}
NEEDS = {"logprobs": ("logprobs",), "detokenize": ("no_detokenize",), "seeds": ("no_seeds",),
         "scheduling": ("colo_params", "colo_loop")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from colo.bench.lengths import LENGTH_MODELS

    ap = argparse.ArgumentParser(prog="python -m colo.bench.rollout", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, default="qwen3-30b-a3b-L4")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per timed call")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--max-tokens", type=int, default=2048, help="rollout.max_tokens: the longest response")
    ap.add_argument("--lengths", choices=LENGTH_MODELS, default="iid",
                    help="imposed response lengths: the step benchmark's long tail (iid, per-prompt) or fixed")
    ap.add_argument("--reps", type=int, default=2, help="timed calls per variant (after one warm-up call)")
    ap.add_argument("--warmup-tokens", type=int, default=32,
                    help="the warm-up call's --max-tokens (its batch shapes compile kernels; its length need not)")
    ap.add_argument("--config", help="a colo YAML whose settings the phases take (placement.vllm_gpu_fraction, the "
                                     "trainer's: e.g. configs/qwen3-30b-a3b-lora-1xh200.yaml for the whole model)")
    ap.add_argument("--phases", default="vllm,colocated", help=f"comma-separated, of {', '.join(PHASES)}")
    ap.add_argument("--toggles", default="all", help=f"all, none, or comma-separated of {', '.join(TOGGLES)}")
    ap.add_argument("--standalone-fraction", type=float, default=0.9,
                    help="gpu_memory_utilization of the standalone phase's engine (the whole GPU, as vLLM's default)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the GPU configs use them)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (last stdout line)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "colo-bench"))
    ap.add_argument("--compare", action="append", default=[], metavar="KEY=A,B",
                    help="run the phases at each value of these engine settings (repeatable: every combination)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for every phase")
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args(argv)
    if min(args.prompts, args.n, args.prompt_len, args.max_tokens, args.reps, args.warmup_tokens) < 1:
        ap.error("--prompts, --n, --prompt-len, --max-tokens, --reps and --warmup-tokens must be >= 1")
    if not 0 < args.standalone_fraction <= 1:
        ap.error("--standalone-fraction must be in (0, 1]")
    compared = {}
    for spec in args.compare:
        key, _, values = spec.partition("=")
        vals = [v for v in values.split(",") if v]
        if "." not in key or len(vals) != 2 or vals[0] == vals[1] or key in compared:
            ap.error(f"--compare {spec}: KEY=A,B with a dotted config key, once, and two different values")
        compared[key] = vals
    if any(o.partition("=")[0] in compared for o in args.overrides):
        ap.error("--compare sets its keys itself; drop their overrides")
    args.compare = compared
    args.phases = [p for p in args.phases.split(",") if p]
    args.toggles = {"all": list(TOGGLES), "none": []}.get(args.toggles, [t for t in args.toggles.split(",") if t])
    bad = [p for p in args.phases if p not in PHASES] + [t for t in args.toggles if t not in TOGGLES]
    if bad or not args.phases:
        ap.error(f"unknown or no phases/toggles {bad}; phases: {', '.join(PHASES)}; toggles: {', '.join(TOGGLES)}")
    return args


def prompts(args: argparse.Namespace, call: int) -> list[list[int]]:
    """Call `call`'s prompts: the same for every variant and phase, new for every call."""
    rng = random.Random(f"rollout:{call}")
    return [[rng.randrange(3, TOKEN_ID_LIMIT) for _ in range(args.prompt_len)] for _ in range(args.prompts)]


def call_seed(call: int) -> int:
    return 1000 * call


def budget(args: argparse.Namespace, call: int) -> int:
    """Call `call`'s max_tokens: the warm-up (call 0) is short."""
    return min(args.max_tokens, args.warmup_tokens) if call == 0 else args.max_tokens


def requests(args: argparse.Namespace, call: int) -> list[tuple[list[int], int, int]]:
    """(prompt ids, seed, imposed length) of every sample of call `call`, in colo's order (prompt i's n samples
    together, seeded as Generation.fresh seeds them; lengths as colo.bench.engines.LengthEngine draws them)."""
    from colo.bench.lengths import LengthModel

    model, base = LengthModel.of(args.lengths), call_seed(call)
    return [(p, base + i * args.n + j, model.length(base + i * args.n + j, budget(args, call), p))
            for i, p in enumerate(prompts(args, call)) for j in range(args.n)]


def make_config(args: argparse.Namespace, model_dir: str, standalone: bool = False) -> Any:
    from colo.config import load_config, validate
    from colo.plan.resolve import resolve

    cfg = load_config(args.config, args.overrides)  # + COLO_* env (COLO_VLLM_GPU_FRACTION, ...), then the overrides
    cfg.model.path, cfg.model.dummy_weights = model_dir, args.preset != "tiny"
    cfg.placement.device, cfg.placement.num_gpus = args.device, 1
    cfg.rollout.max_model_len = args.prompt_len + args.max_tokens
    cfg.rollout.max_tokens, cfg.rollout.n = args.max_tokens, args.n
    cfg.rollout.enforce_eager = args.enforce_eager or args.device == "cpu" or cfg.rollout.enforce_eager
    cfg.rollout.kv_cache_mb = 1024
    if standalone:  # one engine on a GPU of its own: the disaggregated engine, with no trainer started
        cfg.placement.mode, cfg.placement.num_gpus, cfg.placement.trainer_gpus = "disaggregated", 2, 1
        cfg.placement.vllm_gpu_fraction = args.standalone_fraction
    cfg.run.dir = str(Path(args.workdir) / f"rollout-run-{args.phase}")  # the engines' logs (colo.run.logs)
    validate(cfg, check_resources=False)
    return resolve(cfg).cfg  # as colo.launch hands it to the actors: no `auto` left


def best(runs: list[tuple[float, int]]) -> dict:
    """The fastest of (seconds, tokens) calls."""
    s, n = min(runs, key=lambda r: r[0] / max(r[1], 1))
    return {"seconds": s, "output_tokens": n, "tokens_per_s": n / s, "all_tokens_per_s": [t / x for x, t in runs]}


# ------------------------------------------------------------------------------------------------ vllm alone

def vllm_kwargs(cfg: Any) -> tuple[dict[str, Any], str | None]:
    """(vllm.LLM's arguments, the fused-MoE tiles it runs): the engine settings of colo's engine
    (colo.rollout.engine.Engine._llm_kwargs) that are not colo's own machinery (its Ray executor, sleep mode, worker
    extension, processed log-probs, routing capture); its environment (FP8 kernels, the MoE tiles) set here."""
    from colo.rollout.quant import engine_quantization

    m, ro = cfg.model, cfg.rollout
    kw: dict[str, Any] = dict(model=m.path, dtype=m.dtype, seed=cfg.run.seed, enforce_eager=ro.enforce_eager,
                              max_model_len=ro.max_model_len)
    if m.dummy_weights:
        kw["load_format"] = "dummy"
    config_json = json.loads((Path(m.path) / "config.json").read_text())
    quant, env = engine_quantization(cfg, config_json)
    os.environ.update(env)
    kw.update(quant)
    tiles = None
    if cfg.placement.device == "cuda":  # one engine, no expert parallelism: as colo's engine on one GPU
        from colo.rollout.moe_tuning import MoeLookup, cuda_device_name, moe_config_env

        lookup = MoeLookup.of(config_json, ro.quantization == "fp8", 1, 1)
        moe_env, tiles = moe_config_env(cfg, lookup, cuda_device_name(), os.environ.get("VLLM_TUNED_CONFIG_FOLDER"))
        os.environ.update(moe_env)
    if cfg.placement.device == "cpu":  # colo's CPU engine: its KV room, no chunked prefill (seeded CPU generators)
        kw.update(kv_cache_memory_bytes=ro.kv_cache_mb * 2**20, enable_chunked_prefill=False)
    else:
        kw["gpu_memory_utilization"] = cfg.placement.vllm_gpu_fraction
    return kw, tiles


def cpu_env(enforce_eager: bool) -> None:
    """What colo's CPU engine sets before vLLM starts (colo.rollout.engine.Engine._setup_cpu_env), for the same
    threads and the same in-process engine core."""
    import torch

    if enforce_eager:
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
        torch._dynamo.config.disable = True
    cores = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(len(cores))
    os.environ.update(OMP_NUM_THREADS=str(len(cores)), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)))


def progress(phase: str, variant: str, k: int, dt: float, tokens: int) -> None:
    """One stderr line per call (k 0 is the warm-up): a run cut short by its time limit still shows what it timed."""
    print(f"[bench.rollout] {phase} {variant} call {k}: {tokens} tokens in {dt:.2f} s, {tokens / dt:.0f} tok/s",
          file=sys.stderr, flush=True)


def run_vllm(args: argparse.Namespace, cfg: Any) -> dict:
    """The vllm phase: plain LLM.generate, then colo's request settings and scheduling on the same engine."""
    if args.device == "cpu":
        cpu_env(cfg.rollout.enforce_eager)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from colo.rollout.engine_loop import Sampling, run
    from colo.rollout.generation import fresh_samples
    from colo.rollout.turns import Budget

    t0 = time.perf_counter()
    kwargs, tiles = vllm_kwargs(cfg)
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    print(f"[bench.rollout] vllm: engine started in {start_s:.0f} s", file=sys.stderr, flush=True)
    variants = ["plain"] + [v for t in args.toggles for v in NEEDS.get(t, ())]

    def params(length: int, seed: int, variant: str) -> Any:
        logprobs, detok, seeded, _ = VARIANTS[variant]
        return SamplingParams(n=1, max_tokens=length, min_tokens=length, ignore_eos=True, temperature=1.0, top_p=1.0,
                              logprobs=0 if logprobs else None, detokenize=detok, seed=seed if seeded else None)

    def call(k: int, variant: str) -> tuple[float, int]:
        reqs = requests(args, k)
        t = time.perf_counter()
        if VARIANTS[variant][3]:  # colo's engine loop over colo's samples, their lengths imposed as LengthEngine does
            samples = fresh_samples([p for p, _, _ in reqs[::args.n]], args.n, call_seed(k))
            lengths = {seed: length for _, seed, length in reqs}
            run(llm.llm_engine, samples, Budget(budget(args, k), 1, cfg.rollout.max_model_len), Sampling(1.0, 1.0, 0),
                lambda s, ask: params(lengths[s.seed], ask.seed, variant))
            got = [len(s.response_ids) for s in samples]
        else:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _, _ in reqs],
                                [params(length, seed, variant) for _, seed, length in reqs], use_tqdm=False)
            got = [len(o.outputs[0].token_ids) for o in outs]
        dt = time.perf_counter() - t
        if got != [length for _, _, length in reqs]:
            raise RuntimeError(f"vllm phase, {variant}: {sum(got)} tokens generated, {sum(r[2] for r in reqs)} imposed")
        progress("vllm", variant, k, dt, sum(got))
        return dt, sum(got)

    call(0, "plain")  # warm-up: kernels compiled for the batch's shapes
    runs: dict[str, list] = {v: [] for v in variants}
    for k in range(1, args.reps + 1):
        for v in variants:
            runs[v].append(call(k, v))
    return {"phase": "vllm", "start_s": start_s, "vllm_fraction": cfg.placement.vllm_gpu_fraction, "moe_configs": tiles,
            "kv_cache_tokens": int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks or 0)
            * int(llm.llm_engine.vllm_config.cache_config.block_size), **{v: best(r) for v, r in runs.items()}}


# ---------------------------------------------------------------------------------------------------- colo

def colo_call(engines: list, args: argparse.Namespace, k: int, routing: bool, captures: bool = True
              ) -> tuple[float, int]:
    """Engine.generate of call k's samples through Ray, as a sync step sends them (one engine). `captures`: the
    engine records routing (a MoE model), so a call that asks for it must get every sample's rows."""
    import ray

    from colo.rollout.generation import Generation

    reqs = requests(args, k)
    g = Generation.fresh([p for p, _, _ in reqs[::args.n]], args.n, budget(args, k), 1.0, 1.0, call_seed(k), routing)
    t = time.perf_counter()
    arrays, _ = ray.get(engines[0].generate.remote(g))
    dt = time.perf_counter() - t
    samples = arrays.unpack()
    short = sum(s.complete_routing() is None for s in samples) if routing and captures else 0
    if short:  # a capture that kept nothing would be timed as free
        raise RuntimeError(f"colo's engine returned {short} of {len(samples)} samples without every routing row "
                           "asked for: this rollout.routing_capture kept none, so its speed is no measurement")
    got = [len(s.response_ids) for s in samples]
    if got != [length for _, _, length in reqs]:
        raise RuntimeError(f"colo's engine generated {sum(got)} tokens, vLLM's requests impose "
                           f"{sum(r[2] for r in reqs)} (the two sides' lengths must be the same requests')")
    progress("colo", "routing" if routing else "no_routing", k, dt, sum(got))
    return dt, sum(got)


def run_colo(args: argparse.Namespace, cfg: Any, phase: str) -> dict:
    """The colocated or standalone phase: colo's engine (LengthEngine: lengths imposed) through Ray."""
    import ray

    from colo.bench.engines import LengthEngine
    from colo.bench.lengths import LengthModel
    from colo.cluster.actors import start_cluster
    from colo.cluster.placement import init_ray, plan_placement, scheduling
    from colo.config import to_dict
    from colo.host.net import free_port

    plan = plan_placement(cfg)
    init_ray(plan, log_to_driver=not args.json)
    out: dict[str, Any] = {"phase": phase, "vllm_fraction": cfg.placement.vllm_gpu_fraction}
    try:
        t0 = time.perf_counter()
        if phase == "standalone":
            from ray.util.placement_group import placement_group

            pg = placement_group([plan.bundle()], strategy="STRICT_PACK")  # the engine's only: no trainer started
            ray.get(pg.ready(), timeout=300)
            engines = [ray.remote(LengthEngine).options(num_gpus=0 if args.device == "cuda" else 1, num_cpus=0,
                                                        scheduling_strategy=scheduling(pg))
                       .remote(to_dict(cfg), 0, 1, free_port())]
            ray.get(engines[0].ready.remote())
        else:
            c = start_cluster(cfg, plan, engine_cls=LengthEngine)
            engines = c.engines
        model = LengthModel.of(args.lengths)
        ray.get([e.set_lengths.remote(model.kind, model.rho) for e in engines])
        out["start_s"] = time.perf_counter() - t0
        info = ray.get(engines[0].ready.remote())
        out["moe_configs"], out["routing_capture"] = info["moe_configs"], info["routing"]  # tiles: the vllm phase's?
        call = functools.partial(colo_call, engines, args, captures=info["routing"] is not None)
        runs: dict[str, list] = {"colo": [], **({"no_routing": []} if "routing" in args.toggles else {})}
        if phase == "colocated" and "wake_sleep" in args.toggles:  # the engine as it started, before any cycle
            call(0, True)  # warm-up
            runs["before_cycle"] = [call(k, True) for k in range(1, args.reps + 1)]
        if phase == "colocated":
            t = time.perf_counter()
            ray.get([e.sleep.remote(2) for e in engines])
            ray.get([e.wake_up.remote(["weights"]) for e in engines])
            reports = c.trainer_group.sync_weights()
            ray.get([tr.offload.remote() for tr in c.trainers])
            ray.get([e.wake_up.remote(["kv_cache", "scheduling"]) for e in engines])
            out.update(weight_cycle_s=time.perf_counter() - t, sync_verified=all(r["verified"] for r in reports),
                       memory_after_offload=ray.get(c.trainers[0].memory.remote()))
        call(0, True)  # warm-up (after the cycle too: the same footing as before it)
        for k in range(1, args.reps + 1):
            runs["colo"].append(call(k, True))
            if "no_routing" in runs:
                runs["no_routing"].append(call(k, False))
        out.update({v: best(r) for v, r in runs.items() if r})
    finally:
        ray.shutdown()
    return out


# ------------------------------------------------------------------------------------------- the comparison

def where(vllm: dict, colo: dict) -> dict:
    """Each toggle's factor (module docstring): a variant's tokens/s over its reference's."""
    tps = {k: v["tokens_per_s"] for k, v in vllm.items() if isinstance(v, dict) and "tokens_per_s" in v}
    out: dict[str, float] = {}

    def ratio(name: str, a: float | None, b: float | None) -> None:
        if a and b:
            out[name] = a / b

    plain, colo_tps = tps["plain"], colo["colo"]["tokens_per_s"]
    ratio("logprobs", tps.get("logprobs"), plain)  # asking the sampled token's log-prob
    ratio("detokenize", tps.get("no_detokenize"), plain)  # colo's detokenize=False
    ratio("seeds", plain, tps.get("no_seeds"))  # a seeded generator per request
    ratio("params", tps.get("colo_params"), plain)  # colo's request settings together
    ratio("scheduling", tps.get("colo_loop"), tps.get("colo_params"))  # colo's engine loop against LLM.generate
    ratio("engine", colo_tps, tps.get("colo_loop"))  # colo's engine actor, colocated, against its loop in vLLM alone
    ratio("routing", colo_tps, colo.get("no_routing", {}).get("tokens_per_s"))  # R3 capture
    ratio("wake_sleep", colo_tps, colo.get("before_cycle", {}).get("tokens_per_s"))  # the weight cycle's after-effect
    if "engine" in out:
        out["rest"] = out["engine"] / out.get("routing", 1.0) / out.get("wake_sleep", 1.0)
    return out


def run_child(phase: str, argv: list[str]) -> dict:
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


def run_phase(args: argparse.Namespace) -> dict:
    from colo.models.tiny import make_tiny_model

    model_dir = str(make_tiny_model(Path(args.workdir) / f"{args.preset}-s0", args.preset, 0))
    cfg = make_config(args, model_dir, standalone=args.phase == "standalone")
    return run_vllm(args, cfg) if args.phase == "vllm" else run_colo(args, cfg, args.phase)


def without_compare(argv: list[str]) -> list[str]:
    """argv less its --compare flags (a child runs one setting of them, given as overrides)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--compare":
            skip = True
        elif not a.startswith("--compare="):
            out.append(a)
    return out


def throughput(cell: dict) -> dict:
    """A cell's headline figures: vLLM alone's plain calls, else colo's colocated ones."""
    return cell["vllm"]["plain"] if "vllm" in cell else cell["colocated"]["colo"]


def per_call(a: dict, b: dict) -> dict:
    """A over B per call index (the same requests on both sides): the median and spread of the paired ratios."""
    from colo.bench.spread import spread

    return spread(x / y for x, y in zip(a["all_tokens_per_s"], b["all_tokens_per_s"]))


def compare_grid(args: argparse.Namespace, argv: list[str]) -> dict:
    """--compare: the phases at every combination of the compared values (module docstring), and per key A over B."""
    import itertools

    keys = list(args.compare)
    cells = []
    for values in itertools.product(*(args.compare[k] for k in keys)):
        setting = dict(zip(keys, values))
        child = without_compare(argv) + [f"{k}={v}" for k, v in setting.items()]
        cells.append({"settings": setting, **{p: run_child(p, child) for p in PHASES if p in args.phases}})
        print(f"[bench.rollout] {setting}: {throughput(cells[-1])['tokens_per_s']:.0f} tok/s", file=sys.stderr,
              flush=True)
    ratios: dict[str, list] = {}
    for key, (a, b) in args.compare.items():
        for ca in (c for c in cells if c["settings"][key] == a):
            cb = next(c for c in cells if c["settings"][key] == b and
                      all(c["settings"][k] == v for k, v in ca["settings"].items() if k != key))
            ta, tb = throughput(ca), throughput(cb)
            paired = per_call(ta, tb)
            ratios.setdefault(key, []).append({
                "at": {k: v for k, v in ca["settings"].items() if k != key}, "ratio": paired["median"],
                "per_rep": paired, "ratio_best": ta["tokens_per_s"] / tb["tokens_per_s"]})
    return {"cells": cells, "compare": ratios}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.phase:
        print(json.dumps(run_phase(args), sort_keys=True), flush=True)
        return 0
    if args.compare:
        result = {"bench": "rollout", **compare_grid(args, argv), "preset": args.preset, "device": args.device,
                  "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                  "lengths": args.lengths, "reps": args.reps, "overrides": args.overrides,
                  "date": time.strftime("%Y-%m-%d")}
        if args.json:
            print(json.dumps(result, sort_keys=True), flush=True)
        else:
            for key, rows in result["compare"].items():
                for r in rows:
                    q = r["per_rep"]
                    print(f"{key} {'/'.join(args.compare[key])} at {r['at']}: {r['ratio']:.3f}x, median of {q['n']} "
                          f"reps ({q['min']:.3f}-{q['max']:.3f}; best calls {r['ratio_best']:.3f}x)", flush=True)
        return 0
    got = {p: run_child(p, argv) for p in PHASES if p in args.phases}
    result: dict[str, Any] = {"bench": "rollout", **got, "preset": args.preset, "device": args.device,
                              "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len,
                              "max_tokens": args.max_tokens, "lengths": args.lengths, "reps": args.reps,
                              "enforce_eager": args.enforce_eager, "date": time.strftime("%Y-%m-%d")}
    if "colocated" in got and "vllm" in got:
        result["vs_vllm_per_call"] = per_call(got["colocated"]["colo"], got["vllm"]["plain"])
        result["vs_vllm"] = result["vs_vllm_per_call"]["median"]
        result["vs_vllm_best"] = got["colocated"]["colo"]["tokens_per_s"] / got["vllm"]["plain"]["tokens_per_s"]
        result["where"] = where(got["vllm"], got["colocated"])
    if "colocated" in got and "standalone" in got:
        result["vs_standalone"] = got["colocated"]["colo"]["tokens_per_s"] / got["standalone"]["colo"]["tokens_per_s"]
    if args.json:
        print(json.dumps(result, sort_keys=True), flush=True)
    else:
        print(f"colo.bench.rollout {args.preset} on {args.device}: {args.prompts} prompts x n={args.n}, "
              f"{args.prompt_len}+{args.max_tokens} tokens ({args.lengths} lengths)", flush=True)
        for p, r in got.items():
            main_key = "plain" if p == "vllm" else "colo"
            print(f"{p:<11} (vLLM fraction {r['vllm_fraction']:g}): {r[main_key]['tokens_per_s']:.0f} output tok/s",
                  flush=True)
        if "vs_vllm_per_call" in result:
            q = result["vs_vllm_per_call"]
            print(f"vs_vllm: {q['median']:.3f}, median of {q['n']} paired calls ({q['min']:.3f}-{q['max']:.3f}); "
                  f"best calls {result['vs_vllm_best']:.3f}, split in `where`:", flush=True)
        if "vs_standalone" in result:
            print(f"vs_standalone: {result['vs_standalone']:.3f}", flush=True)
        for k, v in result.get("where", {}).items():
            print(f"  {k:<11} x{v:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
