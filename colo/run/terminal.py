"""What the terminal shows before the RL bar: the run's phases, each as it starts and when it is done, so the
minute of start-up and the supervised warm-up are never silence. The summary splits the wall time the same way.

    colo: run dir runs/tiny-cpu/20261128-101500
    colo: start-up: Ray, 2 FSDP2 trainer ranks, 2 vLLM engines
    colo: start-up: ready in 48 s
    warm-up: 100%|██████████| 70/70 [00:31<00:00, 2.2step/s, sft_loss=0.612]
    colo: warm-up: 70 supervised steps in 35 s; held-out eval: greedy 0.484, sampled 0.309
    RL: 100%|██████████| 140/140 [01:27<00:00, 1.6step/s, reward=0.434, eval=0.516, step_s=0.6]
    colo: done: 140 RL steps (0-139) in 2:50: start-up 0:48, warm-up 0:35, RL 1:27

Lines go to stdout (flushed at once, so a pipe or a log file sees them when they happen); the bars are tqdm's,
on stderr (colo.run.metrics.ProgressLine).
"""
from __future__ import annotations

import sys
import time


def clock(seconds: float) -> str:
    """m:ss (h:mm:ss from an hour on)."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{s // 60}:{s % 60:02d}"


class Phases:
    """The run's phases in order (start-up, warm-up, RL), each timed from begin() to end(); `seconds` holds the
    finished ones, `wall()` the time since the run began (the clock starts at construction)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self._name: str | None = None
        self._t0 = 0.0

    def begin(self, name: str, what: str = "", at: float | None = None) -> None:
        """Start phase `name` (ending the one running), timed from now or from `at` (a time.perf_counter());
        with `what`, one line says what it does."""
        if self._name is not None:
            self.end()
        self._name, self._t0 = name, time.perf_counter() if at is None else at
        if what:
            say(f"{name}: {what}")

    def end(self, line: str | None = None) -> float:
        """End the running phase; returns its seconds. `line`: printed after `<name>: ` ("{s}" becomes the
        seconds, "ready in 48 s"); None prints nothing."""
        if self._name is None:
            return 0.0
        s = time.perf_counter() - self._t0
        self.seconds[self._name] = self.seconds.get(self._name, 0.0) + s
        if line is not None:
            say(f"{self._name}: {line.format(s=f'{s:.0f} s')}")
        self._name = None
        return s

    def wall(self) -> float:
        return time.perf_counter() - self.started


def warmed_up(steps: int, evals: dict[str, float]) -> str:
    """The warm-up phase's closing line (Phases.end): its supervised steps and the held-out evals after it."""
    done = f"{steps} supervised step{'s' * (steps != 1)} and a weight sync in {{s}}" if steps else "done in {s}"
    scores = [f"{name} {evals[k]:.3f}" for name, k in (("greedy", "eval/reward"), ("sampled", "eval/sampled_reward"))
              if isinstance(evals.get(k), (int, float))]
    return done + (f"; held-out eval: {', '.join(scores)}" if scores else "")


def say(line: str) -> None:
    """One colo line on the terminal."""
    print(f"colo: {line}", file=sys.stdout, flush=True)
