"""`loop.mode=async` with `configs/tiny-cpu-tools.yaml`: conversations with the calculator carried across weight
updates (colo.rollout.turns), on the session's tools job (tests/conftest.py) resumed in async mode.

    .venv/bin/python -m pytest tests/e2e/test_async_tools_job.py -q

The tools job (the README's command, 3 RL steps after its 45-step warm-up) is copied and resumed with
`loop.mode=async` for 4 more steps: the warm-up is not run again, and the model already calls the tool, so the
conversations have two or three turns. With twice the prompts in flight the rollout stops once 16 groups ended, with
conversations mid-way, which the next step resumes under new weights (their calculator replayed from their turns).
A copy of that run cut back to its step-4 checkpoint (which holds the carried conversations) and resumed again trains
steps 5 and 6 exactly as the uninterrupted run did.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from colo.rollout.sample import SampleArrays

ASYNC = ["loop.mode=async", "loop.max_staleness=1", "rollout.oversample=2", "loop.checkpoint_every=1"]
KEYS = ("async/staleness_mean", "async/staleness_max", "async/offpolicy_frac", "async/carried", "async/dropped",
        "async/completed", "async/resumed", "rollout/turns/mean", "rollout/tool_calls_per_sample",
        "rollout/model_token_frac", "env/errors", "reward/mean", "loss", "grad_norm", "response_len/mean")


def rows(run_dir: Path) -> dict[int, dict]:
    return {x["step"]: x for x in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def async_tools(tools_job, tmp_path_factory: pytest.TempPathFactory, warm_jobs) -> Path:
    src, r = tools_job
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path_factory.mktemp("async-tools") / "run"
    shutil.copytree(src, run_dir, ignore=shutil.ignore_patterns("export"))
    r = warm_jobs("--resume", f"run.dir={run_dir}", *ASYNC, "loop.steps=7", timeout=1200)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return run_dir


def test_async_conversations_are_carried_within_the_staleness_bound(async_tools: Path) -> None:
    got = rows(async_tools)
    assert sorted(got) == [-1, 0, 1, 2, 3, 4, 5, 6]
    steps = [got[s] for s in (3, 4, 5, 6)]
    print({k: [x[k] for x in steps] for k in KEYS})
    for x in steps:
        assert x["sync/verified"] is True and x["async/staleness_max"] <= 1  # never past loop.max_staleness
        assert x["rollout/turns/mean"] > 1 and x["rollout/turns/max"] <= 3  # conversations: the tool is called
        assert x["env/errors"] == 0  # every resumed conversation's calculator gave its recorded answers back
        assert 0.2 < x["rollout/model_token_frac"] < 0.9  # the tool's tokens are in the rows, without loss
        assert x["logprob_diff/mean"] < 0.05
    assert steps[0]["async/staleness_max"] == 0  # the first async step: nothing older yet
    assert sum(x["async/carried"] for x in steps) > 0, "no conversation was stopped mid-way: the test shows nothing"
    assert sum(x["async/resumed"] for x in steps) > 0
    assert any(x["async/offpolicy_frac"] > 0 for x in steps), "no trained token came from older weights"
    assert not (async_tools / "env-errors.log").exists()


def test_async_conversations_resume_exactly_from_a_checkpoint(async_tools: Path, tmp_path: Path, warm_jobs) -> None:
    """The step-4 checkpoint holds the carried conversations (ids, log-probs, versions, turn bookkeeping); resumed,
    steps 5 and 6 equal the uninterrupted run's, their environments rebuilt by replay as in the run itself."""
    cut = tmp_path / "cut"
    shutil.copytree(async_tools, cut, ignore=shutil.ignore_patterns("export"))
    for step in (5, 6):
        shutil.rmtree(cut / "checkpoints" / f"step_{step:06d}")
    carried = json.loads((cut / "checkpoints" / "step_000004" / "extra.json").read_text())["async_buffer"]
    mid = [s for s in SampleArrays.from_state(carried["samples"]).unpack() if not s.done and s.response_ids]
    assert all(len(s.model_mask) == len(s.response_ids) == len(s.versions) and s.turns is not None for s in mid)
    r = warm_jobs("--resume", f"run.dir={cut}", timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = rows(async_tools), rows(cut)
    assert sorted(got) == sorted(want)
    assert want[4]["async/carried"] > 0 or want[5]["async/resumed"] > 0, "nothing was carried across the cut"
    for step in (5, 6):
        for k in KEYS:
            assert got[step][k] == want[step][k], (step, k, got[step][k], want[step][k])
