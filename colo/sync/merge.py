"""The merged weight W + s B A that sync.lora=merged sends and the merged export writes: one function for both.

    merged(w, a, b, scale)      # w (out, in) with a (r, in), b (out, r); or w (E, out, in) with a (E, r, in),
                                # b (E, out, r): every expert at once (one batched matmul)

The sender (colo.sync.sender.ParamSource) calls it on what a unit hands out: dense units gathered in the compute
dtype, an expert unit's own rows on the fast path (W, A and B are all sharded by expert on dim 0, so each rank
merges its experts without any all-gather); the export calls it on full tensors. A and B are first rounded to W's
dtype, the dtype the trainer's forward runs them in (FSDP2 gathers them in it), so every path forms the same
product whichever form of A and B it holds (the fp32 master shard, or its gathered bf16 copy); the sum is formed in
fp32 and rounded once, to W's dtype, which is vLLM's (model.dtype).
"""
from __future__ import annotations

import torch


@torch.no_grad()
def merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A in W's dtype (shapes in the module docstring)."""
    delta = torch.matmul(b.to(w.dtype).float(), a.to(w.dtype).float())  # (out, in) or (E, out, in), fp32
    return delta.mul_(scale).add_(w).to(w.dtype)  # add_ upcasts w element by element: no fp32 copy of it
