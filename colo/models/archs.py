"""What colo knows of each model family, keyed by config.json's `architectures[0]`: one `Arch` table each.

    arch = arch_for("Qwen3MoeForCausalLM")          # the table; NotImplementedError for a family colo lacks
    num_experts(config)                             # routed experts per MoE layer (dict or HF config), 0: dense
    expert_shard_range(E, W, r)                     # experts FSDP2's dim-0 shard holds on rank r
    REPLAY_ARCHS                                    # families whose HF routers routing replay can drive
    reference_segments(arch, name, shape)           # trainer tensor -> its Hub (on-disk) tensors

Adding a model family means adding one table here (and a tiny checkpoint of it to colo.models.families,
which tests/integration/test_families.py runs). The sync's plan (colo.sync.plan) is the only reader of the HF -> vLLM
parts (`stacked`, `experts[].vllm`, `renames`); the trainer's loader (colo.trainer.load) and the reference
sync read the HF -> Hub parts (`experts[].ckpt`, `ckpt_renames`); routing replay (colo.algo.replay) reads
`router`. Pure data and arithmetic: no torch import (colo.config reads it before anything heavy).

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
- `router`: the HF router class of a family whose routing replay is proven
  (tests/integration/test_engines_across_syncs.py), and how it turns logits into weights; None:
  `algo.routing_replay=r3` is refused for the family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Experts:
    hf: str  # HF fused param in the experts module, e.g. "gate_up_proj" (dim 0 = expert)
    vllm: str  # vLLM FusedMoE param, e.g. "w13_weight"
    ckpt: tuple[str, ...] = ()  # Hub per-expert names, split evenly along dim 1; () = stored fused
    transpose: bool = False  # HF expert block (A, B) is vLLM's (B, A)


@dataclass(frozen=True)
class Router:
    cls: str  # the HF router module's class name (transformers 5.19)
    renormalize: str  # over the top-k: "config" (when norm_topk_prob) | "always"
    cast: bool  # weights cast to the logits' dtype (else kept in float32)


@dataclass(frozen=True)
class Arch:
    stacked: tuple[tuple[str, str, int], ...] = ()  # (HF module suffix, vLLM module suffix, slot index)
    experts: tuple[Experts, ...] = ()
    experts_module: str = "mlp.experts"  # the HF module owning the fused expert params
    renames: tuple[tuple[str, str], ...] = ()  # HF -> vLLM name substrings (direct path)
    ckpt_renames: tuple[tuple[str, str], ...] = ()  # HF in-memory -> Hub on-disk name substrings
    router: Router | None = None  # routing replay (colo.algo.replay); None: not supported


def _fused(hf: str, vllm: str) -> tuple[tuple[str, str, int], ...]:
    return ((f"{hf}.gate_proj", f"{vllm}.gate_up_proj", 0), (f"{hf}.up_proj", f"{vllm}.gate_up_proj", 1))


_ATTN = (("self_attn.q_proj", "self_attn.qkv_proj", 0), ("self_attn.k_proj", "self_attn.qkv_proj", 1),
         ("self_attn.v_proj", "self_attn.qkv_proj", 2))
_MLP = _fused("mlp", "mlp")  # dense MLP layers (dense models; mlp_only_layers; first_k_dense_replace)
_EXPERTS = (Experts("gate_up_proj", "w13_weight", ("gate_proj.weight", "up_proj.weight")),
            Experts("down_proj", "w2_weight", ("down_proj.weight",)))

# softmax, top-k, renormalized over the k when norm_topk_prob, cast to the logits' dtype
QWEN3_MOE = Arch(stacked=_ATTN + _MLP, experts=_EXPERTS, router=Router("Qwen3MoeTopKRouter", "config", True))
HUB_LAYOUT = Arch(experts=_EXPERTS)  # on disk: names as in memory, experts per expert (colo.trainer.load)
# an always-on shared expert (a dense MLP vLLM fuses like any other) and its sigmoid gate, which keeps its name
QWEN2_MOE = Arch(stacked=_ATTN + _MLP + _fused("mlp.shared_expert", "mlp.shared_expert"), experts=_EXPERTS,
                 router=Router("Qwen2MoeTopKRouter", "config", True))
# transformers 5 names the MoE block `mlp` in memory; the Hub checkpoint and vLLM call it block_sparse_moe.
# Router: softmax, top-k, always renormalized, kept in float32.
MIXTRAL = Arch(stacked=_ATTN, renames=((".mlp.", ".block_sparse_moe."),),
               ckpt_renames=((".mlp.", ".block_sparse_moe."),),
               experts=(Experts("gate_up_proj", "w13_weight", ("w1.weight", "w3.weight")),
                        Experts("down_proj", "w2_weight", ("w2.weight",))),
               router=Router("MixtralTopKRouter", "always", False))
# MLA: vLLM fuses the two down-projections of the input (q_lora_rank set); kv_b_proj stays whole and
# vLLM derives its attention's W_UK/W_UV from it after every load (colo.sync.receiver re-runs that).
# DeepSeek-V3 / GLM-4.5 route by sigmoid + bias + groups: no replay.
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
# gated delta-net layers keep HF's names in vLLM (in_proj_qkvz, in_proj_ba, conv1d, A_log, dt_bias, norm);
# its router is Qwen2-MoE's in name only (the replay is not proven on it)
QWEN3_NEXT = Arch(stacked=QWEN2_MOE.stacked, experts=_EXPERTS)

ARCHS: dict[str, Arch] = {
    "Qwen3MoeForCausalLM": QWEN3_MOE, "Qwen2MoeForCausalLM": QWEN2_MOE, "MixtralForCausalLM": MIXTRAL,
    "DeepseekV3ForCausalLM": DEEPSEEK_V3, "Glm4MoeForCausalLM": GLM4_MOE, "GptOssForCausalLM": GPT_OSS,
    "Qwen3ForCausalLM": DENSE, "LlamaForCausalLM": DENSE, "Qwen3NextForCausalLM": QWEN3_NEXT,
}

# Architectures whose HF routers colo.algo.replay can replay (each proven by
# tests/integration/test_engines_across_syncs.py).
REPLAY_ARCHS: tuple[str, ...] = tuple(sorted(a for a, t in ARCHS.items() if t.router is not None))

# config.json's name for the routed experts per MoE layer, by family convention
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def arch_for(architecture: str) -> Arch:
    if architecture not in ARCHS:
        raise NotImplementedError(f"no weight-sync mapping for {architecture}; supported: {sorted(ARCHS)}")
    return ARCHS[architecture]


def architecture(config: Any) -> str | None:
    """config.json's `architectures[0]` (a dict or an HF config), None when it names none."""
    archs = config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
    return archs[0] if archs else None


