"""colo's slot capture (colo.rollout.capture_cuda) on plain torch tensors: the arithmetic that places each token's
expert ids at its KV slot and reads a request's rows back through its block table. What needs vLLM's CUDA runner
(the binding, CUDA graphs, the finish hook) runs in tests/gpu/test_routing_gpu.py.

The steps below stand in for vLLM's: a slot is block_table[pos // block_size] * block_size + pos % block_size
(vllm/v1/worker/gpu/block_table.py, _compute_slot_mappings_kernel), tokens past the step's real ones get slot -1.
"""
from __future__ import annotations

import pytest
import torch

from colo.algo.batch import NO_EXPERT
from colo.rollout.capture_cuda import SlotRows, gather_rows, request_slots, trim_rows, write_rows

BS, M, K, E = 4, 2, 3, 64  # block size, MoE layers, top-k, experts
NUM_BLOCKS = 8


def empty_rows(dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """R as the worker allocates it: a row per KV slot and the dummy last row, all NO_EXPERT."""
    return torch.full((NUM_BLOCKS * BS + 1, M, K), NO_EXPERT[str(dtype).removeprefix("torch.")], dtype=dtype)


def routed(req: int, pos: int, layer: int) -> list[int]:
    """The ids a stand-in router picks for request req's token at pos in MoE layer `layer`: distinct per token."""
    return [(req * 17 + pos * 5 + layer * 11 + j) % E for j in range(K)]


def slot_of(blocks: list[int], pos: int) -> int:
    return blocks[pos // BS] * BS + pos % BS


def run_step(rows: torch.Tensor, tokens: list[tuple[int, list[int], int]], padded: int) -> None:
    """One forward: (request, its block ids, position) per token, padded to `padded` tokens (slot -1), every MoE
    layer writing its (padded, K) ids through the step's slot mapping."""
    slots = torch.tensor([slot_of(b, p) for _, b, p in tokens] + [-1] * (padded - len(tokens)))
    for layer in range(M):
        ids = torch.tensor([routed(r, p, layer) for r, _, p in tokens] + [[E - 1] * K] * (padded - len(tokens)),
                           dtype=torch.int32)  # the router's dtype; padding rows route somewhere too
        write_rows(rows, slots, layer, ids)


def expected(req: int, positions: range) -> torch.Tensor:
    return torch.tensor([[routed(req, p, layer) for layer in range(M)] for p in positions], dtype=torch.uint8)


def test_ids_land_at_their_slots_and_padding_in_the_dummy_row() -> None:
    rows = empty_rows()
    slots = torch.tensor([9, 2, -1, -1])
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 7, 7], [8, 8, 8]], dtype=torch.int64)
    write_rows(rows, slots, 1, ids)
    assert rows[9, 1].tolist() == [1, 2, 3] and rows[2, 1].tolist() == [4, 5, 6]
    assert rows[-1, 1].tolist() in ([7, 7, 7], [8, 8, 8])  # both pads went to the dummy row
    assert rows.dtype == torch.uint8
    written = torch.zeros(rows.shape[:2], dtype=torch.bool)
    written[9, 1] = written[2, 1] = written[-1, 1] = True
    assert (rows[~written] == NO_EXPERT["uint8"]).all()  # layer 0 and every other slot untouched


