"""Packing, shared-memory transport and coverage checks, across two real processes (no vLLM).

    .venv/bin/python -m pytest tests/unit/test_sync_pack.py -q
"""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from colo.models.dtypes import torch_dtype
from colo.sync.plan import Segment
from colo.sync.plan import SyncPlan, pack_segments
from colo.sync.sender import pack_piece
from colo.sync.transport import ALIGN, ReceiverBuffers, SenderBuffers
from colo.sync.verify import Coverage

SHAPES = {"a.bf16": ((37, 5), torch.bfloat16), "b.fp32": ((1000,), torch.float32),
          "c.i64": ((3, 7, 2), torch.int64), "big.bf16": ((50, 100), torch.bfloat16),  # 10000 B > bucket
          "scalar.fp32": ((1,), torch.float32)}
BUCKET = 4096


def _sources() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (shape, dt) in SHAPES.items():
        if dt.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dt)
        else:
            out[name] = torch.randint(-2**62, 2**62, shape, generator=g, dtype=dt)
    return out


def _plan() -> SyncPlan:
    segs = [Segment(n, 0, n, 0, int(torch.Size(s).numel())) for n, (s, _) in SHAPES.items()]
    dtypes = {n: str(dt).removeprefix("torch.") for n, (_, dt) in SHAPES.items()}
    buckets, used = pack_segments(segs, dtypes, BUCKET)
    expect = {n: int(torch.Size(s).numel()) for n, (s, _) in SHAPES.items()}
    return SyncPlan(BUCKET, buckets, expect, list(SHAPES), used)


def _receiver(conn, handles, plan_wire, expect, shapes) -> None:
    """Another process: opens each handle once, copies pieces out per bucket, reports coverage."""
    rb = ReceiverBuffers("cpu")
    dst = {n: torch.zeros(torch.Size(s).numel(), dtype=torch_dtype(d)) for n, (s, d) in shapes.items()}
    cov = Coverage(expect)
    while True:
        msg = conn.recv()
        if msg == "end":
            break
        k, slot = msg
        rb.set_active(handles)
        buf = rb.get(slot)
        for p in plan_wire[k]:
            dt = torch_dtype(p["dtype"])
            src = buf[p["buf_offset"]: p["buf_offset"] + p["numel"] * dt.itemsize].view(dt)
            dst[p["dst"]][p["dst_offset"]: p["dst_offset"] + p["numel"]].copy_(src)
            cov.add(p["dst"], p["dst_offset"], p["numel"], p["numel"] * dt.itemsize)
        conn.send("ok")
    raw = {n: t.view(torch.uint8).numpy().tobytes() for n, t in dst.items()}  # plain bytes over the pipe
    conn.send((raw, rb.opened, cov.errors({n: t.numel() for n, t in dst.items()})))


def test_plan_splits_and_aligns() -> None:
    plan = _plan()
    assert len(plan.buckets) >= 3
    big = [p for b in plan.buckets for p in b if p["dst"] == "big.bf16"]
    assert len(big) >= 3, "a 10000-byte tensor must span several 4096-byte buckets"
    assert sum(p["numel"] for p in big) == 5000
    assert [p["dst_offset"] for p in big] == sorted(p["dst_offset"] for p in big)
    for b in plan.buckets:
        for p in b:
            assert p["buf_offset"] % ALIGN == 0
            assert p["dst_offset"] * torch_dtype(p["dtype"]).itemsize % 16 == 0  # splits keep 16-byte starts
            assert p["buf_offset"] + p["numel"] * torch_dtype(p["dtype"]).itemsize <= BUCKET


def test_roundtrip_bit_exact_across_processes() -> None:
    plan = _plan()
    src = _sources()
    sb = SenderBuffers(BUCKET, 2, "cpu")
    shapes = {n: (s, str(d).removeprefix("torch.")) for n, (s, d) in SHAPES.items()}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, sb.handles(), [plan.wire(k) for k in range(len(plan.buckets))],
                                               plan.expect, shapes))
    proc.start()
    try:
        for k, bucket in enumerate(plan.buckets):
            slot = k % sb.count
            for p in bucket:
                pack_piece(sb.tensors[slot], p, (src[p["src"]], 0), tuple(src[p["src"]].shape))
            parent.send((k, slot))
            assert parent.recv() == "ok"  # synchronous here; the sender overlaps via Ray refs
        parent.send("end")
        raw, opened, errors = parent.recv()
    finally:
        proc.join(timeout=30)
        sb.close()
    assert errors == []
    assert opened == 2, "each buffer must be opened once and then served from the cache"
    for n, t in src.items():
        assert raw[n] == t.reshape(-1).view(torch.uint8).numpy().tobytes(), n  # bit-exact


def test_sender_unlinks_segments() -> None:
    from multiprocessing import shared_memory

    sb = SenderBuffers(4096, 2, "cpu")
    names = [h["name"] for h in sb.handles()]
    sb.close()
    for n in names:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=n)


def test_coverage_names_dropped_and_duplicated() -> None:
    cov = Coverage({"w": 100, "v": 10})
    cov.add("w", 0, 40, 80)
    cov.add("w", 60, 40, 80)      # [40, 60) dropped
    cov.add("v", 0, 10, 20)
    cov.add("v", 5, 5, 10)        # [5, 10) twice
    errs = cov.errors({"w": 100, "v": 10, "u": 3})
    assert any(e.startswith("w: elements [40, 60) never written") for e in errs), errs
    assert any(e.startswith("v: elements [5, 10) written twice") for e in errs), errs
    assert any(e.startswith("u:") for e in errs), errs
    ok = Coverage({"w": 4})
    ok.add("w", 0, 2, 4)
    ok.add("w", 2, 2, 4)
    assert ok.errors({"w": 4}) == []


def test_cuda_ipc_args_pin_torchs_rebuild_layout() -> None:
    """CudaIpcArgs names, in order, the parameters of the torch function that opens a CUDA-IPC handle: a
    torch that reorders, adds or drops one fails here, on CPU, before a GPU sync could rebuild a tensor
    from the wrong fields."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from colo.sync.transport import CudaIpcArgs

    assert CudaIpcArgs._fields == tuple(inspect.signature(rebuild_cuda_tensor).parameters)
