"""R3 and the routing metrics through the real CLI: the default job logs them every step; an r3 job runs
with every sync verified."""
from __future__ import annotations

from pathlib import Path


def test_default_job_logs_routing_and_logprob_gap_every_step(default_job) -> None:
    """The default job (replay off) captures the engine's routing every step: routing/mismatch and the gap
    (mean, max, KL) are in metrics.jsonl and TensorBoard for every RL step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from colo.run.metrics import read_metrics

    run_dir, r = default_job
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [x for x in read_metrics(run_dir / "metrics.jsonl") if x["step"] >= 0]
    keys = ("routing/mismatch", "logprob_diff/mean", "logprob_diff/max", "logprob_diff/kl")
    assert rows and all(k in x for x in rows for k in keys)
    assert all(0.0 <= x["routing/mismatch"] < 0.2 and x["logprob_diff/max"] >= x["logprob_diff/mean"] for x in rows)
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert len(acc.Scalars("routing/mismatch")) == len(rows)


def test_r3_job_runs_with_every_sync_verified(tmp_path: Path, warm_jobs) -> None:
    """`python -m colo.launch algo.routing_replay=r3`, shortened: the default job with replay on (on this process's
    warm clusters, conftest run_job)."""
    from colo.run.metrics import read_metrics

    run_dir = tmp_path / "run"
    r = warm_jobs(f"run.dir={run_dir}", "algo.routing_replay=r3", "loop.steps=3", "loop.sft_warmup_steps=2",
                "loop.eval_every=0", "loop.eval_samples=0", "loop.checkpoint_every=0", "data.prompts_per_step=4",
                "rollout.n=4", "data.eval_size=8", timeout=600)  # ~40 s idle; 300 s ran out at load 44
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [x["step"] for x in rows] == [-1, 0, 1, 2] and all(x["sync/verified"] for x in rows)
    assert all("routing/mismatch" in x and x["logprob_diff/mean"] < 0.1 for x in rows[1:]), rows
