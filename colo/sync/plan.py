"""SyncPlan: which element runs go into which bucket at which byte offset. Built once per engine.

    plan = build_plan(arch, trainer_shapes, engine.describe(), bucket_bytes)      # direct: into vLLM's params
    plan = build_reference_plan(arch, trainer_shapes, "bfloat16", bucket_bytes)  # whole Hub-named tensors

The HF -> vLLM name rules live here and nowhere else: the family's table (colo.models.archs) is data, and
`direct_mapping` applies it against what the engine declares (fused q/k/v and gate/up, fused experts by
module prefix, renames, vocabulary padding). The sender looks the family's table up (arch_for) only to hand
it to the plan, and asks the plan, never the table, where a trainer tensor goes and which are fused experts
(`SyncPlan.expert_modules`, for the expert fast path; expert_shard_range is FSDP's shard rule, not a name rule).

Vocabulary padding: vLLM pads the rows of the embedding and lm_head to a multiple of 64 and fills the
pad rows with zeros when it loads from disk. The engine declares them (`describe()["params"][name]
["rows"]` = rows holding vocabulary); the plan then writes the trainer's V rows and a zero-fill segment
over exactly the declared pad rows, so coverage stays exact: a missing vocabulary row is still a gap.

FP8 engines (colo.sync.fp8): a trainer tensor vLLM holds in e4m3 comes with a companion `<name>_scale_inv` of its
block-scale shape, which maps as its base does (stacked parts to row offsets of the fused scale; experts by module to
`<expert param>_scale_inv`).

The plan depends only on (trainer param names/shapes, the engine's describe()), both fixed for a run,
so the sender caches it and every sync replays it: no per-sync name matching or shape arithmetic.

Pieces are in trainer-parameter order (the order the source materializes tensors), so buckets fill
front to back while FSDP units are gathered one after another. Every piece starts on a 256-byte
boundary; a tensor larger than a bucket is split over consecutive buckets by element ranges.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from colo.models.dtypes import torch_dtype
from colo.models.archs import Arch, Experts, expert_param, numel, reference_segments, rename
from colo.sync.fp8 import SCALE
from colo.sync.transport import align_up

WIRE_KEYS = ("dst", "dst_offset", "numel", "dtype", "buf_offset")  # direct: element runs of vLLM params
FILL_WIRE_KEYS = ("dst", "dst_offset", "numel", "dtype", "fill")  # direct: zeros into declared pad rows
REFERENCE_WIRE_KEYS = ("name", "shape", "dtype", "buf_offset")  # reference: whole checkpoint tensors


class MappingError(ValueError):
    """Trainer tensors without a vLLM destination, or vLLM params nothing writes: every one, named."""


@dataclass(frozen=True)
class Segment:
    """src.view(-1)[src_offset : src_offset+numel] -> dst.view(-1)[dst_offset : ...] (elements).

    `src_offset` counts in the full (unsharded) HF tensor; a source holding only rows [r0, ...) of it
    subtracts r0 * row_numel. `layout` (A, B): the run is whole expert blocks stored (A, B) in the
    source and (B, A) in the destination. `fill`: no source bytes; the destination elements are the
    engine's declared padding rows and get zeros."""
    src: str
    src_offset: int
    dst: str
    dst_offset: int
    numel: int
    layout: tuple[int, int] | None = None
    fill: bool = False


def find_expert_param(params: dict, moe_module: str, suffix: str) -> str | None:
    """vLLM name of an MoE layer's fused expert param, with or without a nested `routed_experts`."""
    hits = [n for n in params if n.startswith(moe_module + ".") and n.endswith("." + suffix)]
    if len(hits) > 1:
        raise ValueError(f"ambiguous vLLM expert params for {moe_module}.{suffix}: {hits}")
    return hits[0] if hits else None


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """[(first global id, first local slot, count)] for consecutive runs of global expert ids."""
    out: list[tuple[int, int, int]] = []
    for slot, g in enumerate(ids):
        if out and out[-1][0] + out[-1][2] == g:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((g, slot, 1))
    return out


def _expert_entry(arch: Arch, name: str) -> Experts | None:
    """The expert table entry of trainer tensor `name`, also for an FP8 scale companion `<expert param>_scale_inv`
    (colo.sync.fp8), which maps expert by expert onto `<vLLM expert param>_scale_inv` as its base maps."""
    ex = expert_param(arch, name)
    if ex is None and name.endswith(SCALE):
        base = expert_param(arch, name[: -len(SCALE)])
        if base is not None and not base.transpose:
            return Experts(base.hf + SCALE, base.vllm + SCALE)
    return ex


