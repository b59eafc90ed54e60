"""vLLM's weights on an engine GPU, for the memory plan: bf16, or FP8 rollout's e4m3 weights and their scales.

    weights, staging = engine_weights(model_shape, settings, vocab_pad)     # bytes per engine GPU

Pure (no torch: the plan runs before anything heavy is imported). What an FP8 engine holds in e4m3 is what
colo.rollout.quant leaves to vLLM's FP8 config: every matrix of the linears and experts but the router, the
embeddings and the lm_head (and the attention projections when rollout.fp8_attention=false), one byte per element
and one float32 scale per 128 x 128 block (colo.sync.fp8). A receiver-quantizing engine (sync.fp8_in=receiver)
also holds a bf16 staging copy of every quantized weight while a sync runs (colo.sync.refresh writes the bf16 bytes
there, vLLM's post-load step quantizes them, and the storage is freed at the sync's end), outside vLLM's memory
fraction: colocated, beside the weights woken for the sync while the KV cache still sleeps.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from colo.plan.memory import ModelShape, ParamSpec
    from colo.plan.settings import Settings

FP8_BLOCK = 128  # colo.sync.fp8.BLOCK: one float32 scale per 128 x 128 block (torch-free here)


def fp8_quantized(p: ParamSpec, attention: bool) -> bool:
    """Whether an FP8 engine holds this weight in e4m3 (colo.rollout.quant): every matrix of the linears and experts
    but the router (`mlp.gate`, a shared expert's gate), the embeddings and the lm_head; attention per `attention`."""
    if len(p.shape) < 2 or p.name in ("model.embed_tokens.weight", "lm_head.weight"):
        return False
    if p.name.endswith((".mlp.gate.weight", ".shared_expert_gate.weight")):
        return False
    return attention or ".self_attn." not in p.name


def engine_weights(m: ModelShape, s: Settings, vocab_pad: int) -> tuple[float, float]:
    """(bytes of vLLM's weights on one engine GPU, bytes of the bf16 staging copy a receiver-quantizing FP8 engine
    holds during a sync). Experts are split over EP (colocated) or TP (disaggregated), the rest replicated (or split
    over TP).
    FP8: one byte per quantized element and a float32 scale per 128 x 128 block of each matrix."""
    r, mode = s.rollout, s.placement.mode
    fp8, attention = r.quantization == "fp8", bool(r.fp8_attention)

    def nbytes(p: ParamSpec) -> float:
        if not fp8 or not fp8_quantized(p, attention):
            return 2.0 * p.numel
        rows, cols = p.shape[-2:]
        lead = p.numel // (rows * cols)
        return p.numel + 4.0 * lead * (-(-rows // FP8_BLOCK)) * (-(-cols // FP8_BLOCK))

    def share(p: ParamSpec) -> float:
        if mode != "colocated":
            return 1.0 / r.tp_size
        return 1.0 / s.placement.num_gpus if p.expert else 1.0

    weights = sum(nbytes(p) * share(p) for p in m.params) + 2.0 * vocab_pad / (1 if mode == "colocated" else r.tp_size)
    staging = 0.0
    if fp8 and s.cfg.sync.fp8_in == "receiver":
        staging = sum(2.0 * p.numel * share(p) for p in m.params if fp8_quantized(p, attention))
    return weights, staging
