"""The long-tail response lengths the step benchmarks impose (colo.bench.step's engines, colo.bench.packed_attention's
packed rows); torch-free, so a bench can draw them without importing vLLM or Ray.

    response_length(seed, max_tokens)                                  # iid: a function of the sample's seed
    LengthModel("per-prompt", rho=0.7).length(seed, max_tokens, prompt_ids)   # samples of one prompt correlate

Both models have the same marginal distribution: log L normal with mean log(median_frac * max_tokens) and the
sigma that puts tail_frac of the draws past max_tokens (cut there). "iid" draws every sample's z from its own seed;
"per-prompt" writes z = sqrt(rho) * z_prompt + sqrt(1 - rho) * z_sample, z_prompt a function of the prompt's token
ids only (prompt_key), so every sample of one prompt shares it wherever and whenever it is generated (both variants of
a --compare run, a sample carried to a later step by loop.mode=async), and corr(log L_i, log L_j) = rho for two
samples of one prompt (before the cut at max_tokens).
"""
from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

LENGTH_MODELS = ("iid", "per-prompt", "fixed")  # fixed: every response max_tokens long
DEFAULT_RHO = 0.7
"""per-prompt's default correlation of log lengths within a prompt: an assumption, not a measurement. Response lengths
in RL on reasoning tasks are driven mostly by the prompt (a hard problem gets long answers from all its samples, an
easy one short ones); 0.7 puts 70% of the log-length variance between prompts and 30% between a prompt's samples.
rho = 0 is iid again (the same draws), rho = 1 gives all samples of a prompt one length."""


def _sigma(median_frac: float, tail_frac: float) -> float:
    return math.log(1.0 / median_frac) / NormalDist().inv_cdf(1.0 - tail_frac)


def response_length(seed: int, max_tokens: int, median_frac: float = 0.25, tail_frac: float = 0.05) -> int:
    """A long-tail response length in [1, max_tokens], a pure function of `seed`: lognormal with median
    median_frac * max_tokens and sigma chosen so that a tail_frac share would run past max_tokens (those
    stop there, as truncated responses do). Defaults: median max/4, 5% at the limit."""
    x = random.Random(seed).lognormvariate(math.log(median_frac * max_tokens), _sigma(median_frac, tail_frac))
    return max(1, min(max_tokens, round(x)))


def prompt_key(prompt_ids: Sequence[int]) -> int:
    """The per-prompt model's key of a prompt: a 64-bit hash (blake2b) of its token ids. A pure function of the
    prompt itself, not of where it sits in a batch, which engine serves it, or at which step a carried sample of
    it resumes."""
    h = hashlib.blake2b(",".join(str(int(t)) for t in prompt_ids).encode(), digest_size=8, person=b"colo-len")
    return int.from_bytes(h.digest(), "little")


def prompt_z(key: int) -> float:
    """z_prompt: a standard normal draw that is a pure function of the prompt's key."""
    return random.Random(f"prompt:{key}").normalvariate(0.0, 1.0)  # a str seed: its own stream, not a sample's


@dataclass(frozen=True)
class LengthModel:
    """How colo.bench.engines.LengthEngine draws each sample's length (colo.bench.step --lengths, --length-rho)."""

    kind: str = "iid"
    rho: float = 0.0
    median_frac: float = 0.25
    tail_frac: float = 0.05

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_MODELS:
            raise ValueError(f"length model {self.kind!r}: one of {LENGTH_MODELS}")
        if not 0.0 <= self.rho <= 1.0:
            raise ValueError(f"rho {self.rho}: a correlation in [0, 1]")
        if self.kind != "per-prompt" and self.rho != 0.0:
            raise ValueError("rho applies to the per-prompt model only")

    @classmethod
    def of(cls, kind: str, rho: float | None = None) -> "LengthModel":
        """The model a bench's --lengths / --length-rho name: rho None is 0 for iid, DEFAULT_RHO for per-prompt."""
        return cls(kind, (DEFAULT_RHO if kind == "per-prompt" else 0.0) if rho is None else rho)

    def length(self, seed: int, max_tokens: int, prompt_ids: Sequence[int]) -> int:
        """The imposed length of the sample with request seed `seed` of the prompt `prompt_ids`, in [1, max_tokens]."""
        if self.kind == "fixed":
            return max_tokens
        if self.kind == "iid":
            return response_length(seed, max_tokens, self.median_frac, self.tail_frac)
        z_sample = random.Random(seed).normalvariate(0.0, 1.0)  # iid's z (lognormvariate draws this one normal)
        z = math.sqrt(self.rho) * prompt_z(prompt_key(prompt_ids)) + math.sqrt(1.0 - self.rho) * z_sample
        x = math.exp(math.log(self.median_frac * max_tokens) + _sigma(self.median_frac, self.tail_frac) * z)
        return max(1, min(max_tokens, round(x)))

    def describe(self) -> dict:
        """What a figure's JSON records about its workload."""
        return {"model": self.kind, "rho": self.rho, "median_frac": self.median_frac, "tail_frac": self.tail_frac}
