"""colo.sync.sender on a real FSDP2 model (gloo, 2 ranks): the bytes the Sender packs into its shared
buffers, read back through the receiver's ReceiverBuffers, equal the unsharded model's in vLLM layout,
with the expert fast path (no all-gather) and without it.

    .venv/bin/python -m pytest tests/integration/test_sync_fsdp.py -q       (~40 s)
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as tmp

from colo.config import SyncConfig
from colo.host.net import free_port
from colo.models.dtypes import torch_dtype
from colo.models.archs import QWEN3_MOE
from colo.sync.plan import direct_mapping
from colo.sync.sender import Sender
from colo.sync.transport import ReceiverBuffers

E = 8


def _describe(model, held: list[int]) -> dict:
    """What colo_describe reports for the tiny Qwen3-MoE (vLLM 0.32 names), holding experts `held`."""
    params, experts = {}, {}
    for n, p in model.named_parameters():
        shape = list(p.shape)
        if ".q_proj." in n:
            n = n.replace("q_proj", "qkv_proj")
            shape = [shape[0] + 2 * model.get_parameter(n.replace("qkv_proj", "k_proj")).shape[0], shape[1]]
        elif ".k_proj." in n or ".v_proj." in n:
            continue
        elif n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj"):
            pre = n.rpartition(".")[0] + ".routed_experts"
            n = pre + (".w13_weight" if n.endswith("gate_up_proj") else ".w2_weight")
            shape = [len(held)] + shape[1:]
            experts[pre] = held
        params[n] = {"shape": shape, "dtype": "bfloat16"}
    return {"params": params, "experts": experts}


def _assemble(model, describe: dict, timings: dict | None = None) -> tuple[dict[str, torch.Tensor], Sender]:
    """One sync's packing by the product Sender (collective), each bucket read back from the shared buffer
    as soon as it is packed, and unpacked into flat vLLM-named tensors like the receiver's direct copy."""
    sender = Sender(model, SyncConfig(bucket_mb=1 / 16, buffers=2), describe, [None], placement="colocated")
    out = {n: torch.zeros(v, dtype=torch.bfloat16) for n, v in sender.plan.expect.items()}
    received = ReceiverBuffers("cpu")
    received.set_active(sender.buffers.handles())

    def unpack(k: int, slot: int) -> None:
        buf = received.get(slot)
        for p in sender.plan.wire(k):
            if "fill" not in p:
                dt = torch_dtype(p["dtype"])
                v = buf[p["buf_offset"]: p["buf_offset"] + p["numel"] * dt.itemsize].view(dt)
                out[p["dst"]][p["dst_offset"]: p["dst_offset"] + p["numel"]] = v

    timings = {} if timings is None else timings
    try:
        sender.pack(timings, reuse=lambda slot: None, send=unpack)
    finally:
        received.set_active([])
        sender.close()
    assert timings.get("full_tensor_fallbacks", 0) == 0, "a unit was not gathered by one batched unshard()"
    return out, sender


