"""A misbehaving environment in a real run (`python -m colo.launch`, configs/tiny-cpu-tools.yaml shortened):
by default the samples it breaks end with a logged error and the run goes on (a process joined to the test's Ray);
with algo.env_errors=fail the run ends with one `colo: error:` line that names the environment and what it did (on
warm clusters)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import clean_env, run_cli

MOODY = '''
from colo.envs.calculator import CalculatorEnv


class Moody(CalculatorEnv):
    """The calculator, except that it breaks on every prompt with a 7 in it."""

    def step(self, turn):
        if "7" in self.prompt:
            raise RuntimeError("the tool fell over")
        return super().step(turn)

    def reset(self, row):
        self.prompt = row["prompt"]
        return super().reset(row)
'''
# one trainer/engine pair: each engine runs its own samples' environments the same way, a second pair adds two processes
ARGS = ["--config", "configs/tiny-cpu-tools.yaml", "loop.sft_warmup_steps=0",
        "loop.steps=1", "loop.eval_every=0", "data.eval_path=null", "rollout.max_turn_tokens=8", "placement.num_gpus=1"]


def test_a_breaking_environment_ends_its_samples_and_the_run_goes_on(tmp_path: Path, ray_address: str) -> None:
    """The job joins the test process's Ray (conftest's ray_address), whose workers were not started with the
    module's directory on their PYTHONPATH: the engines import it because a joined job takes the driver's
    PYTHONPATH along (colo.cluster.placement.job_env)."""
    (tmp_path / "moody.py").write_text(MOODY)
    env = clean_env(PYTHONPATH=f"{tmp_path}:{clean_env()['PYTHONPATH']}", RAY_ADDRESS=ray_address)
    run_dir = tmp_path / "survives"
    r = run_cli(*ARGS, "algo.environment=moody:Moody", f"run.dir={run_dir}", env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    step = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    logged = (run_dir / "env-errors.log").read_text().splitlines()
    assert step["step"] == 0 and step["env/errors"] == len(logged) > 0
    assert all(line.startswith("step 0: row ") and "RuntimeError: the tool fell over" in line for line in logged)
    assert step["sync/verified"] is True  # the rest of the step went on


@pytest.mark.ends_cluster  # the engine raised: it is ended after the job (tests/warm_clusters.py)
def test_env_errors_fail_ends_the_run_with_one_line(tmp_path: Path, warm_jobs) -> None:
    """algo.env_errors=fail, on this process's warm clusters (conftest run_job): the module goes where their
    engines import from (conftest warm_modules), under a name of this test's own. Until 2026-11-27 a second joined
    process of the test above (~40 CPU-s more; the same job, the same engines' code path)."""
    from conftest import warm_modules

    module = f"moody_{os.getpid()}_{abs(hash(str(tmp_path)))}"
    (warm_modules() / f"{module}.py").write_text(MOODY)
    r = warm_jobs(*ARGS, f"algo.environment={module}:Moody", f"run.dir={tmp_path / 'fails'}", "algo.env_errors=fail",
                  timeout=900)
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("colo: error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert "raised EnvError: environment Moody: row" in errors[0] and "the tool fell over" in errors[0]
