"""The checksum's CUDA path (colo.sync.checksum): copy and checksum in one Triton kernel, a batch of pieces per launch.

Imported only where CopySums runs fused (CUDA with Triton), so a machine without Triton never imports it; the CPU
suite runs the kernel in Triton's interpreter (tests/unit/test_sync_checksum.py). The integers are the module doc's
of colo.sync.checksum; tests/gpu/test_checksum_gpu.py checks them on a GPU and times the kernel against `copy_` at
the launch settings below and around them (BLOCK, WARPS, PER_SM).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _copy_sum(src_base, dst_base, table, n_pieces, sums, COPY: tl.constexpr, BITS: tl.constexpr,
              VEC: tl.constexpr, WORDS: tl.constexpr, BLOCK: tl.constexpr):
    # table: (n_pieces, 5) int64: source element offset from src_base, destination element offset from
    # dst_base, elements, the destination index of the first element (the checksum's position), slot
    # Index arithmetic in 32 bits where it can be: the mix is mod 2^32 anyway, and a block's lanes and remaining count
    # fit; the pointers and the piece's first word are 64-bit. Vectorized (VEC > 1: the host guarantees every offset
    # and count of the launch is a multiple of VEC), the offsets and the mask are known to move in runs of VEC
    # elements, so each thread loads and stores 16 bytes at once; without the hints a 2-byte load stayed 2 bytes wide.
    # WORDS (every piece of the launch starts on a word of its destination): a block's R = 32 / BITS neighbours are
    # one word, assembled in registers, and the mix runs once per word; else once per element, at its word and shift.
    R: tl.constexpr = 32 // BITS
    W: tl.constexpr = BLOCK // R if WORDS else BLOCK  # terms per loop step
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lane = tl.arange(0, BLOCK)
    k1 = tl.full([W], 0x9E3779B1, tl.uint32)
    k2 = tl.full([W], 0x85EBCA77, tl.uint32)
    for p in range(n_pieces):
        so = tl.load(table + p * 5)
        do = tl.load(table + p * 5 + 1)
        n = tl.load(table + p * 5 + 2)
        pos = tl.load(table + p * 5 + 3)
        slot = tl.load(table + p * 5 + 4)
        acc = tl.zeros([W], tl.uint32)
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
                b = y.to(tl.int8, bitcast=True).to(tl.uint8, bitcast=True).to(tl.uint32)  # e4m3 casts only to int8
            elif BITS == 16:
                b = y.to(tl.uint16, bitcast=True).to(tl.uint32)
            else:
                b = y.to(tl.uint32, bitcast=True)
            b = tl.where(m, b, 0)  # a partial last word is zero-padded (an e4m3 load takes no `other`)
            first = pos + start  # the block's first element in its destination
            if WORDS:
                if R > 1:
                    shift = (tl.arange(0, R) * BITS).to(tl.uint32)
                    b = tl.sum(tl.reshape(b, [BLOCK // R, R]) << shift[None, :], axis=1)  # disjoint bits: an or
                j = (first // R).to(tl.uint32) + tl.arange(0, BLOCK // R).to(tl.uint32)
            else:
                t = (first % R).to(tl.int32) + lane  # the lane's element, counted from the word of `first`
                b = b << ((t % R) * BITS).to(tl.uint32)
                j = (first // R).to(tl.uint32) + (t // R).to(tl.uint32)
            h = j * k1  # uint32 products wrap: mod 2^32, as the torch path's
            h = h ^ (h >> 15)
            acc += b * ((h * k2) | 1)
        if pid * BLOCK < n:  # only programs that summed a block of this piece: a small piece's add is one, not
            tl.atomic_add(sums + slot, tl.sum(acc, axis=0).to(tl.int64))  # one per program on one address


BLOCK = 1024  # elements per program per loop step
WARPS = 8
PER_SM = 16  # programs per SM in a launch: the loop strides over a piece's blocks
_SMS: dict[int, int] = {}  # device index -> its SM count


def _programs(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter (the CPU suite): a few programs, so that they stride
        return 3
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return PER_SM * _SMS[index]


def launch(pending: list[tuple[torch.Tensor, torch.Tensor | None, int, int]], sums: torch.Tensor) -> None:
    """The pending pieces, one launch per (source dtype, destination dtype, copy or sum only, vectorizable, starts on a
    word) group; a piece without a source is summed where it lies. Addresses are element offsets from the group's
    first tensors (one flat address space), so a launch takes any number of tensors; where every address is 16-byte
    aligned and every count a multiple of 16 bytes' elements, the kernel is told so and vectorizes. The groups'
    tables travel in one pinned host-to-device copy, and nothing here waits for the device: a flush costs the host a
    table, built from plain integers (a row per piece: the host's share of the sync's checksum is per piece)."""
    groups: dict[tuple, _Group] = {}
    for dst, src, pos, slot in pending:
        n, d, ds = dst.numel(), dst.data_ptr(), dst.dtype.itemsize
        if src is None:
            s, ss = d, ds
        elif src.numel() != n:
            raise ValueError(f"copy of {src.numel()} elements into {n}")
        else:
            s, ss = src.data_ptr(), src.dtype.itemsize
        key = (None if src is None else src.dtype, dst.dtype, _aligned(n, max(ds, ss), d, s), pos % (4 // ds) == 0)
        group = groups.get(key)
        if group is None:
            group = groups[key] = _Group(dst, src)
        group.rows.append((s, d, n, pos, slot))
    tables = np.concatenate([g.table() for g in groups.values()])
    table = _to_device(torch.from_numpy(tables), sums.device)
    at, programs = 0, _programs(sums.device)
    for (_, _, aligned, words), g in groups.items():
        _run(g.dst, g.src, len(g.rows), table[at: at + len(g.rows)], sums, aligned, words, programs)
        at += len(g.rows)


@dataclass
class _Group:
    """One launch's pieces: its first tensors (the kernel's base pointers), a row of integers per piece (source and
    destination addresses, elements, the checksum's position of the first element, the total's slot)."""

    dst: torch.Tensor
    src: torch.Tensor | None
    rows: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    def table(self) -> np.ndarray:
        """(P, 5) int64: the rows with addresses made element offsets from the first tensors'."""
        table = np.array(self.rows, dtype=np.int64)
        s0, d0 = self.rows[0][:2]
        table[:, 0] = (table[:, 0] - s0) // (self.dst if self.src is None else self.src).dtype.itemsize
        table[:, 1] = (table[:, 1] - d0) // self.dst.dtype.itemsize
        return table


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return table
    return table.pin_memory().to(device, non_blocking=True)  # torch's pinned cache keeps the host copy till done


def _run(dst0: torch.Tensor, src0: torch.Tensor | None, n_pieces: int, table: torch.Tensor, sums: torch.Tensor,
         aligned: bool, words: bool, programs: int) -> None:
    copy = src0 is not None
    src0 = src0 if copy else dst0
    ds, ss = dst0.element_size(), src0.element_size()
    vec = max(1, 16 // max(ds, ss)) if aligned else 1
    _copy_sum[(programs,)](src0, dst0, table, n_pieces, sums, COPY=copy, BITS=8 * ds, VEC=vec, WORDS=words,
                           BLOCK=BLOCK, num_warps=WARPS)


def _aligned(n: int, widest: int, *ptrs: int) -> bool:
    """VEC's contract: n elements, a count of whole 16-byte vectors of the widest element (of `widest` bytes), every
    address 16-byte aligned."""
    return n % max(1, 16 // widest) == 0 and all(p % 16 == 0 for p in ptrs)
