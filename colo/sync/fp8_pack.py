"""FP8 rollout's quantization fused into the sync's packing (CUDA): trainer weights -> e4m3 bytes in the packing
buffer, in one pass, the checksum taken in the same pass.

    tensors = quantize_unit(fp8_plan, unit_tensors, timings)  # the sender, per FSDP unit: a Deferred per tensor
    d = Deferred(w, torch.bfloat16)         # w (M, N, K) or (N, K): an FSDP shard (float32 master copy) or bf16
    d.pack(out, start, n, sums.device_total(name), pos)
                                            # out (n,) bytes of the buffer := the e4m3 of w's flat elements
                                            # [start, start + n); d.scales (M, ceil(N/128), ceil(K/128)) float32
                                            # := the scale of every block the run touches; the run's checksum
                                            # (destination positions pos, pos + 1, ...) into `name`'s total
    quantize_pack(w, start, n, out, scales)  # the same, without the object

Why: colo.sync.fp8.quantize_blocks (the torch path, kept for CPU) makes several passes over float32 temporaries
(rounding, abs, amax, the product, the cast: ~30 bytes of memory traffic per element), and the packing copy reads
its e4m3 bytes once more; a bf16 sync reads 4 bytes (the float32 expert shard) and writes 2 per element. This reads
each element once (4 or 2 bytes) and writes 1: on the L4 slice's H100 figures the FP8 sync took 1.85x bf16's with the
torch path (docs/benchmarks.md, "FP8 against bf16").

One Triton program per 128 x 128 block (strided over the grid): load the block, round it through the engine's dtype,
take its amax, write the block's scale into `scales`, then write the e4m3 bytes of the block's elements that lie in
the run [start, start + n) (a run starts and ends anywhere: the plan splits a tensor over buckets at 16-byte
boundaries, and a block cut in two is quantized whole by both runs, each writing its own bytes) and add their
checksum terms (colo.sync.checksum's: each byte shifted to its place in its 32-bit word, times the word's mix) to
the total. The scales then travel as the plan's `<name>_scale_inv` pieces, copied out of `scales` by the ordinary
packing copy (4 bytes per 16,384 elements): the sender launches every run of a tensor before its scale pieces
(Sender.pack walks the plan in order; the plan puts a tensor's scale after it, colo.sync.fp8.Fp8Plan.shapes), so
stream order makes the copy read finished scales, and `uncovered_scales` checks at plan time that the runs touch
every block whose scale a piece sends.

Bit for bit quantize_blocks on the same device (tests/unit/test_sync_fp8_pack.py under Triton's interpreter against
the CPU torch path; tests/gpu/test_fp8_gpu.py against the CUDA one):
- the engine's rounding of a float32 source (`via` bf16): round to nearest even, in integer operations (c10's
  round_to_nearest_even; torch's CUDA cast agrees for finite values);
- the block's amax of |x|, clamped at 1e-4 (colo.sync.fp8.AMAX_FLOOR);
- scale = amax / 448: eager CUDA torch multiplies by the float32 reciprocal of 448 (ATen's true division by a CPU
  scalar), eager CPU torch divides: RECIP picks the device's (the CPU form is what the interpreter test compares);
- x * (1 / scale) in float32, the reciprocal an IEEE division (tl.math.div_rn: Triton's `/` divides approximately on
  CUDA);
- float32 -> e4m3 as c10's fp8e4m3fn_from_fp32_value (round to nearest even, subnormals by one float32 add, 0x7F
  from 480 up) in integer operations: the same integers in the interpreter and on a GPU (the interpreter's own float
  casts do not round to nearest even), and the kernel is compiled without FMA contraction.
Non-finite weights are not matched (the trainer stops on a non-finite loss first).
"""
from __future__ import annotations

import torch

from colo.models.dtypes import torch_dtype
from colo.sync.fp8 import BLOCK, SCALE, Fp8Plan, scale_shape

SOURCES = (torch.float32, torch.bfloat16)  # what the kernel reads; anything else takes the torch path
VIAS = (torch.bfloat16, torch.float32)  # the engine dtypes it rounds through (float32: no rounding)
_KERNELS: dict = {}
_PROGRAMS: dict[int, int] = {}  # device index -> programs per launch


def supported(w: torch.Tensor, via: torch.dtype) -> bool:
    """Whether the fused kernel takes this source (else colo.sync.fp8.quantize_blocks does)."""
    return w.dtype in SOURCES and via in VIAS and w.dim() in (2, 3) and w.is_contiguous()