def _stacked_dst(arch: Arch, name: str, trainer_shapes: dict, params: dict) -> tuple[str, int] | None:
    """(vLLM param, element offset) when `name` is one part of a param vLLM stacks along dim 0."""
    module, _, leaf = name.rpartition(".")
    for hf, vl, slot in arch.stacked:
        if not module.endswith("." + hf):
            continue
        base = module[: -len(hf)]
        dst = rename(f"{base}{vl}.{leaf}", arch.renames)
        if dst not in params:
            return None  # vLLM keeps this one unfused here: maps by name
        rows_before = sum(int(trainer_shapes[f"{base}{h}.{leaf}"][0]) for h, v, s in arch.stacked
                          if v == vl and s < slot and f"{base}{h}.{leaf}" in trainer_shapes)
        return dst, rows_before * numel(trainer_shapes[name][1:])
    return None


def direct_mapping(arch: Arch, trainer_shapes: dict[str, tuple[int, ...]], describe: dict,
                   names_only: bool = False) -> tuple[list[Segment], list[str]]:
    """(segments in trainer-parameter order, problems). Problems name every trainer tensor without a
    destination and every vLLM param that the segments do not cover exactly, all at once. `names_only`:
    compare names, not sizes (a tensor-parallel worker holds slices; its segments are not meaningful)."""
    params = describe["params"]
    experts = describe.get("experts", {})
    segs: list[Segment] = []
    errors: list[str] = []
    for name, shape in trainer_shapes.items():
        stacked = _stacked_dst(arch, name, trainer_shapes, params)
        if stacked is not None:
            segs.append(Segment(name, 0, stacked[0], stacked[1], numel(shape)))
            continue
        ex = _expert_entry(arch, name)
        if ex is not None:
            module = rename(name.rpartition(".")[0], arch.renames)
            dst = find_expert_param(params, module, ex.vllm)
            if dst is None:
                errors.append(f"{name}: no vLLM param {module}.*{ex.vllm}")
                continue
            block = tuple(int(s) for s in shape[1:])
            want = tuple(reversed(block)) if ex.transpose else block
            if names_only:
                segs.append(Segment(name, 0, dst, 0, numel(params[dst]["shape"])))
                continue
            if tuple(params[dst]["shape"][1:]) != want:
                errors.append(f"{name}: expert block {list(block)} -> {list(want)} does not fit vLLM "
                              f"{dst} {params[dst]['shape']}")
                continue
            ids = experts.get(dst.rpartition(".")[0], list(range(int(shape[0]))))
            per = numel(block)
            layout = block if ex.transpose else None
            for g, slot, count in _runs([int(i) for i in ids]):
                segs.append(Segment(name, g * per, dst, slot * per, count * per, layout=layout))
            continue
        dst = rename(name, arch.renames)
        if dst not in params:
            errors.append(f"{name}: no vLLM param {dst}" if dst != name else f"{name}: no vLLM param of that name")
            continue
        p, n = params[dst], numel(shape)
        if numel(p["shape"]) == n or names_only:
            segs.append(Segment(name, 0, dst, 0, n))
        elif p.get("rows") == shape[0] and list(p["shape"][1:]) == list(shape[1:]) and p["shape"][0] > shape[0]:
            # vocabulary padding the engine declared: the real rows, then zeros over exactly the pad rows
            segs.append(Segment(name, 0, dst, 0, n))
            segs.append(Segment(name, 0, dst, n, numel(p["shape"]) - n, fill=True))
        else:
            pad = f" (rows holding vocabulary: {p['rows']})" if "rows" in p else ""
            errors.append(f"{name}: trainer shape {list(shape)} vs vLLM {p['shape']}{pad}")
    got: dict[str, int] = {}
    for s in segs:
        got[s.dst] = got.get(s.dst, 0) + s.numel
    for n in params:
        if n not in got:
            errors.append(f"{n}: nothing writes it (no trainer tensor maps to this vLLM param)")
        elif got[n] != numel(params[n]["shape"]) and not names_only:
            errors.append(f"{n}: {got[n]} of {numel(params[n]['shape'])} elements written")
    return segs, errors


@dataclass
class SyncPlan:
    bucket_bytes: int
    buckets: list[list[dict]]  # per bucket: pieces (contract keys + sender-only "src", "src_offset", "layout")
    expect: dict[str, int]  # every vLLM param the engine must receive -> numel
    src_names: list[str]  # trainer params read, in order
    bucket_used: list[int] = field(default_factory=list)  # bytes used per bucket
    mode: str = "direct"  # "direct" (copy into vLLM params) | "reference" (vLLM's load_weights)
    expert_modules: dict[str, str] = field(default_factory=dict)  # direct: fused expert param -> vLLM MoE module

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
        # smallest piece: whole expert blocks (layout), whole tensors (reference), else 16 bytes, so that a split
        # leaves both parts' starts 16-byte aligned where the tensor's are (the fused CUDA copy vectorizes then)
        unit = s.layout[0] * s.layout[1] if s.layout else (max(1, s.numel) if whole else max(1, 16 // esize))
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
    experts = {s.src: s.dst.rpartition(".")[0] for s in segs if expert_param(arch, s.src) is not None}
    return SyncPlan(bucket_bytes=bucket_bytes, buckets=buckets, expect=expect, src_names=src_names, bucket_used=used,
                    expert_modules=experts)


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
