"""`python -m colo.launch loop.mode=async`: a short tiny job runs to the end with the async metrics on every step.

    .venv/bin/python -m pytest tests/e2e/test_async_job.py -q

A long tail: after 10 SFT steps most answers end in a few tokens, while some run on to rollout.max_tokens=32.
With twice the prompts in flight, the rollout stops once the short groups are done, with samples unfinished,
which the next step resumes under new weights (staleness 1) or drops (older than loop.max_staleness).
"""
from __future__ import annotations

from pathlib import Path

from conftest import clean_env, run_cli

from colo.run.metrics import read_metrics

JOB = ["loop.steps=5", "loop.sft_warmup_steps=10", "loop.eval_every=0", "loop.eval_samples=0", "loop.checkpoint_every=0",
       "data.prompts_per_step=4", "rollout.n=4", "data.eval_size=8", "rollout.max_tokens=32"]
KEYS = ("async/staleness_mean", "async/staleness_max", "async/offpolicy_frac", "async/carried", "async/dropped",
        "async/dropped_tokens", "async/completed", "async/resumed", "async/buffered_groups")


def test_async_job_carries_samples_within_the_staleness_bound(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = run_cli(f"run.dir={run_dir}", "loop.mode=async", "loop.max_staleness=1", "rollout.oversample=2", *JOB,
                env=clean_env(), timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
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
