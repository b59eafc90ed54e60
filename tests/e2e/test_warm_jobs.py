"""Jobs in turn on one process's warm clusters (tests/warm_clusters.py), as the suite's short CPU jobs run (conftest
run_job): the next job of the same shape gets the same trainer and engine processes, reconfigured for its config
(another model, another run dir), and trains with every sync verified; a process found dead is replaced by a new
cluster; what warm clusters do not run is refused before anything starts.

    .venv/bin/python -m pytest -q tests/e2e/test_warm_jobs.py
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

from colo.run.metrics import read_metrics

JOB = ["loop.steps=1", "loop.sft_warmup_steps=1", "loop.eval_every=0", "loop.checkpoint_every=0",
       "data.prompts_per_step=4", "rollout.n=4", "data.eval_size=8", "placement.num_gpus=1"]


def _one_pair():
    """This test process's idle one-pair warm cluster."""
    from conftest import _WARM

    (c,) = [c for key, c in _WARM[0]._idle.items() if key[2] == 1]  # noqa: SLF001 (the test looks inside)
    return c


def _pids(c) -> list[int]:
    return ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for _, a in c.actors()])


def _ok(r, run_dir: Path) -> list[dict]:
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [x["step"] for x in rows] == [-1, 0] and all(x["sync/verified"] for x in rows), rows
    return rows


def test_next_job_reuses_the_processes_reconfigured(warm_jobs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """... and each job's driver resolves its config once (colo.plan.resolve), the actors never (they refuse a config
    with an `auto` left: tests/unit/test_resolve.py)."""
    from conftest import _WARM, count_resolves

    calls = count_resolves(monkeypatch)
    first = _ok(warm_jobs(*JOB, f"run.dir={tmp_path / 'a'}"), tmp_path / "a")
    assert calls == [1]
    c = _one_pair()
    pids, reused = _pids(c), _WARM[0].reused
    # another model (the tools preset: other tokens, another tokenizer) and learning rate, the same shape
    r = warm_jobs(*JOB, "model.path=auto:tiny-tools", "trainer.lr=1e-3", f"run.dir={tmp_path / 'b'}")
    second = _ok(r, tmp_path / "b")
    assert calls == [1, 1]
    assert _one_pair() is c and _pids(c) == pids and _WARM[0].reused == reused + 1
    assert second[1]["trainer/lr"] == 1e-3 and first[1]["trainer/lr"] != 1e-3
    # each job's actors wrote to its own run dir's logs
    assert "Resolved architecture" in (tmp_path / "b" / "logs" / "engine-0.log").read_text()
    assert (tmp_path / "b" / "logs" / "trainer-0.log").exists()


@pytest.mark.ends_cluster(restarts=True)  # its second job starts the cluster a later test ends
def test_a_dead_process_gets_a_new_cluster(warm_jobs, tmp_path: Path) -> None:
    _ok(warm_jobs(*JOB, f"run.dir={tmp_path / 'a'}"), tmp_path / "a")
    c = _one_pair()
    ray.kill(c.engines[0], no_restart=True)  # as an OOM kill between two jobs would
    _ok(warm_jobs(*JOB, f"run.dir={tmp_path / 'b'}"), tmp_path / "b")
    assert _one_pair() is not c


def test_what_warm_clusters_do_not_run_is_refused_first(warm_jobs, tmp_path: Path) -> None:
    r = warm_jobs(*JOB, "placement.mode=disaggregated", "placement.num_gpus=3", "placement.trainer_gpus=1",
                  "rollout.tp_size=2", f"run.dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert ("colo: error: warm clusters run CPU jobs with one-process engines only (this one: cpu, disaggregated, "
            "rollout.tp_size=2)") in r.stderr
    assert not (tmp_path / "run").exists(), "refused before the run dir is made"
