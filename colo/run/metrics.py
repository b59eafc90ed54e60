"""Run outputs: metrics.jsonl, TensorBoard scalars, W&B, a PNG plot at close, and a progress bar.

    run_dir/metrics.jsonl   one JSON object per step: {"step": 3, "reward/mean": 0.4, ...}  (always)
    run_dir/tb/             TensorBoard event files (tensorboard --logdir run_dir/tb)       (run.loggers)
    run_dir/wandb/          Weights & Biases run files; online runs upload as they go          (run.loggers)
    run_dir/metrics.png     reward (and eval reward) per step; per-phase timings timing/*_s, stacked

W&B plots against colo's own `step` (define_metric), not its internal counter: W&B's step must be a
non-negative, increasing integer, while colo logs the warm-up as step -1 and a resumed run logs the
steps after its checkpoint again. Those redone steps then appear twice in W&B (it cannot drop records);
metrics.jsonl and TensorBoard keep one of each.

The plot is drawn from metrics.jsonl, not from memory, so after a resume it still covers the whole
run. On resume, pass `resume_step` or call `resume_from(step)` once the checkpoint's step is known:
lines logged after that step by the interrupted run are dropped (the resumed run logs them again)
and TensorBoard purges its events after that step too. Records with step -1 (warm-up) are kept.
Non-finite floats are written as null so the file stays strict JSON (jq, pandas).
"""

from __future__ import annotations

import json
import math
import numbers
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIMING_PREFIX = "timing/"
TOTAL_TIMING = "timing/step_s"
# the step's timeline, bottom to top in the stacked plot; phases not listed go on top, so a new phase key
# (timing/<phase>_s) is drawn without a change here
PHASE_ORDER = ("rollout", "reward", "sleep", "train", "wait", "sync", "offload", "wake", "probe")
# spans timed inside a phase (colo.loop.Timer part=True), listed once: part -> the phase that contains it. A part
# is drawn inside its phase's bar, never stacked on it (stacked, the bars overshot the step's total)
PARTS = {"batch": "train"}
CPU_MARKER = "_cpu_s"  # timing/<span>_cpu_s: a span's CPU time on the driver's thread, beside its wall time


def _plain(v: Any) -> Any:
    """Tensors / numpy scalars -> Python numbers; non-finite -> None; others unchanged."""
    if hasattr(v, "item") and callable(v.item):
        v = v.item()
    if isinstance(v, bool):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        v = float(v)
        return v if math.isfinite(v) else None
    return v


def read_metrics(path: str | Path) -> list[dict]:
    """All step records of a metrics.jsonl (skips a torn last line from a crash)."""
    rows = []
    p = Path(path)
    if not p.exists():
        return rows
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class MetricsWriter:
    """Appends one record per step; call close() at the end to flush and draw the plot."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None,
                 loggers: tuple[str, ...] | list[str] = ("jsonl", "tensorboard"),
                 wandb: WandbSettings | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.plot_path = self.run_dir / "metrics.png"
        self._jsonl = self.jsonl_path.open("a")
        self._tb = self._summary_writer(None) if "tensorboard" in loggers else None
        self._wandb = WandbLogger(self.run_dir, wandb or WandbSettings()) if "wandb" in loggers else None
        if resume_step is not None:
            self.resume_from(resume_step)

    def _summary_writer(self, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # slow import (tensorboard): keep it here

        return SummaryWriter(str(self.run_dir / "tb"), purge_step=purge_step)

    def resume_from(self, step: int) -> None:
        """Forget everything the interrupted run logged after `step` (the last checkpointed step)."""
        self._jsonl.close()
        keep = [r for r in read_metrics(self.jsonl_path) if r.get("step", -1) <= step]
        self.jsonl_path.write_text("".join(json.dumps(r) + "\n" for r in keep))
        self._jsonl = self.jsonl_path.open("a")
        if self._tb is not None:
            self._tb.close()
            self._tb = self._summary_writer(step + 1)

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Write one step's record; returns it as written (plain Python values)."""
        record = {"step": int(step)}
        record.update({k: _plain(v) for k, v in metrics.items() if k != "step"})
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()  # a crash loses at most the step being written
        scalars = {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}  # bools 0/1
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(step, scalars)
        return record

    def close(self) -> Path | None:
        """Flush everything and write metrics.png; returns its path (None when nothing was logged)."""
        if self._jsonl.closed:
            return self.plot_path if self.plot_path.exists() else None
        self._jsonl.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
        rows = read_metrics(self.jsonl_path)
        if not rows:
            return None
        plot_metrics(rows, self.plot_path)
        return self.plot_path

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class WandbSettings:
    project: str = "colo"
    mode: str = "offline"  # online | offline (colo.plan.resolve turns run.wandb_mode=auto into one)
    config: dict[str, Any] = field(default_factory=dict)  # the resolved colo config, shown with the run


class WandbLogger:
    """One W&B run per colo run dir: its id is kept in <run_dir>/wandb_id, so --resume continues it."""

    def __init__(self, run_dir: Path, settings: WandbSettings) -> None:
        import wandb  # not at module level: a run without the wandb logger never imports it

        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=settings.project, mode=settings.mode, dir=str(run_dir), id=run_id,
                              name=run_dir.name, resume="allow", config=settings.config)
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({"step": step, **scalars})

    def close(self) -> None:
        self.run.finish()


MEAN_OF = 10  # steps in the plot's running mean of the training reward (and the summary's first and last means)


