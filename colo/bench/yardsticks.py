"""The yardsticks colo.bench.sync times colo's weight sync against (benchmark code, not product code).

- `push_weights_baseline` (colocated): the straightforward sync, as vLLM's FSDP+EP RL example does it.
  Per sync: `full_tensor()` of every parameter (one all-gather per tensor, experts included), experts
  un-fused into per-expert checkpoint names, a fresh shared buffer + handle per bucket (opened anew by
  the receiver and let go after it), buckets packed and loaded one after another as the parameters are
  gathered, and vLLM's own weight loading for every tensor (`load_weights`, then vLLM's post-load step).
- `broadcast_weights_baseline` (disaggregated): as vLLM's RLHF examples do it, one broadcast and one
  load_weights per tensor.
- `push_weights_vllm_ipc` (colocated GPU): vLLM's own packed CUDA-IPC weight-transfer engine, driven as its
  FSDP+EP example drives it: the trainer-side `IPCTrainerWeightTransferEngine` over a `WeightSource`, talking
  to the engines (colo.bench.engines.VllmIpcEngine) through a client object (`_EngineClient`).

colo's own reference mode (`sync.mode: load_weights`) is not these: it runs through colo.sync.sender's
plan, buffers and links like the direct mode.
"""
from __future__ import annotations

import time
from typing import Any

import ray
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from colo.config import SyncConfig
from colo.models.dtypes import dtype_name
from colo.models.archs import reference_segments, reference_weights
from colo.sync.sender import SyncError, bucket_bytes, model_arch, sync_tensors
from colo.sync.transport import SenderBuffers, align_up

DTYPE = torch.bfloat16  # what vLLM's examples send (the engines' dtype in every benchmark config)


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter on every rank: one all-gather for an FSDP2 DTensor, the tensor itself otherwise."""
    return p.full_tensor() if isinstance(p, DTensor) else p.data


def reference_expect(arch: Any, params: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Elements per checkpoint-named tensor (experts un-fused) the engine must receive: its coverage target."""
    return {ckpt: int(torch.Size(shape).numel()) for name, p in params
            for ckpt, _, shape in reference_segments(arch, name, tuple(p.shape))}


def push_weights_baseline(model: nn.Module, engine: Any, sync_cfg: SyncConfig, raise_on_error: bool = True) -> dict:
    """Streams: memory stays at one bucket plus one parameter's full tensor (holding every gathered tensor
    and every bucket at once needed 2x the bf16 model on the trainer's GPU, beyond an H200 at full size)."""
    t_start = time.perf_counter()
    limit = bucket_bytes(sync_cfg)
    arch = model_arch(model)
    dtype = DTYPE
    timings = {"gather": 0.0, "pack": 0.0, "load": 0.0}
    params = sync_tensors(model)  # parameters and persistent buffers
    device = params[0][1].device
    expect = reference_expect(arch, params)
    loaded = {"tensors": 0, "buckets": 0}

    def flush(bucket: list[tuple[str, torch.Tensor]]) -> None:
        """A fresh buffer and handle for this bucket alone; the engine opens it, loads it, lets it go."""
        t = time.perf_counter()
        table, total = [], 0
        for name, w in bucket:
            off = align_up(total)
            total = off + w.numel() * w.element_size()
            table.append({"name": name, "shape": list(w.shape), "dtype": dtype_name(w.dtype), "buf_offset": off})
        sb = SenderBuffers(align_up(max(total, 1)), 1, device)
        try:
            for (_, w), piece in zip(bucket, table):
                n = w.numel() * w.element_size()
                sb.tensors[0][piece["buf_offset"]: piece["buf_offset"] + n].view(w.dtype).copy_(w.reshape(-1))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timings["pack"] += time.perf_counter() - t
            t = time.perf_counter()
            res = ray.get(engine.load_transient.remote(table, sb.handles()[0]))
            timings["load"] += time.perf_counter() - t
        finally:
            sb.close()
        loaded["tensors"] += res["tensors"]
        loaded["buckets"] += 1

    t = time.perf_counter()
    ray.get(engine.begin_sync.remote([], expect))
    timings["load"] += time.perf_counter() - t
    bucket: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, p in params:
        t = time.perf_counter()
        full = full_tensor(p)  # one all-gather per parameter
        pieces = reference_weights(arch, name, full.to(dtype))  # experts un-fused, one tensor each
        timings["gather"] += time.perf_counter() - t
        for ckpt, w in pieces:
            size = w.numel() * w.element_size()
            if size > limit:
                raise SyncError(f"{ckpt}: {size} bytes does not fit a {limit}-byte bucket in load_weights "
                                "mode; fix: a larger sync.bucket_mb")
            if bucket and align_up(used) + size > limit:
                flush(bucket)
                bucket, used = [], 0
            bucket.append((ckpt, w))
            used = align_up(used) + size
    if bucket:
        flush(bucket)
    t = time.perf_counter()
    res = ray.get(engine.end_sync.remote(False))  # vLLM's post-load step runs here
    timings["load"] += time.perf_counter() - t
    errors = list(res.get("errors", []))
    report = {"seconds": time.perf_counter() - t_start, "gather_s": timings["gather"], "pack_s": timings["pack"],
              "load_s": timings["load"], "verify_s": 0.0, "tensors": res["tensors"], "bytes": res["bytes"],
              "loaded_tensors": loaded["tensors"], "buckets": loaded["buckets"],
              "verified": not errors, "errors": errors}
    if errors and raise_on_error:
        raise SyncError("baseline sync verification failed:\n  " + "\n  ".join(errors[:50]))
    return report


