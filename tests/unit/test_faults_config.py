"""Faults a user's config or data brings, refused before anything starts: one ConfigError line with the fix."""
from __future__ import annotations

import pytest

from colo.config import ConfigError, load_config, validate


def config_error(overrides: list[str], check_resources: bool = False) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["placement.device=cpu", *overrides], {}), check_resources=check_resources)
    msg = str(e.value)
    assert "\n" not in msg and "fix:" in msg, msg
    return msg


def test_group_of_one_is_refused() -> None:
    """rollout.n=1: every group-normalized advantage is 0, so nothing would train."""
    msg = config_error(["rollout.n=1"])
    assert "rollout.n=1" in msg and "rollout.n=8" in msg
    validate(load_config(None, ["placement.device=cpu", "rollout.n=2"], {}), check_resources=False)
