"""HF (trainer) parameter names and layouts -> vLLM parameter names and element ranges, one table per family.

An `Arch` is data; adding a model family means adding a table (and a checkpoint to
colo.models.families, and the family test runs it):
- `stacked`: HF linears that vLLM fuses along dim 0 (q/k/v -> qkv_proj rows [q | k | v]; gate/up ->
  gate_up_proj rows [gate | up]; DeepSeek's q_a_proj/kv_a_proj_with_mqa -> fused_qkv_a_proj). Stacking
  along dim 0 keeps each part one contiguous element run. A rule applies only where vLLM has the fused
  param (DeepSeek fuses q_a/kv_a only when q_lora_rank is set); otherwise the name maps as it is.
- `experts`: HF v5 keeps experts fused in the module `experts_module` with the expert index on dim 0 —
  `gate_up_proj` (E, 2I, H), `down_proj` (E, H, I) — which is vLLM's `w13_weight` (E_local, 2I, H) (gate
  rows then up rows, as HF) and `w2_weight` (E_local, H, I), so expert e is one contiguous run in both.
  `transpose`: HF holds the expert as (in, out) and vLLM as (out, in) (GPT-OSS), so each expert is
  copied transposed. `ckpt`: the Hub's per-expert tensor names (what save_pretrained writes and vLLM's
  load_weights reads; empty: the checkpoint keeps the fused tensor). The vLLM param is found by module
  prefix + suffix: vLLM 0.26/0.32 nest it as `…experts.routed_experts.w13_weight` (measured on both),
  older versions as `…experts.w13_weight`; both are accepted.
- `renames`: substring renames HF -> vLLM names (GPT-OSS `.self_attn.` -> `.attn.`), applied after
  stacking; `ckpt_renames`: HF in-memory -> Hub on-disk names (Mixtral `.mlp.` -> `.block_sparse_moe.`).
- everything else maps by identical name (persistent buffers included: DeepSeek's and GLM's
  `e_score_correction_bias` is a buffer in HF and a parameter in vLLM).

Vocabulary padding: vLLM pads the rows of the embedding and lm_head to a multiple of 64 and fills the
pad rows with zeros when it loads from disk. The engine declares them (`describe()["params"][name]
["rows"]` = rows holding vocabulary); the plan then writes the trainer's V rows and a zero-fill segment
over exactly the declared pad rows, so coverage stays exact: a missing vocabulary row is still a gap.

The reference path (`reference_weights`) turns trainer tensors into checkpoint-named tensors for
vLLM's own `load_weights`: experts un-fused per expert, names as the Hub has them.
"""
from __future__ import annotations

from dataclasses import dataclass

# no torch import at module level: colo.config.checks reads ARCHS before anything heavy is imported


@dataclass(frozen=True)
class Experts:
    hf: str  # HF fused param in the experts module, e.g. "gate_up_proj" (dim 0 = expert)
    vllm: str  # vLLM FusedMoE param, e.g. "w13_weight"
    ckpt: tuple[str, ...] = ()  # Hub per-expert names, split evenly along dim 1; () = stored fused
    transpose: bool = False  # HF expert block (A, B) is vLLM's (B, A)


@dataclass(frozen=True)
class Arch:
    stacked: tuple[tuple[str, str, int], ...] = ()  # (HF module suffix, vLLM module suffix, slot index)
    experts: tuple[Experts, ...] = ()
    experts_module: str = "mlp.experts"  # the HF module owning the fused expert params
    renames: tuple[tuple[str, str], ...] = ()  # HF -> vLLM name substrings (direct path)
    ckpt_renames: tuple[tuple[str, str], ...] = ()  # HF in-memory -> Hub on-disk name substrings


def _fused(hf: str, vllm: str) -> tuple[tuple[str, str, int], ...]:
    return ((f"{hf}.gate_proj", f"{vllm}.gate_up_proj", 0), (f"{hf}.up_proj", f"{vllm}.gate_up_proj", 1))


