"""A reward function that never returns, in a real run: algo.reward_timeout_s ends the run with one line naming it,
step 0 saved, nothing left behind (the watchdog's signal reaches the driver's main thread, where rewards are scored).
On this process's warm clusters (conftest run_job): the driver is this test process, whose main thread scores the
rewards as colo.launch's does, and a reward that times out leaves the cluster healthy for the session's next job."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from colo.run.rundir import complete_checkpoints

HANGS = '''
import time
from colo.algo.rewards import exact_match

calls = 0


def hangs_in_step_1(responses, answers, prompts):
    global calls
    calls += 1  # 1: the warm-up eval, 2: step 0, 3: step 1
    if calls >= 3:
        time.sleep(3600)
    return exact_match(responses, answers, prompts)
'''

JOB = ["loop.steps=3", "loop.sft_warmup_steps=1", "loop.eval_every=0", "loop.eval_samples=0", "loop.checkpoint_every=0",
       "data.prompts_per_step=4", "rollout.n=4", "data.eval_size=8", "placement.num_gpus=1"]


def test_reward_that_never_returns_ends_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warm_jobs) -> None:
    module = f"hanging_reward_{os.getpid()}"  # imported once per process: a name of its own, a fresh call count
    (tmp_path / f"{module}.py").write_text(HANGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / "run"
    r = warm_jobs(f"run.dir={run_dir}", *JOB, f"algo.rewards=[{module}:hangs_in_step_1]", "algo.reward_timeout_s=5",
                  timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("colo: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"colo: error: reward function '{module}:hangs_in_step_1' "
                                                     "did not return within 5 s (algo.reward_timeout_s); fix:"), r.stderr
    assert "Traceback" not in r.stderr
    assert [c.name for c in complete_checkpoints(run_dir)] == ["step_000000"]
    assert f"--resume run.dir={run_dir}" in r.stderr
