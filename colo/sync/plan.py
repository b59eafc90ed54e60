"""SyncPlan: which element runs go into which bucket at which byte offset. Built once per engine.

The plan depends only on (trainer param names/shapes, the engine's describe()), both fixed for a run,
so the sender caches it and every sync replays it: no per-sync name matching or shape arithmetic.

Pieces are in trainer-parameter order (the order the source materializes tensors), so buckets fill
front to back while FSDP units are gathered one after another. Every piece starts on a 256-byte
boundary; a tensor larger than a bucket is split over consecutive buckets by element ranges.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from colo.sync.mapping import Arch, Segment, direct_segments
from colo.sync.transport import align_up

WIRE_KEYS = ("dst", "dst_offset", "numel", "dtype", "buf_offset")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


@dataclass
class SyncPlan:
    bucket_bytes: int
    buckets: list[list[dict]]  # per bucket: pieces (contract keys + sender-only "src", "src_offset")
    expect: dict[str, int]  # every vLLM param the engine must receive -> numel
    src_names: list[str]  # trainer params read, in order
    bucket_used: list[int] = field(default_factory=list)  # bytes used per bucket

    def wire(self, k: int) -> list[dict]:
        """Bucket k's pieces as the receiver sees them (plain data, contract keys only)."""
        return [{key: p[key] for key in WIRE_KEYS} for p in self.buckets[k]]

    @property
    def total_bytes(self) -> int:
        return sum(p["numel"] * torch_dtype(p["dtype"]).itemsize for b in self.buckets for p in b)


def pack_segments(segs: list[Segment], dtypes: dict[str, str], bucket_bytes: int) -> tuple[list[list[dict]], list[int]]:
    """Lay segments out in buckets of `bucket_bytes`; splits a segment where a bucket fills up."""
    if bucket_bytes < 4096:
        raise ValueError(f"bucket of {bucket_bytes} bytes is too small")
    buckets: list[list[dict]] = [[]]
    used = [0]
    for s in segs:
        dtype = dtypes[s.dst]
        esize = torch_dtype(dtype).itemsize
        done = 0
        while done < s.numel:
            off = align_up(used[-1])
            room = (bucket_bytes - off) // esize if off < bucket_bytes else 0
            if room <= 0:
                buckets.append([])
                used.append(0)
                continue
            n = min(s.numel - done, room)
            buckets[-1].append({"dst": s.dst, "dst_offset": s.dst_offset + done, "numel": n, "dtype": dtype,
                                "buf_offset": off, "src": s.src, "src_offset": s.src_offset + done})
            used[-1] = off + n * esize
            done += n
    if not buckets[-1]:
        buckets.pop()
        used.pop()
    return buckets, used


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def build_plan(arch: Arch, trainer_shapes: dict[str, tuple[int, ...]], describe: dict, bucket_bytes: int) -> SyncPlan:
    """The direct-copy plan; raises naming any vLLM param that nothing would write, or writes past."""
    segs = direct_segments(arch, trainer_shapes, describe)
    params = describe["params"]
    expect = {n: _numel(p["shape"]) for n, p in params.items()}
    got: dict[str, int] = {}
    for s in segs:
        got[s.dst] = got.get(s.dst, 0) + s.numel
    missing = sorted(n for n in expect if n not in got)
    wrong = sorted(f"{n}: {got[n]} of {expect[n]} elements" for n in got if n in expect and got[n] != expect[n])
    if missing or wrong:
        raise ValueError("sync plan does not cover the engine's params exactly:\n  "
                         + "\n  ".join([f"{n}: nothing writes it" for n in missing] + wrong))
    buckets, used = pack_segments(segs, {n: p["dtype"] for n, p in params.items()}, bucket_bytes)
    src_names = list(dict.fromkeys(s.src for s in segs))
    return SyncPlan(bucket_bytes=bucket_bytes, buckets=buckets, expect=expect, src_names=src_names, bucket_used=used)