def test_a_request_reads_its_rows_back_through_its_block_table() -> None:
    """Two requests on scattered blocks, prefilled in one padded step and chunked, then decoded; a third shares the
    first one's prompt block through the prefix cache and computes only past it. Each reads back exactly the rows of
    its tokens, position by position, and trimming keeps the rows asked for."""
    rows = empty_rows()
    a, b, c = [5, 1, 6], [2, 7], [5, 3]  # block ids; c's first block is a's (a prefix-cache hit)
    run_step(rows, [(0, a, p) for p in range(6)] + [(1, b, p) for p in range(3)], padded=12)  # a's first chunk
    run_step(rows, [(0, a, p) for p in range(6, 9)] + [(1, b, 3)], padded=8)  # a's last chunk, b decodes
    run_step(rows, [(0, a, 9), (1, b, 4), (2, c, 4)], padded=4)  # decode, graph-padded; c prefills past a's block
    run_step(rows, [(0, a, 10), (1, b, 5), (2, c, 5)], padded=4)
    got_a = gather_rows(rows, torch.tensor(a, dtype=torch.int32), BS)
    assert got_a.shape == (len(a) * BS, M, K)
    assert torch.equal(trim_rows(got_a, 0, 11), expected(0, range(11)))
    assert torch.equal(trim_rows(got_a, 4, 7), expected(0, range(4, 11)))  # rows the sample lacks, from row 4
    got_b = gather_rows(rows, torch.tensor(b, dtype=torch.int32), BS)
    assert torch.equal(trim_rows(got_b, 0, 6), expected(1, range(6)))
    got_c = trim_rows(gather_rows(rows, torch.tensor(c, dtype=torch.int32), BS), 0, 6)
    assert torch.equal(got_c[:4], expected(0, range(4)))  # the cached block holds the rows of whoever computed it
    assert torch.equal(got_c[4:], expected(2, range(4, 6)))
    assert (gather_rows(rows, torch.tensor([4, 0]), BS) == NO_EXPERT["uint8"]).all()  # blocks no token used


def test_slots_of_a_block_table_and_short_holdings() -> None:
    assert request_slots(torch.tensor([3, 0, 2], dtype=torch.int32), 4).tolist() == [12, 13, 14, 15, 0, 1, 2, 3,
                                                                                     8, 9, 10, 11]
    assert request_slots(torch.tensor([], dtype=torch.int32), 4).numel() == 0
    held = torch.arange(8).view(8, 1, 1)
    assert trim_rows(held, 2, 3).view(-1).tolist() == [2, 3, 4]
    assert trim_rows(held, 6, 5).view(-1).tolist() == [6, 7]  # fewer than asked: the engine names what is missing


def test_past_254_experts_ids_are_int16_and_no_expert_is_minus_one() -> None:
    rows = empty_rows(torch.int16)
    write_rows(rows, torch.tensor([3, -1]), 0, torch.tensor([[300, 255, 0], [1, 1, 1]], dtype=torch.int32))
    assert rows[3, 0].tolist() == [300, 255, 0] and rows[3, 1].tolist() == [-1, -1, -1]


def test_slot_rows_turns_vllms_buffer_write_into_a_slot_write() -> None:
    """vLLM's RoutedExpertsCapturer.capture ends in `device_buffer[:n, layer_id] = ids` with decoder layer ids; the
    stand-in writes MoE layer index(layer_id) at the step's first n slots, and refuses any other form."""
    rows = empty_rows()
    step_slots = torch.full((16,), -1, dtype=torch.int64)  # the persistent slot mapping, as vLLM pads it
    step_slots[:2] = torch.tensor([7, 30])
    writer = SlotRows(rows, step_slots, {3: 0, 5: 1})  # MoE layers at decoder layers 3 and 5
    assert writer.shape[1] == 6  # capture() checks 0 <= layer_id < shape[1]
    writer[:3, 5] = torch.tensor([[1, 2, 3], [4, 5, 6], [9, 9, 9]])
    assert rows[7, 1].tolist() == [1, 2, 3] and rows[30, 1].tolist() == [4, 5, 6] and rows[-1, 1].tolist() == [9, 9, 9]
    assert (rows[:, 0] == NO_EXPERT["uint8"]).all()
    with pytest.raises(TypeError, match="needs updating"):
        writer[1:3, 5] = torch.zeros(2, K, dtype=torch.int32)
    with pytest.raises(KeyError):
        writer[:1, 4] = torch.zeros(1, K, dtype=torch.int32)  # a decoder layer that is no MoE layer
