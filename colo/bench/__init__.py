"""Benchmarks, each `python -m colo.bench.<name>` with a baseline measured in the same run (docs/benchmarks.md):
sync (weight sync against the yardsticks in yardsticks.py, on the actor subclasses of engines.py), step (whole RL
steps at long-tail lengths; lengths.py draws them), rollout, decode, routing, loadmem, trainmem, memcal, fit,
optimizer, buildbatch, shipbatch, packed_attention, and asyncsim (the async step replayed on a decode curve)."""
