"""The checksum kernel alone against torch's copy_, and against the kernel it replaced, in one run.

    python -m tools.experiments.checksum_kernel --json                  # a GPU: 1 GiB of bf16 in 64 pieces
    TRITON_INTERPRET=1 python -m tools.experiments.checksum_kernel --device cpu --elements 4096 --reps 1   # it runs

Why: on an H100 the sync's checksum cost 13% of the L4 slice's sync, and its GPU test timed the kernel at 2.5x a
plain copy from bf16. This times colo.sync.checksum_cuda's kernel launched directly (no CopySums host side), at the
module's launch settings and a few others, beside `before`, the kernel as it was until 2026-12-07 (64-bit index
arithmetic; masked 2-byte loads that stayed 2 bytes wide), on the same pieces: the destination is bf16, the source
float32 (the sender's shards) or bf16 (the receiver's buffer). Every launch's sums must equal the first's.
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
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    k1 = tl.full([BLOCK], 0x9E3779B1, tl.uint32)
    k2 = tl.full([BLOCK], 0x85EBCA77, tl.uint32)
    for p in range(n_pieces):
        so = tl.load(table + p * 5)
        do = tl.load(table + p * 5 + 1)
        n = tl.load(table + p * 5 + 2)
        pos = tl.load(table + p * 5 + 3)
        slot = tl.load(table + p * 5 + 4)
        so = tl.multiple_of(so, VEC)
        do = tl.multiple_of(do, VEC)
        acc = tl.zeros([BLOCK], tl.int64)
        for start in range(pid * BLOCK, n, nprog * BLOCK):
            o = start + tl.arange(0, BLOCK).to(tl.int64)
            m = o < n
            if COPY:
                x = tl.load(src_base + so + o, mask=m)
                y = x.to(dst_base.dtype.element_ty, fp_downcast_rounding="rtne")
                tl.store(dst_base + do + o, y, mask=m)
            else:
                y = tl.load(dst_base + do + o, mask=m)
            if BITS == 8:
                b = y.to(tl.int8, bitcast=True).to(tl.int32).to(tl.uint32, bitcast=True)
            elif BITS == 16:
                b = y.to(tl.int16, bitcast=True).to(tl.int32).to(tl.uint32, bitcast=True)
            else:
                b = y.to(tl.uint32, bitcast=True)
            h = (pos + o).to(tl.uint32) * k1  # uint32 products wrap: mod 2^32, as the torch path's & M32
            h = h ^ (h >> 15)
            w = (h * k2) | 1
            acc += tl.where(m, (b * w).to(tl.int64), 0)
        tl.atomic_add(sums + slot, tl.sum(acc, axis=0))



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
        first = None
        for name, kernel, settings in [("colo", K._copy_sum, (K.BLOCK, K.WARPS, K.PER_SM)),
                                       ("colo", K._copy_sum, (2048, 4, 4)), ("before", _before, (2048, 4, 4)),
                                       ("before", _before, (1024, 8, 16))]:
            block, warps, per_sm = settings
            sums = torch.zeros(8, dtype=torch.int64, device=dev)

            def launch() -> None:
                kernel[(per_sm * sms,)](src, dst, table, parts, sums, COPY=True, BITS=16, VEC=vec, BLOCK=block,
                                        num_warps=warps)
            launch()
            first = sums.clone() if first is None else first
            assert torch.equal(sums, first), (name, settings)  # one launch's sums: every kernel computes the same
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
