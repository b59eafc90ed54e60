"""Standing yardsticks, each `python -m colo.bench.<name>` with its baseline measured in the same run
(docs/benchmarks.md): sync (the weight sync against the paths in yardsticks.py, on the actor subclasses of
engines.py), step (whole RL steps at long-tail lengths: lengths.py draws them, stepreward.py scores them, spread.py
and combine.py give a ratio's median and spread), rollout, decode and routing. Answered one-off experiments live in
tools/experiments/, outside the package."""
