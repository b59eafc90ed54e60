"""colo.cluster.placement.job_env: what a job that joins a Ray cluster (run.ray_address) takes along."""
from __future__ import annotations

import pytest

from colo.cluster.placement import job_env


def test_a_joined_job_takes_the_drivers_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/shared/rewards:/shared/colo")
    assert job_env() == {"env_vars": {"PYTHONPATH": "/shared/rewards:/shared/colo"}}
    monkeypatch.delenv("PYTHONPATH")
    assert job_env() is None


def test_a_submitted_job_keeps_its_own_runtime_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ray job submit` hands the driver its job config; Ray refuses a ray.init runtime_env that names an
    environment variable that config names too, so the submitted one is left as it is."""
    monkeypatch.setenv("PYTHONPATH", "/shared/rewards")
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {"env_vars": {"PYTHONPATH": "/x"}}}')
    assert job_env() is None
