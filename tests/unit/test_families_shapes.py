"""The family checkpoints' shapes: DeepSeek-V3 with its real MLA head dims (the ones vLLM's CUDA kernels accept,
and the ones the CPU backends, the AMX one included, compute with), and which families have experts."""
from colo.models.families import FAMILIES, family_config


def test_deepseek_v3_has_real_mla_head_dims() -> None:
    cfg = family_config("deepseek_v3")
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank) == (128, 64, 128, 512)
    assert cfg.num_attention_heads % 16 == 0  # the CUDA decode kernels' head tiles are whole


def test_expert_parallel_only_for_models_with_experts(tmp_path) -> None:
    """GPU engines ask vLLM for expert parallelism only where there are experts: vLLM 0.32 refuses it on a
    dense model (Qwen3's family check on an H200 died on it, 2026-11-25)."""
    from colo.rollout.engine import has_experts, read_model_json

    for name in FAMILIES:
        d = tmp_path / name
        d.mkdir()
        family_config(name).to_json_file(d / "config.json")
        assert has_experts(read_model_json(str(d))) == (name not in ("qwen3", "llama")), name
