"""Sequence packing: micro-batches by a token budget, several samples in one row, no padding.

    bins = pack_bins(lengths, budget)                  # row indices per micro-batch, as few as fit, even
    p = Packed.of(attention_mask)                      # (b, T) padded rows -> one (1, N) row of their tokens
    ids, pos = p.pack(input_ids), p.position_ids       # (1, N) each; pos restarts at 0 on every sample
    p.bounds                                           # (0, L0, L0 + L1, ..., N): where each sample starts
    lp = p.unpack(lp_packed)                           # (1, N) -> (b, T), zeros where the padding was

A packed row holds samples back to back:

    input_ids      a0 a1 a2 a3 b0 b1 c0 c1 c2
    position_ids    0  1  2  3  0  1  0  1  2

The trainer's attention keeps each token inside its own sample: colo.trainer.attention's sdpa_varlen runs
one flash-attention varlen call per row on CUDA and SDPA per sample on CPU, from `bounds` (no N x N mask);
the flash_attn package (where installed) sees batch 1 with restarting
positions and calls its varlen kernel; transformers' own sdpa / eager would build a block-diagonal mask from
the restarts (masking_utils.find_packed_sequence_indices; tests/unit/test_packed_attention.py checks all
three against separate forwards). The rotary positions are the padded path's. The trainer then unpacks every per-token result to the padded (b, T) layout before
the loss, so losses, TIS, KL, the R3 ids and every metric are computed exactly as on the padded path
(tests/integration/test_packing.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def pack_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices into `lengths` grouped into bins of at most `budget` tokens (a length above the budget gets a bin of
    its own), as few bins as first-fit decreasing needs, the tokens spread evenly over them: longest first, each
    into the bin with the most room (worst-fit decreasing), where that fits; else first-fit decreasing's own bins.
    Even bins, not full ones and a remainder: first-fit left a step's last micro-batch what the full ones did not
    take (1,545 tokens of one L12 step at a 32,768 budget), a token count far from the others' that failed a guard
    of the compiled layers and recompiled them in that step (docs/benchmarks/2026-11-27-l12-train-phase.md: that
    step's train MFU 13.7% packed first-fit, 25.5% packed evenly). Bins in creation
    order, indices ascending inside each. Deterministic."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    first = _fill(order, lengths, budget, None)
    even = _fill(order, lengths, budget, len(first))
    return [sorted(b) for b in (even if even is not None else first)]


def _fill(order: list[int], lengths: Sequence[int], budget: int, k: int | None) -> list[list[int]] | None:
    """k None: first-fit, opening bins as needed. k bins: each index into the bin with the most room, None when
    one does not fit (an over-budget length fits only an empty bin)."""
    bins: list[list[int]] = [[] for _ in range(k or 0)]
    room: list[int] = [budget] * (k or 0)
    for i in order:
        if k is None:
            b = next((b for b, free in enumerate(room) if lengths[i] <= free), None)
            if b is None:
                bins.append([])
                room.append(budget)
                b = len(bins) - 1
        else:
            b = max(range(k), key=lambda b: (room[b], -b))
            if lengths[i] > room[b] and bins[b]:
                return None
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


@dataclass
class Packed:
    """Where the real tokens of (b, T) padded rows sit in one packed (1, N) row."""

    index: torch.Tensor  # (N,) flat positions into the (b*T) padded layout, row-major
    position_ids: torch.Tensor  # (1, N) position of each token inside its own sample
    shape: tuple[int, int]  # (b, T) of the padded rows
    bounds: tuple[int, ...]  # start offset of every sample in the packed row, then N: (0, L0, L0 + L1, ..., N)

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> Packed:
        """From the host's (b, T) mask: the layout is planned on the host, with no device sync."""
        am = attention_mask.long()  # (b, T)
        pos = (am.cumsum(-1) - 1).clamp(min=0)  # (b, T) the padded path's positions (left padding too)
        index = am.reshape(-1).nonzero().squeeze(1)  # (N,)
        position_ids = pos.reshape(-1)[index][None]
        starts = (position_ids[0] == 0).nonzero().squeeze(1).tolist()
        return cls(index, position_ids, tuple(am.shape), (*starts, int(index.numel())))

    def to(self, upload: Callable[[torch.Tensor], torch.Tensor]) -> Packed:
        """The same layout with its tensors moved by `upload` (the trainer's host -> device copy, which on CUDA
        does not wait for the GPU): pack and unpack of device tensors then never move an index themselves."""
        return Packed(upload(self.index), upload(self.position_ids), self.shape, self.bounds)

    @property
    def tokens(self) -> int:
        return self.bounds[-1]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(b, T, ...) -> (1, N, ...)."""
        b, T = self.shape
        return x.reshape(b * T, *x.shape[2:])[self.index.to(x.device)][None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(1, N) -> (b, T), zeros off the tokens; differentiable in `x`."""
        b, T = self.shape
        out = x.new_zeros(b * T)
        return out.index_copy(0, self.index.to(x.device), x.reshape(-1)).view(b, T)