_ATTN = (("self_attn.q_proj", "self_attn.qkv_proj", 0), ("self_attn.k_proj", "self_attn.qkv_proj", 1),
         ("self_attn.v_proj", "self_attn.qkv_proj", 2))
_MLP = _fused("mlp", "mlp")  # dense MLP layers (dense models; mlp_only_layers; first_k_dense_replace)
_EXPERTS = (Experts("gate_up_proj", "w13_weight", ("gate_proj.weight", "up_proj.weight")),
            Experts("down_proj", "w2_weight", ("down_proj.weight",)))

QWEN3_MOE = Arch(stacked=_ATTN + _MLP, experts=_EXPERTS)
HUB_LAYOUT = Arch(experts=_EXPERTS)  # on disk: names as in memory, experts per expert (colo.trainer.load)
# an always-on shared expert (a dense MLP vLLM fuses like any other) and its sigmoid gate, which keeps its name
QWEN2_MOE = Arch(stacked=_ATTN + _MLP + _fused("mlp.shared_expert", "mlp.shared_expert"), experts=_EXPERTS)
# transformers 5 names the MoE block `mlp` in memory; the Hub checkpoint and vLLM call it block_sparse_moe
MIXTRAL = Arch(stacked=_ATTN, renames=((".mlp.", ".block_sparse_moe."),),
               ckpt_renames=((".mlp.", ".block_sparse_moe."),),
               experts=(Experts("gate_up_proj", "w13_weight", ("w1.weight", "w3.weight")),
                        Experts("down_proj", "w2_weight", ("w2.weight",))))
# MLA: vLLM fuses the two down-projections of the input (q_lora_rank set); kv_b_proj stays whole and
# vLLM derives its attention's W_UK/W_UV from it after every load (colo.sync.receiver re-runs that)
DEEPSEEK_V3 = Arch(stacked=(("self_attn.q_a_proj", "self_attn.fused_qkv_a_proj", 0),
                            ("self_attn.kv_a_proj_with_mqa", "self_attn.fused_qkv_a_proj", 1))
                   + _MLP + _fused("mlp.shared_experts", "mlp.shared_experts"), experts=_EXPERTS)
GLM4_MOE = Arch(stacked=_ATTN + _MLP + _fused("mlp.shared_experts", "mlp.shared_experts"), experts=_EXPERTS)
# HF keeps GPT-OSS experts as (E, in, out) with gate/up interleaved along `out`; vLLM as (E, out, in) with
# the same interleaving (its loader permutes, nothing else), and the checkpoint stores them fused
GPT_OSS = Arch(stacked=_ATTN, renames=((".self_attn.", ".attn."), ("model.embed_tokens.", "model.embedding.")),
               experts=(Experts("gate_up_proj", "w13_weight", transpose=True), Experts("gate_up_proj_bias", "w13_bias"),
                        Experts("down_proj", "w2_weight", transpose=True), Experts("down_proj_bias", "w2_bias")))
DENSE = Arch(stacked=_ATTN + _MLP)  # Qwen3, Llama: nothing in the path needs experts
# gated delta-net layers keep HF's names in vLLM (in_proj_qkvz, in_proj_ba, conv1d, A_log, dt_bias, norm)
QWEN3_NEXT = QWEN2_MOE

ARCHS: dict[str, Arch] = {
    "Qwen3MoeForCausalLM": QWEN3_MOE, "Qwen2MoeForCausalLM": QWEN2_MOE, "MixtralForCausalLM": MIXTRAL,
    "DeepseekV3ForCausalLM": DEEPSEEK_V3, "Glm4MoeForCausalLM": GLM4_MOE, "GptOssForCausalLM": GPT_OSS,
    "Qwen3ForCausalLM": DENSE, "LlamaForCausalLM": DENSE, "Qwen3NextForCausalLM": QWEN3_NEXT,
}


class MappingError(ValueError):
    """Trainer tensors without a vLLM destination, or vLLM params nothing writes: every one, named."""


