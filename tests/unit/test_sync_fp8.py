"""FP8 rollout's quantization (colo.sync.fp8) against vLLM's own, bit for bit, and the plan's scale companions.

    pytest -q tests/unit/test_sync_fp8.py        (~10 s: imports vLLM's quantization function, ~4 s idle)

The engine side (vLLM's FP8 params as its code creates them, the packed bytes as the receiver writes them) is
tests/integration/test_fp8_sync.py; on CUDA, tests/gpu/test_fp8_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from colo.models.archs import QWEN3_MOE
from colo.sync.fp8 import (BLOCK, FP8_DTYPE, SCALE, Fp8Plan, Fp8PlanError, dequantize_blocks, quantize_blocks,
                           scale_shape)
from colo.sync.plan import build_plan, direct_mapping


def _vllm_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32's per-block FP8 quantization of one matrix: what its online fp8_per_block calls per linear and per
    expert (vllm/model_executor/layers/quantization/online/fp8.py). vLLM wraps it in torch.compile; its body runs
    here as written (the compile costs ~20-60 s on 2 cores). On CPU inductor keeps the division by 448 a true
    division, as eager does (torch/_inductor/lowering.py, div_prim: its reciprocal rewrite is for other devices, where
    eager multiplies by the reciprocal too), so the compiled function gives these bytes; tests/gpu/test_fp8_gpu.py
    compares with the compiled function on CUDA."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    body = per_block_cast_to_fp8._torchdynamo_orig_callable
    return body(w, block_size=[BLOCK, BLOCK], use_ue8m0=False)


def _weights(*shape: int, seed: int = 0) -> torch.Tensor:
    """bf16 weights with blocks of very different magnitudes, one all-zero block and values on e4m3's edges."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.logspace(-4, 1, shape[-1]).view(*([1] * (len(shape) - 1)), -1)
    w[..., :BLOCK, :BLOCK] = 0.0  # amax 0: vLLM clamps it to 1e-4
    w.view(-1)[7] = 3e4
    return w.to(torch.bfloat16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (64, 1000), (1024, 1024)])
def test_a_matrix_quantizes_as_vllm_does(shape: tuple[int, int]) -> None:
    w = _weights(*shape)
    q, s = quantize_blocks(w)
    vq, vs = _vllm_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == scale_shape(shape)
    assert _same(q, vq), "e4m3 bytes differ from vLLM's"
    assert torch.equal(s, vs), "block scales differ from vLLM's"
    if shape == (1024, 1024):  # 64 blocks: a scale made by the reciprocal instead of a division would show here
        amax = w.float().abs().view(8, BLOCK, 8, BLOCK).amax(dim=(1, 3)).clamp(1e-4)
        assert not torch.equal(amax * torch.tensor(1 / 448.0), s), "the test cannot tell division from reciprocal"


def test_experts_quantize_one_by_one_as_vllm_does() -> None:
    """A stack of experts (E, 2I, H) in chunks of a few experts: each expert's bytes and scales are vLLM's for that
    expert alone (what its online MoE method computes per expert)."""
    w = _weights(5, 256, 384, seed=1)
    import colo.sync.fp8 as fp8

    chunk, fp8.CHUNK_ELEMS = fp8.CHUNK_ELEMS, 2 * 256 * 384  # two experts per chunk: the chunking is exercised
    try:
        q, s = quantize_blocks(w)
    finally:
        fp8.CHUNK_ELEMS = chunk
    assert tuple(s.shape) == (5, 2, 3)
    for e in range(5):
        vq, vs = _vllm_quantize(w[e])
        assert _same(q[e], vq) and torch.equal(s[e], vs), f"expert {e}"


def test_float32_master_weights_quantize_as_their_bf16_copy() -> None:
    """The trainer's FSDP2 expert shard is the float32 master copy; the engine would have loaded its bf16 rounding."""
    w32 = torch.randn(2, 256, 256, dtype=torch.float32)
    q, s = quantize_blocks(w32, via=torch.bfloat16)
    rq, rs = quantize_blocks(w32.to(torch.bfloat16))
    assert _same(q, rq) and torch.equal(s, rs)
    assert not _same(quantize_blocks(w32)[0], q), "rounding first changed nothing: the test could not fail"


