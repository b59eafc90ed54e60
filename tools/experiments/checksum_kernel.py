"""The checksum kernel alone against torch's copy_, and against the kernel it replaced, in one run.

    python -m tools.experiments.checksum_kernel --json                  # a GPU: 1 GiB of bf16 in 64 pieces
    TRITON_INTERPRET=1 python -m tools.experiments.checksum_kernel --device cpu --elements 4096 --reps 1   # it runs

Why: on an H100 the checksum cost the L4 slice's sync 9-13%, and the fused kernel ran at 0.87x `copy_`'s speed from
bf16 with a mix of each element's index (about ten integer operations per 2-byte element: the kernel was bound by
its arithmetic, not by memory). This times colo.sync.checksum_cuda's kernel launched directly (no CopySums host
side): one mix per 32-bit word (`colo`), the same kernel with a mix per element at the element's word and shift
(`colo per-element`, its path for pieces that start inside a word), and `before`, the per-element checksum it
replaced (sign-extended elements, 64-bit sums), on the same pieces: the destination is bf16, the source float32 (the
sender's shards) or bf16 (the receiver's buffer). colo's sums must equal the torch path's (colo.sync.checksum) in
both forms, and `before`'s launches must agree with each other.
Its answer is in docs/benchmarks.md, "Verification: cost and noise". Arguments are parsed before torch is imported.
"""
from __future__ import annotations

import argparse
import json
import time

import triton
import triton.language as tl


@triton.jit
def _before(src_base, dst_base, table, n_pieces, sums, COPY: tl.constexpr, BITS: tl.constexpr,
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
        if pid * BLOCK < n:  # only programs that summed a block of this piece: a small piece's add is one, not
            tl.atomic_add(sums + slot, tl.sum(acc, axis=0))  # one per program on one address


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.experiments.checksum_kernel", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--elements", type=int, default=1 << 29, help="bf16 elements of the destination")
    ap.add_argument("--pieces", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    import torch

    from colo.sync import checksum_cuda as K
    from colo.sync.checksum import MASK, checksum

    dev = torch.device(args.device)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    n, parts = args.elements, args.pieces
    step = n // parts
    table = torch.tensor([[i * step, i * step, step, i * step, i % 8] for i in range(parts)], dtype=torch.int64,
                         device=dev)

    def timed(fn) -> float:  # seconds per call, after one warm-up call (CUDA events on a GPU)
        fn()
        if dev.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(args.reps):
                fn()
            return (time.perf_counter() - t0) / args.reps
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / args.reps

    rows = []
    for sd in (torch.float32, torch.bfloat16):
        src = torch.randn(n, device=dev, dtype=sd)
        dst = torch.empty(n, device=dev, dtype=torch.bfloat16)
        vec = 16 // src.element_size()
        copy = timed(lambda: [dst[i * step:(i + 1) * step].copy_(src[i * step:(i + 1) * step]) for i in range(parts)])
        first_before, written = None, None
        for name, kernel, settings in [("colo", K._copy_sum, (K.BLOCK, K.WARPS, K.PER_SM)),
                                       ("colo", K._copy_sum, (2048, 4, 4)),
                                       ("colo per-element", K._copy_sum, (K.BLOCK, K.WARPS, K.PER_SM)),
                                       ("before", _before, (1024, 8, 16)), ("before", _before, (2048, 4, 4))]:
            block, warps, per_sm = settings
            sums = torch.zeros(8, dtype=torch.int64, device=dev)
            words = {} if kernel is _before else {"WORDS": name == "colo"}

            def launch() -> None:
                kernel[(per_sm * sms,)](src, dst, table, parts, sums, COPY=True, BITS=16, VEC=vec, BLOCK=block,
                                        num_warps=warps, **words)
            launch()
            if kernel is _before:  # its own definition: its launches agree
                first_before = sums.clone() if first_before is None else first_before
                assert torch.equal(sums, first_before), (name, settings)
            else:  # the torch path's totals (colo.sync.checksum) of what the launch wrote
                written = written or [sum(checksum(dst[i * step:(i + 1) * step], i * step) for i in range(k, parts, 8))
                                      & MASK for k in range(8)]
                assert [int(x) & MASK for x in sums.cpu()] == written, (name, settings)
            seconds = timed(launch)
            rows.append({"source": str(sd).removeprefix("torch."), "kernel": name, "block": block, "warps": warps,
                         "per_sm": per_sm, "ms": seconds * 1e3, "copy_ms": copy * 1e3, "ratio": seconds / copy})
            print(f"[checksum_kernel] {rows[-1]['source']} -> bf16, {name} BLOCK {block} WARPS {warps} PER_SM "
                  f"{per_sm}: {seconds * 1e3:.2f} ms, {seconds / copy:.2f}x copy_ ({copy * 1e3:.2f} ms)")
    out = {"experiment": "checksum_kernel", "device": args.device, "elements": n, "pieces": parts, "rows": rows}
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
