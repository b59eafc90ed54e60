"""Drive one weight sync from the trainer into vLLM engines.

    report = push_weights(model, engine, cfg.sync, state)                  # colocated: rank r -> its engine
    report = broadcast_weights(model, engines, group, cfg.sync, state)     # disaggregated: rank 0 -> all

`state` is a dict the caller keeps across syncs. First call: engine.describe() -> SyncPlan and
SenderBuffers (allocated once, cached in `state`). Every call: begin_sync(handles, expect) -> for each
bucket k: pack into buffer k % B, send it (colocated: load_bucket reads our shared buffer; disaggregated:
every engine posts load_bucket, which receives the broadcast) -> end_sync(digest) on every engine ->
report. The two modes share the source, plan, packing and verification; only the link differs.
Verification failures raise SyncError naming the params.
"""
from __future__ import annotations

import time
from typing import Any

import ray
import torch
from torch import nn

from colo.sync.mapping import MappingError, arch_for, direct_mapping
from colo.sync.broadcast import WeightGroup
from colo.sync.plan import SyncPlan, build_plan, build_reference_plan, torch_dtype
from colo.sync.source import ParamSource
from colo.sync.transport import SenderBuffers, align_up
from colo.sync.verify import compare_digests, piece_digest


class SyncError(RuntimeError):
    pass


def cfg_get(cfg: Any, key: str, default: Any) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def architecture(model: nn.Module) -> str:
    archs = getattr(getattr(model, "config", None), "architectures", None) or []
    return archs[0] if archs else type(model).__name__


def prepare(model: nn.Module, describe: dict, sync_cfg: Any, state: dict, *, buffers: str | None) -> dict:
    """Plan, source and (buffers="shared"|"private") sender buffers for this model and engine kind; built
    once and kept in `state`. Collective (the expert fast-path check): every trainer rank calls it.

    The plan is "direct" (copy into vLLM's own tensors) unless sync.mode is load_weights or the engine is
    tensor-parallel: TP workers hold slices, so they get whole checkpoint tensors for vLLM's loaders."""
    if "plan" in state:
        return state
    arch = arch_for(architecture(model))
    source = ParamSource(model, arch)
    bucket_bytes = int(float(cfg_get(sync_cfg, "bucket_mb", 1024)) * 2**20)
    if int(describe.get("tp_size", 1)) > 1 or cfg_get(sync_cfg, "mode", "direct") == "load_weights":
        # the names must still correspond (a TP worker's params are slices, so their sizes cannot)
        _, errors = direct_mapping(arch, source.shapes, describe, names_only=True)
        if errors:
            raise MappingError("the trainer's parameters do not map onto the engine's:\n  " + "\n  ".join(errors))
        dtypes = [p["dtype"] for p in describe["params"].values()]
        plan = build_reference_plan(arch, source.shapes, max(set(dtypes), key=dtypes.count), bucket_bytes)
    else:
        plan = build_plan(arch, source.shapes, describe, bucket_bytes)
    fast, why = source.expert_fast_path(describe)  # collective: every rank prepares together
    state.update(describe=describe, plan=plan, source=source, expert_fast=fast, expert_fast_reason=why)
    if buffers is not None:
        nbuf = max(1, min(int(cfg_get(sync_cfg, "buffers", 2)), len(plan.buckets)))
        size = align_up(max(plan.bucket_used))  # a small model does not need 1 GiB buffers
        device = next(model.parameters()).device
        state["buffers"] = SenderBuffers(size, nbuf, device, shared=buffers == "shared")
    return state


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


def _pack_piece(buf: torch.Tensor, piece: dict, src: tuple[torch.Tensor, int], full_shape: tuple[int, ...]) -> torch.Tensor:
    """Copy one piece's elements (cast to the engine's dtype) into `buf` at its offset; returns that view.
    A "layout" piece is whole expert blocks stored (A, B) here and (B, A) in the engine: copied transposed."""
    tensor, row_start = src
    row = 1
    for s in full_shape[1:]:
        row *= int(s)
    flat = tensor.reshape(-1)
    s = piece["src_offset"] - row_start * row
    n = piece["numel"]
    if s < 0 or s + n > flat.numel():
        raise SyncError(f"{piece['src']}: elements [{piece['src_offset']}, +{n}) are not in this rank's "
                        f"rows [{row_start}, ...): the expert fast path does not match the plan")
    dtype = torch_dtype(piece["dtype"])
    out = buf[piece["buf_offset"]: piece["buf_offset"] + n * dtype.itemsize].view(dtype)  # (n,)
    if "layout" in piece:
        a, b = piece["layout"]
        out.view(-1, b, a).copy_(flat[s: s + n].view(-1, a, b).transpose(1, 2))  # (k, B, A) <- (k, A, B)
    else:
        out.copy_(flat[s: s + n])  # casts to the engine's dtype while packing
    return out