def test_fused_parts_give_the_fused_weights_bytes() -> None:
    """vLLM (receiver placement) quantizes the fused qkv_proj whole; colo (sender placement) each of q, k and v: the
    same blocks when every part but the last is whole 128-row blocks, the last may end in a partial block."""
    q_, k_, v_ = _weights(256, 256, seed=2), _weights(128, 256, seed=3), _weights(72, 256, seed=4)
    fused_q, fused_s = _vllm_quantize(torch.cat([q_, k_, v_]))
    parts = [quantize_blocks(p) for p in (q_, k_, v_)]
    assert _same(torch.cat([p[0] for p in parts]), fused_q)
    assert torch.equal(torch.cat([p[1] for p in parts]), fused_s)


def test_dequantized_weights_are_within_e4m3s_rounding() -> None:
    w = _weights(256, 384, seed=5).float()
    q, s = quantize_blocks(w.to(torch.bfloat16))
    back = dequantize_blocks(q, s)
    scale = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)  # (256, 384)
    # e4m3: 3 mantissa bits, half an ulp is 2^-4 of a normal value; subnormals (below 2^-6) are 2^-9 apart
    bound = w.abs() * 2 ** -4 + scale * 2 ** -10
    assert bool(((back - w).abs() <= bound * (1 + 1e-5)).all())
    assert float((back - w).abs().max()) > 0, "no rounding at all: the test could not fail"


# ------------------------------------------------------------------------------------------------- the plan

H, I, E, Q, KV, V = 256, 128, 4, 256, 128, 512


def _trainer() -> dict[str, tuple[int, ...]]:
    p = "model.layers.0."
    return {"model.embed_tokens.weight": (V, H), f"{p}self_attn.q_proj.weight": (Q, H),
            f"{p}self_attn.k_proj.weight": (KV, H), f"{p}self_attn.v_proj.weight": (KV, H),
            f"{p}self_attn.o_proj.weight": (H, Q), f"{p}mlp.gate.weight": (E, H),
            f"{p}mlp.experts.gate_up_proj": (E, 2 * I, H), f"{p}mlp.experts.down_proj": (E, H, I),
            "model.norm.weight": (H,), "lm_head.weight": (V, H)}


