"""Re-measure every learning test's job (tests/learning.py JOBS) over seeds and kernel settings, with controls that
must not pass, rewrite tests/learning_table.json, and print each assertion's margin per trajectory.

    .venv/bin/python tests/learning_margins.py                       # the whole plan below, one job at a time
    .venv/bin/python tests/learning_margins.py --print               # margins from the table, nothing run
    .venv/bin/python tests/learning_margins.py --jobs lora --keep    # one job; skip what this CPU has measured

Run it when a learning test is added, or a default, a config or the sampling streams change. Each job runs as its
test runs it (the same arguments, JOBS[...].args) through the real CLI (`python -m colo.launch`, a process of its
own), with run.seed=S, and with the kernels torch and oneDNN choose held or not (KERNELS: ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA). A setting changes the float32 results' last bits; it is another trajectory only where that
flips a sampled token, which a short RL run from a cached base may never do (the script warns where two settings
gave one trajectory: the same training rewards step by step); seeds always give another (other prompts, other
samples, and another tiny model and warm-up). Controls, the same job with a policy that does not learn:
- frozen: trainer.lr=1e-30, below every weight's rounding step (trainer.lr must be > 0), so the policy stays the
  warm-up's; its sampled evals repeat the warm-up's exactly and its training reward moves only by the batches;
- drift: the job's own learning rate on exact_match's scores shuffled across each batch (shuffled_exact_match):
  the logged training reward and evals keep the task's mean, but which sample scored carries no signal, so GRPO
  moves the policy by steps of the usual size in directions unrelated to the task.
The rule must fail every control (exit status 1 otherwise); the report marks a control's statistic that reached
its bound (`over`), since then only the other statistic rejects it. Rows of other CPUs stay in the table;
rows of this CPU are replaced as they are re-measured (written after each run, so an interrupted run keeps them);
a job whose resolved config changed loses its older rows.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from learning import ASSERTED, JOBS, TABLE, bounds, load_table, run_config, statistics  # noqa: E402

KERNEL_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
KERNELS = {  # a setting's name -> the variables it sets (unset: the library picks the CPU's best)
    "default": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
}
CONTROLS = {"frozen": ("trainer.lr=1e-30",), "drift": ("algo.rewards=[learning_margins:shuffled_exact_match]",)}
# (role, seeds, kernel settings) measured by default: seven seeds, three of them under AVX2 kernels too, and the
# controls under both
PLAN = [("learns", (0, 1, 2, 3, 4, 5, 6), ("default",)), ("learns", (0, 1, 2), ("avx2",)),
        ("frozen", (0,), ("default",)), ("frozen", (1,), ("avx2",)),
        ("drift", (0, 1), ("default", "avx2"))]
JOB_TIMEOUT_S = 3600


def shuffled_exact_match(responses: list[str], answers: list[str], prompts: list[str]) -> list[float]:
    """The drift control's reward: exact_match's scores permuted across the batch by a generator seeded with the
    batch itself (deterministic per trajectory). The batch's mean, what the run logs as reward/mean and as its
    evals, is the task's; the assignment of scores to samples, all GRPO learns from, is noise."""
    from colo.algo.rewards import exact_match

    scores = list(exact_match(responses, answers, prompts))
    digest = hashlib.sha256("\0".join([*prompts, *responses]).encode()).digest()
    random.Random(int.from_bytes(digest[:8], "little")).shuffle(scores)
    return scores