def num_experts(config: Any) -> int:
    """Routed experts per MoE layer (a config.json dict or an HF config), under each family's key; 0: dense."""
    for key in EXPERT_COUNT_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if value:
            return int(value)
    return 0


def expert_shard_range(num_experts: int, world_size: int, rank: int) -> tuple[int, int]:
    """Experts [start, stop) that FSDP2's dim-0 shard holds on `rank` (torch.chunk semantics:
    ceil(E/W) per rank, the last ranks short or empty when W does not divide E)."""
    per = -(-num_experts // world_size)
    start = min(rank * per, num_experts)
    return start, min(start + per, num_experts)


def numel(shape) -> int:
    """Elements of a tensor of `shape` (torch-free)."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


def rename(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        name = name.replace(old, new)
    return name


def expert_param(arch: Arch, name: str) -> Experts | None:
    """The table entry when trainer param `name` is a fused expert param."""
    module, _, leaf = name.rpartition(".")
    if not (module == arch.experts_module or module.endswith("." + arch.experts_module)):
        return None
    return next((e for e in arch.experts if e.hf == leaf), None)


def reference_segments(arch: Arch, name: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]]:
    """(checkpoint name, element offset in `name`, shape) of each Hub tensor trainer param `name` is made
    of (what vLLM's load_weights expects, and what colo.trainer.load reads): itself under its Hub name, or
    per expert and part for fused experts. Expert e's parts are each one contiguous run of the fused tensor
    (split along dim 1), so every entry is a plain element range."""
    ex = expert_param(arch, name)
    ckpt = rename(name, arch.ckpt_renames)
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
