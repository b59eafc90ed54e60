"""A ratio with its spread: the statistics of colo.bench.step's repeated comparisons and of colo.bench.combine.

    spread([12.0, 9.5, 14.1])                       # {"n", "median", "q1", "q3", "min", "max"}
    blocks = [block(records, variant="async", repeat=0, gpus=1), ...]   # one per variant and repeat
    compare(blocks, "async", "sync")                # the ratio per repeat, its median and spread, per-step figures

One call of a few steps per mode cannot tell 1.3x from 1.5x (issue 47: the async step's tokens/s ranged from 11k to
24k over 8 measured steps, because each step trains whichever whole groups finished, some of them long). So the
bench runs the two variants in blocks on one cluster (--repeats), A B, B A, A B, ... after both warm-ups, and a
ratio is taken per repeat: A's block against the B block next to it, each block's throughput its tokens over its
seconds (a step that trains more tokens counts for more, as in a long run). Slow drifts of the machine (a compile
still finishing, another process on the host) then hit both sides of a pair, and the alternating order cancels a
steady one (on CPU the first block measured after the warm-ups ran 11-18% slower per trained token than the rest,
whichever variant it was). The ratio is reported as the median over the pairs with its
min, max and quartiles, and `separated` says whether the whole spread lies on one side of 1: a claim "A is faster
than B" stands when the slowest pair still says so. colo.bench.combine pools the pairs of several calls (several
device sessions) the same way. Plain Python: no torch, no Ray.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile of xs by linear interpolation between order statistics (numpy's default, 'linear')."""
    if not xs:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    s = sorted(float(x) for x in xs)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(xs: Iterable[float]) -> dict[str, float]:
    """{"n", "median", "q1", "q3", "min", "max"} of xs (all NaN-free); n 0 gives only {"n": 0}."""
    v = [float(x) for x in xs]
    if any(math.isnan(x) for x in v):
        raise ValueError("spread of a NaN")
    if not v:
        return {"n": 0}
    return {"n": len(v), "median": quantile(v, 0.5), "q1": quantile(v, 0.25), "q3": quantile(v, 0.75),
            "min": min(v), "max": max(v)}


def block(records: Sequence[dict], variant: Any, repeat: int, gpus: int) -> dict:
    """One block of measured steps of one variant (colo.loop.rl_step records with the bench's keys): its token
    and second totals, its throughput (tokens / seconds / GPUs) and each step's, and the train phase per token."""
    tokens = sum(float(m["bench/tokens"]) for m in records)
    step_s = sum(float(m["timing/step_s"]) for m in records)
    train_s = sum(float(m["timing/train_s"]) for m in records)
    return {"variant": variant, "repeat": repeat, "gpus": gpus, "steps": len(records), "tokens": tokens,
            "step_s": step_s,
            "train_s": train_s, "rollout_s": sum(float(m["timing/rollout_s"]) for m in records),
            "tokens_per_s_per_gpu": tokens / step_s / gpus if step_s > 0 else 0.0,
            "train_s_per_mtok": 1e6 * train_s / tokens if tokens > 0 else 0.0,
            "step_tokens_per_s_per_gpu": [float(m["bench/tokens"]) / float(m["timing/step_s"]) / gpus
                                          for m in records],
            "step_train_s": [float(m["timing/train_s"]) for m in records],
            "step_tokens": [float(m["bench/tokens"]) for m in records]}


def pairs(blocks: Sequence[dict], a: Any, b: Any) -> list[tuple[dict, dict]]:
    """(A's block, B's block) per repeat, in repeat order; a repeat missing either side is left out (a call that
    ran out of time mid-repeat)."""
    by = {(bl["variant"], bl.get("call", 0), bl["repeat"]): bl for bl in blocks}
    keys = sorted({(c, r) for v, c, r in by if v == a} & {(c, r) for v, c, r in by if v == b})
    return [(by[(a, c, r)], by[(b, c, r)]) for c, r in keys]


def compare(blocks: Sequence[dict], a: Any, b: Any) -> dict:
    """A over B from their blocks: the throughput ratio of each repeat's pair and its spread, the train phase's
    seconds per token (B's over A's: above 1, A trains the same tokens faster), and every measured step's
    throughput of each side. `separated`: every pair's ratio lies on the same side of 1 (None with no pairs)."""
    got = pairs(blocks, a, b)
    ratios = [x["tokens_per_s_per_gpu"] / y["tokens_per_s_per_gpu"] for x, y in got
              if y["tokens_per_s_per_gpu"] > 0]
    train = [y["train_s_per_mtok"] / x["train_s_per_mtok"] for x, y in got if x["train_s_per_mtok"] > 0]
    steps = {str(v): [t for bl in blocks if bl["variant"] == v for t in bl["step_tokens_per_s_per_gpu"]]
             for v in (a, b)}
    whole = {str(v): _whole([bl for bl in blocks if bl["variant"] == v]) for v in (a, b)}
    out = {"variants": [a, b], "pairs": len(got), "ratio": spread(ratios), "ratios": ratios,
           "train_speedup": spread(train),
           "separated": (min(ratios) > 1.0 or max(ratios) < 1.0) if ratios else None,
           "whole": whole,
           "ratio_of_totals": whole[str(a)] / whole[str(b)] if whole[str(b)] else None,
           "per_step": {k: spread(v) for k, v in steps.items()}}
    sa, sb = out["per_step"][str(a)], out["per_step"][str(b)]
    out["ratio_of_step_medians"] = sa["median"] / sb["median"] if sa["n"] and sb["n"] and sb["median"] else None
    return out


def _whole(blocks: Sequence[dict]) -> float:
    """Tokens / seconds / GPUs over all of a variant's blocks (of one call, or pooled over calls on as many GPUs)."""
    secs = sum(bl["step_s"] for bl in blocks)
    return sum(bl["tokens"] for bl in blocks) / secs / blocks[0]["gpus"] if secs > 0 else 0.0


def describe(stats: dict) -> str:
    """One line: the median ratio, its spread and whether the spread separates the variants."""
    a, b = stats["variants"]
    r = stats["ratio"]
    if not r["n"]:
        return f"{a} over {b}: no complete pair of blocks"
    verdict = {True: "every pair on one side of 1", False: "the pairs straddle 1", None: ""}[stats["separated"]]
    return (f"{a} over {b}: median {r['median']:.3f}x over {r['n']} pairs (min {r['min']:.3f}, q1 {r['q1']:.3f}, "
            f"q3 {r['q3']:.3f}, max {r['max']:.3f}; {verdict}); train seconds per token, {b}'s over {a}'s: "
            + (f"{stats['train_speedup']['median']:.3f}x (above 1: {a} trains a token faster)"
               if stats["train_speedup"]["n"] else "n/a"))
