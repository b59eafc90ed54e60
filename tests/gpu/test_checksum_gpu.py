"""The sync's checksum kernel on CUDA (colo.sync.checksum): exact copies, the torch path's integers, and its cost.

    PYTHONPATH=. python -m pytest --noconftest tests/gpu/test_checksum_gpu.py -q -s      (~1 min; no vLLM, no Ray)

The CPU suite runs the same kernel in Triton's interpreter (tests/unit/test_sync_checksum.py); on a GPU:
1. copy + checksum in one launch: bit-exact copies (bf16, float32, e4m3; float32 -> bf16 rounded as torch rounds),
   sums equal to the torch path's, for batched, unaligned and split pieces;
2. its cost: a 1 GiB bucket of bf16 pieces packed from float32 shards (the expert fast path's copy) with torch's
   copy_ against the fused kernel, and the receiver's bf16 -> bf16 copy the same way: `[gpu] checksum` lines with
   both times and their ratio (the sync-level ratio is colo.bench.sync --checksum-ratio: tests/gpu/run.sh step
   `checksum`).
"""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_kernel_copies_exactly_and_sums_as_the_torch_path() -> None:
    _cuda()
    from colo.sync.checksum import CopySums, checksum

    g = torch.Generator(device="cuda").manual_seed(0)
    src32 = torch.randn(3_000_001, generator=g, device="cuda")
    src32[:4] = torch.tensor([0.0, -0.0, float("inf"), 1e-40])  # signed zero, infinity, a denormal
    srcbf = torch.randn(1_234_567, generator=g, device="cuda").to(torch.bfloat16)
    src8 = torch.randn(777_777, generator=g, device="cuda").to(torch.float8_e4m3fn)
    buf = torch.zeros(32 << 20, dtype=torch.uint8, device="cuda")  # the pieces below take ~23 MB
    sums = CopySums("cuda")
    assert sums.fused, "Triton is needed on CUDA (the GPU bundle brings Triton 3.7)"
    want, at = {}, 0
    pieces = [("cast", src32, torch.bfloat16, 0), ("cast unaligned", src32[7:1_000_007], torch.bfloat16, 7),
              ("same", srcbf, torch.bfloat16, 3), ("e4m3", src8, torch.float8_e4m3fn, 11),
              ("fp32", src32, torch.float32, 5)]
    for name, src, dt, pos in pieces:
        n = src.numel()
        at = (at + 255) // 256 * 256 + (2 if name == "same" else 0)  # one destination 2 bytes off alignment
        out = buf[at: at + n * dt.itemsize].view(dt)
        at += n * dt.itemsize
        sums.copy(out, src, name, pos)
        want[name] = (out, src.to(dt), pos)
    sums.add(srcbf[5:1005], "added", 9)  # summed where it lies (a transposed expert block, a reference tensor)
    sums.add(src32[1:4], "added unaligned", 2)
    got = sums.totals()
    assert got["added"] == checksum(srcbf[5:1005], 9) and got["added unaligned"] == checksum(src32[1:4], 2)
    for name, (out, ref, pos) in want.items():
        a, b = out.view(torch.uint8), ref.contiguous().view(torch.uint8)
        bad = (a != b).nonzero().flatten()  # torch's rounding, byte for byte
        assert bad.numel() == 0, (name, f"{bad.numel()} bytes differ, first at {bad[:4].tolist()} of {out.nbytes}",
                                  a[bad[:4]].tolist(), b[bad[:4]].tolist())
        assert got[name] == checksum(ref, pos), name


def _time(fn, reps: int = 20) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3  # seconds


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_fused_checksum_costs_little_over_the_copy(src_dtype) -> None:
    """1 GiB of bf16 destination in 64 pieces (a bucket), from float32 (the sender's expert shards) or bf16 (the
    receiver's buffer): torch's copy_ per piece against the fused copy + checksum, one launch per batch, its table
    built on the host as the sync builds it. The totals' one device read per sync is not timed: read after every
    call, it made the GPU wait for the host between calls (2.65 ms for a 1.03-ms kernel on an H100)."""
    _cuda()
    from colo.sync.checksum import CopySums

    n, parts = (1 << 29), 64  # bf16 elements of the bucket
    src = torch.randn(n, device="cuda", dtype=src_dtype)
    dst = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    step = n // parts

    def plain() -> None:
        for i in range(parts):
            dst[i * step:(i + 1) * step].copy_(src[i * step:(i + 1) * step])

    sums = CopySums("cuda")

    def fused() -> None:  # as a bucket's pieces: batched, one flush (the totals are read once per sync, not here)
        for i in range(parts):
            sums.copy(dst[i * step:(i + 1) * step], src[i * step:(i + 1) * step], f"p{i % 8}", i * step)
        sums.flush()

    a, b = _time(plain), _time(fused)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        fused()
    host = (time.perf_counter() - t0) / 10  # what a bucket's 64 copies and its flush cost the host (no waits)
    torch.cuda.synchronize()
    print(f"\n[gpu] checksum {str(src_dtype).removeprefix('torch.')} -> bf16, 1 GiB in {parts} pieces: copy_ "
          f"{a * 1e3:.2f} ms ({n * (src.element_size() + 2) / a / 1e9:.0f} GB/s), fused copy + checksum "
          f"{b * 1e3:.2f} ms: {b / a:.3f}x; its host side {host * 1e3:.2f} ms per bucket")
    from colo.sync import checksum_cuda as K

    keep = K.BLOCK, K.WARPS, K.PER_SM
    try:  # the launch settings around the module's, to tune them from one run: `[gpu] checksum sweep` lines
        swept = []
        for K.BLOCK in (512, 1024, 2048, 4096):
            for K.WARPS in (4, 8):
                for K.PER_SM in (4, 8, 16):
                    swept.append((_time(fused, reps=10) / a, K.BLOCK, K.WARPS, K.PER_SM))
    finally:
        K.BLOCK, K.WARPS, K.PER_SM = keep
    for ratio, block, warps, per_sm in sorted(swept)[:4]:
        print(f"[gpu] checksum sweep {str(src_dtype).removeprefix('torch.')}: BLOCK {block} WARPS {warps} "
              f"PER_SM {per_sm}: {ratio:.3f}x the copy")
    assert b / a < 2.0, "far off the copy's bandwidth: the kernel did not vectorize?"
