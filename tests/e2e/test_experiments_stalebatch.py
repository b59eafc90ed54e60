"""python -m tools.experiments.stalebatch on CPU: one trainer trains a batch of stale behaviour log-probs and the same
batch with fresh ones; the experiment still runs and prints its figures (its answer: docs/benchmarks.md, "Answered
experiments")."""
from __future__ import annotations

import json

from conftest import run_cli


def test_bench_stalebatch_trains_stale_and_fresh_batches_of_the_same_shapes(tmp_path) -> None:
    """`python -m tools.experiments.stalebatch`: one trainer, a batch with the policy's own behaviour log-probs and
    the same batch with far-off ones (tokens from older weights: TIS weights away from 1), trained in turn at lr 0; the figure
    docs/benchmarks.md quotes for issue 47 (the train phase does not care how old a batch's tokens are)."""
    res = run_cli("--samples", "8", "--max-tokens", "64", "--rounds", "3", "--json", "--workdir", str(tmp_path),
                  module="tools.experiments.stalebatch", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["rounds"] == 2 and out["tokens"] > 8 * 64
    assert out["gap"]["fresh"] < 0.05 and out["gap"]["stale"] > 0.3  # |policy - behaviour| log-prob per token
    assert abs(out["tis_mean"]["fresh"] - 1.0) < 0.01
    assert 0.2 < out["stale_over_fresh"] < 5.0 and out["train_step_s"]["stale"] > 0
