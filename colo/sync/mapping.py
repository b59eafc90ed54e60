"""HF (trainer) parameter names and layouts -> vLLM parameter names and element ranges.

A mapping is a small table per architecture (`Arch`); adding an MoE family means adding a table:
- `stacked`: HF linears that vLLM fuses along dim 0 (q/k/v -> qkv_proj rows [q | k | v]; gate/up ->
  gate_up_proj rows [gate | up]). Stacking along dim 0 keeps each part one contiguous element run.
- `fused_experts`: HF v5 keeps experts fused in the module — `mlp.experts.gate_up_proj` (E, 2I, H),
  `mlp.experts.down_proj` (E, H, I) — which is vLLM's `w13_weight` (E_local, 2I, H) (gate rows then up
  rows, as HF) and `w2_weight` (E_local, H, I), so expert e is one contiguous run in both. The vLLM
  param is found by module prefix + suffix: vLLM 0.26/0.32 nest it as `…mlp.experts.routed_experts.
  w13_weight` (measured on both), older versions as `…mlp.experts.w13_weight`; both are accepted.
- everything else maps by identical name.

The reference path (`reference_weights`) un-fuses experts into the per-expert checkpoint names
(`…mlp.experts.{e}.gate_proj.weight`, which is also what save_pretrained writes to disk) for
vLLM's own `load_weights`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Arch:
    stacked: tuple[tuple[str, str, int], ...]  # (HF module suffix, vLLM module suffix, slot index)
    fused_experts: tuple[tuple[str, str, tuple[str, ...]], ...]  # (HF param, vLLM param, per-expert names)
    experts_module: str = "mlp.experts"
    tied_alias: tuple[tuple[str, str], ...] = (("lm_head.weight", "model.embed_tokens.weight"),)


_ATTN = (("self_attn.q_proj", "self_attn.qkv_proj", 0), ("self_attn.k_proj", "self_attn.qkv_proj", 1),
         ("self_attn.v_proj", "self_attn.qkv_proj", 2))
_EXPERTS = (("gate_up_proj", "w13_weight", ("gate_proj", "up_proj")), ("down_proj", "w2_weight", ("down_proj",)))

QWEN3_MOE = Arch(stacked=_ATTN + (("mlp.gate_proj", "mlp.gate_up_proj", 0), ("mlp.up_proj", "mlp.gate_up_proj", 1)),
                 fused_experts=_EXPERTS)
# Qwen2-MoE adds an always-on shared expert (a dense MLP vLLM fuses like any other) and its gate,
# which keeps its name. Not yet exercised by a test.
QWEN2_MOE = Arch(stacked=QWEN3_MOE.stacked + (("mlp.shared_expert.gate_proj", "mlp.shared_expert.gate_up_proj", 0),
                                              ("mlp.shared_expert.up_proj", "mlp.shared_expert.gate_up_proj", 1)),
                 fused_experts=_EXPERTS)
MIXTRAL = Arch(stacked=_ATTN, fused_experts=_EXPERTS)  # transformers v5 layout; not yet exercised by a test

ARCHS: dict[str, Arch] = {"Qwen3MoeForCausalLM": QWEN3_MOE, "Qwen2MoeForCausalLM": QWEN2_MOE,
                          "MixtralForCausalLM": MIXTRAL}


def arch_for(architecture: str) -> Arch:
    if architecture not in ARCHS:
        raise NotImplementedError(f"no weight-sync mapping for {architecture}; add one to colo.sync.mapping.ARCHS")
    return ARCHS[architecture]


@dataclass(frozen=True)
class Segment:
    """src.view(-1)[src_offset : src_offset+numel] -> dst.view(-1)[dst_offset : ...] (elements).

    `src_offset` counts in the full (unsharded) HF tensor; a source holding only rows [r0, ...) of it
    subtracts r0 * row_numel."""
    src: str
    src_offset: int
    dst: str
    dst_offset: int
    numel: int


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def find_expert_param(params: dict, moe_module: str, suffix: str) -> str | None:
    """vLLM name of an MoE layer's fused expert param, with or without a nested `routed_experts`."""
    hits = [n for n in params if n.startswith(moe_module + ".") and n.endswith("." + suffix)]
    if len(hits) > 1:
        raise ValueError(f"ambiguous vLLM expert params for {moe_module}.{suffix}: {hits}")
    return hits[0] if hits else None


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """[(first global id, first local slot, count)] for consecutive runs of global expert ids."""
    out: list[tuple[int, int, int]] = []
    for slot, g in enumerate(ids):
        if out and out[-1][0] + out[-1][2] == g:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((g, slot, 1))
    return out


