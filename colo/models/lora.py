"""What LoRA adapts in a model, and how colo's adapter tensors are named in memory and in a PEFT folder.

    target_of("model.layers.0.self_attn.q_proj")       # "attention" (None: never adapted)
    LORA_ARCHS                                          # families whose LoRA a test syncs and trains
    peft_key("model.layers.0.mlp.experts.gate_up_proj", "A")  # the PEFT adapter file's key

Pure names and arithmetic (no torch import): colo.config checks trainer.lora_* with it before anything heavy,
colo.trainer.adapters builds the adapters from it, the export writes PEFT's keys from it.

In memory (colo.trainer.adapters), adapters are parameters beside the weight they adapt, so every name the
weight path, the loader and the checkpoint know stays as it was:
- a Linear `m` (weight (out, in)): `m.lora_A` (r, in), `m.lora_B` (out, r): y = x W^T + s (x A^T) B^T;
- a fused experts module `e` (transformers 5: `gate_up_proj` (E, 2I, H), `down_proj` (E, H, I), expert on dim 0):
  `e.gate_up_proj_lora_A` (E, r, H), `e.gate_up_proj_lora_B` (E, 2I, r), and `down_proj_lora_*` likewise: one
  adapter per expert, sharded by FSDP2 on dim 0 like the weight, so rank r holds its experts' adapters too.
The scale s = lora_alpha / lora_rank.

PEFT's format (what `PeftModel.from_pretrained` and vLLM's `--enable-lora` read): keys `base_model.model.<module>.
lora_{A,B}.weight`; a Linear's A and B are stored as they are. Fused experts are PEFT's `target_parameters` layout
(peft >= 0.17, ParamWrapper; the two wrappers nest, gate_up_proj inside as `experts.base_layer`, down_proj outside
as `experts`, the order vLLM's loader expects): A (E*r, in) expert-major, B (out, r*E) with the expert index
fastest (`B.reshape(out, r, E)`), so expert e's delta is B[:, :, e] @ A[e] in both.
"""
from __future__ import annotations

TARGETS = ("attention", "experts", "shared_experts", "mlp")
"""trainer.lora_targets' choices."""

LORA_ARCHS = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
"""Families whose LoRA runs are proven (tests/integration/test_families.py: merged sync equals the merged checkpoint
loaded from disk, over 2 ranks; Qwen2-MoE has shared experts and dense layers). colo.config refuses the others."""

PEFT_PREFIX = "base_model.model."
LINEAR_PARTS = ("lora_A", "lora_B")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # HF's fused expert params LoRA adapts, in PEFT's nesting order
MLP_LEAVES = ("gate_proj", "up_proj", "down_proj")
SHARED_MODULES = ("shared_expert", "shared_experts")  # Qwen2-MoE / Qwen3-Next; DeepSeek / GLM


def target_of(module: str) -> str | None:
    """The trainer.lora_targets category of Linear module `module` (full dotted name), None when LoRA never adapts
    it (routers and their gates, a shared expert's sigmoid gate, embeddings, lm_head)."""
    parent, _, leaf = module.rpartition(".")
    if ".self_attn." in f".{module}" and leaf.endswith("_proj"):
        return "attention"
    if leaf not in MLP_LEAVES:
        return None
    owner = parent.rpartition(".")[2]
    if owner in SHARED_MODULES:
        return "shared_experts"
    if owner == "mlp":
        return "mlp"
    return None


def expert_adapter(param: str, part: str) -> str:
    """The adapter param of fused expert param `param` ("gate_up_proj") and part "A" or "B", on the experts module."""
    return f"{param}_lora_{part}"


def peft_key(weight: str, part: str) -> str:
    """The PEFT adapter file's key of the A or B adapter of `weight` (a Linear's `<m>.weight` or a fused expert
    param `<experts>.gate_up_proj` / `.down_proj`)."""
    module, _, leaf = weight.rpartition(".")
    if leaf == "weight":
        return f"{PEFT_PREFIX}{module}.lora_{part}.weight"
    if leaf == EXPERT_PARAMS[0]:  # the inner ParamWrapper
        return f"{PEFT_PREFIX}{module}.base_layer.lora_{part}.weight"
    if leaf == EXPERT_PARAMS[1]:
        return f"{PEFT_PREFIX}{module}.lora_{part}.weight"
    raise ValueError(f"{weight}: not a weight colo's LoRA adapts")
