"""Attention over packed rows of long-tail samples: colo's kernels against per-sample SDPA as torch picks it.

    python -m tools.experiments.packed_attention --device cuda --json       # Qwen3-30B-A3B's heads, 8192-token rows
    python -m tools.experiments.packed_attention --device cpu --tokens 512 --heads 4 --kv-heads 2 --head-dim 64 --reps 2

Each rep draws a new packed row: samples of prompt (--prompt-len) + a response of colo.bench.step's long-tail
length (median a quarter of --max-tokens) until --tokens, so nearly every sample has a length no earlier call
had, as in training. Each variant runs forward + backward (bf16 on CUDA, float32 on CPU) on the same rows:
    per_sample_default   SDPA per sample, torch's own backend choice (cuDNN first on Hopper): colo before d8d27e4
    per_sample           colo.trainer.attention.per_sample: SDPA per sample, cuDNN left out (CUDA)
    varlen               colo.trainer.attention.varlen: one flash-attention varlen call per row (CUDA, torch >= 2.10)
    padded               the padded path's layout for the same samples: one row each, padded to the longest, with
                         a causal key-padding mask, one SDPA call (its slots / the packed row's: `padded_slots_ratio`)
The JSON line holds each variant's median ms per row (first rep dropped), `vs_default` (per_sample_default's
time / the variant's), and each variant's largest |difference| from per_sample_default in the output and in
the gradients of q, k and v. Arguments are parsed before torch is imported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.experiments.packed_attention",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per packed row (the micro-batch budget)")
    ap.add_argument("--heads", type=int, default=32, help="query heads (Qwen3-30B-A3B: 32)")
    ap.add_argument("--kv-heads", type=int, default=4, help="key/value heads (Qwen3-30B-A3B: 4)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4096, help="longest response; median a quarter of it")
    ap.add_argument("--reps", type=int, default=6, help="rows timed per variant (the first is dropped)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (last stdout line)")
    args = ap.parse_args(argv)
    if min(args.tokens, args.heads, args.kv_heads, args.head_dim, args.prompt_len, args.max_tokens, args.reps) < 1:
        ap.error("every size and --reps must be >= 1")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    return args


def row_lengths(rep: int, args: argparse.Namespace) -> list[int]:
    """Sample lengths filling one packed row of args.tokens (the last one cut to fit), a function of `rep`."""
    from colo.bench.lengths import response_length

    out: list[int] = []
    seed = rep * 100_003
    while sum(out) < args.tokens:
        seed += 1
        out.append(min(args.prompt_len + response_length(seed, args.max_tokens), args.tokens - sum(out)))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from colo.trainer.attention import _varlen_attn, per_sample, varlen

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("colo: error: --device cuda but torch sees no GPU; fix: run on a GPU host or pass --device cpu",
              file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    scale = d ** -0.5

    def padded(q, k, v, bounds):
        """The padded path: each sample its own row of the longest length, a boolean key mask, one call."""
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        T = max(lengths)
        def rows(t):
            return torch.stack([torch.nn.functional.pad(t[0, :, s:e], (0, 0, 0, T - (e - s)))
                                for s, e in zip(bounds[:-1], bounds[1:])])  # (b, heads, T, d)
        ok = torch.arange(T, device=q.device)[None, :] < torch.tensor(lengths, device=q.device)[:, None]  # (b, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None, None] & ok[:, None, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(rows(q), rows(k), rows(v), attn_mask=mask,
                                                               scale=scale, enable_gqa=hk != h)
        return torch.cat([out[i, :, :n] for i, n in enumerate(lengths)], dim=1)[None].transpose(1, 2)

    variants = {"per_sample_default": lambda q, k, v, b: per_sample(q, k, v, b, scale, cudnn=True)}
    if dev.type == "cuda":
        variants["per_sample"] = lambda q, k, v, b: per_sample(q, k, v, b, scale)
        if _varlen_attn() is not None:
            variants["varlen"] = lambda q, k, v, b: varlen(q, k, v, b, scale)
    variants["padded"] = padded

    def sync() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    times: dict[str, list[float]] = {name: [] for name in variants}
    diffs: dict[str, float] = {name: 0.0 for name in variants}
    slots = [0, 0]
    for rep in range(args.reps):
        lengths = row_lengths(rep, args)
        bounds = tuple([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))])
        slots[0] += len(lengths) * max(lengths)
        slots[1] += args.tokens
        g = torch.Generator(device=dev).manual_seed(rep)
        q0 = torch.randn(1, h, args.tokens, d, device=dev, dtype=dtype, generator=g)
        k0 = torch.randn(1, hk, args.tokens, d, device=dev, dtype=dtype, generator=g)
        v0 = torch.randn(1, hk, args.tokens, d, device=dev, dtype=dtype, generator=g)
        grad = torch.randn(1, args.tokens, h, d, device=dev, dtype=dtype, generator=g)
        ref = None
        for name, fn in variants.items():
            q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
            t0 = sync()
            out = fn(q, k, v, bounds)  # (1, N, h, d)
            out.backward(grad)
            times[name].append(sync() - t0)
            got = [out.detach().float()] + [t.grad.float() for t in (q, k, v)]
            if ref is None:
                ref = got
            else:
                diffs[name] = max(diffs[name], *(float((a - b).abs().max()) for a, b in zip(got, ref)))
    runs = {name: statistics.median(ts[1:] if len(ts) > 1 else ts) * 1e3 for name, ts in times.items()}
    base = runs["per_sample_default"]
    result = {"device": args.device, "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "tokens": args.tokens,
              "heads": h, "kv_heads": hk, "head_dim": d, "reps": args.reps, "ms": runs,
              "vs_default": {name: base / ms for name, ms in runs.items()}, "max_abs_diff": diffs,
              "padded_slots_ratio": slots[0] / slots[1], "date": time.strftime("%Y-%m-%d")}
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for name, ms in runs.items():
            print(f"{name:>20}: {ms:9.2f} ms per row, {base / ms:5.2f}x per_sample_default, "
                  f"max |diff| {diffs[name]:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
