"""LoRA on the trainer's model: adapters beside the frozen base, the experts' adapters batched beside their GEMMs.

    spec = LoraSpec.of(cfg.trainer)                    # None when trainer.lora_rank == 0
    pairs = add_adapters(meta_model, spec)             # before parallelize: {weight name: (A name, B name)}
    ... fully_shard, load the base ...
    init_adapters(model, seed)                         # A uniform, B = 0: the model computes the base exactly
    colo.trainer.checkpoint.export_adapter(...)        # collective: a PEFT folder (rank 0 writes)
    colo.trainer.checkpoint.export_hf(..., items=merged_items(model))   # collective: W + s B A, an HF checkpoint

The adapters are parameters of the module they adapt (colo.models.lora names them), so the base keeps its names
for the loader, the sync's tables and the checkpoint. A Linear's adapter runs in a forward hook: y + s B(A(x)).
A fused experts module gets its own forward (`experts_forward`): transformers' grouped form (tokens sorted by
expert, one grouped GEMM per projection, colo.trainer.fsdp keeps `trainer.experts_implementation` = auto or
grouped_mm) with two small grouped GEMMs beside each projection, x -> x A_e^T (S, r) -> (.) B_e^T, over every
expert at once: no loop over experts, and no (E, out, in) delta is ever formed in training (the merged sync forms
it, colo.sync.merge). The base stays in model.dtype with requires_grad False: FSDP2 gathers it, never reduces a
gradient for it, and AdamW gets the adapters only (fp32 master weights, gathered in model.dtype like the base).

What peft (0.21) offers and colo does not use for training: `LoraConfig(target_parameters=...)` wraps fused
experts in ParamWrapper, which parametrizes the weight as W + delta (the whole (E, out, in) delta and its gradient
every forward: a full fine-tune's weight-gradient FLOPs and memory), refuses dropout there, and renames the base
weights (`base_layer`), which every name table in colo would have to follow. colo uses peft's format (keys and
adapter_config.json, written with peft's own LoraConfig) for the export, and peft itself in the tests that load it.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from colo.models.lora import EXPERT_PARAMS, expert_adapter, target_of
from colo.sync.merge import merged

RANK_ALIGN = 8  # grouped GEMMs want 16-byte strides: an (S, r) bf16 operand needs r % 8 == 0 (measured on CPU)


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, trainer) -> LoraSpec | None:  # noqa: ANN001 (colo.config.TrainerConfig)
        if int(trainer.lora_rank) <= 0:
            return None
        return cls(int(trainer.lora_rank), float(trainer.lora_alpha), float(trainer.lora_dropout),
                   tuple(trainer.lora_targets))


def _linear_hook(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    x = args[0]  # (..., in)
    if m.colo_lora_dropout and m.training:
        x = F.dropout(x, m.colo_lora_dropout, True)
    return out + m.colo_lora_scale * F.linear(F.linear(x, m.lora_A), m.lora_B)  # (..., r) -> (..., out)


def _lora_grouped(m: nn.Module, param: str, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """s * B_e A_e x for each row x of expert e's group: (S, in) -> (S, out), two grouped GEMMs (rank padded with
    zeros to RANK_ALIGN: the products are unchanged)."""
    from transformers.integrations.moe import _grouped_mm

    a, b = getattr(m, expert_adapter(param, "A")), getattr(m, expert_adapter(param, "B"))  # (E, r, in), (E, out, r)
    pad = -a.shape[1] % RANK_ALIGN
    if pad:
        a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
    if m.colo_lora_dropout and m.training:
        x = F.dropout(x, m.colo_lora_dropout, True)
    t = _grouped_mm(x, a.transpose(-2, -1), offs=offsets)  # (S, r)
    return m.colo_lora_scale * _grouped_mm(t, b.transpose(-2, -1), offs=offsets)  # (S, out)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers 5.19's grouped_mm_experts_forward (gated, no bias, (E, out, in) weights, no expert parallelism),
    each projection plus its adapter: with B = 0 it computes the base model's values exactly. hidden_states (N, H),
    top_k_index / top_k_weights (N, k) -> (N, H)."""
    from transformers.integrations.moe import _grouped_linear

    device = hidden_states.device
    k, n, hidden = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
    weights, ids = top_k_weights.reshape(-1), top_k_index.reshape(-1)  # (S,) with S = N k
    ids_g, perm = torch.sort(ids)
    x = hidden_states[perm // k]  # (S, H), grouped by expert
    weights_g = weights[perm]
    counts = torch.histc(ids_g.float() if device.type in ("cpu", "mps") else ids_g.int(), bins=self.num_experts,
                         min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E,)
    h = _grouped_linear(x, self.gate_up_proj, offsets) + _lora_grouped(self, "gate_up_proj", x, offsets)  # (S, 2I)
    h = self._apply_gate(h)  # (S, I)
    out = _grouped_linear(h, self.down_proj, offsets) + _lora_grouped(self, "down_proj", h, offsets)  # (S, H)
    out = out * weights_g.unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0), device=device)
    return out[inv].view(n, k, hidden).sum(dim=1).to(hidden_states.dtype)