def running_mean(ys: list[float], n: int) -> list[float]:
    """Means of each n consecutive values (len(ys) - n + 1 of them)."""
    return [sum(ys[i - n:i]) / n for i in range(n, len(ys) + 1)]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def plot_metrics(rows: list[dict], path: str | Path) -> None:
    """Top: reward/mean and every eval/*reward* key per step. Bottom: per-phase timings stacked."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes; must precede pyplot import
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    keys = sorted({k for r in rows for k in r})
    fig, (ax_r, ax_t) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for key in ["reward/mean"] + [k for k in keys if k.startswith("eval/") and "reward" in k]:
        xs, ys = _series(rows, key)
        if xs:
            ax_r.plot(xs, ys, marker="o" if key.startswith("eval/") else None, ms=4, label=key,
                      alpha=0.4 if key == "reward/mean" and len(xs) > MEAN_OF else 1.0)
        if key == "reward/mean" and len(xs) > MEAN_OF:  # one step's reward is noisy: its trend, over MEAN_OF steps
            ax_r.plot(xs[MEAN_OF - 1:], running_mean(ys, MEAN_OF), color=ax_r.lines[-1].get_color(), lw=2,
                      label=f"reward/mean, mean of {MEAN_OF} steps")
    ax_r.set_ylabel("reward")
    ax_r.grid(alpha=0.3)
    if ax_r.lines:
        ax_r.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)

    phases, parts = timing_layout(keys)
    steps = [r["step"] for r in rows]
    bottom, base = [0.0] * len(rows), {}
    for k in phases:
        vals = _values(rows, k)
        base[k] = bottom
        ax_t.bar(steps, vals, bottom=bottom, width=0.8, label=k[len(TIMING_PREFIX):-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    for k, phase in parts.items():  # inside its phase's bar, from the phase's base: a share of it, not more
        ax_t.bar(steps, _values(rows, k), bottom=base[phase], width=0.4, fill=False, hatch="///", lw=0.5,
                 label=f"{k[len(TIMING_PREFIX):-2]} (part of {phase[len(TIMING_PREFIX):-2]})")
    xs, ys = _series(rows, TOTAL_TIMING)
    if xs:
        ax_t.plot(xs, ys, color="black", lw=1, label="step (total)")
    ax_t.set_xlabel("step")
    ax_t.set_ylabel("seconds")
    ax_t.grid(alpha=0.3)
    ax_t.xaxis.set_major_locator(MaxNLocator(integer=True))
    if phases or xs:
        handles, labels = ax_t.get_legend_handles_labels()  # top phase first, as stacked
        ax_t.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0),
                    fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def timing_layout(keys: list[str] | set[str]) -> tuple[list[str], dict[str, str]]:
    """The phase panel's bars from the timing keys present: (phases, stacked bottom to top; {part: its phase}).
    The step's total, CPU times (CPU_MARKER) and parts (PARTS) are not stacked; a part whose phase is absent is
    left out. Any other timing/<name>_s is a phase, so a new one needs no change here."""
    timing = [k for k in keys if k.startswith(TIMING_PREFIX) and k.endswith("_s") and k != TOTAL_TIMING
              and not k.endswith(CPU_MARKER)]
    part_keys = {f"{TIMING_PREFIX}{p}_s": f"{TIMING_PREFIX}{ph}_s" for p, ph in PARTS.items()}
    phases = [k for k in timing if k not in part_keys]
    rank = {f"{TIMING_PREFIX}{p}_s": i for i, p in enumerate(PHASE_ORDER)}
    phases.sort(key=lambda k: (rank.get(k, len(rank)), k))
    parts = {k: part_keys[k] for k in sorted(timing) if k in part_keys and part_keys[k] in phases}
    return phases, parts


def _values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) if isinstance(r.get(key), (int, float)) else 0.0 for r in rows]


def format_progress(m: dict[str, Any]) -> dict[str, str]:
    """Headline numbers of a step record, for the progress bar's postfix."""
    out = {}
    for label, key, fmt in (("sft_loss", "sft_loss", "{:.3f}"), ("reward", "reward/mean", "{:.3f}"),
                            ("eval", None, "{:.3f}"),
                            ("step_s", TOTAL_TIMING, "{:.1f}"), ("sync_s", "timing/sync_s", "{:.2f}")):
        if key is None:  # the most specific eval reward present
            key = next((k for k in ("eval/reward/mean", "eval/reward") if k in m), None)
        v = m.get(key) if key else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[label] = fmt.format(v)
    return out


class ProgressLine:
    """tqdm bar over RL steps showing reward, last eval, step and sync time (desc="warm-up": over the supervised
    warm-up's steps, showing its loss)."""

    def __init__(self, total_steps: int, initial_step: int = 0, disable: bool = False, desc: str = "RL") -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total_steps, initial=initial_step, desc=desc, unit="step",
                         dynamic_ncols=True, disable=disable)
        self._last_eval: str | None = None

    def update(self, record: dict[str, Any]) -> str:
        """Advance one step; returns the postfix string shown (also handy for plain logs)."""
        post = format_progress(record)
        if "eval" in post:
            self._last_eval = post["eval"]
        elif self._last_eval is not None:  # eval runs every few steps; keep showing the last one
            post["eval"] = self._last_eval
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(1)
        return ", ".join(f"{k}={v}" for k, v in post.items())

    def close(self) -> None:
        self._bar.close()  # idempotent: the loop closes it before its summary, and again in `finally`
