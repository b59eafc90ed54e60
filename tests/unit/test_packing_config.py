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