def _reference(ref_model, describe, full: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The unsharded model's bytes in vLLM's layout; `full`: these tensors instead of ref_model's (LoRA: merged)."""
    shapes = {n: tuple(p.shape) for n, p in ref_model.named_parameters()}
    tensors = full or dict(ref_model.named_parameters())
    full = {n: p.detach().to(torch.bfloat16).reshape(-1) for n, p in tensors.items()}
    out = {n: torch.zeros(torch.Size(v["shape"]).numel(), dtype=torch.bfloat16) for n, v in describe["params"].items()}
    segs, errors = direct_mapping(QWEN3_MOE, shapes, describe)
    assert not errors, errors
    for s in segs:
        out[s.dst][s.dst_offset: s.dst_offset + s.numel] = full[s.src][s.src_offset: s.src_offset + s.numel]
    return out


def _worker(rank: int, world: int, port: int, path: str, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from colo.trainer.fsdp import build_sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = build_sharded(path, dummy=False, mesh=mesh, device=torch.device("cpu"))
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        res = {}
        per = E // world
        cases = {"replica": list(range(E)),  # CPU engines hold all experts: experts are gathered
                 "ep": list(range(rank * per, (rank + 1) * per)),  # EP shard == FSDP shard: local rows
                 "ep_one_rank_off": list(range(E)) if rank == 1 else list(range(per))}
        for case, held in cases.items():
            d = _describe(model, held)
            got, sender = _assemble(model, d)
            want = _reference(ref, d)
            bad = sorted(n for n in want if not torch.equal(got[n], want[n]))
            res[case] = {"fast": sender.expert_fast, "why": sender.expert_fast_reason, "bad": bad, "n": len(want),
                         "buckets": len(sender.plan.buckets)}
        # LoRA (sync.lora=merged): random adapters; each unit leaves as W + s B A, the expert shards merged locally on
        # the fast path; the bytes equal colo's merged export (colo.trainer.adapters.merged_items), bit for bit
        from colo.models.lora import TARGETS
        from colo.trainer.adapters import LoraSpec, merged_items

        lora = build_sharded(path, dummy=False, mesh=mesh, device=torch.device("cpu"),
                             lora=LoraSpec(3, 6.0, 0.0, TARGETS))
        g = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for p in (p for p in lora.parameters() if p.requires_grad):
                p.to_local().copy_(torch.randn(p.to_local().shape, generator=g) * 0.1)
        merged = dict(merged_items(lora))  # collective
        for case in ("replica", "ep"):
            d, timings = _describe(model, cases[case]), {}
            got, sender = _assemble(lora, d, timings)
            want = _reference(ref, d, merged)
            base = _reference(ref, d)
            res["lora_" + case] = {"fast": sender.expert_fast,
                                   "expert_gathered_bytes": timings.get("expert_gathered_bytes", 0),
                                   "bad": sorted(n for n in want if not torch.equal(got[n], want[n])),
                                   "changed": sorted(n for n in want if not torch.equal(got[n], base[n]))}
        results[rank] = res
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tiny_model):
    path = str(tiny_model)
    mgr = tmp.get_context("spawn").Manager()
    shared = mgr.dict()
    tmp.start_processes(_worker, args=(2, free_port(), path, shared), nprocs=2, join=True, start_method="spawn")
    out = dict(shared)
    mgr.shutdown()
    return out


def test_gathered_experts_match_unsharded(results) -> None:
    for rank in (0, 1):
        r = results[rank]["replica"]
        assert not r["fast"] and r["bad"] == [] and r["n"] > 10 and r["buckets"] > 2, r  # buffers reused


def test_expert_fast_path_reads_local_shard(results) -> None:
    for rank in (0, 1):
        r = results[rank]["ep"]
        assert r["fast"], r
        assert r["bad"] == [], r


def test_fast_path_decision_is_collective(results) -> None:
    """Rank 0's engine matches its shard, rank 1's does not: both ranks must take the gather path
    (unshard is collective; one rank skipping it would hang the other)."""
    for rank in (0, 1):
        r = results[rank]["ep_one_rank_off"]
        assert not r["fast"], r
        assert r["bad"] == [], r
    assert "another rank" in results[0]["ep_one_rank_off"]["why"]


def test_lora_merged_sync_merges_expert_shards_where_they_lie(results) -> None:
    """sync.lora=merged: with the engine holding every expert (CPU) and with EP (the fast path: no expert byte
    all-gathered, each rank merging its own experts), the packed bytes are the merged export's; the adapters
    changed the experts, the attention and the dense layers' bytes."""
    for rank in (0, 1):
        for case, fast in (("lora_replica", False), ("lora_ep", True)):
            r = results[rank][case]
            assert r["fast"] is fast and r["bad"] == [], (rank, case, r)
            assert any("w13_weight" in n for n in r["changed"]) and any("qkv_proj" in n for n in r["changed"]), r
        assert results[rank]["lora_ep"]["expert_gathered_bytes"] == 0, results[rank]["lora_ep"]