def cpu() -> tuple[str, str]:
    """(model: lscpu's name with family and model number, the ISA that picks kernels)."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    isa = ["AMX" if "amx_bf16" in flags else "no AMX"]
    isa += [name for flag, name in (("avx512_fp16", "AVX512-FP16"), ("avx512_bf16", "AVX512-BF16"))
            if flag in flags] or (["AVX512"] if "avx512f" in flags else ["AVX2"] if "avx2" in flags else [])
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})",
            ", ".join(reversed(isa)))


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return head.strip() + ("+changes" if dirty else "")


class CpuClock:
    """CPU-seconds of a process and every process it starts (Ray's daemons and actors are not its waited-for
    children, so getrusage misses them): a cgroup of its own (v1 cpuacct or v2), where this user may make one."""

    def __init__(self, name: str) -> None:
        self.dir: Path | None = None
        for root, usage in ((Path("/sys/fs/cgroup/cpuacct"), "cpuacct.usage"), (Path("/sys/fs/cgroup"), "cpu.stat")):
            if (root / usage).exists() or (root / "cgroup.controllers").exists():
                try:
                    (root / name).mkdir(exist_ok=True)
                    self.dir, self.usage = root / name, usage
                    break
                except OSError:
                    continue

    def join(self) -> None:  # preexec_fn: the child moves itself in before it execs
        if self.dir is not None:
            (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def seconds(self) -> float | None:
        if self.dir is None or not (self.dir / self.usage).exists():
            return None
        text = (self.dir / self.usage).read_text()
        if self.usage == "cpuacct.usage":
            return int(text) / 1e9
        return int(dict(line.split() for line in text.splitlines())["usage_usec"]) / 1e6

    def remove(self) -> None:
        if self.dir is not None:
            with contextlib.suppress(OSError):
                self.dir.rmdir()


def measure(job: str, role: str, seed: int, setting: str, work: Path) -> tuple[dict, list[dict], float | None]:
    """Run the job once through the CLI; (its resolved config, its metrics rows, the CPU-seconds of its processes)."""
    run_dir = work / f"{job}-{role}-{seed}-{setting}"
    args = [*JOBS[job].args, f"run.dir={run_dir}", f"run.seed={seed}", *CONTROLS.get(role, ())]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLO_") and k not in KERNEL_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    env.update(KERNELS[setting])
    log = work / f"{run_dir.name}.log"
    clock = CpuClock(f"learning-margins-{os.getpid()}")
    try:
        with log.open("w") as out:
            p = subprocess.run([sys.executable, "-m", "colo.launch", *args], cwd=ROOT, env=env, stdout=out,
                               stderr=subprocess.STDOUT, timeout=JOB_TIMEOUT_S, preexec_fn=clock.join)
        cpu_s = clock.seconds()
    finally:
        clock.remove()
    if p.returncode != 0:
        raise SystemExit(f"learning_margins: {' '.join(args)} exited {p.returncode}:\n{log.read_text()[-3000:]}")
    from colo.run.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    config = run_config(run_dir)
    shutil.rmtree(run_dir)
    return config, rows, cpu_s


def record(table: dict, job: str, config: dict, row: dict) -> None:
    """Put a trajectory into the table (replacing this CPU's row of the same role, seed and kernels) and write it."""
    entry = table["jobs"].setdefault(job, {"test": JOBS[job].test, "args": list(JOBS[job].args), "config": config,
                                           "trajectories": []})
    if row["role"] == "learns" and entry["config"] != config:
        changed = sorted(k for k in config.keys() | entry["config"].keys()
                         if config.get(k) != entry["config"].get(k))
        print(f"learning_margins: job {job}'s config changed ({', '.join(changed)}): its "
              f"{len(entry['trajectories'])} older trajectories are dropped", flush=True)
        entry.update(config=config, trajectories=[])
    entry["test"], entry["args"] = JOBS[job].test, list(JOBS[job].args)
    key = ("role", "seed", "kernels", "cpu")
    entry["trajectories"] = [t for t in entry["trajectories"] if any(t[k] != row[k] for k in key)] + [row]
    entry["trajectories"].sort(key=lambda t: (t["role"] != "learns", t["role"], t["cpu"], sorted(t["kernels"].items()),
                                              t["seed"]))
    TABLE.write_text(dump(table))


def dump(table: dict) -> str:
    """The table as JSON, one line per list of numbers (a trajectory's series stay readable in a diff)."""
    text = json.dumps(table, indent=1)
    return re.sub(r"\[\s*(-?[\d.e+-]+(?:,\s*-?[\d.e+-]+)*)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def shortened(table: dict, steps: int) -> dict:
    """The table as if each job ran its first `steps` steps: each trajectory's statistics from its kept series (an
    L-step job is the first L steps of a longer one); trajectories without series, or shorter ones, are left out."""
    out = {"jobs": {}}
    for job, entry in table["jobs"].items():
        kept = []
        for t in entry["trajectories"]:
            if len(t.get("rewards", [])) < steps:
                continue
            (_, sampled, greedy), evals = t["evals"][0], [e for e in t["evals"][1:] if e[0] < steps]
            rows = [{"step": -1, "eval/sampled_reward": sampled, "eval/reward": greedy}]
            rows += [{"step": i, "reward/mean": r} for i, r in enumerate(t["rewards"][:steps])]
            for step, sampled, greedy in evals:
                rows[step + 1].update({"eval/sampled_reward": sampled, "eval/reward": greedy})
            kept.append({**t, "stats": statistics(rows)})
        out["jobs"][job] = {**entry, "args": [*entry["args"], f"(first {steps} steps)"], "trajectories": kept}
    return out


def report(table: dict, jobs: list[str]) -> int:
    """Print each trajectory's margins (value minus bound) for each asserted statistic and whether the rule passes it;
    1 when it fails a learner or passes a control (its test would pass for a policy that does not learn), else 0.
    A control's statistic at or over its bound is marked `over`: the rule rejects the control through the other."""
    bad = 0
    for job in jobs:
        entry = table["jobs"].get(job)
        if entry is None:
            print(f"\n{job}: not measured")
            bad = 1
            continue
        try:
            limit = bounds(job, table)
        except AssertionError as e:
            print(f"\n{job}: {e}")
            bad = 1
            continue
        print(f"\n{job} ({entry['test']}; {' '.join(entry['args'])}): bounds "
              + ", ".join(f"{k} >= {v:+.4f}" for k, v in limit.items()))
        print(f"  {'role':7} {'seed':>4} {'kernels':12} " + " ".join(f"{k + ' (margin)':>26}" for k in ASSERTED)
              + f" {'rule':>6} {'greedy_eval':>11} {'trend':>7} {'CPU-s':>6}  cpu")
        for t in entry["trajectories"]:
            s, learns = t["stats"], t["role"] == "learns"
            margins = {k: s[k] - limit[k] for k in ASSERTED}
            passes = all(m >= 0 for m in margins.values())
            bad |= passes != learns
            cells = [f"{s[k]:+.4f} ({m:+.4f}){' over' if m >= 0 and not learns else '     '}"
                     for k, m in margins.items()]
            verdict = ("passes" if passes else "FAILS") if learns else ("PASSES" if passes else "fails")
            print(f"  {t['role']:7} {t['seed']:>4} {t['setting']:12} " + " ".join(f"{c:>26}" for c in cells)
                  + f" {verdict:>6} {s['greedy_eval']:>+11.4f} {s['training_trend']:>+7.4f} {t['cpu_s'] or 0:>6.0f}  "
                    f"{t['cpu']}, {t['isa']}")
        same = {}
        for t in entry["trajectories"]:
            same.setdefault((t["role"], t["seed"], t["cpu"], t["digest"]), []).append(t["setting"])
        for (role, seed, _, _), settings in same.items():
            if len(settings) > 1:
                print(f"  warning: {role} seed {seed}: kernel settings {settings} gave one trajectory")
        controls = [t for t in entry["trajectories"] if t["role"] != "learns"]
        learners = [t for t in entry["trajectories"] if t["role"] == "learns"]
        if controls:  # how far apart learners and controls are, for the training reward's two statistics
            for k in ("training_reward", "training_trend"):
                lo, hi = min(t["stats"][k] for t in learners), max(t["stats"][k] for t in controls)
                print(f"  {k}: smallest over learners {lo:+.4f}, largest over controls {hi:+.4f}")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of {', '.join(JOBS)}")
    ap.add_argument("--print", action="store_true", help="print the margins from the table; run nothing")
    ap.add_argument("--keep", action="store_true", help="skip trajectories this CPU has in the table already")
    ap.add_argument("--at", type=int, default=None, metavar="STEPS",
                    help="with --print: the margins had each job run its first STEPS steps (read off the table)")
    ap.add_argument("--plan", default=None, help="ROLE:SEEDS:SETTINGS;... instead of the default plan, e.g. "
                    "'learns:0-4:default,avx2;drift:0:default' (settings: " + ", ".join(KERNELS) + ")")
    a = ap.parse_args(argv)
    jobs = [j for j in a.jobs.split(",") if j]
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        ap.error(f"unknown job(s) {unknown}; the jobs: {', '.join(JOBS)}")
    table = load_table()
    if a.print:
        return report(table if a.at is None else shortened(table, a.at), jobs)
    plan = PLAN if a.plan is None else [_plan_item(p) for p in a.plan.split(";") if p]
    model, isa = cpu()
    work = Path(tempfile.mkdtemp(prefix="learning-"))
    try:
        for job in jobs:
            for role, seeds, settings in plan:
                for setting in settings:
                    for seed in seeds:
                        kernels = {v: KERNELS[setting].get(v, "default") for v in KERNEL_VARS}
                        have = [t for t in table["jobs"].get(job, {}).get("trajectories", [])
                                if (t["role"], t["seed"], t["kernels"], t["cpu"]) == (role, seed, kernels, model)]
                        if a.keep and have:
                            continue
                        t0 = time.monotonic()
                        config, rows, cpu_s = measure(job, role, seed, setting, work)
                        stats = statistics(rows)
                        rewards = [r["reward/mean"] for r in rows[1:]]
                        record(table, job, config, {
                            "role": role, "seed": seed, "setting": setting, "kernels": kernels, "cpu": model,
                            "isa": isa, "stats": {k: round(v, 6) for k, v in stats.items()},
                            "digest": hashlib.sha256(json.dumps(rewards).encode()).hexdigest()[:12],
                            # the run itself, so a shorter job's statistics can be read off it (no lr schedule: an
                            # L-step job is the first L steps of this one)
                            "rewards": [round(x, 6) for x in rewards],
                            "evals": [[r["step"], round(r["eval/sampled_reward"], 6), round(r["eval/reward"], 6)]
                                      for r in rows if "eval/sampled_reward" in r],
                            "cpu_s": None if cpu_s is None else round(cpu_s),
                            "date": datetime.date.today().isoformat(), "commit": commit()})
                        print(f"learning_margins: {job} {role} seed {seed} {setting}: "
                              + ", ".join(f"{k} {v:+.4f}" for k, v in stats.items())
                              + f" ({time.monotonic() - t0:.0f} s, {cpu_s or 0:.0f} CPU-s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(table, jobs)


def _plan_item(text: str) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
    role, seeds, settings = text.split(":")
    if role != "learns" and role not in CONTROLS:
        raise SystemExit(f"learning_margins: role {role!r} is not learns or one of {', '.join(CONTROLS)}")
    lo, _, hi = seeds.partition("-")
    names = tuple(settings.split(","))
    if any(n not in KERNELS for n in names):
        raise SystemExit(f"learning_margins: kernel settings are {', '.join(KERNELS)}, not {settings}")
    return role, tuple(range(int(lo), int(hi or lo) + 1)), names


if __name__ == "__main__":
    sys.exit(main())