def prepare_push(model: nn.Module, engine: Any, sync_cfg: Any, state: dict) -> dict:
    """Colocated: plan, source, shared buffers and link for this rank's engine, once (collective)."""
    if "plan" not in state:
        prepare(model, ray.get(engine.describe.remote()), sync_cfg, state, buffers="shared")
        state["link"] = IpcLink(engine, state["buffers"])
    return state


def prepare_broadcast(model: nn.Module, engines: list, group: WeightGroup | None, sync_cfg: Any, state: dict) -> dict:
    """Disaggregated: the same for rank 0's broadcast to every engine (other ranks: plan and source only)."""
    if "plan" not in state:
        prepare(model, ray.get(engines[0].describe.remote()), sync_cfg, state,
                buffers="private" if group is not None else None)
        if group is not None:
            state["link"] = BroadcastLink(engines, state["buffers"], group)
    return state


def check_names(model: nn.Module, engine: Any) -> dict:
    """sync.mode=load_weights (colocated): no plan is kept, but the names must still correspond."""
    describe = ray.get(engine.describe.remote())
    arch = arch_for(architecture(model))
    _, errors = direct_mapping(arch, ParamSource(model, arch).shapes, describe, names_only=True)
    if errors:
        raise MappingError("the trainer's parameters do not map onto the engine's:\n  " + "\n  ".join(errors))
    return {"plan": "reference", "vllm_params": len(describe["params"])}


def plan_summary(state: dict) -> dict:
    plan: SyncPlan = state["plan"]
    return {"plan": plan.mode, "buckets": len(plan.buckets), "bytes": plan.total_bytes,
            "pieces": sum(len(b) for b in plan.buckets), "vllm_params": len(plan.expect),
            "expert_fast_path": state["expert_fast"], "expert_fast_reason": state["expert_fast_reason"]}


def push_weights(model: nn.Module, engine: Any, sync_cfg: Any, state: dict, raise_on_error: bool = True) -> dict:
    """Colocated: this trainer rank's weights into the engine on its GPU."""
    if cfg_get(sync_cfg, "mode", "direct") == "load_weights":  # the straightforward path (reference, baseline)
        from colo.sync.baseline import push_weights_baseline

        return push_weights_baseline(model, engine, sync_cfg, raise_on_error=raise_on_error)
    prepare_push(model, engine, sync_cfg, state)
    return _push(state, state["link"], sync_cfg, raise_on_error)


def broadcast_weights(model: nn.Module, engines: list, group: WeightGroup | None, sync_cfg: Any, state: dict,
                      raise_on_error: bool = True) -> dict:
    """Disaggregated: called on every trainer rank (the gathers are collective); rank 0, which holds
    `group`, packs and broadcasts to all engines, the other ranks only take part in the gathers."""
    prepare_broadcast(model, engines, group, sync_cfg, state)
    if group is None:
        t0, timings = time.perf_counter(), {"gather": 0.0}
        for _ in state["source"].iter_units(state["expert_fast"], timings):
            pass
        return {"seconds": time.perf_counter() - t0, "gather_s": timings["gather"], "tensors": 0, "bytes": 0,
                "buckets": 0, "verified": True, "errors": [], "role": "gather only (trainer rank > 0)"}
    return _push(state, state["link"], sync_cfg, raise_on_error)


