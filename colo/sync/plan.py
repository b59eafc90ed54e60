"""SyncPlan: which element runs go into which bucket at which byte offset. Built once per engine.

The plan depends only on (trainer param names/shapes, the engine's describe()), both fixed for a run,
so the sender caches it and every sync replays it: no per-sync name matching or shape arithmetic.

Pieces are in trainer-parameter order (the order the source materializes tensors), so buckets fill
front to back while FSDP units are gathered one after another. Every piece starts on a 256-byte
boundary; a tensor larger than a bucket is split over consecutive buckets by element ranges.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from colo.dtypes import torch_dtype
from colo.sync.mapping import Arch, MappingError, Segment, direct_mapping, numel, reference_segments
from colo.sync.transport import align_up

WIRE_KEYS = ("dst", "dst_offset", "numel", "dtype", "buf_offset")  # direct: element runs of vLLM params
FILL_WIRE_KEYS = ("dst", "dst_offset", "numel", "dtype", "fill")  # direct: zeros into declared pad rows
REFERENCE_WIRE_KEYS = ("name", "shape", "dtype", "buf_offset")  # reference: whole checkpoint tensors


@dataclass
class SyncPlan:
    bucket_bytes: int
    buckets: list[list[dict]]  # per bucket: pieces (contract keys + sender-only "src", "src_offset", "layout")
    expect: dict[str, int]  # every vLLM param the engine must receive -> numel
    src_names: list[str]  # trainer params read, in order
    bucket_used: list[int] = field(default_factory=list)  # bytes used per bucket
    mode: str = "direct"  # "direct" (copy into vLLM params) | "reference" (vLLM's load_weights)

    def wire(self, k: int) -> list[dict]:
        """Bucket k's pieces as the receiver sees them (plain data, contract keys only)."""
        if self.mode != "direct":
            return [{key: p[key] for key in REFERENCE_WIRE_KEYS} for p in self.buckets[k]]
        return [{key: p[key] for key in (FILL_WIRE_KEYS if "fill" in p else WIRE_KEYS)} for p in self.buckets[k]]

    @property
    def total_bytes(self) -> int:
        return sum(p["numel"] * torch_dtype(p["dtype"]).itemsize for b in self.buckets for p in b if "fill" not in p)


def pack_segments(segs: list[Segment], dtypes: dict[str, str], bucket_bytes: int,
                  whole: bool = False) -> tuple[list[list[dict]], list[int]]:
    """Lay segments out in buckets of `bucket_bytes`; splits a segment where a bucket fills up (transposed
    expert runs only between experts), unless `whole` (reference mode: vLLM's load_weights takes whole
    tensors), which starts a new bucket instead. Fill segments carry no bytes: they ride in the current
    bucket as a piece with "fill" instead of "buf_offset"."""
    if bucket_bytes < 4096:
        raise ValueError(f"bucket of {bucket_bytes} bytes is too small")
    buckets: list[list[dict]] = [[]]
    used = [0]
    for s in segs:
        dtype = dtypes[s.dst]
        esize = torch_dtype(dtype).itemsize
        if s.fill:
            buckets[-1].append({"dst": s.dst, "dst_offset": s.dst_offset, "numel": s.numel, "dtype": dtype,
                                "fill": 0, "src": s.src, "src_offset": 0})
            continue
        unit = s.layout[0] * s.layout[1] if s.layout else (max(1, s.numel) if whole else 1)  # smallest piece
        if unit * esize > bucket_bytes:
            what = "one expert" if s.layout else "it"
            raise ValueError(f"{s.dst}: {unit * esize} bytes ({what}) does not fit a {bucket_bytes}-byte "
                             "bucket whole; fix: raise sync.bucket_mb")
        done = 0
        while done < s.numel:
            off = align_up(used[-1])
            room = ((bucket_bytes - off) // esize) // unit * unit if off < bucket_bytes else 0
            if room <= 0:
                buckets.append([])
                used.append(0)
                continue
            n = min(s.numel - done, room)
            piece = {"dst": s.dst, "dst_offset": s.dst_offset + done, "numel": n, "dtype": dtype,
                     "buf_offset": off, "src": s.src, "src_offset": s.src_offset + done}
            if s.layout:
                piece["layout"] = list(s.layout)
            buckets[-1].append(piece)
            used[-1] = off + n * esize
            done += n
    if not buckets[-1]:
        buckets.pop()
        used.pop()
    return buckets, used


def build_plan(arch: Arch, trainer_shapes: dict[str, tuple[int, ...]], describe: dict, bucket_bytes: int) -> SyncPlan:
    """The direct-copy plan; raises MappingError naming, all at once, every trainer tensor without a
    destination and every vLLM param that nothing would write exactly."""
    segs, errors = direct_mapping(arch, trainer_shapes, describe)
    if errors:
        raise MappingError("the trainer's parameters do not map onto the engine's exactly:\n  " + "\n  ".join(errors))
    params = describe["params"]
    expect = {n: numel(p["shape"]) for n, p in params.items()}
    buckets, used = pack_segments(segs, {n: p["dtype"] for n, p in params.items()}, bucket_bytes)
    src_names = list(dict.fromkeys(s.src for s in segs))
    return SyncPlan(bucket_bytes=bucket_bytes, buckets=buckets, expect=expect, src_names=src_names, bucket_used=used)


def build_reference_plan(arch: Arch, trainer_shapes: dict[str, tuple[int, ...]], dtype: str,
                         bucket_bytes: int) -> SyncPlan:
    """Whole checkpoint-named tensors (experts un-fused) for vLLM's own weight loaders.

    The plan for engines whose params are tensor-parallel shards: every TP worker receives the same full
    tensors and vLLM's loaders cut each worker's slice (and fuse q/k/v, gate/up) as they do from disk."""
    segs, shapes = [], {}
    for name, shape in trainer_shapes.items():
        for ckpt, off, part_shape in reference_segments(arch, name, shape):
            segs.append(Segment(name, off, ckpt, 0, numel(part_shape)))
            shapes[ckpt] = list(part_shape)
    buckets, used = pack_segments(segs, {s.dst: dtype for s in segs}, bucket_bytes, whole=True)
    for b in buckets:
        for p in b:
            p["name"], p["shape"] = p["dst"], shapes[p["dst"]]
    return SyncPlan(bucket_bytes=bucket_bytes, buckets=buckets, expect={s.dst: s.numel for s in segs},
                    src_names=list(trainer_shapes), bucket_used=used, mode="reference")
