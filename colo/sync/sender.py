"""The trainer side of the weight sync: FSDP2 shards -> packed buffers -> the engines, verified.

    sender = Sender.colocated(model, cfg.sync, engine)               # rank r -> the engine on its GPU
    sender = Sender.broadcast(model, cfg.sync, engines, group)       # rank 0 -> every engine (others: group None)
    report = sender.push()                                           # every sync; raises SyncError when unverified
    sender.close()                                                   # unlink the shared buffers

Building a Sender is collective (every trainer rank builds one at the same time): it asks the engine
for its describe(), builds the SyncPlan (plan.py, from the family's table in colo.models.archs), decides the
expert fast path (an all-reduce) and allocates its buffers once. Every push() then replays the plan:

    FSDP unit ──unshard() (1 all-gather/unit; expert units ──to_local(), no all-gather, when the
      shard is exactly the engine's experts)──▶ tensors ──[FP8 engine: fp8.py quantizes: e4m3 + scales;
      on CUDA fp8_pack.py does it inside pack_piece]──pack_piece: copy+cast into buffer k % B──▶
    link.send(k): colocated, engine.load_bucket reads our buffer in place (transport: shm / CUDA IPC);
      disaggregated, every engine posts load_bucket and we broadcast the bucket (transport.WeightGroup)
    ──▶ end_sync on every engine: coverage + checksums (colo.sync.checksum: the sender's, taken as it packs,
      against the receiver's, taken as it writes) ──▶ report

Two plans, one path: "direct" copies element runs into vLLM's own (fused) tensors; "reference"
(sync.mode=load_weights, or tensor-parallel engines) sends whole checkpoint-named tensors (experts
un-fused) that the receiver hands to vLLM's own load_weights. Both go through the same source,
packing, buffers, links and verification.

FSDP units (`ParamSource`): colo.trainer.fsdp applies fully_shard to each `layer.mlp.experts`, each
decoder layer, then the root; every param is a DTensor sharded Shard(0) over all ranks. Persistent
buffers (DeepSeek's and GLM's `e_score_correction_bias`: state the engine needs, not trained) are plain
tensors on every rank and travel with the unit that owns them. Never one `full_tensor()` per param
(one collective per tensor: the baseline's cost, colo.bench.yardsticks). unshard() is collective, so
the expert fast-path choice must be the same on every rank: the flags are all-reduced.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from colo.config import SyncConfig
from colo.models.dtypes import torch_dtype
from colo.models.archs import Arch, arch_for, architecture, expert_shard_range
from colo.sync.fp8 import FP8_DTYPE, SCALE, Fp8Plan, Fp8PlanError
from colo.sync.fp8_pack import Deferred, VIAS, quantize_unit, uncovered_scales
from colo.sync.merge import merged
from colo.sync.plan import MappingError, build_plan, build_reference_plan, direct_mapping
from colo.sync.transport import SenderBuffers, WeightGroup, align_up
from colo.sync.checksum import CopySums, compare


class SyncError(RuntimeError):
    pass


def model_arch(model: nn.Module) -> Arch:
    """The family table of a HF model (NotImplementedError naming the supported ones otherwise)."""
    return arch_for(architecture(getattr(model, "config", None)) or type(model).__name__)


def bucket_bytes(cfg: SyncConfig) -> int:
    return int(float(cfg.bucket_mb) * 2**20)


# ------------------------------------------------------------------------------ the source: FSDP units


@dataclass
class Unit:
    path: str  # FSDP module path ("" = root); for an unsharded model the single unit ""
    module: nn.Module
    names: list[str]  # full param (and persistent buffer) names owned by this unit (not by a nested unit)
    is_experts: bool
    adapters: list[str] = field(default_factory=list)  # LoRA: its weights' adapters, merged in, never sent


def sync_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a sync sends: every parameter, then every persistent buffer (in the state dict, so in the
    checkpoint: vLLM holds them as parameters). Non-persistent buffers (RoPE tables) are derived. LoRA's
    adapters (`model.colo_lora`, colo.trainer.adapters) are not sent: they are merged into their weights."""
    adapters = {n for pair in getattr(model, "colo_lora", {}).values() for n in pair}
    out = [(n, p) for n, p in model.named_parameters() if n not in adapters]
    mods = dict(model.named_modules())
    for name, buf in model.named_buffers():
        mpath, _, leaf = name.rpartition(".")
        if leaf not in mods[mpath]._non_persistent_buffers_set:
            out.append((name, buf))
    return out