def _push(state: dict, link: IpcLink | BroadcastLink, sync_cfg: Any, raise_on_error: bool) -> dict:
    """One sync over `link`: per bucket k, pack into buffer k % B and send (up to B buckets in flight;
    before packing into a buffer we wait for the loads that last read it); then verify on every engine."""
    t_start = time.perf_counter()
    plan: SyncPlan = state["plan"]
    bufs: SenderBuffers = state["buffers"]
    source: ParamSource = state["source"]
    digest = bool(cfg_get(sync_cfg, "digest", False))
    timings = {"gather": 0.0, "pack": 0.0, "load": 0.0}
    cuda = bufs.device.type == "cuda"

    ray.get([e.begin_sync.remote(bufs.handles(), plan.expect, digest) for e in link.engines])
    flat = [(k, i) for k, b in enumerate(plan.buckets) for i in range(len(b))]
    inflight: dict[int, list] = {}  # buffer index -> ObjectRefs of the loads reading it
    loaded = {"tensors": 0, "bytes": 0}
    sent_digest: dict[str, float] = {}
    pos = 0

    def wait(slot: int, in_pack: bool = False) -> None:
        refs = inflight.pop(slot, None)
        if refs is not None:
            t = time.perf_counter()
            results = ray.get(refs)
            dt = time.perf_counter() - t
            timings["load"] += dt
            timings["pack"] -= dt if in_pack else 0.0  # this wait sits inside a timed packing stretch
            loaded["tensors"] += sum(r["tensors"] for r in results)
            loaded["bytes"] += sum(r["bytes"] for r in results)

    for tensors in source.iter_units(state["expert_fast"], timings):
        t = time.perf_counter()
        while pos < len(flat) and plan.buckets[flat[pos][0]][flat[pos][1]]["src"] in tensors:
            k, i = flat[pos]
            slot = k % bufs.count
            if i == 0:
                wait(slot, in_pack=True)  # the load that last read this buffer must be done before we overwrite it
            piece = plan.buckets[k][i]
            if "fill" in piece:  # zeros into the engine's declared pad rows: no bytes, digest contribution 0
                if digest:
                    sent_digest.setdefault(piece["dst"], 0.0)
            else:
                out = _pack_piece(bufs.tensors[slot], piece, tensors[piece["src"]], source.shapes[piece["src"]])
                if digest:
                    sent_digest[piece["dst"]] = sent_digest.get(piece["dst"], 0.0) + piece_digest(out, piece["dst_offset"])
            pos += 1
            if i == len(plan.buckets[k]) - 1:
                if cuda:
                    torch.cuda.current_stream(bufs.device).synchronize()  # the receiver reads on its own stream
                timings["pack"] += time.perf_counter() - t
                inflight[slot] = link.send(slot, plan.wire(k), plan.bucket_used[k])
                t = time.perf_counter()
        timings["pack"] += time.perf_counter() - t
    if pos != len(flat):
        p = plan.buckets[flat[pos][0]][flat[pos][1]]
        raise SyncError(f"source never produced {p['src']} (plan order differs from FSDP unit order)")
    for slot in list(inflight):
        wait(slot)

    t = time.perf_counter()
    results = ray.get([e.end_sync.remote(digest) for e in link.engines])
    errors: list[str] = []
    for e, res in enumerate(results):
        where = f"engine {e}: " if len(results) > 1 else ""
        errors += [where + x for x in res.get("errors", [])]
        if digest:
            errors += [where + x for x in compare_digests(sent_digest, res.get("digest") or {})]
    verify_s = time.perf_counter() - t
    report = {"seconds": time.perf_counter() - t_start, "gather_s": timings["gather"], "pack_s": timings["pack"],
              "load_s": timings["load"], "verify_s": verify_s, "tensors": sum(r["tensors"] for r in results),
              "bytes": sum(r["bytes"] for r in results), "engines": len(results),
              "loaded_tensors": loaded["tensors"], "loaded_bytes": loaded["bytes"], "buckets": len(plan.buckets),
              "plan": plan.mode, "expert_fast_path": state["expert_fast"],
              "expert_fast_reason": state["expert_fast_reason"], "digest_checked": digest,
              "verified": not errors, "errors": errors,
              # source-side byte counters (colo.sync.source): expert_gathered_bytes is 0 on the fast path
              **{k: int(timings.get(k, 0)) for k in ("gathered_bytes", "local_bytes", "expert_gathered_bytes",
                                                     "expert_local_bytes")}}
    if errors and raise_on_error:
        raise SyncError("weight sync verification failed:\n  " + "\n  ".join(errors[:50]))
    return report
