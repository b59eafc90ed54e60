"""A reward function that never returns, in a real run: algo.reward_timeout_s ends the run with one line naming it,
step 0 saved, nothing left behind (the watchdog's signal reaches the driver's main thread, where rewards are scored)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import clean_env, run_cli

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


def test_reward_that_never_returns_ends_the_run(tmp_path: Path) -> None:
    (tmp_path / "hanging_reward.py").write_text(HANGS)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(tmp_path)])
    run_dir = tmp_path / "run"
    r = run_cli(f"run.dir={run_dir}", *JOB, "algo.rewards=[hanging_reward:hangs_in_step_1]", "algo.reward_timeout_s=5",
                env=env, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("colo: error:")]
    assert len(errors) == 1 and errors[0].startswith("colo: error: reward function 'hanging_reward:hangs_in_step_1' "
                                                     "did not return within 5 s (algo.reward_timeout_s); fix:"), r.stderr
    assert "Traceback" not in r.stderr
    assert [c.name for c in complete_checkpoints(run_dir)] == ["step_000000"]
    assert f"--resume run.dir={run_dir}" in r.stderr
