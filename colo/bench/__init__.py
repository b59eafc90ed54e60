"""Benchmarks, each `python -m colo.bench.<name>` with a baseline measured in the same run: sync (weight sync
against the yardsticks), loadmem, trainmem, memcal, fit, rollout, routing (docs/benchmarks.md)."""
