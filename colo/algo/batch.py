"""Rollout samples -> trainer batches (docs/contract.md), split over the FSDP ranks.

A sample is colo.rollout.sample.Sample: prompt_ids (P,), response_ids (R,), logprobs (R,) with
logprobs[j] = log p(response_ids[j] | prompt_ids + response_ids[:j]) under vLLM's sampler, its status.

A conversation's sample (algo.environment, colo.rollout.turns) has a model_mask (R,): 1 on the tokens the
model sampled, 0 on the environment's (observations and their chat-template framing). Those get loss_mask 0 and
rollout_logprobs 0 (vLLM never sampled them: no behaviour log-prob), so the loss, TIS, the KL term and the
log-prob gap cover the model's tokens only; their routed_experts rows hold NO_EXPERT (they were prefilled, not
sampled: replay keeps the trainer's own routing there). A sample whose environment failed (Status.FAILED) gets an
all-zero loss mask, like a filtered overlong one.

Row b of the batch is prompt_ids + response_ids, right-padded to T:

    position    0 .. P-1        P .. P+R-1             P+R .. T-1
    input_ids   prompt          response               pad_id
    attn_mask   1               1                      0
    loss_mask   0               1                      0
    rollout_lp  0               logprobs[0 .. R-1]     0

so rollout_logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t]), the same alignment as the
trainer's recomputed log-probs (logits at t-1 score token t).

Samples that carry the engine's routing (Sample.routing: (P+R-1, M, K) expert ids, colo.rollout.capture) add
routed_experts (B, T, M, K) in their dtype (uint8, or int16 past 254 experts): row t holds the experts
token t was routed to in each MoE layer. The last token of each sample (the engine never forwarded it) and
the padding hold NO_EXPERT (255 / -1), where the trainer keeps its own routing. A whole step of Qwen3-30B-A3B
(M=48, K=8) costs 384 bytes per token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from colo.rollout.sample import Sample


def build_batch(
    samples: Sequence[Sample],
    advantages: torch.Tensor | Sequence[float],
    pad_id: int = 0,
    pad_to_multiple: int = 1,
    mask_truncated: bool = False,
) -> dict[str, torch.Tensor]:
    """One batch of CPU tensors from `samples` and their advantages (N,).

    `mask_truncated` (algo.overlong=filter) gives samples that stopped at the length limit
    (Status.TRUNCATED) an all-zero loss mask: they stay in the batch (and in their group's
    baseline, computed before) but add no gradient and count toward no token or sequence total.

    Keys: input_ids (B, T) long, attention_mask (B, T) long, loss_mask (B, T) float32,
    advantages (B,) float32, rollout_logprobs (B, T) float32, sample_index (B,) long (the
    sample's position in `samples`; shard_batch marks its filler rows -1).
    """
    adv = torch.as_tensor(advantages, dtype=torch.float32).flatten()  # (N,)
    if adv.numel() != len(samples):
        raise ValueError(f"{len(samples)} samples but {adv.numel()} advantages")
    trained = [not (mask_truncated and s.finish_reason == "length") and s.finish_reason != "error" for s in samples]
    batch = pad_rows([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                     [(s.model_mask if s.model_mask is not None else 1) if t else 0 for s, t in zip(samples, trained)],
                     [s.logprobs for s in samples], pad_id, pad_to_multiple)
    T = batch["input_ids"].shape[1]
    routed = _routed_experts(samples, T) if any(s.routing is not None for s in samples) else {}
    return {**routed, **batch,
            "advantages": adv,  # (B,)
            "sample_index": torch.arange(len(samples)),  # (B,)
            }


def pad_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
             loss: Sequence[Sequence[int] | int], logprobs: Sequence[Sequence[float]] | None = None,
             pad_id: int = 0, pad_to_multiple: int = 1) -> dict[str, torch.Tensor]:
    """Rows prompt + response, right-padded (the module docstring's table): input_ids, attention_mask, loss_mask
    (`loss[b]`: the response's per-token mask, or 1 / 0 for all of it), rollout_logprobs (zero without `logprobs`).
    What build_batch and the supervised warm-up's batches (colo.data.inputs) share."""
    if not prompts:
        raise ValueError("cannot build an empty batch")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    T = -(-max(lengths) // pad_to_multiple) * pad_to_multiple
    B = len(prompts)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    rollout_lp = torch.zeros((B, T), dtype=torch.float32)
    for b, (p, r, m) in enumerate(zip(prompts, responses, loss)):
        P, L = len(p), len(p) + len(r)
        if P == 0:
            # no position can predict the first token; a response starting at 0 would be unscorable
            raise ValueError(f"sample {b}: empty prompt")
        input_ids[b, :L] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attention_mask[b, :L] = 1
        if not isinstance(m, int):
            if len(m) != len(r):
                raise ValueError(f"sample {b}: {len(r)} response tokens but {len(m)} model_mask entries")
            loss_mask[b, P:L] = torch.tensor(m, dtype=torch.float32)
        elif m:
            loss_mask[b, P:L] = 1.0
        lp = logprobs[b] if logprobs is not None else None
        if lp is not None and len(lp) != len(r):
            raise ValueError(f"sample {b}: {len(r)} response tokens but {len(lp)} logprobs")
        if r and lp is not None:
            rollout_lp[b, P:L] = torch.tensor([float(x) for x in lp], dtype=torch.float32)
    return {"input_ids": input_ids,  # (B, T)
            "attention_mask": attention_mask,  # (B, T)
            "loss_mask": loss_mask,  # (B, T)
            "rollout_logprobs": rollout_lp}  # (B, T)


NO_EXPERT = {"uint8": 255, "int16": -1}
"""'No engine expert id here' (the padding, each sample's last token, an environment's tokens), by the expert ids'
dtype: the one definition. colo.rollout.capture.ids_dtype takes uint8 below 255 experts, the engine pads its
routing with it, and colo.algo.replay keeps the trainer's own routing wherever it finds it."""


def no_expert(dtype: torch.dtype | np.dtype) -> int:
    """NO_EXPERT of a torch or numpy dtype of expert ids."""
    return NO_EXPERT[str(dtype).removeprefix("torch.")]


def _routed_experts(samples: Sequence[Sample], T: int) -> dict[str, torch.Tensor]:
    """{"routed_experts": (B, T, M, K)} from each sample's (P+R-1, M, K) routing (numpy or tensor); a sample
    without one, and the environment's tokens of a multi-turn sample, keep NO_EXPERT."""
    first = _ids(next(s.routing for s in samples if s.routing is not None))
    dtype = first.dtype
    if str(dtype).removeprefix("torch.") not in NO_EXPERT:
        raise ValueError(f"routing ids of dtype {dtype}; expected uint8 or int16 (colo.rollout.capture.ids_dtype)")
    out = torch.full((len(samples), T, *first.shape[1:]), no_expert(dtype), dtype=dtype)
    for b, s in enumerate(samples):
        if s.routing is None:
            continue
        if s.routed_from:
            raise ValueError(f"sample {b}: routing from row {s.routed_from}; a batch takes whole samples")
        ids = _ids(s.routing)
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        if ids.dtype != dtype or ids.shape[1:] != first.shape[1:] or ids.shape[0] != n:
            raise ValueError(f"sample {b}: routing {tuple(ids.shape)} {ids.dtype}, expected ({n}, "
                             f"{', '.join(map(str, first.shape[1:]))}) {dtype}")
        out[b, :n] = ids
        if s.model_mask is not None:  # the environment's tokens: prefilled, so replay leaves them to the trainer
            P = len(s.prompt_ids)
            env = P + torch.nonzero(torch.tensor(s.model_mask, dtype=torch.long) == 0).flatten()  # (E,) positions
            out[b, env[env < n]] = no_expert(dtype)
    return {"routed_experts": out}  # (B, T, M, K)


def _ids(x: object) -> torch.Tensor:
    """A tensor of its own (Ray hands numpy arrays over read-only)."""
    return x.clone() if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x))


def balance(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Split sample indices into `world_size` groups with equal counts (differing by at most one)
    and token totals as even as a greedy longest-first pass gets them. Deterministic.

    Equal counts first: every rank then runs the same number of micro-batches, so the FSDP
    collectives line up; tokens second, because the slowest rank sets the step time.
    """
    n = len(lengths)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    base, extra = divmod(n, world_size)  # `extra` ranks get one more; whichever fills up lightest
    groups: list[list[int]] = [[] for _ in range(world_size)]
    tokens = [0] * world_size
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        big = sum(len(g) > base for g in groups)
        r = min((r for r in range(world_size)
                 if len(groups[r]) < base or (len(groups[r]) == base and big < extra)),
                key=lambda r: (tokens[r], r))
        groups[r].append(i)
        tokens[r] += lengths[i]
    return [sorted(g) for g in groups]


def shard_batch(batch: dict, world_size: int, pad_to_multiple: int = 1) -> list[dict]:
    """Split a built batch (rollout or SFT) into one batch per trainer rank: shards[r] is rank r's.

    Rows are assigned by `balance` on their attention-mask lengths; each shard is cut back to its
    own longest row, not the global one, to save compute. Every (B, ...) tensor is split by rows,
    every (B, T, ...) tensor also trimmed to the shard's T; other values are passed to all shards.

    Every shard gets exactly ceil(B / world_size) rows. FSDP ranks must run forward and backward
    in lockstep: a rank with no rows, or with one micro-batch fewer than its peers, leaves the others
    hanging in all-gather / reduce-scatter. Short shards are therefore topped up with copies of the
    batch's shortest row with loss_mask 0 and advantage 0 (sample_index -1): they join the
    collectives, add exactly zero gradient, and count toward neither token nor sequence totals.
    """
    mask = batch["attention_mask"]  # (B, T)
    B, T = mask.shape
    if B == 0:
        raise ValueError("cannot shard an empty batch")
    lengths = [int(x) for x in mask.sum(dim=1).tolist()]  # (B,)
    size = -(-B // world_size)
    filler = min(range(B), key=lambda i: (lengths[i], i))
    shards = []
    for group in balance(lengths, world_size):
        n_pad = size - len(group)
        rows = torch.tensor(group + [filler] * n_pad, dtype=torch.long)
        t_len = max(lengths[i] for i in rows.tolist())
        t_len = min(T, -(-t_len // pad_to_multiple) * pad_to_multiple)
        shard = {k: _take(v, rows, B, T, t_len) for k, v in batch.items()}
        if n_pad:
            pad = slice(len(group), size)
            for key, value in (("loss_mask", 0), ("advantages", 0), ("sample_index", -1)):
                if key in shard:
                    shard[key][pad] = value
        shards.append(shard)
    return shards


def _take(v: object, rows: torch.Tensor, B: int, T: int, t_len: int) -> object:
    if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != B:
        return v
    v = v.index_select(0, rows)  # a copy: the padding edits above never touch the global batch
    if v.dim() >= 2 and v.shape[1] == T:
        v = v[:, :t_len].contiguous()
    return v


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the span, then back. The loop builds a step's batch on one: the
    build is a few small copies per sample, each parallel one waits for its slowest thread, and on a host whose
    other cores run trainers, engines and Ray a descheduled thread stalls every one of them
    (docs/benchmarks.md, "Answered experiments": 67 ms on one thread against 174 ms on two with a core kept busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def to_wire(batch: dict) -> dict:
    """A batch as it crosses Ray to a trainer (colo.cluster.actors.TrainerGroup): its tensors as numpy arrays, which
    Ray's object store hands over without pickling them (a tensor is pickled in-band: a copy into the message and
    one out of it, in Python). One L12-shaped shard, 128 samples with R3 ids (66.8 MB), took 0.14 s to reach an
    actor as tensors on 2 idle CPU cores against 0.037 s as arrays (docs/benchmarks.md, "Answered experiments"). A
    dtype numpy lacks (bfloat16) stays a tensor."""
    return {k: v.numpy() if torch.is_tensor(v) and v.dtype != torch.bfloat16 else v for k, v in batch.items()}


def from_wire(batch: dict) -> dict:
    """to_wire undone on the trainer: numpy arrays back to tensors, each a copy of its own. Ray maps the arrays
    read-only from its object store; a tensor over one would let a write reach memory other readers share."""
    return {k: torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else v for k, v in batch.items()}