def _new(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32))  # fp32 master weights (meta under from_config)


def add_adapters(model: nn.Module, spec: LoraSpec, experts_module: str = "mlp.experts") -> dict[str, tuple[str, str]]:
    """Give every targeted weight its adapters (model on meta, before fully_shard) and freeze the rest; sets
    `model.colo_lora` (what this returns) and `model.colo_lora_scale`, which the sync and the export read."""
    model.requires_grad_(False)
    pairs: dict[str, tuple[str, str]] = {}
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and target_of(name) in spec.targets:
            m.lora_A, m.lora_B = _new(spec.rank, m.in_features), _new(m.out_features, spec.rank)
            m.register_forward_hook(_linear_hook)
            pairs[f"{name}.weight"] = (f"{name}.lora_A", f"{name}.lora_B")
        elif (name == experts_module or name.endswith("." + experts_module)) and "experts" in spec.targets \
                and all(isinstance(getattr(m, p, None), nn.Parameter) for p in EXPERT_PARAMS):
            for p in EXPERT_PARAMS:
                E, out, inp = getattr(m, p).shape
                m.register_parameter(expert_adapter(p, "A"), _new(E, spec.rank, inp))
                m.register_parameter(expert_adapter(p, "B"), _new(E, out, spec.rank))
                pairs[f"{name}.{p}"] = (f"{name}.{expert_adapter(p, 'A')}", f"{name}.{expert_adapter(p, 'B')}")
            m.forward = types.MethodType(experts_forward, m)
        else:
            continue
        m.colo_lora_scale, m.colo_lora_dropout = spec.scale, spec.dropout
    for a, b in pairs.values():
        model.get_parameter(a).requires_grad_(True)
        model.get_parameter(b).requires_grad_(True)
    model.colo_lora, model.colo_lora_scale = pairs, spec.scale
    return pairs


def adapter_names(model: nn.Module) -> set[str]:
    return {n for pair in getattr(model, "colo_lora", {}).values() for n in pair}


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """What AdamW steps and the grad norm covers: every parameter, or with LoRA the adapters only."""
    return [p for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (peft's default, kaiming-uniform with a = sqrt(5)), B = 0; each rank draws
    its own shards, deterministic for (seed, rank, world size)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = None
    for a, b in getattr(model, "colo_lora", {}).values():
        pa, pb = model.get_parameter(a), model.get_parameter(b)
        la = pa.to_local() if isinstance(pa, DTensor) else pa.data
        if gen is None:
            gen = torch.Generator(device=la.device).manual_seed(seed * 1_000_003 + rank + 7919)
        bound = 1.0 / math.sqrt(pa.shape[-1])
        la.uniform_(-bound, bound, generator=gen)
        (pb.to_local() if isinstance(pb, DTensor) else pb.data).zero_()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t  # an all-gather: every rank, same order


@torch.no_grad()
def merged_items(model: nn.Module):  # -> Iterator[tuple[str, torch.Tensor]]
    """The model's state dict as full tensors, each adapted weight merged (W + s B A, colo.sync.merge), adapters left
    out: what colo.trainer.checkpoint.export_hf writes. Collective: every rank walks the same names."""
    pairs, skip = getattr(model, "colo_lora", {}), adapter_names(model)
    sd = model.state_dict()
    for name, t in sd.items():
        if name in skip:
            continue
        full = full_tensor(t)
        if name in pairs:
            a, b = pairs[name]
            full = merged(full, full_tensor(sd[a]), full_tensor(sd[b]), model.colo_lora_scale)
        yield name, full
