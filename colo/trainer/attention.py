"""Attention for packed rows without an (N, N) mask: `sdpa_varlen`, a transformers attention implementation.

    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_for(device, config))
    model.model(input_ids=ids, position_ids=pos, colo_bounds=(0, 37, 52, 90), use_cache=False)   # (1, 90) packed

Why: transformers reads packed rows from position_ids, but for sdpa and eager it turns them into a dense
(1, 1, N, N) block-diagonal mask (masking_utils.find_packed_sequence_indices), and SDPA with a dense mask
computes every one of the N^2 scores, then masks them: a 16k-token micro-batch of 1.5k-token samples does ~10x
the attention work it needs, and the mask alone is N^2 bytes. flash-attention's varlen kernel skips it (the
trainer uses flash_attention_2 where the flash_attn package is installed), but it is not part of torch.

On a packed row sdpa_varlen runs exactly causal attention inside each sample, no mask, no N^2 term, with one of
two kernels (`packed_attention`):
- `varlen` (CUDA, torch.nn.attention.varlen): one flash-attention varlen call for the whole row from its
  cumulative sample offsets, GQA in the kernel.
- `per_sample` (CPU, or a torch without varlen): SDPA once per sample with is_causal=True on views of q, k, v.
  On CUDA it leaves cuDNN's SDPA out: cuDNN builds (and caches) an execution graph per distinct shape, and every
  sample of a long-tail batch has a length of its own, so each call paid a graph build on the host, and packing lost
  to the padded path (whose rows all have one length) at 4k. Per 8,192-token row one varlen call took 3.76 ms, per-
  sample SDPA as torch picks it 499.6 ms, with cuDNN left out 4.24 ms (docs/benchmarks.md, "Answered experiments",
  on an H100).
`colo_bounds` (the samples' start offsets and the row length, host ints: no device sync per layer) reach the
attention function through transformers' **kwargs (model -> decoder layer -> self_attn -> attention interface).
Without them (padded rows, attention_mask given) it is transformers' own sdpa, mask and all: the mask function
registered with it is sdpa's where a 2-D mask is given and none otherwise (plain causal, or a packed row).
"""
from __future__ import annotations

import functools

import torch

NAME = "sdpa_varlen"


def per_sample(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: tuple[int, ...],
               scale: float | None = None, dropout: float = 0.0, cudnn: bool = False) -> torch.Tensor:
    """query (1, h, N, d), key / value (1, h_kv, N, d), samples at `bounds` -> (1, N, h, d): SDPA per sample.
    cudnn=False keeps cuDNN's SDPA out on CUDA (a graph build per new sample length; module docstring)."""
    gqa = key.shape[1] != query.shape[1]

    def run() -> list[torch.Tensor]:
        return [torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout, is_causal=True, scale=scale,
            enable_gqa=gqa) for s, e in zip(bounds[:-1], bounds[1:])]  # (1, h, L, d) each

    if query.is_cuda and not cudnn:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = run()
    else:
        out = run()
    return torch.cat(out, dim=2).transpose(1, 2).contiguous()  # (1, N, h, d)


@functools.cache
def _varlen_attn():
    """torch.nn.attention.varlen.varlen_attn (torch >= 2.10) and the keywords that make it causal and GQA on this
    torch; None where this torch lacks it. Looked up once: the trainer calls it per layer."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    # torch 2.13: causal is a window reaching back without limit; older: is_causal
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


class Bounds:
    """A packed row's `colo_bounds` as one object that torch.compile passes through untouched (trainer.compile).

    A tuple of ints reaching a compiled decoder layer is guarded on its length (and the ints on their values), so
    each new sample count per row recompiled the layer: the tiny model hit dynamo's recompile limit in its first
    step. This object is only handed on to _attention, which dynamo does not trace."""

    __slots__ = ("offsets",)

    def __init__(self, offsets: tuple[int, ...]) -> None:
        self.offsets = tuple(offsets)


# the last row's cumulative offsets on the device: one host-to-device copy per row, not per layer
_CU_SEQ: dict[tuple, torch.Tensor] = {}


def varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: tuple[int, ...],
           scale: float | None = None) -> torch.Tensor:
    """query (1, h, N, d), key / value (1, h_kv, N, d), samples at `bounds` -> (1, N, h, d): one
    flash-attention varlen call (CUDA only), causal inside each sample."""
    fn, causal, gqa_kernel = _varlen_attn()
    key_ = (bounds, query.device)
    cu = _CU_SEQ.get(key_)
    if cu is None:
        _CU_SEQ.clear()
        cu = _CU_SEQ[key_] = torch.tensor(bounds, dtype=torch.int32, device=query.device)
    longest = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (N, heads, d)
    kw: dict = {"scale": scale, **causal}
    if k.shape[1] != q.shape[1]:
        if gqa_kernel:
            kw["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return fn(q, k, v, cu, cu, longest, longest, **kw)[None]  # (1, N, h, d)


def packed_attention(device: torch.device, dropout: float = 0.0) -> str:
    """Which kernel runs a packed row here: "varlen" (CUDA with torch's varlen attention, no dropout) or
    "per_sample"."""
    if device.type == "cuda" and dropout == 0.0 and _varlen_attn() is not None:
        return "varlen"
    return "per_sample"


@torch.compiler.disable
def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               colo_bounds: tuple[int, ...] | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, h, N, d), key / value (1, h_kv, N, d) -> (1, N, h, d), as transformers' sdpa returns it.
    Compile-disabled: a graph break in a compiled layer (trainer.compile), whose kernels here are one varlen call
    or SDPA per sample either way, and whose `colo_bounds` (a tuple or a Bounds) dynamo must not guard on."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(colo_bounds, Bounds):
        colo_bounds = colo_bounds.offsets

    if colo_bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or colo_bounds[-1] != query.shape[2]:
        raise ValueError(f"colo_bounds {colo_bounds[:3]}..{colo_bounds[-1]} do not describe one packed row of "
                         f"{query.shape[2]} tokens (batch {query.shape[0]})")
    if packed_attention(query.device, dropout) == "varlen":
        return varlen(query, key, value, colo_bounds, scaling), None
    return per_sample(query, key, value, colo_bounds, scaling, dropout), None


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
