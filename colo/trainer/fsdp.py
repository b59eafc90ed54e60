"""Build the policy and shard it with FSDP2: per MoE expert block, per decoder layer, then root.

    config ─ every rank: from_config on meta ─ parallelize ─ to_empty ─┬ HF checkpoint: each rank reads its
                                                                      │ own dim-0 rows (colo.trainer.load)
                                                                      └ dummy: random-init local shards

Invariants the weight sync (colo.sync.sender) relies on:
- every parameter is a DTensor sharded `Shard(0)` over one 1-D mesh of all ranks;
- each MoE layer's `layer.mlp.experts` is its own FSDP unit, so its fused `gate_up_proj` (E, 2I, H)
  and `down_proj` (E, H, I) shards on rank r are exactly experts [r*ceil(E/W), ...) in torch.chunk
  order (colo.models.archs.expert_shard_range), and can be read without an all-gather.

Why not from_pretrained: it builds the whole model in fp32 on the host (120 GB for Qwen3-30B-A3B, 940 GB
for Qwen3-235B-A22B); eight ranks each holding one would not fit a 560 GiB host, and even rank 0 alone
(colo's first loader, which broadcast from there) needs the full fp32 copy. Each rank reads its shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from colo.algo.logprobs import shifted_logprobs
from colo.trainer.attention import Bounds, attention_for, supports_sdpa

def meta_model(model_path: str, attn_implementation: str | None = None,
               experts_implementation: str | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The unsharded HF causal LM on the meta device (no memory), fp32 (LoRA: the frozen base in the compute
    dtype), from the checkpoint's config.json; parallelize() shards it, then to_empty() + load_sharded() or
    materialize() fill each rank's shards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    if attn_implementation is not None and not supports_sdpa(config):
        attn_implementation = "eager"  # GPT-OSS: sinks live in eager/flash only (colo.trainer.attention.attention_for)
    with torch.device("meta"):
        extra = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                **extra)


def _logprob_forward(self: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor, temperature: float, chunk: int,
                     bounds: tuple[int, ...] | None = None, token_loss=None) -> tuple[torch.Tensor, ...]:
    """(b, T) log-probs and entropies of input_ids (colo.algo.logprobs.shifted_logprobs), from the decoder's
    hidden states and the lm_head weight, without the (b, T, V) logits. A packed row: attention_mask None,
    `bounds` its samples' start offsets and its length (colo.trainer.attention). `token_loss`
    (colo.algo.loss.TokenLoss, laid out as input_ids): the loss's gradient taken in the lm_head's chunk loop, and a
    third output, the scalar whose backward() is the loss's."""
    extra = {} if bounds is None else {"colo_bounds": Bounds(bounds)}  # opaque to torch.compile (Bounds)
    hidden = self.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False, **extra).last_hidden_state  # (b, T, H)
    return shifted_logprobs(hidden, self.get_output_embeddings().weight, input_ids,
                            position_ids if attention_mask is None else None, temperature, chunk,
                            getattr(self, "colo_compile_backend", None),  # trainer.compile: fused chunk math
                            token_loss=token_loss)


def _probe_forward(self: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """(S, T, V) float32 logits of unpadded sequences input_ids (S, T): the sync's functional check
    (colo.sync.probe), a few dozen tokens, so the whole logits are fine here."""
    hidden = self.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state  # (S, T, H)
    return hidden.float() @ self.get_output_embeddings().weight.float().T


def enable_logprob_forward(model: nn.Module) -> nn.Module:
    """Give the sharded root `model.colo_logprobs(input_ids, attention_mask, position_ids, temperature, chunk,
    bounds)` and `model.colo_probe(input_ids)`,
    registered with FSDP2 as forward methods: their pre/post-forward hooks gather the root's params (embedding,
    final norm, lm_head) around them as around forward, and backward reduce-scatters the lm_head's gradient that
    the chunked function produces. Calling the decoder and the weight outside such a method would read
    sharded DTensors."""
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    model.colo_logprobs = types.MethodType(_logprob_forward, model)
    register_fsdp_forward_method(model, "colo_logprobs")
    model.colo_probe = types.MethodType(_probe_forward, model)
    register_fsdp_forward_method(model, "colo_probe")
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of an HF causal LM (`model.model.layers` for Qwen/Llama/Mixtral)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers ModuleList; colo shards "
                        "HF decoder-only LMs layer by layer")
    return layers


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
    compile_backend: str | None = None,
) -> nn.Module:
    """fully_shard each `mlp.experts`, each decoder layer, then the root (torchtitan's order). `compile_backend`
    (trainer.compile): torch.compile each decoder layer first (colo.trainer.compile), and the log-prob chunks'
    math (colo.algo.logprobs)."""
    if gradient_checkpointing:
        # non-reentrant: the reentrant variant reruns forward outside autograd and breaks FSDP2's
        # post-backward hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layers = decoder_layers(model)
    model.colo_compile_backend = compile_backend  # the log-prob chunks' math too (_logprob_forward)
    if compile_backend is not None:
        from colo.trainer.compile import compile_layers

        compile_layers(layers, compile_backend)
    for i, layer in enumerate(layers):
        # the last block's params are needed again right away by backward: keep them gathered
        keep = i == len(layers) - 1
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None and any(True for _ in experts.parameters(recurse=False)):
            fully_shard(experts, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep)
            experts.colo_reshard_after_forward = not keep
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep)
        layer.colo_reshard_after_forward = not keep
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    model.colo_reshard_after_forward = False
    return model