def direct_segments(arch: Arch, trainer_shapes: dict[str, tuple[int, ...]], describe: dict) -> list[Segment]:
    """Every element the engine needs, as segments in trainer-parameter order.

    Raises if a trainer param has no destination, or a destination's size disagrees; coverage of
    the engine's params is checked by the plan."""
    params = describe["params"]
    experts = describe.get("experts", {})
    stacked = {hf: (vl, slot) for hf, vl, slot in arch.stacked}
    segs: list[Segment] = []
    errors: list[str] = []
    for name, shape in trainer_shapes.items():
        module, _, leaf = name.rpartition(".")
        hit = next(((hf, *stacked[hf]) for hf in stacked if module.endswith("." + hf)), None)
        if hit is not None:
            hf_suffix, vl_suffix, slot = hit
            base = module[: -len(hf_suffix)]
            dst = f"{base}{vl_suffix}.{leaf}"
            row = _numel(shape[1:])
            rows_before = sum(int(trainer_shapes[f"{base}{h}.{leaf}"][0]) for h, (v, s) in stacked.items()
                              if v == vl_suffix and s < slot and f"{base}{h}.{leaf}" in trainer_shapes)
            segs.append(Segment(name, 0, dst, rows_before * row, _numel(shape)))
            continue
        fused = next((f for f in arch.fused_experts if module.endswith("." + arch.experts_module) and leaf == f[0]), None)
        if fused is not None:
            dst = find_expert_param(params, module, fused[1])
            if dst is None:
                errors.append(f"{name}: no vLLM param {module}.*{fused[1]}")
                continue
            ids = experts.get(dst.rpartition(".")[0], list(range(int(shape[0]))))
            per = _numel(shape[1:])
            for g, slot, count in _runs([int(i) for i in ids]):
                segs.append(Segment(name, g * per, dst, slot * per, count * per))
            continue
        if name not in params:
            alias = dict(arch.tied_alias).get(name)
            if alias is not None and alias in params:
                continue  # tied embeddings: vLLM holds one tensor, fed by its own name
            errors.append(f"{name}: no vLLM param of that name")
            continue
        if _numel(params[name]["shape"]) != _numel(shape):
            errors.append(f"{name}: trainer shape {list(shape)} vs vLLM {params[name]['shape']}")
            continue
        segs.append(Segment(name, 0, name, 0, _numel(shape)))
    if errors:
        raise ValueError("weight-sync mapping failed:\n  " + "\n  ".join(errors))
    return segs


def reference_segments(arch: Arch, name: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]]:
    """(checkpoint name, element offset in `name`, shape) of each tensor vLLM's load_weights expects from
    trainer param `name`: itself, or per expert for fused experts. Expert e's gate, up and down blocks are
    each one contiguous run of the fused tensor, so every entry is a plain element range."""
    module, _, leaf = name.rpartition(".")
    fused = next((f for f in arch.fused_experts if module.endswith("." + arch.experts_module) and leaf == f[0]), None)
    if fused is None:
        return [(name, 0, tuple(shape))]
    parts = fused[2]
    rows = int(shape[1]) // len(parts)
    part_shape = (rows, *map(int, shape[2:]))
    part_numel = _numel(part_shape)
    return [(f"{module}.{e}.{p}.weight", (e * len(parts) + i) * part_numel, part_shape)
            for e in range(int(shape[0])) for i, p in enumerate(parts)]


def reference_weights(arch: Arch, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint-style (name, tensor) pairs for vLLM's load_weights; un-fuses experts per expert."""
    flat = tensor.reshape(-1)
    return [(n, flat[off: off + _numel(shape)].view(shape)) for n, off, shape in
            reference_segments(arch, name, tuple(tensor.shape))]