def arch_for(architecture: str) -> Arch:
    if architecture not in ARCHS:
        raise NotImplementedError(f"no weight-sync mapping for {architecture}; supported: {sorted(ARCHS)}")
    return ARCHS[architecture]


@dataclass(frozen=True)
class Segment:
    """src.view(-1)[src_offset : src_offset+numel] -> dst.view(-1)[dst_offset : ...] (elements).

    `src_offset` counts in the full (unsharded) HF tensor; a source holding only rows [r0, ...) of it
    subtracts r0 * row_numel. `layout` (A, B): the run is whole expert blocks stored (A, B) in the
    source and (B, A) in the destination. `fill`: no source bytes; the destination elements are the
    engine's declared padding rows and get zeros."""
    src: str
    src_offset: int
    dst: str
    dst_offset: int
    numel: int
    layout: tuple[int, int] | None = None
    fill: bool = False


def numel(shape) -> int:
    """Elements of a tensor of `shape` (torch-free: colo.config.checks imports this module)."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _rename(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        name = name.replace(old, new)
    return name


def find_expert_param(params: dict, moe_module: str, suffix: str) -> str | None:
    """vLLM name of an MoE layer's fused expert param, with or without a nested `routed_experts`."""
    hits = [n for n in params if n.startswith(moe_module + ".") and n.endswith("." + suffix)]
    if len(hits) > 1:
        raise ValueError(f"ambiguous vLLM expert params for {moe_module}.{suffix}: {hits}")
    return hits[0] if hits else None


def expert_param(arch: Arch, name: str) -> Experts | None:
    """The table entry when trainer param `name` is a fused expert param."""
    module, _, leaf = name.rpartition(".")
    if not (module == arch.experts_module or module.endswith("." + arch.experts_module)):
        return None
    return next((e for e in arch.experts if e.hf == leaf), None)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """[(first global id, first local slot, count)] for consecutive runs of global expert ids."""
    out: list[tuple[int, int, int]] = []
    for slot, g in enumerate(ids):
        if out and out[-1][0] + out[-1][2] == g:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((g, slot, 1))
    return out


def _stacked_dst(arch: Arch, name: str, trainer_shapes: dict, params: dict) -> tuple[str, int] | None:
    """(vLLM param, element offset) when `name` is one part of a param vLLM stacks along dim 0."""
    module, _, leaf = name.rpartition(".")
    for hf, vl, slot in arch.stacked:
        if not module.endswith("." + hf):
            continue
        base = module[: -len(hf)]
        dst = _rename(f"{base}{vl}.{leaf}", arch.renames)
        if dst not in params:
            return None  # vLLM keeps this one unfused here: maps by name
        rows_before = sum(int(trainer_shapes[f"{base}{h}.{leaf}"][0]) for h, v, s in arch.stacked
                          if v == vl and s < slot and f"{base}{h}.{leaf}" in trainer_shapes)
        return dst, rows_before * numel(trainer_shapes[name][1:])
    return None


