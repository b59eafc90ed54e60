"""Drive one weight sync from a trainer rank into its colocated RolloutEngine.

    report = push_weights(model, engine, cfg.sync, state)   # state: a dict the caller keeps across syncs

First call: engine.describe() -> SyncPlan (cached in `state`) and SenderBuffers (allocated once).
Every call: begin_sync(handles, expect) -> for each bucket k: pack into buffer k % B, load_bucket(k % B)
(up to B loads in flight; before packing into a buffer we wait for the load that last read it) ->
end_sync(digest) -> report. Verification failures raise SyncError naming the params.
"""
from __future__ import annotations

import time
from typing import Any

import ray
import torch
from torch import nn

from colo.sync.mapping import arch_for
from colo.sync.plan import SyncPlan, build_plan, torch_dtype
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


def prepare(model: nn.Module, engine: Any, sync_cfg: Any, state: dict) -> dict:
    """Plan, source and buffers for this (model, engine) pair; built once and kept in `state`."""
    if "plan" in state:
        return state
    describe = ray.get(engine.describe.remote())
    arch = arch_for(architecture(model))
    source = ParamSource(model, arch)
    bucket_bytes = int(float(cfg_get(sync_cfg, "bucket_mb", 1024)) * 2**20)
    plan = build_plan(arch, source.shapes, describe, bucket_bytes)
    fast, why = source.expert_fast_path(describe)  # collective: every rank prepares together
    device = next(model.parameters()).device
    nbuf = max(1, min(int(cfg_get(sync_cfg, "buffers", 2)), len(plan.buckets)))
    size = align_up(max(plan.bucket_used))  # a small model does not need 1 GiB buffers
    state.update(describe=describe, plan=plan, source=source, expert_fast=fast, expert_fast_reason=why,
                 buffers=SenderBuffers(size, nbuf, device))
    return state


def _pack_piece(buf: torch.Tensor, piece: dict, src: tuple[torch.Tensor, int], full_shape: tuple[int, ...]) -> torch.Tensor:
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
    out.copy_(flat[s: s + n])  # casts to the engine's dtype while packing
    return out


def push_weights(model: nn.Module, engine: Any, sync_cfg: Any, state: dict, raise_on_error: bool = True) -> dict:
    if cfg_get(sync_cfg, "mode", "direct") == "load_weights":
        from colo.sync.baseline import push_weights_baseline

        return push_weights_baseline(model, engine, sync_cfg, raise_on_error=raise_on_error)
    t_start = time.perf_counter()
    prepare(model, engine, sync_cfg, state)
    plan: SyncPlan = state["plan"]
    bufs: SenderBuffers = state["buffers"]
    source: ParamSource = state["source"]
    digest = bool(cfg_get(sync_cfg, "digest", False))
    timings = {"gather": 0.0, "pack": 0.0, "load": 0.0}
    cuda = bufs.device.type == "cuda"

    ray.get(engine.begin_sync.remote(bufs.handles(), plan.expect))
    flat = [(k, i) for k, b in enumerate(plan.buckets) for i in range(len(b))]
    inflight: dict[int, Any] = {}  # buffer index -> ObjectRef of the load reading it
    loaded = {"tensors": 0, "bytes": 0}
    sent_digest: dict[str, float] = {}
    pos = 0

    def wait(slot: int, in_pack: bool = False) -> None:
        ref = inflight.pop(slot, None)
        if ref is not None:
            t = time.perf_counter()
            r = ray.get(ref)
            dt = time.perf_counter() - t
            timings["load"] += dt
            timings["pack"] -= dt if in_pack else 0.0  # this wait sits inside a timed packing stretch
            loaded["tensors"] += r["tensors"]
            loaded["bytes"] += r["bytes"]

    for tensors in source.iter_units(state["expert_fast"], timings):
        t = time.perf_counter()
        while pos < len(flat) and plan.buckets[flat[pos][0]][flat[pos][1]]["src"] in tensors:
            k, i = flat[pos]
            slot = k % bufs.count
            if i == 0:
                wait(slot, in_pack=True)  # the load that last read this buffer must be done before we overwrite it
            piece = plan.buckets[k][i]
            out = _pack_piece(bufs.tensors[slot], piece, tensors[piece["src"]], source.shapes[piece["src"]])
            if digest:
                sent_digest[piece["dst"]] = sent_digest.get(piece["dst"], 0.0) + piece_digest(out, piece["dst_offset"])
            pos += 1
            if i == len(plan.buckets[k]) - 1:
                if cuda:
                    torch.cuda.current_stream(bufs.device).synchronize()  # the receiver reads on its own stream
                timings["pack"] += time.perf_counter() - t
                inflight[slot] = engine.load_bucket.remote(slot, plan.wire(k))
                t = time.perf_counter()
        timings["pack"] += time.perf_counter() - t
    if pos != len(flat):
        p = plan.buckets[flat[pos][0]][flat[pos][1]]
        raise SyncError(f"source never produced {p['src']} (plan order differs from FSDP unit order)")
    for slot in list(inflight):
        wait(slot)

    t = time.perf_counter()
    res = ray.get(engine.end_sync.remote(digest))
    errors = list(res.get("errors", []))
    if digest:
        errors += compare_digests(sent_digest, res.get("digest") or {})
    verify_s = time.perf_counter() - t
    report = {"seconds": time.perf_counter() - t_start, "gather_s": timings["gather"], "pack_s": timings["pack"],
              "load_s": timings["load"], "verify_s": verify_s, "tensors": res["tensors"], "bytes": res["bytes"],
              "loaded_tensors": loaded["tensors"], "loaded_bytes": loaded["bytes"], "buckets": len(plan.buckets),
              "expert_fast_path": state["expert_fast"], "expert_fast_reason": state["expert_fast_reason"],
              "digest_checked": digest, "verified": not errors, "errors": errors,
              # source-side byte counters (colo.sync.source): expert_gathered_bytes is 0 on the fast path
              **{k: int(timings.get(k, 0)) for k in ("gathered_bytes", "local_bytes", "expert_gathered_bytes",
                                                     "expert_local_bytes")}}
    if errors and raise_on_error:
        raise SyncError("weight sync verification failed:\n  " + "\n  ".join(errors[:50]))
    return report
