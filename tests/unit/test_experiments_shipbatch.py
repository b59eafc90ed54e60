"""python -m tools.experiments.shipbatch on CPU: a step's shard reaches a Ray actor as tensors and as
colo.algo.batch.to_wire's numpy arrays, whole either way (the actor counts what from_wire gives it). The wire format's own round trip:
tests/unit/test_algo_batch.py."""
from __future__ import annotations

import json


def test_bench_ships_a_shard_both_ways(ray_cluster, capsys) -> None:
    from tools.experiments.shipbatch import main

    assert main(["--samples", "8", "--max-tokens", "256", "--prompt-len", "16", "--reps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["seconds"]) == {"tensors", "arrays"} and all(v > 0 for v in out["seconds"].values())
    assert out["samples"] == 8 and out["shard_mb"] > 0 and out["tensors_over_arrays"] > 0
