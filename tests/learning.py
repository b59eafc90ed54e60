"""One rule for every test that asserts a job learns, with bounds computed from measured trajectories.

    assert_learns("default", run_dir, rows)        # in the test that owns JOBS["default"]
    .venv/bin/python tests/learning_margins.py     # re-measures every job below, rewrites TABLE, prints margins

A tiny job's learning curve is one trajectory among many: each seed gives another, and so may each choice of kernels
torch and oneDNN make (the CPU kind, or ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA), so a bound read off one run turns
the suite red on the next machine (issues 43, 52). Hence:

- What is asserted: the two quantities GRPO maximizes, each averaged so that one lucky or unlucky batch does not
  decide it.
  - `sampled_eval`: the held-out eval sampled at the rollout temperature (eval/sampled_reward; fixed seed, so every
    eval draws the same random streams), the mean of the evals in the run's second half minus the warm-up's eval.
  - `training_reward`: the training reward (reward/mean) of the last 10 steps minus that of the first 10.
  The greedy eval is not asserted: GRPO does not maximize it, it swings by about 0.1 from one eval to the next (64
  prompts), and on an Intel Xeon it fell below its warm-up while the sampled eval rose (issue 52). It is kept in
  TABLE (greedy_eval), beside the least-squares trend of the training reward (training_trend), for reading.
- The rule: each bound is half the smallest value that statistic took over the job's learning trajectories in
  TABLE (at least MIN_TRAJECTORIES distinct ones, measured under at least MIN_KERNEL_SETTINGS kernel settings). A
  job whose smallest value is not positive has no bound: it does not learn on every trajectory, and must run longer.
  Kernel settings change a float32 run's last bits; whether that changes a sampled token, and so the trajectory,
  depends on the job (the table says which: learning_margins.py warns where two settings gave one trajectory), so
  distinct trajectories come from seeds first.
- What it must reject: learning_margins.py also runs controls, the same job with a policy that does not learn
  (`frozen`: trainer.lr below every weight's rounding step; `drift`: the job's own learning rate on rewards
  shuffled across each batch, so the logged rewards are the task's but the samples they are assigned to carry no
  signal). The rule fails every control, the sampled eval alone rejects each (tests/unit/test_learning_rule.py);
  the training reward alone need not, since a frozen policy's 10-step means move with the prompts by about as much
  as its bound. The margins of both are printed beside the learners'.
- The table holds the job's resolved config as it was measured; a test whose run was configured otherwise fails
  and names the keys that differ, since its bounds were not measured for it: re-run learning_margins.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TABLE = Path(__file__).resolve().parent / "learning_table.json"
MIN_TRAJECTORIES = 5
MIN_KERNEL_SETTINGS = 2
ASSERTED = ("sampled_eval", "training_reward")
WINDOW = 10  # steps in each of the training reward's two means

DEFAULT_JOB_STEPS = 80  # the default job's steps in the suite (tests/conftest.py default_job)
LORA_JOB_STEPS = 60  # at 30 the training reward rose no more than a frozen policy's (tests/README.md, "Learning")


@dataclass(frozen=True)
class LearningJob:
    test: str  # the test that asserts it learns (it calls assert_learns with this job's name)
    args: tuple[str, ...]  # `python -m colo.launch` arguments as the test runs the job, run.dir aside


JOBS = {
    "default": LearningJob("tests/e2e/test_loop.py::test_default_job_learns", (f"loop.steps={DEFAULT_JOB_STEPS}",)),
    "lora": LearningJob("tests/e2e/test_lora_job.py::test_lora_job_learns",
                        ("--config", "configs/tiny-cpu-lora.yaml", f"loop.steps={LORA_JOB_STEPS}")),
}


def statistics(rows: list[dict]) -> dict[str, float]:
    """A run's learning statistics from its metrics.jsonl rows (the warm-up's eval first, step -1)."""
    warm, steps = rows[0], rows[1:]
    if warm["step"] != -1 or "eval/sampled_reward" not in warm:
        raise ValueError(f"the run's first record is not the warm-up's sampled eval: {warm}")
    if len(steps) < 2 * WINDOW:
        raise ValueError(f"{len(steps)} RL steps; the training reward's two {WINDOW}-step means need {2 * WINDOW}")
    later = [r for r in steps if "eval/sampled_reward" in r and r["step"] >= len(steps) // 2]
    if not later:
        raise ValueError("no sampled eval in the run's second half (loop.eval_every, loop.eval_samples)")
    train = [r["reward/mean"] for r in steps]
    return {
        "sampled_eval": _mean([r["eval/sampled_reward"] for r in later]) - warm["eval/sampled_reward"],
        "training_reward": _mean(train[-WINDOW:]) - _mean(train[:WINDOW]),
        "greedy_eval": _mean([r["eval/reward"] for r in later]) - warm["eval/reward"],
        "training_trend": _slope(train) * len(train),
    }


def run_config(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config (<run.dir>/config.yaml) as flat `key: value`, its own folder written as <run.dir>;
    run.* left out (the seed and the run's place vary between trajectories and change nothing else)."""
    import yaml

    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = node.replace(str(run_dir), "<run.dir>") if isinstance(node, str) else node

    walk("", yaml.safe_load((run_dir / "config.yaml").read_text()))
    return {k: v for k, v in flat.items() if not k.startswith("run.")}


