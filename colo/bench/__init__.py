"""Benchmarks: `python -m colo.bench.sync` (weight sync against the straightforward path)."""
