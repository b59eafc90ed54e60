"""`python -m colo.models.families --cuda`: DeepSeek-V3 with the MLA head dims vLLM's CUDA kernels accept."""
from colo.models.families import CUDA_KWARGS, FAMILIES, _marker, family_config


def test_deepseek_v3_cuda_has_real_mla_head_dims() -> None:
    cfg = family_config("deepseek_v3", cuda=True)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank) == (128, 64, 128, 512)
    tiny = family_config("deepseek_v3")
    assert (tiny.qk_nope_head_dim, tiny.v_head_dim) == (64, 64)  # the CPU checkpoint keeps its small dims
    assert cfg.vocab_size == tiny.vocab_size and cfg.n_routed_experts == tiny.n_routed_experts


def test_cuda_variant_is_its_own_build() -> None:
    """A --cuda dir and a plain dir never pass for each other; families without CUDA dims build the same."""
    assert _marker("deepseek_v3", 0, cuda=True) != _marker("deepseek_v3", 0)
    for name in FAMILIES:
        if name not in CUDA_KWARGS:
            assert _marker(name, 0, cuda=True) == _marker(name, 0)


def test_expert_parallel_only_for_models_with_experts(tmp_path) -> None:
    """GPU engines ask vLLM for expert parallelism only where there are experts: vLLM 0.32 refuses it on a
    dense model (Qwen3's family check on an H200 died on it, 2026-11-25)."""
    from colo.rollout.engine import has_experts, read_model_json

    for name in FAMILIES:
        d = tmp_path / name
        d.mkdir()
        family_config(name).to_json_file(d / "config.json")
        assert has_experts(read_model_json(str(d))) == (name not in ("qwen3", "llama")), name
