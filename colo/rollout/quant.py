"""How the vLLM engine holds FP8 weights (rollout.quantization=fp8), its KV cache dtype and its FP8 kernels.

    kwargs, env = engine_quantization(cfg, config_json)   # into vllm.LLM(**kwargs) and os.environ, before vLLM starts

Two ways, one per sync.fp8_in (colo.sync.fp8 says what each sync does):
- sender: the engine is created as for a block-FP8 checkpoint, through vLLM's `Fp8Config` (hf_overrides gives the
  model a `quantization_config`: quant_method fp8, weight_block_size [128, 128], dynamic activation scales,
  modules_to_not_convert = the bf16 modules below). Its linears hold `weight` e4m3 (N, K) and `weight_scale_inv`
  float32 (ceil(N/128), ceil(K/128)); its experts `w13_weight` / `w2_weight` e4m3 with `w13_weight_scale_inv` /
  `w2_weight_scale_inv` (vllm/model_executor/layers/quantization/fp8.py, Fp8LinearMethod / Fp8MoEMethod). colo
  writes those, and vLLM's post-load step (kernel layouts: CUTLASS's or DeepGEMM's scale layouts, the MoE
  backend's weight order) is re-run after every sync by colo.sync.refresh.
- receiver: vLLM's online FP8 (`quantization="fp8_per_block"`, with `quantization_config={"ignore": ...}` for the
  bf16 modules: vLLM's online FP8 would quantize the router too). Its linears and experts declare their bf16
  checkpoint layout (LAYERWISE_INFO); colo writes bf16 into staging tensors of that layout (colo.sync.refresh) and
  the re-run post-load step quantizes them (vllm/utils/deep_gemm.py per_block_cast_to_fp8, per linear and expert).
Either way the engine starts from random weights (load_format="dummy"): the loop's first sync, before any
generation, writes every weight (its byte check fails on any it misses), and a bf16 checkpoint could not be
loaded into the FP8 params of the sender way anyway.

Kernels (rollout.fp8_kernels): vLLM's DeepGEMM compiles its kernels with nvcc at run time, which had not finished
warming up after 265 s on an H200, and the GPU hosts start bare: auto turns it off (VLLM_USE_DEEP_GEMM=0) and lets
vLLM choose among the rest, which in vLLM 0.32 on Hopper is CUTLASS block-FP8 for the linears
(CutlassFp8BlockScaledMMKernel) and Triton for the experts (the FlashInfer CUTLASS MoE it prefers with expert
parallelism is not in colo's GPU bundle); triton and deep_gemm name both backends (vLLM's moe_backend and
linear_backend).
"""
from __future__ import annotations

from typing import Any

from colo.config import ColoConfig
from colo.models.archs import architecture

BLOCK = [128, 128]
BF16_MODULES: dict[str, tuple[str, ...]] = {"Qwen3MoeForCausalLM": ("mlp.gate",)}
"""Per decoder layer, the vLLM modules left in bf16 per family: the router (vLLM's GateLinear is a linear layer its
FP8 configs would quantize). Embeddings, lm_head and norms are not linear layers there: never quantized."""
ATTENTION = ("self_attn.qkv_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
"""rollout.fp8_attention=false: the attention projections, by their fused name (what vLLM's Fp8Config matches first)
and by their parts (what its online config matches through the fused mapping)."""
KERNELS: dict[str, tuple[dict[str, str], str]] = {
    "auto": ({}, "0"), "triton": ({"moe_backend": "triton", "linear_backend": "triton"}, "0"),
    "deep_gemm": ({"moe_backend": "deep_gemm", "linear_backend": "deep_gemm"}, "1")}
"""rollout.fp8_kernels -> (vllm.LLM kwargs, VLLM_USE_DEEP_GEMM)."""


def bf16_modules(config_json: dict[str, Any], fp8_attention: bool) -> list[str]:
    """The vLLM module names an FP8 engine keeps in bf16: every layer's router (and attention, unless quantized)."""
    per_layer = BF16_MODULES[architecture(config_json) or ""] + (() if fp8_attention else ATTENTION)
    return [f"model.layers.{i}.{m}" for i in range(int(config_json["num_hidden_layers"])) for m in per_layer]


def engine_quantization(cfg: ColoConfig, config_json: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(vllm.LLM keyword arguments, environment variables) for cfg.rollout's quantization settings (module doc);
    empty for a bf16 engine with vLLM's own KV cache dtype."""
    r = cfg.rollout
    kwargs: dict[str, Any] = {} if r.kv_cache_dtype == "auto" else {"kv_cache_dtype": r.kv_cache_dtype}
    if r.quantization == "none":
        return kwargs, {}
    keep = bf16_modules(config_json, bool(r.fp8_attention))
    if cfg.sync.fp8_in == "sender":
        kwargs["hf_overrides"] = {"quantization_config": {
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK,
            "modules_to_not_convert": keep}}
    else:
        kwargs.update(quantization="fp8_per_block", quantization_config={"ignore": keep})
    kwargs["load_format"] = "dummy"
    backends, deep_gemm = KERNELS[r.fp8_kernels]
    kwargs.update(backends)
    return kwargs, {"VLLM_USE_DEEP_GEMM": deep_gemm}
