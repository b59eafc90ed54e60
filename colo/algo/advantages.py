"""Group-relative advantages (GRPO).

Each prompt is sampled `group_size` times; a sample's advantage is its reward minus the mean reward
of its group, optionally divided by the group's standard deviation. The group itself is the
baseline, so no value network is needed.

    rewards  (N*G,)  samples of one prompt contiguous: [p0s0, p0s1, ..., p1s0, ...]
    returns  (N*G,)  float32

Invariant: a group whose rewards are all equal (all right, all wrong) carries no signal and gets
exactly 0 advantage, never the float residue of `r - mean(r)` and never 0/0 from std normalization.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from colo.rollout.sample import Sample


def grpo_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_size: int,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages for rewards laid out group by group.

    `std_normalize=False` gives the Dr. GRPO variant (mean-centred only), which does not up-weight
    groups that are nearly unanimous. The std is the unbiased one (torch.std default, as in verl and
    TRL); `eps` guards groups with a tiny but non-zero spread.
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()  # (N*G,)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if r.numel() % group_size != 0:
        raise ValueError(
            f"{r.numel()} rewards do not split into groups of {group_size}; the loop must keep every "
            "sample of a prompt (sort samples by prompt_index before scoring)"
        )
    if not torch.isfinite(r).all():
        bad = int((~torch.isfinite(r)).nonzero()[0])
        raise ValueError(f"reward of sample {bad} is not finite: {r[bad].item()}")
    g = r.view(-1, group_size)  # (N, G)
    adv = g - g.mean(dim=1, keepdim=True)  # (N, G)
    if std_normalize and group_size > 1:
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    flat = (g.amax(dim=1) == g.amin(dim=1)).unsqueeze(1)  # (N, 1) zero-variance groups
    adv = adv.masked_fill(flat, 0.0)
    return adv.flatten()  # (N*G,)


def grpo_advantages_by_index(
    rewards: torch.Tensor | Sequence[float],
    prompt_index: torch.Tensor | Sequence[int],
    std_normalize: bool = True,
    eps: float = 1e-6,
    group_size: int | None = None,
) -> torch.Tensor:
    """Same as `grpo_advantages` for samples in any order, grouped by their `prompt_index`.

    Samples come back from several engines interleaved; this avoids making the caller reorder them.
    Every group must have the same size, `group_size` when given (a missing sample would silently
    change a group's baseline), which is checked.
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()  # (M,)
    idx = torch.as_tensor(prompt_index, dtype=torch.long).flatten()  # (M,)
    if idx.numel() != r.numel():
        raise ValueError(f"{r.numel()} rewards but {idx.numel()} prompt indices")
    if r.numel() == 0:
        return r
    order = torch.argsort(idx, stable=True)  # (M,) groups contiguous
    _, counts = torch.unique_consecutive(idx[order], return_counts=True)
    if (counts != counts[0]).any():
        raise ValueError(f"unequal group sizes {sorted(set(counts.tolist()))}: a sample is missing")
    if group_size is not None and int(counts[0]) != group_size:
        raise ValueError(f"groups of {int(counts[0])} samples, expected {group_size}: samples are missing")
    adv_sorted = grpo_advantages(r[order], int(counts[0]), std_normalize, eps)
    adv = torch.empty_like(adv_sorted)
    adv[order] = adv_sorted
    return adv  # (M,) in the caller's order


def overlong_penalty(
    lengths: torch.Tensor | Sequence[int], max_tokens: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), to add to the rewards: (N,) float32.

        0                                   len <= max_tokens - buffer
        factor * (max_tokens - buffer - len) / buffer   in the buffer: linear from 0 down to -factor
        -factor                             len >= max_tokens (the engine stops there: truncated)

    A response that ran into the length limit has no answer to score, yet its reward says "wrong" no
    louder than a short wrong one; the ramp tells the policy that length itself costs.
    """
    if buffer < 1 or buffer > max_tokens:
        raise ValueError(f"overlong buffer must be in [1, max_tokens={max_tokens}], got {buffer}")
    n = torch.as_tensor(lengths, dtype=torch.float32).flatten()  # (N,)
    start = max_tokens - buffer
    return (-factor * ((n - start).clamp(min=0.0) / buffer).clamp(max=1.0)).to(torch.float32)


def step_advantages(
    samples: Sequence[Sample], rewards: torch.Tensor, n: int, algo: Any, max_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop's rewards -> advantages for one step's samples (any order): (advantages, penalties), (N*G,) each.

    `algo` is the config's AlgoConfig. With algo.overlong=penalty the overlong penalty is added to each
    sample's reward first; the advantages are grouped by Sample.group, each group checked to hold `n`.
    """
    lengths = [len(s.response_ids) for s in samples]
    penalty = torch.zeros(len(samples), dtype=torch.float32)  # (N*G,)
    if algo.overlong == "penalty":
        penalty = overlong_penalty(lengths, max_tokens, int(algo.overlong_buffer), float(algo.overlong_penalty))
    adv = grpo_advantages_by_index(torch.as_tensor(rewards, dtype=torch.float32) + penalty,
                                   [s.group for s in samples], std_normalize=bool(algo.std_normalize),
                                   group_size=n)
    return adv, penalty