def load_table(path: Path = TABLE) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"jobs": {}}


def bounds(job: str, table: dict | None = None) -> dict[str, float]:
    """Each asserted statistic's bound by the rule: half the smallest value over the job's learning trajectories."""
    entry = (table or load_table())["jobs"].get(job)
    learners = [t for t in (entry or {}).get("trajectories", []) if t["role"] == "learns"]
    settings = {tuple(sorted(t["kernels"].items())) for t in learners}
    distinct = {tuple(sorted(t["stats"].items())) for t in learners}  # a setting may leave every sample as it was
    if len(distinct) < MIN_TRAJECTORIES or len(settings) < MIN_KERNEL_SETTINGS:
        raise AssertionError(f"{TABLE.name} holds {len(distinct)} distinct learning trajectories of job {job!r} "
                             f"under {len(settings)} kernel setting(s); the rule needs {MIN_TRAJECTORIES} under "
                             f"{MIN_KERNEL_SETTINGS}: fix: .venv/bin/python tests/learning_margins.py --jobs {job}")
    out = {}
    for stat in ASSERTED:
        low = min(t["stats"][stat] for t in learners)
        if low <= 0:
            raise AssertionError(f"job {job!r}: {stat} was {low:+.3f} on a trajectory of {TABLE.name}: the job does "
                                 "not learn on every trajectory; run it longer, then re-measure")
        out[stat] = low / 2
    return out


def assert_learns(job: str, run_dir: Path, rows: list[dict]) -> dict[str, float]:
    """The job's run (its run dir and metrics rows) learned, by the rule above; returns its statistics."""
    table = load_table()
    entry = table["jobs"].get(job)
    if entry is None:
        raise AssertionError(f"job {job!r} is not in {TABLE.name}; fix: .venv/bin/python tests/learning_margins.py "
                             f"--jobs {job}")
    ran, measured = run_config(run_dir), entry["config"]
    changed = sorted(k for k in ran.keys() & measured.keys() if ran[k] != measured[k])
    assert not changed, (f"job {job!r} ran with {', '.join(f'{k}={ran[k]!r}' for k in changed)}, but its bounds were "
                         f"measured with {', '.join(f'{k}={measured[k]!r}' for k in changed)} ({TABLE.name}); fix: "
                         f".venv/bin/python tests/learning_margins.py --jobs {job}")
    stats, limit = statistics(rows), bounds(job, table)
    low = {k: stats[k] for k in ASSERTED if stats[k] < limit[k]}
    seen = ", ".join(f"{k} {stats[k]:+.3f} (bound {limit[k]:+.3f})" for k in ASSERTED)
    evals = [(r["step"], r["eval/sampled_reward"], r["eval/reward"]) for r in rows if "eval/sampled_reward" in r]
    assert not low, (f"job {job!r} did not learn: {seen}; the bounds are half the smallest rise over the trajectories "
                     f"of {TABLE.name}. Training reward {[round(r['reward/mean'], 3) for r in rows[1:]]}; evals "
                     f"(step, sampled, greedy) {evals}")
    return stats


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _slope(ys: list[float]) -> float:
    """Least-squares slope of ys against their index."""
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))