def hold_gathered(model: nn.Module, hold: bool) -> None:
    """trainer.gather_once: with `hold`, every FSDP unit stays gathered after its forward and after its backward,
    and gradients are not reduced, until hold_gathered(model, False): a pass over many micro-batches gathers (and
    casts to bf16) each unit once instead of once per micro-batch, twice with backward. Without `hold`, each unit's
    reshard_after_forward is parallelize()'s again."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_reshard_after_forward(False if hold else getattr(m, "colo_reshard_after_forward", True),
                                        recurse=False)
    if isinstance(model, FSDPModule):
        model.set_reshard_after_backward(not hold)
        model.set_requires_gradient_sync(not hold)


def reduce_next_backward(model: nn.Module) -> None:
    """Under hold_gathered: the next backward (a mini-batch's last micro-batch) reduces the gradients accumulated
    unsharded so far and reshards every unit after it, as a default backward does."""
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, *, seed: int) -> None:
    """Allocate the local shards of a meta-built, sharded model and random-init them.

    Deterministic for (seed, rank, world size): each rank draws its own shards from a generator
    seeded with seed and rank, so no rank ever holds or draws a full tensor. Norm weights are 1 and
    biases 0, like HF's init; std is the config's initializer_range. Persistent buffers (DeepSeek's
    e_score_correction_bias) start at 0, as HF inits them.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    model.to_empty(device=device)
    std = float(getattr(model.config, "initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank)
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p.data
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        elif name.endswith(".bias"):
            local.zero_()
        else:
            local.normal_(0.0, std, generator=gen)
    for name, buf in persistent_buffers(model):
        buf.zero_()
    rebuild_buffers(model)


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers in the state dict (and so in the checkpoint): loaded like parameters, never re-created."""
    mods = dict(model.named_modules())
    return [(n, b) for n, b in model.named_buffers()
            if n.rpartition(".")[2] not in mods[n.rpartition(".")[0]]._non_persistent_buffers_set]


@torch.no_grad()
def rebuild_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers (RoPE inv_freq) that to_empty left as garbage.

    They are not in any state dict, so neither a checkpoint load nor a weight broadcast restores
    them; a silent garbage inv_freq gives finite but wrong logits. Persistent buffers come with the
    state dict; any other non-persistent buffer is refused.
    """
    done: set[str] = set()
    for mname, m in model.named_modules():
        if "RotaryEmbedding" in type(m).__name__ and hasattr(m, "inv_freq"):
            with torch.device("cpu"):
                fresh = type(m)(m.config)
            for bname, buf in fresh.named_buffers(recurse=False):
                old = m._buffers[bname]
                # replace (not copy_ into) so a buffer still on meta becomes real too
                m._buffers[bname] = buf.to("cpu" if old.is_meta else old.device)
                done.add(f"{mname}.{bname}" if mname else bname)
    persistent = {n for n, _ in persistent_buffers(model)}
    left = [n for n, _ in model.named_buffers() if n not in done and n not in persistent]
    if left:
        raise NotImplementedError(f"colo cannot re-create these buffers after meta init: {left}")


def build_sharded(
    model_path: str,
    *,
    dummy: bool,
    mesh: DeviceMesh,
    device: torch.device,
    param_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    gradient_checkpointing: bool = False,
    experts_implementation: str | None = None,
    compile_backend: str | None = None,
    lora=None,  # colo.trainer.adapters.LoraSpec | None
) -> nn.Module:
    """The whole build: meta model on every rank, sharded, then each rank's rows of the checkpoint, or random.
    The result also has `colo_logprobs` (enable_logprob_forward). `lora`: the base frozen in param_dtype, adapters
    beside it (colo.trainer.adapters), B = 0."""
    from colo.trainer.adapters import add_adapters, adapter_names, init_adapters

    model = meta_model(model_path, attention_for(device), experts_implementation,
                       dtype=torch.float32 if lora is None else param_dtype)
    if lora is not None:
        add_adapters(model, lora)
    parallelize(model, mesh, param_dtype=param_dtype, gradient_checkpointing=gradient_checkpointing,
                compile_backend=compile_backend)
    enable_logprob_forward(model)
    if dummy:
        materialize(model, device, seed=seed)
    else:
        model.to_empty(device=device)
        from colo.trainer.load import load_sharded

        load_sharded(model, model_path, skip=adapter_names(model))
        rebuild_buffers(model)
    init_adapters(model, seed)
    return model

