"""Trainer vs engine: how far the trainer's log-probs of the sampled tokens are from the engine's.

    sums = logprob_gap(old, rollout, mask)       # per rank; the worker sums (max for "max") over ranks
    metrics = gap_metrics(sums)                   # logprob_diff/mean, /max, /kl

`old` is the trainer's recompute before the update, `rollout` what vLLM reported while sampling, both
log p(token t | tokens < t) at the same temperature (B, T). The samples come from the engine's policy mu,
so with r = pi/mu = exp(old - rollout) on each sampled token, E[r - 1 - log r] is the k3 estimate of
KL(mu || pi): unbiased, never negative (Schulman, "Approximating KL divergence"). It is 0 only when the
two agree on every sampled token, which is what routing replay pushes toward.
"""
from __future__ import annotations

import torch


def logprob_gap(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Sums over `mask` (B, T) of |old - rollout| and the k3 term, the token count, and the largest |gap|."""
    m = mask.float()
    d = (old.float() - rollout.float()) * m  # (B, T) log r, 0 off the mask
    k3 = (torch.exp(d) - 1.0 - d) * m
    return {"gap_abs": float(d.abs().sum()), "gap_k3": float(k3.sum()), "gap_tokens": float(m.sum()),
            "gap_max": float(d.abs().max()) if d.numel() else 0.0}


def gap_metrics(tot: dict[str, float]) -> dict[str, float]:
    """Global sums (and max) -> the logged metrics."""
    n = max(tot["gap_tokens"], 1.0)
    return {"logprob_diff/mean": tot["gap_abs"] / n, "logprob_diff/max": tot["gap_max"],
            "logprob_diff/kl": tot["gap_k3"] / n}