def _is_fsdp(m: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(m, FSDPModule)


class ParamSource:
    """The model's tensors, one FSDP unit at a time, in the order every rank walks them."""

    def __init__(self, model: nn.Module, arch: Arch) -> None:
        self.model, self.arch = model, arch
        mods = dict(model.named_modules())
        unit_paths = [p for p, m in mods.items() if _is_fsdp(m)] or [""]
        owned: dict[str, list[str]] = {p: [] for p in unit_paths}
        tensors = dict(sync_tensors(model))
        self.buffers = {n for n, _ in model.named_buffers()} & set(tensors)
        for name in tensors:
            owner = max((p for p in unit_paths if p == "" or name.startswith(p + ".")), key=len)
            owned[owner].append(name)
        suffix = "." + arch.experts_module
        self.units = [Unit(p, mods[p], owned[p], p.endswith(suffix)) for p in unit_paths if owned[p]]
        # LoRA (sync.lora=merged): each adapted weight leaves its unit as W + s B A (colo.sync.merge)
        self.lora: dict[str, tuple[str, str]] = dict(getattr(model, "colo_lora", {}))
        self.lora_scale = float(getattr(model, "colo_lora_scale", 0.0))
        for u in self.units:
            u.adapters = [n for w in u.names if w in self.lora for n in self.lora[w]]
        self.shapes: dict[str, tuple[int, ...]] = {}
        for u in self.units:
            for n in u.names:
                self.shapes[n] = tuple(tensors[n].shape)  # DTensor: global shape

    def _tensor(self, name: str) -> torch.Tensor:
        return self.model.get_buffer(name) if name in self.buffers else self.model.get_parameter(name)

    def expert_fast_path(self, describe: dict, expert_modules: dict[str, str]) -> tuple[bool, str]:
        """True when every expert unit's local shard is exactly what the colocated engine holds.
        `expert_modules`: the plan's vLLM MoE module of each fused expert param (SyncPlan.expert_modules).

        Collective when torch.distributed is initialized (all ranks must call it)."""
        ok, why = True, "expert shards match the engine's experts"
        if not any(u.is_experts for u in self.units):
            ok, why = False, "no FSDP expert units (a dense model, or an unsharded one)"
        rank = dist.get_rank() if dist.is_initialized() else 0
        for u in (u for u in self.units if u.is_experts):
            for name in u.names:
                p = self._tensor(name)
                if name not in expert_modules:  # the plan says where each tensor goes (colo.sync.plan)
                    ok, why = False, f"{name}: not a fused expert param"
                    break
                if not isinstance(p, DTensor) or p.device_mesh.ndim != 1 or not p.placements[0].is_shard(0):
                    ok, why = False, f"{name}: not a dim-0 sharded DTensor"
                    break
                held = describe.get("experts", {}).get(expert_modules.get(name, ""), None)
                start, stop = expert_shard_range(p.shape[0], p.device_mesh.size(), p.device_mesh.get_local_rank())
                if held != list(range(start, stop)):
                    ok, why = False, f"rank {rank} {u.path}: engine holds {held}, FSDP shard is [{start}, {stop})"
                    break
            if not ok:
                break
        if dist.is_initialized():
            dev = next(self.model.parameters()).device
            flag = torch.tensor([1 if ok else 0], device="cpu" if dev.type in ("cpu", "meta") else dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if ok and int(flag.item()) == 0:
                ok, why = False, "another rank's expert shard does not match its engine"
        return ok, why

    def _start_gather(self, u: Unit, expert_fast: bool) -> tuple[object | None, bool]:
        """Issue unit u's all-gather without waiting; (handle, gathered)."""
        if (expert_fast and u.is_experts) or not _is_fsdp(u.module):
            return None, False
        return u.module.unshard(async_op=True), True  # one batched all-gather (bf16 under mixed precision)

    def iter_units(self, expert_fast: bool, timings: dict[str, float]) -> Iterator[dict[str, tuple[torch.Tensor, int]]]:
        """Yields per unit {name: (tensor, row_start)}; `tensor` holds rows [row_start, ...) of the full
        param. The unit stays gathered until the consumer asks for the next one.

        The next unit's all-gather is issued before this one is handed out, so it runs while the consumer
        packs (measured on gloo: 9.0 ms sequential vs 5.7 ms overlapped for the tiny model's 5 units). Every
        rank walks the units in the same order, so the collectives match; at most two units are gathered."""
        pending = self._start_gather(self.units[0], expert_fast) if self.units else (None, False)
        for i, u in enumerate(self.units):
            t0 = time.perf_counter()
            handle, gathered = pending
            if handle is not None:
                handle.wait()
            nxt = self.units[i + 1] if i + 1 < len(self.units) else None
            pending = self._start_gather(nxt, expert_fast) if nxt is not None else (None, False)
            local = expert_fast and u.is_experts
            out: dict[str, tuple[torch.Tensor, int]] = {}
            for n in u.names + u.adapters:
                p = self._tensor(n)
                moved = gathered  # bytes of this tensor came out of an all-gather
                if isinstance(p, DTensor):
                    if local:
                        mesh = p.device_mesh
                        start, _ = expert_shard_range(p.shape[0], mesh.size(), mesh.get_local_rank())
                        out[n] = (p.to_local(), start)
                    else:  # outside FSDP (or unshard did not swap it): the slow but correct way
                        out[n] = (p.full_tensor(), 0)
                        moved = True
                        timings["full_tensor_fallbacks"] = timings.get("full_tensor_fallbacks", 0) + 1
                else:
                    out[n] = (p.data, 0)
                # Byte counters, so a test can prove the expert fast path gathered no expert bytes:
                # *_gathered_bytes = full tensors materialized by a collective (own shard included).
                nb = out[n][0].numel() * out[n][0].element_size()
                key = ("expert_" if u.is_experts else "") + ("gathered_bytes" if moved else "local_bytes")
                timings[key] = timings.get(key, 0) + nb
            for w in (w for w in u.names if w in self.lora):  # LoRA: the same rows of W, A and B (dim 0)
                a, b = (out.pop(n)[0] for n in self.lora[w])
                out[w] = (merged(out[w][0], a, b, self.lora_scale), out[w][1])
            timings["gather"] = timings.get("gather", 0.0) + time.perf_counter() - t0
            yield out
            if gathered:
                u.module.reshard()


def pack_piece(buf: torch.Tensor, piece: dict, src: tuple[torch.Tensor, int],
               full_shape: tuple[int, ...], sums: CopySums | None = None) -> torch.Tensor:
    """Copy one piece's elements (cast to the engine's dtype) into `buf` at its offset; returns that view. With
    `sums` the copy also adds the piece's checksum (in its destination's coordinates) to its destination's total,
    in the same pass on CUDA (colo.sync.checksum; batched: the caller flushes). A "layout" piece is whole expert
    blocks stored (A, B) here and (B, A) in the engine: copied transposed, then summed. A Deferred source (FP8 on
    CUDA, colo.sync.fp8_pack) is quantized into the buffer by the piece's own launch."""
    tensor, row_start = src
    row = 1
    for s in full_shape[1:]:
        row *= int(s)
    s = piece["src_offset"] - row_start * row
    n = piece["numel"]
    if s < 0 or s + n > tensor.numel():
        raise SyncError(f"{piece['src']}: elements [{piece['src_offset']}, +{n}) are not in this rank's "
                        f"rows [{row_start}, ...): the expert fast path does not match the plan")
    dtype = torch_dtype(piece["dtype"])
    out = buf[piece["buf_offset"]: piece["buf_offset"] + n * dtype.itemsize].view(dtype)  # (n,)
    if isinstance(tensor, Deferred):  # FP8 on CUDA: quantized straight into the buffer, checksum in the same pass
        tensor.pack(out, s, n, sums.device_total(piece["dst"]) if sums is not None else None, piece["dst_offset"])
        return out
    flat = tensor.reshape(-1)
    if "layout" in piece:
        a, b = piece["layout"]
        out.view(-1, b, a).copy_(flat[s: s + n].view(-1, a, b).transpose(1, 2))  # (k, B, A) <- (k, A, B)
        if sums is not None:
            sums.add(out, piece["dst"], piece["dst_offset"])
    elif sums is not None:
        sums.copy(out, flat[s: s + n], piece["dst"], piece["dst_offset"])  # casts to the engine's dtype
    else:
        out.copy_(flat[s: s + n])  # casts to the engine's dtype while packing
    return out


# ------------------------------------------------------------------------------------------ the links


class IpcLink:
    """Colocated: the one engine on this GPU reads our buffers in place (CUDA IPC / shared memory)."""

    def __init__(self, engine: Any, buffers: SenderBuffers) -> None:
        self.engines, self.buffers = [engine], buffers

    def send(self, slot: int, pieces: list[dict], nbytes: int) -> list:
        return [self.engines[0].load_bucket.remote(slot, pieces)]


class BroadcastLink:
    """Disaggregated: every engine (each of its TP workers) receives each bucket by broadcast from us."""

    def __init__(self, engines: list, buffers: SenderBuffers, group: WeightGroup) -> None:
        self.engines, self.buffers, self.group = list(engines), buffers, group

    def send(self, slot: int, pieces: list[dict], nbytes: int) -> list:
        refs = [e.load_bucket.remote(slot, pieces) for e in self.engines]  # each first posts its receive
        self.group.broadcast(self.buffers.tensors[slot][:nbytes], wait=False)  # overlaps the next packing
        return refs


# ------------------------------------------------------------------------------------------ the sender


class Sender:
    """One trainer rank's weight sync: plan, source, buffers and link, built once, replayed by push().

    `link` is None on disaggregated ranks > 0: they only take part in the FSDP gathers (collective)."""

    def __init__(self, model: nn.Module, cfg: SyncConfig, describe: dict, engines: list, *,
                 placement: str, group: WeightGroup | None = None) -> None:
        arch = model_arch(model)
        self.cfg, self.describe = cfg, describe
        self.source = ParamSource(model, arch)
        self.shapes = self.source.shapes  # what the plan reads: with FP8, each quantized tensor's scale too
        self.fp8: Fp8Plan | None = None
        reference = int(describe.get("tp_size", 1)) > 1 or cfg.mode == "load_weights"
        fp8_engine = any(p["dtype"] == FP8_DTYPE for p in describe["params"].values())
        if reference and fp8_engine:
            raise MappingError("an engine holding FP8 weights takes the direct plan only (colo quantizes into vLLM's "
                               "own params); fix: sync.mode=direct and rollout.tp_size=1")
        if reference:
            # the names must still correspond (a TP worker's params are slices, so their sizes cannot)
            _, errors = direct_mapping(arch, self.source.shapes, describe, names_only=True)
            if errors:
                raise MappingError("the trainer's parameters do not map onto the engine's:\n  " + "\n  ".join(errors))
            dtypes = [p["dtype"] for p in describe["params"].values()]
            self.plan = build_reference_plan(arch, self.source.shapes, max(set(dtypes), key=dtypes.count),
                                             bucket_bytes(cfg))
            # whole checkpoint tensors: every rank gathers its experts too (the choice is config-wide, so
            # the ranks agree without the all-reduce)
            self.expert_fast, self.expert_fast_reason = False, "reference plan: whole tensors"
        else:
            if fp8_engine:
                try:  # an FP8 engine: the sender quantizes (colo.sync.fp8), the plan carries bytes and scales
                    self.fp8 = Fp8Plan.of(arch, self.shapes, describe, direct_mapping(arch, self.shapes, describe)[0])
                except Fp8PlanError as e:
                    raise MappingError(str(e)) from e
                self.shapes = self.fp8.shapes
            self.plan = build_plan(arch, self.shapes, describe, bucket_bytes(cfg))
            self.expert_fast, self.expert_fast_reason = self.source.expert_fast_path(describe, self.plan.expert_modules)  # collective
        self.buffers: SenderBuffers | None = None
        self.link: IpcLink | BroadcastLink | None = None
        if placement == "colocated" or group is not None:
            nbuf = max(1, min(int(cfg.buffers), len(self.plan.buckets)))
            size = align_up(max(self.plan.bucket_used))  # a small model does not need 1 GiB buffers
            device = next(model.parameters()).device
            self.buffers = SenderBuffers(size, nbuf, device, shared=placement == "colocated")
            self.link = (IpcLink(engines[0], self.buffers) if placement == "colocated"
                         else BroadcastLink(engines, self.buffers, group))
        self.fp8_fused, self.fp8_fused_reason = self._fused_fp8()

    def _fused_fp8(self) -> tuple[bool, str]:
        """Whether this sender quantizes inside the packing copy (colo.sync.fp8_pack), and why (summary())."""
        if self.fp8 is None:
            return False, "no FP8 engine"
        if self.buffers is None or self.buffers.device.type != "cuda" or not CopySums(self.buffers.device).fused:
            return False, "not CUDA with Triton: quantize_blocks per unit, then the packing copy"
        if torch_dtype(self.fp8.dtype) not in VIAS:
            return False, f"engine dtype {self.fp8.dtype}: the fused kernel rounds through bf16 or float32 only"
        if any("layout" in p for b in self.plan.buckets for p in b if p["src"] in self.fp8.quantized):
            return False, "a quantized tensor is packed transposed"
        errors = uncovered_scales(self.plan.buckets, self.fp8.quantized, SCALE)
        if errors:  # the plan order the kernel relies on does not hold: the torch path does not rely on it
            return False, "scale pieces ahead of their blocks: " + "; ".join(errors[:3])
        return True, "quantized inside the packing copy (colo.sync.fp8_pack)"

    @classmethod
    def colocated(cls, model: nn.Module, cfg: SyncConfig, engine: Any) -> Sender:
        """Rank r's sender into the engine on its GPU (collective: every rank builds its own at once)."""
        return cls(model, cfg, ray.get(engine.describe.remote()), [engine], placement="colocated")

    @classmethod
    def broadcast(cls, model: nn.Module, cfg: SyncConfig, engines: list, group: WeightGroup | None) -> Sender:
        """Disaggregated: rank 0 (holding `group`) broadcasts to every engine; other ranks gather only."""
        return cls(model, cfg, ray.get(engines[0].describe.remote()), engines, placement="disaggregated",
                   group=group)

    def summary(self) -> dict:
        plan = self.plan
        return {"plan": plan.mode, "buckets": len(plan.buckets), "bytes": plan.total_bytes,
                "pieces": sum(len(b) for b in plan.buckets), "vllm_params": len(plan.expect),
                "fp8_tensors": 0 if self.fp8 is None else len(self.fp8.quantized),
                "fp8_fused": self.fp8_fused, "fp8_fused_reason": self.fp8_fused_reason,
                "expert_fast_path": self.expert_fast, "expert_fast_reason": self.expert_fast_reason}

    def close(self) -> None:
        """Unlink the shared-memory segments now (ray.kill ends actors without atexit hooks)."""
        if self.buffers is not None:
            self.buffers.close()
            self.buffers = None
        self.link = None

    def push(self, raise_on_error: bool = True) -> dict:
        """One sync: per bucket k, pack into buffer k % B and send (up to B buckets in flight; before
        packing into a buffer we wait for the loads that last read it); then verify on every engine."""
        t_start = time.perf_counter()
        if self.link is None:  # disaggregated rank > 0: the gathers are collective, nothing to send
            timings = {"gather": 0.0}
            for _ in self.source.iter_units(self.expert_fast, timings):
                pass
            return {"seconds": time.perf_counter() - t_start, "gather_s": timings["gather"], "tensors": 0,
                    "bytes": 0, "buckets": 0, "verified": True, "errors": [], "role": "gather only (trainer rank > 0)"}
        plan, bufs, link = self.plan, self.link.buffers, self.link
        digest = bool(self.cfg.digest)
        timings = {"gather": 0.0, "pack": 0.0, "load": 0.0}

        ray.get([e.begin_sync.remote(bufs.handles(), plan.expect, digest) for e in link.engines])
        inflight: dict[int, list] = {}  # buffer index -> ObjectRefs of the loads reading it
        loaded = {"tensors": 0, "bytes": 0}
        sums = CopySums(bufs.device) if digest else None

        def wait(slot: int) -> None:
            refs = inflight.pop(slot, None)
            if refs is not None:
                t = time.perf_counter()
                results = ray.get(refs)
                timings["load"] += time.perf_counter() - t
                loaded["tensors"] += sum(r["tensors"] for r in results)
                loaded["bytes"] += sum(r["bytes"] for r in results)

        def send(k: int, slot: int) -> None:
            inflight[slot] = link.send(slot, plan.wire(k), plan.bucket_used[k])

        self.pack(timings, reuse=wait, send=send, sums=sums)
        for slot in list(inflight):
            wait(slot)

        t = time.perf_counter()
        results = ray.get([e.end_sync.remote(digest) for e in link.engines])
        sent = sums.totals() if sums is not None else None
        errors: list[str] = []
        for e, res in enumerate(results):
            where = f"engine {e}: " if len(results) > 1 else ""
            errors += [where + x for x in res.get("errors", [])]
            if sent is not None:
                errors += [where + x for x in compare(sent, res.get("digest") or {})]
        verify_s = time.perf_counter() - t
        report = {"seconds": time.perf_counter() - t_start, "gather_s": timings["gather"], "pack_s": timings["pack"],
                  "quantize_s": timings.get("quantize", 0.0), "fp8_fused": self.fp8_fused,
                  "load_s": timings["load"], "verify_s": verify_s, "tensors": sum(r["tensors"] for r in results),
                  "bytes": sum(r["bytes"] for r in results), "engines": len(results),
                  "loaded_tensors": loaded["tensors"], "loaded_bytes": loaded["bytes"], "buckets": len(plan.buckets),
                  "plan": plan.mode, "expert_fast_path": self.expert_fast,
                  "expert_fast_reason": self.expert_fast_reason, "digest_checked": digest,
                  "verified": not errors, "errors": errors,
                  # source-side byte counters: expert_gathered_bytes is 0 on the fast path
                  **{k: int(timings.get(k, 0)) for k in ("gathered_bytes", "local_bytes", "expert_gathered_bytes",
                                                         "expert_local_bytes")}}
        if errors and raise_on_error:
            raise SyncError("weight sync verification failed:\n  " + "\n  ".join(errors[:50]))
        return report

    def pack(self, timings: dict[str, float], *, reuse: Callable[[int], None], send: Callable[[int, int], None],
             sums: CopySums | None = None) -> None:
        """Walk the FSDP units and pack the plan's buckets in order: `reuse(slot)` before bucket k starts
        overwriting buffer slot = k % B (push: wait for the loads still reading it), `send(k, slot)` once
        bucket k is packed. Adds to timings' "gather" and "pack" (time spent in `reuse` is not packing).
        `sums`: each destination's checksum of what was packed (fills count 0), taken in the packing copies."""
        plan, bufs = self.plan, self.buffers
        cuda = bufs.device.type == "cuda"
        flat = [(k, i) for k, b in enumerate(plan.buckets) for i in range(len(b))]
        pos = 0
        for tensors in self.source.iter_units(self.expert_fast, timings):
            if self.fp8 is not None:  # after the source (and LoRA's merge, in it): merge, then quantize
                tensors = quantize_unit(self.fp8, tensors, timings) if self.fp8_fused else \
                    self.fp8.quantize(tensors, timings)
            t = time.perf_counter()
            while pos < len(flat) and plan.buckets[flat[pos][0]][flat[pos][1]]["src"] in tensors:
                k, i = flat[pos]
                slot = k % bufs.count
                if i == 0:
                    t_reuse = time.perf_counter()
                    reuse(slot)  # the load that last read this buffer must be done before we overwrite it
                    t += time.perf_counter() - t_reuse
                piece = plan.buckets[k][i]
                if "fill" in piece:  # zeros into the engine's declared pad rows: no bytes, checksum 0
                    if sums is not None:
                        sums.note(piece["dst"])
                else:
                    pack_piece(bufs.tensors[slot], piece, tensors[piece["src"]], self.shapes[piece["src"]], sums)
                pos += 1
                if i == len(plan.buckets[k]) - 1:
                    if sums is not None:
                        sums.flush()  # the bucket's batched copies (CUDA) before anyone reads it
                    if cuda:
                        torch.cuda.current_stream(bufs.device).synchronize()  # the receiver reads on its own stream
                    timings["pack"] = timings.get("pack", 0.0) + time.perf_counter() - t
                    send(k, slot)
                    t = time.perf_counter()
            if sums is not None:
                sums.flush()  # this unit's tensors go (reshard) once the source moves on
            timings["pack"] = timings.get("pack", 0.0) + time.perf_counter() - t
        if pos != len(flat):
            p = plan.buckets[flat[pos][0]][flat[pos][1]]
            raise SyncError(f"source never produced {p['src']} (plan order differs from FSDP unit order)")
