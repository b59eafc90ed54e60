"""tools.experiments.import_gc runs: vLLM's import in fresh processes, plain and with colo.host.heap's paused
collector, each with its CPU-seconds (no timing claim here: its figure is in docs/benchmarks.md).

    .venv/bin/python -m pytest -q tests/integration/test_experiments_import_gc.py     (~20 s: two vLLM imports)
"""
from __future__ import annotations


def test_import_gc_times_both_imports() -> None:
    from tools.experiments.import_gc import main

    out = main(["--reps", "1"])
    assert len(out["plain_cpu_s"]) == len(out["paused_cpu_s"]) == 1
    assert all(x > 0.5 for x in out["plain_cpu_s"] + out["paused_cpu_s"])  # vLLM was imported both times
    assert out["ratio_min"] == out["ratio_median"] == out["paused_cpu_s"][0] / out["plain_cpu_s"][0]
