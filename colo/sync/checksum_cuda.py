"""The checksum's CUDA path (colo.sync.checksum): copy and checksum in one Triton kernel, a batch of pieces per launch.

Imported only where CopySums runs fused (CUDA with Triton), so a machine without Triton never imports it; the CPU
suite runs the kernel in Triton's interpreter (tests/unit/test_sync_checksum.py). The integers are the module doc's
of colo.sync.checksum; tests/gpu/test_checksum_gpu.py checks them on a GPU and times the kernel against `copy_` at
the launch settings below and around them (BLOCK, WARPS, PER_SM).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_sum(src_base, dst_base, table, n_pieces, sums, COPY: tl.constexpr, BITS: tl.constexpr,
              VEC: tl.constexpr, BLOCK: tl.constexpr):
    # table: (n_pieces, 5) int64: source element offset from src_base, destination element offset from
    # dst_base, elements, the destination index of the first element (the checksum's position), slot
    # Index arithmetic in 32 bits: the position mix is mod 2^32 anyway, and a block's lanes and remaining count fit;
    # only the pointers and the sum are 64-bit. Vectorized (VEC > 1: the host guarantees every offset and count of the
    # launch is a multiple of VEC), the offsets and the mask are known to move in runs of VEC elements, so each thread
    # loads and stores 16 bytes at once; without the hints a 2-byte load stayed 2 bytes wide (the mask's runs unknown).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lane = tl.arange(0, BLOCK)
    ulane = lane.to(tl.uint32)
    k1 = tl.full([BLOCK], 0x9E3779B1, tl.uint32)
    k2 = tl.full([BLOCK], 0x85EBCA77, tl.uint32)
    for p in range(n_pieces):
        so = tl.load(table + p * 5)
        do = tl.load(table + p * 5 + 1)
        n = tl.load(table + p * 5 + 2)
        pos = tl.load(table + p * 5 + 3)
        slot = tl.load(table + p * 5 + 4)
        acc = tl.zeros([BLOCK], tl.int64)
        for start in range(pid * BLOCK, n, nprog * BLOCK):
            m = lane < tl.multiple_of(tl.minimum(n - start, BLOCK).to(tl.int32), VEC)
            d = dst_base + tl.multiple_of(do + start, VEC) + lane
            if COPY:
                x = tl.load(src_base + tl.multiple_of(so + start, VEC) + lane, mask=m)
                y = x.to(dst_base.dtype.element_ty, fp_downcast_rounding="rtne")
                tl.store(d, y, mask=m)
            else:
                y = tl.load(d, mask=m)
            if BITS == 8:
                b = y.to(tl.int8, bitcast=True).to(tl.int32).to(tl.uint32, bitcast=True)
            elif BITS == 16:
                b = y.to(tl.int16, bitcast=True).to(tl.int32).to(tl.uint32, bitcast=True)
            else:
                b = y.to(tl.uint32, bitcast=True)
            h = ((pos + start).to(tl.uint32) + ulane) * k1  # uint32 products wrap: mod 2^32, as the torch path's
            h = h ^ (h >> 15)
            w = (h * k2) | 1
            acc += tl.where(m, b * w, 0).to(tl.int64)
        tl.atomic_add(sums + slot, tl.sum(acc, axis=0))


BLOCK = 1024  # elements per program per loop step
WARPS = 8
PER_SM = 16  # programs per SM in a launch: the loop strides over a piece's blocks
_SMS: dict[int, int] = {}  # device index -> its SM count


def _programs(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return PER_SM * _SMS[index]


def launch(pending: list[tuple[torch.Tensor, torch.Tensor, int, int]], sums: torch.Tensor) -> None:
    """The pending copies, one launch per (source dtype, destination dtype, vectorizable) group. Addresses are
    element offsets from the group's first tensors (one flat address space), so a launch takes any number of
    tensors; where every address is 16-byte aligned and every count a multiple of 16 bytes' elements, the kernel is
    told so and vectorizes."""
    groups: dict[tuple, list] = {}
    for dst, src, pos, slot in pending:
        aligned = _vectorizable(dst, src)
        groups.setdefault((src.dtype, dst.dtype, aligned), []).append((dst, src, pos, slot))
    for (_, _, aligned), rows in groups.items():
        _launch_group(rows, sums, aligned, _programs(sums.device))


def _launch_group(rows: list, sums: torch.Tensor, aligned: bool, programs: int) -> None:
    dst0, src0 = rows[0][0], rows[0][1]
    ds, ss = dst0.element_size(), src0.element_size()
    table = []
    for dst, src, pos, slot in rows:
        if dst.numel() != src.numel():
            raise ValueError(f"copy of {src.numel()} elements into {dst.numel()}")
        table.append([(src.data_ptr() - src0.data_ptr()) // ss, (dst.data_ptr() - dst0.data_ptr()) // ds,
                      dst.numel(), pos, slot])
    t = torch.tensor(table, dtype=torch.int64)  # (P, 5)
    if dst0.device.type == "cuda":
        t = t.pin_memory().to(dst0.device, non_blocking=True)
    vec = max(1, 16 // max(ds, ss)) if aligned else 1
    _copy_sum[(programs,)](src0, dst0, t, len(rows), sums, COPY=True, BITS=8 * ds, VEC=vec, BLOCK=BLOCK,
                           num_warps=WARPS)


def _vectorizable(*tensors: torch.Tensor) -> bool:
    """16-byte aligned, and a count of whole 16-byte vectors of the widest element (VEC's contract)."""
    vec = max(1, 16 // max(t.element_size() for t in tensors))
    return all(t.data_ptr() % 16 == 0 and t.numel() % vec == 0 for t in tensors)


def checksum_tensor(values: torch.Tensor, pos: int) -> torch.Tensor:
    """The checksum of `values` (1-D, contiguous, 1-, 2- or 4-byte elements) as a 0-dim int64 device tensor,
    without a host sync."""
    out = torch.zeros(1, dtype=torch.int64, device=values.device)
    t = torch.tensor([[0, 0, values.numel(), pos, 0]], dtype=torch.int64).to(values.device)
    vec = max(1, 16 // values.element_size()) if _vectorizable(values) else 1
    _copy_sum[(_programs(values.device),)](values, values, t, 1, out, COPY=False, BITS=8 * values.element_size(),
                                           VEC=vec, BLOCK=BLOCK, num_warps=WARPS)
    return out[0]