def direct_mapping(arch: Arch, trainer_shapes: dict[str, tuple[int, ...]], describe: dict,
                   names_only: bool = False) -> tuple[list[Segment], list[str]]:
    """(segments in trainer-parameter order, problems). Problems name every trainer tensor without a
    destination and every vLLM param that the segments do not cover exactly, all at once. `names_only`:
    compare names, not sizes (a tensor-parallel worker holds slices; its segments are not meaningful)."""
    params = describe["params"]
    experts = describe.get("experts", {})
    segs: list[Segment] = []
    errors: list[str] = []
    for name, shape in trainer_shapes.items():
        stacked = _stacked_dst(arch, name, trainer_shapes, params)
        if stacked is not None:
            segs.append(Segment(name, 0, stacked[0], stacked[1], numel(shape)))
            continue
        ex = expert_param(arch, name)
        if ex is not None:
            module = _rename(name.rpartition(".")[0], arch.renames)
            dst = find_expert_param(params, module, ex.vllm)
            if dst is None:
                errors.append(f"{name}: no vLLM param {module}.*{ex.vllm}")
                continue
            block = tuple(int(s) for s in shape[1:])
            want = tuple(reversed(block)) if ex.transpose else block
            if names_only:
                segs.append(Segment(name, 0, dst, 0, numel(params[dst]["shape"])))
                continue
            if tuple(params[dst]["shape"][1:]) != want:
                errors.append(f"{name}: expert block {list(block)} -> {list(want)} does not fit vLLM "
                              f"{dst} {params[dst]['shape']}")
                continue
            ids = experts.get(dst.rpartition(".")[0], list(range(int(shape[0]))))
            per = numel(block)
            layout = block if ex.transpose else None
            for g, slot, count in _runs([int(i) for i in ids]):
                segs.append(Segment(name, g * per, dst, slot * per, count * per, layout=layout))
            continue
        dst = _rename(name, arch.renames)
        if dst not in params:
            errors.append(f"{name}: no vLLM param {dst}" if dst != name else f"{name}: no vLLM param of that name")
            continue
        p, n = params[dst], numel(shape)
        if numel(p["shape"]) == n or names_only:
            segs.append(Segment(name, 0, dst, 0, n))
        elif p.get("rows") == shape[0] and list(p["shape"][1:]) == list(shape[1:]) and p["shape"][0] > shape[0]:
            # vocabulary padding the engine declared: the real rows, then zeros over exactly the pad rows
            segs.append(Segment(name, 0, dst, 0, n))
            segs.append(Segment(name, 0, dst, n, numel(p["shape"]) - n, fill=True))
        else:
            pad = f" (rows holding vocabulary: {p['rows']})" if "rows" in p else ""
            errors.append(f"{name}: trainer shape {list(shape)} vs vLLM {p['shape']}{pad}")
    got: dict[str, int] = {}
    for s in segs:
        got[s.dst] = got.get(s.dst, 0) + s.numel
    for n in params:
        if n not in got:
            errors.append(f"{n}: nothing writes it (no trainer tensor maps to this vLLM param)")
        elif got[n] != numel(params[n]["shape"]) and not names_only:
            errors.append(f"{n}: {got[n]} of {numel(params[n]['shape'])} elements written")
    return segs, errors


def direct_segments(arch: Arch, trainer_shapes: dict[str, tuple[int, ...]], describe: dict) -> list[Segment]:
    """Every element the engine needs, as segments in trainer-parameter order; raises MappingError naming
    every unmapped trainer tensor and every uncovered vLLM param."""
    segs, errors = direct_mapping(arch, trainer_shapes, describe)
    if errors:
        raise MappingError("weight-sync mapping failed:\n  " + "\n  ".join(errors))
    return segs


def reference_segments(arch: Arch, name: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]]:
    """(checkpoint name, element offset in `name`, shape) of each tensor vLLM's load_weights expects from
    trainer param `name`: itself under its Hub name, or per expert and part for fused experts. Expert e's
    parts are each one contiguous run of the fused tensor (split along dim 1), so every entry is a plain
    element range."""
    ex = expert_param(arch, name)
    ckpt = _rename(name, arch.ckpt_renames)
    if ex is None or not ex.ckpt:
        return [(ckpt, 0, tuple(int(s) for s in shape))]
    module = ckpt.rpartition(".")[0]
    parts = ex.ckpt
    rows = int(shape[1]) // len(parts)
    part_shape = (rows, *map(int, shape[2:]))
    part_numel = numel(part_shape)
    return [(f"{module}.{e}.{p}", (e * len(parts) + i) * part_numel, part_shape)
            for e in range(int(shape[0])) for i, p in enumerate(parts)]


def reference_weights(arch: Arch, name: str, tensor):  # (torch.Tensor) -> list[tuple[str, torch.Tensor]]
    """Checkpoint-style (name, tensor) pairs for vLLM's load_weights; un-fuses experts per expert."""
    flat = tensor.reshape(-1)
    return [(n, flat[off: off + numel(shape)].view(shape)) for n, off, shape in
            reference_segments(arch, name, tuple(tensor.shape))]