def broadcast_weights_baseline(model: nn.Module, engines: list, group: Any, sync_cfg: SyncConfig,
                               raise_on_error: bool = True) -> dict:
    """The disaggregated yardstick, as vLLM's RLHF examples do it: per parameter, `full_tensor()` on every
    rank; rank 0 then sends each (per-expert un-fused) tensor in a broadcast of its own and waits until
    every engine has loaded it with vLLM's load_weights. `group` is None on ranks > 0 (gather only)."""
    t_start = time.perf_counter()
    arch = model_arch(model)
    dtype = DTYPE
    timings = {"gather": 0.0, "pack": 0.0, "load": 0.0}
    params = sync_tensors(model)  # parameters and persistent buffers
    if group is not None:  # every engine's receive buffer holds the largest single tensor
        expect = reference_expect(arch, params)
        handle = {"kind": "broadcast", "buffer_id": 0, "nbytes": align_up(max(expect.values()) * dtype.itemsize)}
        ray.get([e.begin_sync.remote([handle], expect) for e in engines])
    sent = 0
    for name, p in params:
        t = time.perf_counter()
        full = full_tensor(p)  # one all-gather per parameter
        timings["gather"] += time.perf_counter() - t
        if group is None:
            continue
        for ckpt, w in reference_weights(arch, name, full.to(dtype)):
            t = time.perf_counter()
            piece = {"name": ckpt, "shape": list(w.shape), "dtype": dtype_name(dtype), "buf_offset": 0}
            refs = [e.load_bucket.remote(0, [piece]) for e in engines]
            group.broadcast(w.contiguous().view(-1).view(torch.uint8))
            ray.get(refs)
            timings["load"] += time.perf_counter() - t
            sent += 1
    if group is None:
        return {"seconds": time.perf_counter() - t_start, "gather_s": timings["gather"], "tensors": 0, "bytes": 0,
                "buckets": 0, "verified": True, "errors": []}
    t = time.perf_counter()
    results = ray.get([e.end_sync.remote(False) for e in engines])  # vLLM's post-load step runs here
    timings["load"] += time.perf_counter() - t
    errors = [f"engine {i}: {x}" for i, r in enumerate(results) for x in r.get("errors", [])]
    report = {"seconds": time.perf_counter() - t_start, "gather_s": timings["gather"], "pack_s": 0.0,
              "load_s": timings["load"], "verify_s": 0.0, "tensors": sum(r["tensors"] for r in results),
              "bytes": sum(r["bytes"] for r in results), "buckets": sent, "verified": not errors, "errors": errors}
    if errors and raise_on_error:
        raise SyncError("baseline broadcast sync verification failed:\n  " + "\n  ".join(errors[:50]))
    return report


class _EngineClient:
    """vLLM 0.32's weight-sync client protocol (`VLLMWeightSyncClient`: four methods, structural) over colo's
    VllmIpcEngine actors: each call goes to every engine and waits for all of them, as vLLM's own
    RayVLLMWeightSyncClient does for its LLM actors. Only trainer rank 0 (the sender) calls it."""

    def __init__(self, engines: list, sent: dict) -> None:
        self.engines, self.sent = engines, sent

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        ray.get([e.vllm_init_weight_transfer.remote(init_info) for e in self.engines])

    def start_weight_update(self) -> None:
        ray.get([e.vllm_start_weight_update.remote() for e in self.engines])

    def update_weights(self, update_info: Any) -> None:  # one packed chunk: names, shapes, the merged IPC handles
        self.sent["chunks"] += 1
        ray.get([e.vllm_update_weights.remote(update_info) for e in self.engines])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        ray.get([e.vllm_finish_weight_update.remote() for e in self.engines])


def push_weights_vllm_ipc(model: nn.Module, engines: list, sync_cfg: SyncConfig) -> dict:
    """vLLM's own packed CUDA-IPC weight-transfer engine, driven as its FSDP+EP RL example drives it: every
    rank iterates `full_tensor()` of each parameter (experts un-fused) into vLLM's reusable packed
    buffer and all-gathers the buffer's IPC handle; rank 0 sends the merged handles of each chunk to every
    engine (`LLM.update_weights`, whose workers pick their own GPU's buffer and run vLLM's layerwise
    `load_weights`), between `start_weight_update` and `finish_weight_update`. Needs engines of class
    colo.bench.engines.VllmIpcEngine. It reports no coverage of its own: colo.bench.sync compares the
    engines' parameters with what colo's sync writes (`param_digest`)."""
    t_start = time.perf_counter()
    arch = model_arch(model)
    dtype = DTYPE
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    sender = rank == 0
    sent = {"tensors": 0, "bytes": 0, "chunks": 0}

    def weights():
        for name, p in sync_tensors(model):
            full = full_tensor(p)
            for ckpt, w in reference_weights(arch, name, full.to(dtype)):
                sent["tensors"] += 1
                sent["bytes"] += w.numel() * w.element_size()
                yield ckpt, w

    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    class Source(WeightSource):
        def metadata(self) -> list:  # what iteration yields, without gathering (DTensor.shape is global)
            return [ParamMeta(n, dtype, tuple(shape)) for name, p in sync_tensors(model)
                    for n, _, shape in reference_segments(arch, name, tuple(p.shape))]

        def __iter__(self):
            return weights()

    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=bucket_bytes(sync_cfg)),
        client=_EngineClient(engines, sent), source=Source())
    engine.send_weights()  # start, every packed chunk (all ranks gather; rank 0 sends), finish
    return {"seconds": time.perf_counter() - t_start, "gather_s": 0.0, "pack_s": 0.0, "load_s": 0.0,
            "verify_s": 0.0, "tensors": sent["tensors"] if sender else 0, "bytes": sent["bytes"] if sender else 0,
            "buckets": sent["chunks"], "verified": None, "errors": []}  # None: checked by the caller, see above
