"""`python -m colo.launch loop.mode=async`: a short tiny job runs to the end with the async metrics on every step.

    .venv/bin/python -m pytest tests/e2e/test_async_job.py -q

A long tail: after 10 SFT steps most answers end in a few tokens, while some run on to rollout.max_tokens=32.
With twice the prompts in flight, the rollout stops once the short groups are done, with samples unfinished,
which the next step resumes under new weights (staleness 1) or drops (older than loop.max_staleness).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from colo.run.metrics import read_metrics

JOB = ["loop.steps=5", "loop.sft_warmup_steps=10", "loop.eval_every=0", "loop.eval_samples=0", "loop.checkpoint_every=0",
       "data.prompts_per_step=4", "rollout.n=4", "data.eval_size=8", "rollout.max_tokens=32"]
ASYNC = ["loop.mode=async", "loop.max_staleness=1", "rollout.oversample=2"]
KEYS = ("async/staleness_mean", "async/staleness_max", "async/offpolicy_frac", "async/carried", "async/dropped",
        "async/dropped_tokens", "async/completed", "async/resumed", "async/buffered_groups")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory, warm_jobs) -> Path:
    run_dir = tmp_path_factory.mktemp("async") / "run"
    r = warm_jobs(f"run.dir={run_dir}", *ASYNC, *JOB, "loop.checkpoint_every=1", timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return run_dir


def test_async_job_carries_samples_within_the_staleness_bound(full_run: Path) -> None:
    run_dir = full_run
    rows = [x for x in read_metrics(run_dir / "metrics.jsonl") if x["step"] >= 0]
    assert [x["step"] for x in rows] == [0, 1, 2, 3, 4]
    for x in rows:
        assert all(k in x for k in KEYS), sorted(set(KEYS) - set(x))
        assert x["sync/verified"] and x["async/staleness_max"] <= 1  # never past loop.max_staleness
        assert 0 <= x["async/offpolicy_frac"] <= 1 and x["async/staleness_mean"] <= x["async/staleness_max"]
    print({k: [x[k] for x in rows] for k in KEYS})
    assert rows[0]["async/staleness_max"] == 0 and rows[0]["async/resumed"] == 0  # nothing older than step 0
    assert sum(x["async/carried"] for x in rows) > 0, "the rollout never stopped a sample: the test shows nothing"
    assert sum(x["async/resumed"] for x in rows) > 0
    assert any(x["async/offpolicy_frac"] > 0 for x in rows), "no trained token came from older weights"
    assert (run_dir / "export" / "config.json").exists()


def test_async_resume_continues_the_carried_samples_exactly(full_run: Path, tmp_path: Path, warm_jobs) -> None:
    """A copy of the run cut back to step 2's checkpoint (which holds the carried samples), then --resume to
    step 4: the resumed steps' records equal the uninterrupted run's (bit-identical on CPU, as sync mode).
    (Until 2026-11-26 a second 3-step run made the cut; the copy tests the same resume with one job less.)"""
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(full_run, cut, ignore=shutil.ignore_patterns("export"))
    for step in (3, 4):
        shutil.rmtree(cut / "checkpoints" / f"step_{step:06d}")
    r = warm_jobs("--resume", f"run.dir={cut}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    want = {x["step"]: x for x in read_metrics(full_run / "metrics.jsonl")}
    got = {x["step"]: x for x in read_metrics(cut / "metrics.jsonl")}
    assert sorted(got) == sorted(want) == [-1, 0, 1, 2, 3, 4]
    assert want[2]["async/carried"] > 0 or want[3]["async/resumed"] > 0, "nothing was carried across the cut"
    for step in (3, 4):
        for k in (*KEYS, "reward/mean", "loss", "response_len/mean", "grad_norm"):
            assert got[step][k] == want[step][k], (step, k, got[step][k], want[step][k])


DISAGGREGATED = ["placement.mode=disaggregated", "placement.trainer_gpus=1", "loop.mode=async", "loop.max_staleness=1"]


def test_disaggregated_async_trains_one_step_off_and_resumes_exactly(tmp_path: Path, warm_jobs) -> None:
    """Disaggregated async (colo.rollout.ahead): the engine generates step s + 1's batch while the trainer trains
    step s's, so every step after the first trains tokens one version old; the checkpoint of step 1 holds the
    batch generated ahead, and --resume from it (a copy of the run cut back to that checkpoint) trains step 2
    exactly as the uninterrupted run did."""
    import shutil

    full = tmp_path / "full"
    job = [*DISAGGREGATED, *JOB, "loop.steps=3", "loop.checkpoint_every=1"]
    r = warm_jobs(f"run.dir={full}", *job, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    rows = {x["step"]: x for x in read_metrics(full / "metrics.jsonl")}
    assert sorted(rows) == [-1, 0, 1, 2]
    for step in (0, 1, 2):
        x = rows[step]
        assert all(k in x for k in KEYS) and x["sync/verified"], sorted(set(KEYS) - set(x))
        lag = 0 if step == 0 else 1  # step 0 generates its own batch; later ones train the batch made ahead
        assert (x["async/staleness_mean"], x["async/staleness_max"], x["async/offpolicy_frac"]) == (lag, lag, lag)
        assert x["async/completed"] == 16 and x["async/carried"] == x["async/dropped"] == 0
        assert "timing/wait_s" in x  # the engine's part of the next batch left after the train phase

    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000002")
    r = warm_jobs("--resume", f"run.dir={cut}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {x["step"]: x for x in read_metrics(cut / "metrics.jsonl")}
    assert sorted(got) == [-1, 0, 1, 2]
    for k in (*KEYS, "reward/mean", "loss", "response_len/mean", "grad_norm"):
        assert got[2][k] == rows[2][k], (k, got[2][k], rows[2][k])  # trained on the checkpointed batch