def _engine(attention_fp8: bool = True) -> dict:
    """describe() of a block-FP8 engine for _trainer(): the shapes vLLM's Fp8Config creates (checked against vLLM's
    own create_weights in tests/integration/test_fp8_sync.py), router, embeddings, norms and lm_head in bf16."""
    p, m = "model.layers.0.", "model.layers.0.mlp.experts.routed_experts"
    bf, f8 = "bfloat16", FP8_DTYPE
    att = f8 if attention_fp8 else bf
    params = {"model.embed_tokens.weight": {"shape": [V, H], "dtype": bf},
              f"{p}self_attn.qkv_proj.weight": {"shape": [Q + 2 * KV, H], "dtype": att},
              f"{p}self_attn.o_proj.weight": {"shape": [H, Q], "dtype": att},
              f"{p}mlp.gate.weight": {"shape": [E, H], "dtype": bf},
              f"{m}.w13_weight": {"shape": [E, 2 * I, H], "dtype": f8},
              f"{m}.w13_weight_scale_inv": {"shape": [E, 2 * I // BLOCK, H // BLOCK], "dtype": "float32"},
              f"{m}.w2_weight": {"shape": [E, H, I], "dtype": f8},
              f"{m}.w2_weight_scale_inv": {"shape": [E, H // BLOCK, I // BLOCK], "dtype": "float32"},
              "model.norm.weight": {"shape": [H], "dtype": bf}, "lm_head.weight": {"shape": [V, H], "dtype": bf}}
    if attention_fp8:
        params[f"{p}self_attn.qkv_proj.weight_scale_inv"] = {"shape": [(Q + 2 * KV) // BLOCK, H // BLOCK],
                                                             "dtype": "float32"}
        params[f"{p}self_attn.o_proj.weight_scale_inv"] = {"shape": [H // BLOCK, Q // BLOCK], "dtype": "float32"}
    return {"params": params, "experts": {m: list(range(E))}}


def _fp8_plan(trainer: dict, d: dict) -> Fp8Plan | None:
    return Fp8Plan.of(QWEN3_MOE, trainer, d, direct_mapping(QWEN3_MOE, trainer, d)[0])


@pytest.mark.parametrize("attention_fp8", [True, False])
def test_scales_map_like_their_weights(attention_fp8: bool) -> None:
    """Each quantized trainer tensor gets a `_scale_inv` companion, mapped by the same rules: q/k/v's scales to row
    offsets of qkv_proj's scale in scale rows, the experts' to w13/w2's scales expert by expert; every engine param,
    weights and scales, written exactly once; the router and the rest stay bf16."""
    trainer, d = _trainer(), _engine(attention_fp8)
    fp8 = _fp8_plan(trainer, d)
    att = {f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkvo"}
    experts = {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    assert set(fp8.quantized) == experts | (att if attention_fp8 else set())
    names = list(fp8.shapes)
    for n in fp8.quantized:  # each companion right after its base: the source hands out both in one unit
        assert names[names.index(n) + 1] == n + SCALE and fp8.shapes[n + SCALE] == scale_shape(trainer[n])
    plan = build_plan(QWEN3_MOE, fp8.shapes, d, 1 << 20)
    pieces = [p for b in plan.buckets for p in b]
    assert {p["dst"] for p in pieces} == set(d["params"])
    dtypes = {p["dst"]: p["dtype"] for p in pieces}
    assert dtypes["model.layers.0.mlp.gate.weight"] == "bfloat16"
    assert dtypes["model.layers.0.mlp.experts.routed_experts.w13_weight_scale_inv"] == "float32"
    if attention_fp8:
        scale = [p for p in pieces if p["dst"] == "model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
        offsets = {p["src"].split(".")[-2]: p["dst_offset"] for p in scale}
        assert offsets == {"q_proj": 0, "k_proj": Q // BLOCK * (H // BLOCK), "v_proj": (Q + KV) // BLOCK * (H // BLOCK)}
    wire = plan.total_bytes  # a sync carries one byte per quantized element, 4 per scale
    assert wire == sum(int(torch.Size(p["shape"]).numel()) * torch.tensor([], dtype=getattr(torch, p["dtype"])).itemsize
                       for p in d["params"].values())


def test_a_bf16_engine_has_no_fp8_plan() -> None:
    trainer, d = _trainer(), _engine()
    for p in d["params"].values():
        p["dtype"] = "bfloat16" if p["dtype"] == FP8_DTYPE else p["dtype"]
    assert _fp8_plan(trainer, d) is None


def test_fused_parts_off_block_rows_are_refused() -> None:
    """q_proj rows not whole 128-row blocks inside qkv_proj: its scale rows would not be the fused weight's."""
    trainer, d = _trainer(), _engine()
    trainer["model.layers.0.self_attn.q_proj.weight"] = (Q - 64, H)
    d["params"]["model.layers.0.self_attn.qkv_proj.weight"]["shape"] = [Q - 64 + 2 * KV, H]
    with pytest.raises(Fp8PlanError, match=r"q_proj.weight: 192 rows, not a multiple of 128, inside vLLM's fused "
                                           r"self_attn.qkv_proj"):
        _fp8_plan(trainer, d)


def test_attention_left_in_bf16_needs_no_scale() -> None:
    """rollout.fp8_attention=false: the engine holds q/k/v/o in bf16; a scale param it still declares is a vLLM param
    nothing writes, reported by the plan as any other."""
    trainer, d = _trainer(), _engine(attention_fp8=False)
    fp8 = _fp8_plan(trainer, d)
    assert not any("self_attn" in n for n in fp8.quantized)
    d["params"]["model.layers.0.self_attn.o_proj.weight_scale_inv"] = {"shape": [2, 2], "dtype": "float32"}
    from colo.sync.plan import MappingError

    with pytest.raises(MappingError, match="o_proj.weight_scale_inv: nothing writes it"):
        build_plan(QWEN3_MOE, _fp8_plan(trainer, d).shapes, d, 1 << 20)


def test_fp8_rounding_stays_inside_its_tolerance_and_a_stale_engine_does_not(tmp_path) -> None:
    """TOLERANCE["fp8"] (colo.sync.probe) against what tools.experiments.fp8probe measures on one tiny-fp8 model: FP8's
    rounding of weights and activations well inside it, the weights of another model far outside."""
    from tools.experiments.fp8probe import measure, parse_args
    from colo.sync.probe import TOLERANCE

    out = measure(parse_args(["--preset", "tiny-fp8", "--seeds", "1", "--workdir", str(tmp_path)]))
    row = out["rows"][0]
    assert 0 < row["weights"] <= row["w8a8"] < TOLERANCE["fp8"] / 2, row
    assert row["stale"] > 3 * TOLERANCE["fp8"], row
