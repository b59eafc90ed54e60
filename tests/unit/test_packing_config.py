"""The packing settings are typed and validated: a bad value is one `colo: error:` line naming the key."""
import pytest

from colo.config import ConfigError, load_config, validate


@pytest.mark.parametrize("key", ["trainer.max_tokens_per_micro_batch", "trainer.logprob_chunk"])
def test_packing_sizes_must_be_positive(key):
    with pytest.raises(ConfigError, match=f"{key}=0 must be >= 1"):
        validate(load_config(None, [f"{key}=0"], {}), check_resources=False)


def test_packing_defaults_and_types():
    cfg = load_config(None, ["trainer.packing=false", "trainer.max_tokens_per_micro_batch=4096"], {})
    assert cfg.trainer.packing is False and cfg.trainer.max_tokens_per_micro_batch == 4096
    assert load_config(None, [], {}).trainer.packing is True
    with pytest.raises(ConfigError):
        load_config(None, ["trainer.max_tokens_per_micro_batch=lots"], {})


def test_experts_implementation_reaches_the_model(tmp_path):
    from colo.models.tiny import make_tiny_model
    from colo.trainer.fsdp import meta_model

    with pytest.raises(ConfigError, match="trainer.experts_implementation"):
        validate(load_config(None, ["trainer.experts_implementation=fast"], {}), check_resources=False)
    path = str(make_tiny_model(tmp_path / "m", "tiny", 0))
    assert meta_model(path, "sdpa", "batched_mm").config._experts_implementation == "batched_mm"
    assert meta_model(path, "sdpa").config._experts_implementation == "grouped_mm"  # transformers' default here
