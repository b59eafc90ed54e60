"""FP8 quantization fused into the sync's packing (colo.sync.fp8_pack): bit for bit colo.sync.fp8.quantize_blocks, run
by Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before Triton is imported: a process of its own), and
the plan-time check the kernel relies on.

    .venv/bin/python -m pytest tests/unit/test_sync_fp8_pack.py -q          (~30 s)

On CUDA the same kernel against CUDA torch's quantize_blocks: tests/gpu/test_fp8_gpu.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

KERNEL = textwrap.dedent("""
    import torch
    from colo.sync.checksum import MASK, checksum
    from colo.sync.fp8 import BLOCK, quantize_blocks, scale_shape
    from colo.sync.fp8_pack import quantize_pack

    g = torch.Generator().manual_seed(0)

    def weights(*shape, dtype):
        # blocks of very different magnitudes, an all-zero block, a huge element
        w = torch.randn(*shape, generator=g) * torch.logspace(-6, 1, shape[-1]).view(*([1] * (len(shape) - 1)), -1)
        w[..., :BLOCK, :BLOCK] = 0.0
        w.view(-1)[7 + BLOCK] = 3e4
        return w.to(dtype)

    def edges():
        # one 128 x 128 block whose amax is 448 (scale 1: the products are the values), holding e4m3's ties (normal and
        # subnormal), its largest values and its smallest; and, for a float32 source, bf16's ties (rounding first)
        v = torch.tensor([448.0, -448.0, 446.0, 432.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10,
                          2.0 ** -9, 2.0 ** -6, 2.0 ** -6 - 2.0 ** -10, 7 * 2.0 ** -10, 2.0 ** -20, -0.0, 0.0,
                          1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 255.0, 257.0, 1 + 2.0 ** -9, -(1 + 2.0 ** -8)])
        w = torch.zeros(2, 128, 256)
        w[0, 0, : v.numel()] = v
        w[1] = torch.randn(128, 256, generator=g) * 1e-3  # the second matrix: tiny values, subnormal products
        w[1, 5, 7] = 0.25
        return w

    def cuda_reference(x):
        # quantize_blocks' operations as eager CUDA torch runs them: amax times the float32 reciprocal of 448
        m, n, k = x.shape
        np_, kp = -(-n // BLOCK) * BLOCK, -(-k // BLOCK) * BLOCK
        pad = x.new_zeros((m, np_, kp))
        pad[:, :n, :k] = x
        view = pad.view(m, np_ // BLOCK, BLOCK, kp // BLOCK, BLOCK)
        amax = view.abs().float().amax(dim=(2, 4), keepdim=True).clamp(1e-4)
        sf = amax * torch.tensor(1 / 448.0, dtype=torch.float32)
        q = (view * (1.0 / sf)).to(torch.float8_e4m3fn)
        return q.view(m, np_, kp)[:, :n, :k], sf.view(m, np_ // BLOCK, kp // BLOCK)

    def fused(w, runs, recip, via=torch.bfloat16, summed=True):
        mats = w.reshape(-1, *w.shape[-2:])
        out = torch.full((w.numel(),), 0xAB, dtype=torch.uint8)
        scales = torch.full((mats.shape[0], *scale_shape(tuple(w.shape[-2:]))), float("nan"))
        sums = torch.zeros(3, dtype=torch.int64) if summed else None
        for a, b in runs:
            quantize_pack(w, a, b - a, out[a:b], scales, via, sums, 2, 5 + a, recip=recip, programs=3)
        return out, scales, (int(sums[2]) & MASK if summed else None)

    def cuts(numel, seed):
        r = torch.Generator().manual_seed(seed)
        points = sorted(set(torch.randint(1, numel, (5,), generator=r).tolist()) | {BLOCK * 7 + 3})
        runs = list(zip([0] + points, points + [numel]))
        return [runs[i] for i in torch.randperm(len(runs), generator=r).tolist()]  # any order

    cases = [("float32 experts", weights(3, 256, 384, dtype=torch.float32)),
             ("float32 ragged experts", weights(2, 130, 260, dtype=torch.float32)),
             ("bf16 ragged matrix", weights(200, 130, dtype=torch.bfloat16)),
             ("bf16 matrix", weights(256, 128, dtype=torch.bfloat16)),
             ("float32 edges", edges()), ("bf16 edges", edges().to(torch.bfloat16))]
    told_apart = False
    for name, w in cases:
        q, s = quantize_blocks(w, via=torch.bfloat16)
        qb = q.reshape(-1).view(torch.uint8)
        for runs in ([(0, w.numel())], cuts(w.numel(), 1)):
            out, scales, total = fused(w, runs, recip=False)
            assert torch.equal(out, qb), (name, runs, int((out != qb).sum()))
            assert torch.equal(scales.view(s.shape), s), (name, runs)
            assert total == checksum(q, 5), (name, runs)
        cq, cs = cuda_reference(w.reshape(-1, *w.shape[-2:]).to(torch.bfloat16))
        out, scales, _ = fused(w, cuts(w.numel(), 2), recip=True, summed=False)
        assert torch.equal(out, cq.reshape(-1).view(torch.uint8)), name
        assert torch.equal(scales, cs), name
        told_apart |= not torch.equal(cs.view(s.shape), s)
    assert told_apart, "no case tells the CPU scale (a division) from CUDA's (a reciprocal): the test could not fail"
    w = weights(2, 128, 256, dtype=torch.float32)  # no rounding through bf16: the engine computes in float32
    q, s = quantize_blocks(w, via=torch.float32)
    out, scales, total = fused(w, [(0, w.numel())], recip=False, via=torch.float32)
    assert torch.equal(out, q.reshape(-1).view(torch.uint8)) and torch.equal(scales, s) and total == checksum(q, 5)
    assert not torch.equal(out, quantize_blocks(w, via=torch.bfloat16)[0].reshape(-1).view(torch.uint8))
    print("fused ok")
""")


def _interpreted(script: str, marker: str) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and marker in p.stdout, p.stderr[-3000:]


def test_fused_quantization_is_quantize_blocks_bit_for_bit() -> None:
    """The kernel's e4m3 bytes, block scales and checksum against quantize_blocks (the CPU torch path, vLLM's
    per_block_cast_to_fp8: tests/unit/test_sync_fp8.py): float32 and bf16 sources, expert stacks, ragged edge blocks,
    an all-zero block, e4m3's and bf16's rounding ties, its largest and subnormal values; whole, and cut into runs
    that split blocks, packed in any order. With RECIP (what runs on CUDA) against eager CUDA torch's arithmetic
    emulated on CPU."""
    _interpreted(KERNEL, "fused ok")


PACKING = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, "tests/unit")
    from test_sync_fp8 import _engine, _fp8_plan, _trainer
    from colo.models.archs import QWEN3_MOE
    from colo.models.dtypes import torch_dtype
    from colo.sync.fp8 import SCALE
    from colo.sync.fp8_pack import quantize_unit, uncovered_scales
    from colo.sync.plan import build_plan
    from colo.sync.sender import pack_piece

    trainer, d = _trainer(), _engine()
    fp8 = _fp8_plan(trainer, d)
    plan = build_plan(QWEN3_MOE, fp8.shapes, d, 1 << 16)  # 64 KiB buckets: the expert tensors split over several
    assert len(plan.buckets) > 4 and uncovered_scales(plan.buckets, fp8.quantized, SCALE) == []
    cut = [p for b in plan.buckets for p in b if p["src"] in fp8.quantized
           and p["src_offset"] % (128 * fp8.quantized[p["src"]][-1])]
    assert cut, "no piece starts inside a block row: the test would not see a split block"
    g = torch.Generator().manual_seed(3)
    tensors = {n: ((torch.randn(*s, generator=g) * 0.02).to(torch.float32 if "experts" in n else torch.bfloat16), 0)
               for n, s in trainer.items()}  # the expert shard as FSDP keeps it: float32

    def packed(fused):
        got = quantize_unit(fp8, tensors, {}) if fused else fp8.quantize(tensors, {})
        assert any(type(t).__name__ == "Deferred" for t, _ in got.values()) == fused
        bufs = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in plan.buckets]
        for k, bucket in enumerate(plan.buckets):
            for piece in bucket:
                if "fill" not in piece:
                    pack_piece(bufs[k], piece, got[piece["src"]], fp8.shapes[piece["src"]])
        return bufs

    for k, (a, b) in enumerate(zip(packed(True), packed(False))):
        assert torch.equal(a, b), f"bucket {k}: {int((a != b).sum())} bytes differ"
    print("packing ok")
""")


def test_plan_pieces_pack_the_same_bytes_fused() -> None:
    """The product packing (quantize_unit or Fp8Plan.quantize, then pack_piece over the plan's pieces): fused, every
    bucket holds the bytes the torch path packs, the expert tensors split over buckets mid-block, their scales
    packed from the kernel's."""
    _interpreted(PACKING, "packing ok")


def test_scale_pieces_ahead_of_their_blocks_are_found() -> None:
    """uncovered_scales (the Sender falls back to the torch path on any): silent on the plan's order, and names a scale
    piece that comes before the runs of its blocks."""
    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    from test_sync_fp8 import _engine, _fp8_plan, _trainer

    from colo.models.archs import QWEN3_MOE
    from colo.sync.fp8 import SCALE
    from colo.sync.fp8_pack import uncovered_scales
    from colo.sync.plan import build_plan

    trainer, d = _trainer(), _engine()
    fp8 = _fp8_plan(trainer, d)
    plan = build_plan(QWEN3_MOE, fp8.shapes, d, 1 << 16)
    assert uncovered_scales(plan.buckets, fp8.quantized, SCALE) == []
    flat = [p for b in plan.buckets for p in b]
    name = "model.layers.0.mlp.experts.down_proj"
    first = next(i for i, p in enumerate(flat) if p["src"] == name)
    scale = next(i for i, p in enumerate(flat) if p["src"] == name + SCALE)
    moved = flat[:first] + [flat[scale]] + [p for i, p in enumerate(flat[first:], first) if i != scale]
    errors = uncovered_scales([moved], fp8.quantized, SCALE)
    assert len(errors) == 1 and errors[0].startswith(name + SCALE), errors
