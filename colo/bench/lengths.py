"""The long-tail response lengths the step benchmarks impose (colo.bench.step's engines, colo.bench.packed_attention's
packed rows); torch-free, so a bench can draw them without importing vLLM or Ray."""
from __future__ import annotations


def response_length(seed: int, max_tokens: int, median_frac: float = 0.25, tail_frac: float = 0.05) -> int:
    """A long-tail response length in [1, max_tokens], a pure function of `seed`: lognormal with median
    median_frac * max_tokens and sigma chosen so that a tail_frac share would run past max_tokens (those
    stop there, as truncated responses do). Defaults: median max/4, 5% at the limit."""
    import math
    import random
    from statistics import NormalDist

    sigma = math.log(1.0 / median_frac) / NormalDist().inv_cdf(1.0 - tail_frac)
    x = random.Random(seed).lognormvariate(math.log(median_frac * max_tokens), sigma)
    return max(1, min(max_tokens, round(x)))
