"""Attention for packed rows without an (N, N) mask: `sdpa_varlen`, a transformers attention implementation.

    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_for(device, config))
    model.model(input_ids=ids, position_ids=pos, colo_bounds=(0, 37, 52, 90), use_cache=False)   # (1, 90) packed

Why: transformers reads packed rows from position_ids, but for sdpa and eager it turns them into a dense
(1, 1, N, N) block-diagonal mask (masking_utils.find_packed_sequence_indices), and SDPA with a dense mask
computes every one of the N^2 scores, then masks them: a 16k-token micro-batch of 1.5k-token samples does ~10x
the attention work it needs, and the mask alone is N^2 bytes. flash-attention's varlen kernel skips it (the
trainer uses flash_attention_2 where the flash_attn package is installed), but it is not part of torch.

sdpa_varlen runs SDPA once per sample of a packed row with is_causal=True (the flash / cuDNN kernels on GPU),
on views of q, k, v: exactly causal attention inside each sample, no mask, no N^2 term. `colo_bounds` (the
samples' start offsets and the row length, host ints: no device sync per layer) reach the attention function
through transformers' **kwargs (model -> decoder layer -> self_attn -> attention interface). Without them
(padded rows, attention_mask given) it is transformers' own sdpa, mask and all: the mask function registered
with it is sdpa's where a 2-D mask is given and none otherwise (plain causal, or a packed row).
"""
from __future__ import annotations

import torch

NAME = "sdpa_varlen"


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               colo_bounds: tuple[int, ...] | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, h, N, d), key / value (1, h_kv, N, d) -> (1, N, h, d), as transformers' sdpa returns it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if colo_bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or colo_bounds[-1] != query.shape[2]:
        raise ValueError(f"colo_bounds {colo_bounds[:3]}..{colo_bounds[-1]} do not describe one packed row of "
                         f"{query.shape[2]} tokens (batch {query.shape[0]})")
    gqa = key.shape[1] != query.shape[1]
    out = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout, is_causal=True, scale=scaling,
        enable_gqa=gqa) for s, e in zip(colo_bounds[:-1], colo_bounds[1:])]  # (1, h, L, d) each
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None  # (1, N, h, d)


def _mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """sdpa's mask where a 2-D attention mask is given (padded rows); none without one: plain causal, or a
    packed row, which _attention splits by colo_bounds (a packed row must carry them)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Register sdpa_varlen with transformers (idempotent); returns its name for attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME


def attention_for(device: torch.device, config=None) -> str:
    """flash_attention_2 on GPU where the flash_attn package is installed (its varlen kernel reads the packed
    rows from position_ids), else sdpa_varlen; eager for a model class transformers runs without SDPA (GPT-OSS:
    its attention sinks are in eager and flash kernels only, so SDPA per sample would drop them), where
    transformers' own block-diagonal mask from the packed position ids keeps attention inside each sample."""
    if config is not None and not supports_sdpa(config):
        return "eager"
    if device.type == "cuda":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
    return register()


def supports_sdpa(config) -> bool:
    """Whether transformers runs this config's causal-LM class through SDPA (its `_supports_sdpa`)."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return bool(getattr(cls, "_supports_sdpa", False))