def _kernel():
    """The Triton kernel, compiled on first use (Triton is imported only here)."""
    if "quant_pack" in _KERNELS:
        return _KERNELS["quant_pack"]
    import triton
    import triton.language as tl

    @triton.jit
    def _quant_pack(src, out, scales, sums, slot, start, n, pos, N, K, nb, kb, gb0, blocks,
                    SRC32: tl.constexpr, ROUND: tl.constexpr, RECIP: tl.constexpr, SUM: tl.constexpr,
                    B: tl.constexpr):
        # src: (M, N, K) elements; out: the run's n bytes; scales: (M, nb, kb) float32; blocks: the run's blocks,
        # numbered from block row gb0 (global over the M matrices) times kb columns
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        r = tl.arange(0, B)[:, None]  # (B, 1)
        c = tl.arange(0, B)[None, :]  # (1, B)
        k1 = tl.full([B, B], 0x9E3779B1, tl.uint32)  # colo.sync.checksum's index mix
        k2 = tl.full([B, B], 0x85EBCA77, tl.uint32)
        acc = tl.zeros([B], tl.uint32)
        for blk in range(pid, blocks, nprog):
            gb = gb0 + blk // kb
            bj = blk % kb
            bi = gb % nb
            base = (gb // nb).to(tl.int64) * N * K + (bi * B).to(tl.int64) * K + bj * B  # flat index of (0, 0)
            inb = (bi * B + r < N) & (bj * B + c < K)
            off = r * K + c  # (B, B) int32: the element's flat index - base
            x = tl.load(src + base + off, mask=inb, other=0)
            if SRC32:
                u = x.to(tl.uint32, bitcast=True)
                if ROUND:  # float32 -> bf16, round to nearest even, and back
                    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            else:
                u = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
            amax = tl.max(tl.max((u & 0x7FFFFFFF).to(tl.float32, bitcast=True), axis=1), axis=0)
            amax = tl.maximum(amax, 1e-4)
            if RECIP:
                sf = amax * 0.002232142857142857  # 1 / 448 rounded to float32, as CUDA torch's reciprocal
            else:
                sf = tl.math.div_rn(amax, 448.0)
            tl.store(scales + gb * kb + bj, sf)
            inv = tl.math.div_rn(1.0, sf)  # torch's 1.0 / scale: reciprocal() (an IEEE division) times 1.0
            yb = (u.to(tl.float32, bitcast=True) * inv).to(tl.uint32, bitcast=True)
            sign = (yb >> 24) & 0x80
            ua = (yb & 0x7FFFFFFF).to(tl.int32, bitcast=True)
            sub = ((ua.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000) & 0xFF
            nrm = ((ua - 0x3C000000 + 0x7FFFF + ((ua >> 20) & 1)) >> 20) & 0xFF
            code = tl.where(ua >= 0x43F00000, 0x7F, tl.where(ua < 0x3C800000, sub, nrm)) | sign.to(tl.int32)
            lo = start - base  # the run, in `off` coordinates
            run = inb & (off >= lo) & (off < lo + n)
            tl.store(out + (off - lo), code.to(tl.uint8), mask=run)
            if SUM:
                i = (pos - lo) + off.to(tl.int64)  # the byte's index in the destination: its word and place
                b = (code & 0xFF).to(tl.uint32, bitcast=True) << ((i & 3) * 8).to(tl.uint32)
                h = (i >> 2).to(tl.uint32) * k1  # the word's mix, mod 2^32
                h = h ^ (h >> 15)
                w = (h * k2) | 1
                acc += tl.sum(tl.where(run, b * w, 0), axis=1)
        if SUM:
            tl.atomic_add(sums + slot, tl.sum(acc, axis=0).to(tl.int64))

    _KERNELS["quant_pack"] = _quant_pack
    return _quant_pack


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROGRAMS:
        _PROGRAMS[index] = 4 * torch.cuda.get_device_properties(index).multi_processor_count
    return _PROGRAMS[index]


def run_blocks(shape: tuple[int, ...], start: int, n: int) -> tuple[int, int]:
    """(first block row, block rows) the flat element run [start, start + n) of a (M, N, K) or (N, K) tensor touches;
    block rows are numbered over the M matrices (matrix m's row i is m * ceil(N/128) + i // 128)."""
    *_, N, K = shape
    nb = -(-N // BLOCK)

    def row(f: int) -> int:
        r = f // K
        return r // N * nb + r % N // BLOCK

    return row(start), row(start + n - 1) - row(start) + 1


@torch.no_grad()
def quantize_pack(w: torch.Tensor, start: int, n: int, out: torch.Tensor, scales: torch.Tensor,
                  via: torch.dtype = torch.bfloat16, sums: torch.Tensor | None = None, slot: int = 0, pos: int = 0,
                  recip: bool | None = None, programs: int | None = None) -> None:
    """The module docstring's one pass for the run [start, start + n) of w's flat elements: out (n,) 1-byte elements
    := their e4m3 bytes, scales (M, nb, kb) float32 := every touched block's scale, sums[slot] += the run's checksum
    at destination positions pos.. (sums: int64 device tensor; None: no checksum). recip: the scale as CUDA torch
    computes it (default: on CUDA tensors)."""
    if not supported(w, via):
        raise ValueError(f"fused FP8 packing takes a contiguous float32 or bf16 matrix or expert stack rounded "
                         f"through bf16 or float32, got {w.dtype} {tuple(w.shape)} via {via}")
    N, K = int(w.shape[-2]), int(w.shape[-1])
    if n <= 0:
        return
    if start < 0 or start + n > w.numel() or out.numel() != n or out.element_size() != 1:
        raise ValueError(f"run [{start}, +{n}) of {w.numel()} elements into {out.numel()} x {out.element_size()} bytes")
    if tuple(scales.shape[-2:]) != scale_shape((N, K)) or scales.dtype != torch.float32 or not scales.is_contiguous():
        raise ValueError(f"scales {tuple(scales.shape)} {scales.dtype} for blocks of {(N, K)}")
    nb, kb = scale_shape((N, K))
    gb0, rows = run_blocks(tuple(w.shape), start, n)
    blocks = rows * kb
    grid = min(blocks, programs or _programs(w.device))
    cuda = w.device.type == "cuda"
    summed = sums is not None
    _kernel()[(grid,)](w, out.view(torch.uint8), scales, sums if summed else scales, slot, start, n, pos, N, K, nb,
                       kb, gb0, blocks, SRC32=w.dtype == torch.float32, ROUND=via == torch.bfloat16,
                       RECIP=cuda if recip is None else recip, SUM=summed, B=BLOCK, num_warps=8,
                       enable_fp_fusion=False)


class Deferred:
    """A quantized tensor of one sync unit, quantized only as its runs are packed (Fp8Plan.quantize(fused=True)).
    `scales`: its block scales, filled by the runs; the unit hands them out as `<name>_scale_inv`."""

    def __init__(self, w: torch.Tensor, via: torch.dtype) -> None:
        self.w, self.via = w, via
        lead = tuple(w.shape[:-2]) or (1,)
        self.scales = torch.empty((*lead, *scale_shape(tuple(w.shape))[-2:]), dtype=torch.float32, device=w.device)
        if w.dim() == 2:
            self.scales = self.scales[0]  # (nb, kb), as quantize_blocks' scale of a matrix

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    def numel(self) -> int:
        return self.w.numel()

    def pack(self, out: torch.Tensor, start: int, n: int, target: tuple[torch.Tensor, int] | None, pos: int) -> None:
        """out (n,) e4m3 := the run's bytes; its checksum at destination positions pos.. into target = (sums, slot)
        (colo.sync.checksum.CopySums.device_total), or none."""
        sums, slot = target if target is not None else (None, 0)
        quantize_pack(self.w, start, n, out, self.scales.view(-1, *self.scales.shape[-2:]), self.via, sums, slot, pos)


def quantize_unit(plan: Fp8Plan, tensors: dict[str, tuple[torch.Tensor, int]], timings: dict[str, float]
                  ) -> dict:
    """Fp8Plan.quantize for the fused packing: each quantized tensor the kernel takes becomes a Deferred, its scale
    `<name>_scale_inv` the Deferred's `scales` (filled as its pieces are packed: colo.sync.sender.pack_piece); any
    other goes through Fp8Plan.quantize (quantize_blocks)."""
    via = torch_dtype(plan.dtype)
    out, rest = dict(tensors), {}
    for name in [n for n in tensors if n in plan.quantized]:
        w, row = tensors[name]
        if supported(w, via):
            d = Deferred(w, via)
            out[name], out[name + SCALE] = (d, row), (d.scales, row)
        else:
            rest[name] = tensors[name]
    out.update(plan.quantize(rest, timings) if rest else {})
    return out


def uncovered_scales(buckets: list[list[dict]], quantized: dict[str, tuple[int, ...]], scale_suffix: str) -> list[str]:
    """Plan-time check of what the fused packing relies on: for every quantized tensor, each block whose scale a
    `<name><scale_suffix>` piece sends is touched by a run of the tensor packed before that piece. One line per
    violation (names the piece). Pieces count in full-tensor coordinates, runs and scales alike."""
    done: dict[str, list[tuple[int, int]]] = {}  # tensor -> block-row intervals [a, b) its runs touched so far
    errors = []
    for piece in (p for b in buckets for p in b if "fill" not in p):
        src = piece["src"]
        if src in quantized:
            first, rows = run_blocks(quantized[src], piece["src_offset"], piece["numel"])
            done.setdefault(src, []).append((first, first + rows))
        elif src.endswith(scale_suffix) and src[: -len(scale_suffix)] in quantized:
            base = src[: -len(scale_suffix)]
            kb = scale_shape(quantized[base])[-1]
            a, b = piece["src_offset"] // kb, (piece["src_offset"] + piece["numel"] - 1) // kb + 1
            have = sorted(done.get(base, []))
            reach = a
            for lo, hi in have:
                if lo <= reach < hi:
                    reach = hi
            if reach < b:
                errors.append(f"{src} [{piece['src_offset']}, +{piece['numel']}): block rows [{reach}, {b}) of "
                              f"{base} not quantized by an earlier run")
    return errors
