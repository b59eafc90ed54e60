"""The few lines a finished run prints: what it did, how the rewards moved, where everything is, what next.

    colo: done: 140 RL steps in 2:31 (steps 0-139)
      reward/mean 0.212 -> 0.431 | eval/reward 0.500 -> 0.578 | eval/sampled_reward 0.309 -> 0.414
      metrics  runs/tiny-cpu/20261123-101500/metrics.jsonl  (plot metrics.png; tensorboard --logdir .../tb)
      export   runs/tiny-cpu/20261123-101500/export  (serve: .venv/bin/python -m vllm.entrypoints.openai.api_server --model runs/tiny-cpu/20261123-101500/export)
      logs     runs/tiny-cpu/20261123-101500/logs/
      more     python -m colo.launch --resume run.dir=runs/tiny-cpu/20261123-101500 loop.steps=280

Read from metrics.jsonl, so a resumed run summarizes the whole run, not just its last leg. "first" is the
earliest record holding the key (the warm-up's eval, step -1, for eval keys), "last" the newest.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from colo.run.metrics import read_metrics

KEYS = ("reward/mean", "eval/reward", "eval/sampled_reward")


def run_summary(run_dir: str | Path, seconds: float, loggers: list[str],
                serve: Callable[[Path], str] = lambda d: f"vllm serve {d}") -> str:
    """`serve`: the command that serves a checkpoint dir on this install (colo.rollout.vllm_compat.serve_command)."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = sorted({r["step"] for r in rows if r.get("step", -1) >= 0})
    m, s = divmod(int(seconds), 60)
    span = f" (steps {steps[0]}-{steps[-1]})" if steps else ""
    lines = [f"colo: done: {len(steps)} RL steps in {m}:{s:02d}{span}"]
    moves = []
    for key in KEYS:
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if vals:
            moves.append(f"{key} {vals[0]:.3f} -> {vals[-1]:.3f}")
    if moves:
        lines.append("  " + " | ".join(moves))
    where = [f"plot {run_dir / 'metrics.png'}"]
    if "tensorboard" in loggers:
        where.append(f"tensorboard --logdir {run_dir / 'tb'}")
    if "wandb" in loggers:
        where.append(f"W&B files {run_dir / 'wandb'} (offline runs: wandb sync <run dir there>)")
    lines.append(f"  metrics  {run_dir / 'metrics.jsonl'}  ({'; '.join(where)})")
    export = run_dir / "export"
    if export.is_dir():
        lines.append(f"  export   {export}  (serve: {serve(export)})")
    lines.append(f"  logs     {run_dir / 'logs'}/")
    more = (steps[-1] + 1) * 2 if steps else 2
    lines.append(f"  more     python -m colo.launch --resume run.dir={run_dir} loop.steps={more}")
    return "\n".join(lines)
