"""The lines a finished run prints: what it did and how long each part took, how the rewards moved, where
everything is, and the commands to look at it, serve it and continue it, each runnable as printed
(colo.run.commands):

    colo: done: 140 RL steps (0-139) in 2:50: start-up 0:48, warm-up 0:35, RL 1:27
      training reward  0.284 (mean of steps 0-9) -> 0.434 (mean of steps 130-139)
      held-out eval    greedy 0.484 (after the warm-up) -> 0.516 (step 139); sampled 0.309 -> 0.414
      plot         runs/tiny-cpu/20261128-101500/metrics.png
      metrics      runs/tiny-cpu/20261128-101500/metrics.jsonl
      tensorboard  .venv/bin/tensorboard --logdir runs/tiny-cpu/20261128-101500/tb
      export       runs/tiny-cpu/20261128-101500/export
      serve        .venv/bin/python -m vllm.entrypoints.openai.api_server --model runs/.../export ...
      chat         curl -s localhost:8000/v1/chat/completions ...  # reference answer: 7
      logs         runs/tiny-cpu/20261128-101500/logs/
      more         .venv/bin/python -m colo.launch --resume run.dir=runs/tiny-cpu/20261128-101500 loop.steps=280

Read from metrics.jsonl, so a resumed run summarizes the whole run, not just its last leg; the wall time is this
launch's. One step's training reward is noisy (64 samples of the default job), so the summary compares the means
of the first and the last MEAN_OF steps. The held-out evals compare the earliest record holding the key (the
warm-up's, step -1) with the newest: eval/reward is greedy, eval/sampled_reward samples at the rollout
temperature (what GRPO maximizes).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from colo.run import commands
from colo.run.metrics import MEAN_OF, read_metrics
from colo.run.terminal import clock

EVALS = (("greedy", "eval/reward"), ("sampled", "eval/sampled_reward"))


def run_summary(run_dir: str | Path, seconds: float, loggers: list[str],
                serve: Callable[[Path], str] = lambda d: f"vllm serve {d}",
                phases: dict[str, float] | None = None) -> str:
    """`seconds`: this launch's wall time, split by `phases` (colo.run.terminal.Phases.seconds); `serve`: the
    command that serves a checkpoint dir on this install (colo.rollout.vllm_compat.serve_command)."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = sorted({r["step"] for r in rows if r.get("step", -1) >= 0})
    span = f" ({steps[0]}-{steps[-1]})" if steps else ""
    split = ", ".join(f"{name} {clock(s)}" for name, s in (phases or {}).items())
    lines = [f"colo: done: {len(steps)} RL steps{span} in {clock(seconds)}{': ' + split if split else ''}"]
    lines += reward_lines(rows)
    out = [("plot", commands.shown(run_dir / "metrics.png")), ("metrics", commands.shown(run_dir / "metrics.jsonl"))]
    if "tensorboard" in loggers:
        out.append(("tensorboard", commands.tensorboard(run_dir / "tb")))
    if "wandb" in loggers:
        out.append(("wandb", f"{commands.tool('wandb')} sync {commands.shown(run_dir / 'wandb')}/offline-run-*"
                             "  # uploads an offline run"))
    export = run_dir / "export"
    if export.is_dir():
        out += [("export", commands.shown(export)), ("serve", serve(export))]
        ask = example_request(run_dir)
        if ask:
            out.append(("chat", ask))
    out.append(("logs", commands.shown(run_dir / "logs") + "/"))
    more = (steps[-1] + 1) * 2 if steps else 2
    out.append(("more", commands.resume(run_dir, f"loop.steps={more}")))
    width = max(len(k) for k, _ in out)
    lines += [f"  {k.ljust(width)}  {v}" for k, v in out]
    return "\n".join(lines)


def reward_lines(rows: list[dict]) -> list[str]:
    """The training reward's first and last means (MEAN_OF steps each, fewer when the run is short) and the
    held-out evals, first against last."""
    lines = []
    train = [(r["step"], r["reward/mean"]) for r in rows
             if r.get("step", -1) >= 0 and isinstance(r.get("reward/mean"), (int, float))]
    if train:
        k = min(MEAN_OF, max(1, len(train) // 2))
        first, last = train[:k], train[-k:]
        lines.append(f"  training reward  {_mean(first):.3f} ({_over(first)}) -> {_mean(last):.3f} ({_over(last)})")
    evals = []
    for name, key in EVALS:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            (s0, v0), (s1, v1) = pts[0], pts[-1]
            where = "after the warm-up" if s0 < 0 else f"step {s0}"
            evals.append(f"{name} {v0:.3f} ({where}) -> {v1:.3f} (step {s1})" if not evals else
                         f"{name} {v0:.3f} -> {v1:.3f}")
    if evals:
        lines.append("  held-out eval    " + "; ".join(evals))
    return lines


def _mean(pts: list[tuple[int, float]]) -> float:
    return sum(v for _, v in pts) / len(pts)


def _over(pts: list[tuple[int, float]]) -> str:
    return f"step {pts[0][0]}" if len(pts) == 1 else f"mean of steps {pts[0][0]}-{pts[-1][0]}"


def example_request(run_dir: Path) -> str | None:
    """The chat request (colo.run.commands.chat_request) for the run's first held-out prompt (else its first
    training prompt), as training framed it, with the row's answer; None when the run's config or data cannot
    be read here (a Hub dataset, a Parquet file)."""
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        data, rollout = cfg["data"], cfg["rollout"]
        row = _first_row(data.get("eval_path") or data["path"])
        prompt, answer = str(row[data.get("prompt_key", "prompt")]), row.get(data.get("answer_key", "answer"))
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return None
    chat = bool(data.get("chat_template", True)) and _has_chat_template(run_dir / "export")
    ask = commands.chat_request(prompt, int(rollout.get("max_tokens", 16)), data.get("system_prompt"), chat)
    return ask + (f"  # reference answer: {answer}" if answer is not None else "")  # a comment: pastes as is


def _first_row(path: str) -> dict[str, Any]:
    if not str(path).endswith(".jsonl"):
        raise ValueError(f"not a JSONL file: {path}")
    with open(path) as f:
        return json.loads(f.readline())


def _has_chat_template(model_dir: Path) -> bool:
    if (model_dir / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False
