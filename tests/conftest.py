"""Shared test set-up: a clean COLO_* environment, GPU tests skipped without CUDA, a CLI runner, and the
default job run once per session (test_loop.py and test_readme.py both read it).

Markers (strict, declared in pyproject.toml): `gpu` (everything under tests/gpu/ gets it and is
skipped when torch sees no CUDA device) and `slow`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# what every RL step of a run logs to metrics.jsonl, in both placement modes (test_loop, test_readme)
STEP_KEYS = ["step", "reward/mean", "reward/std", "response_len/mean", "loss", "entropy", "clip_frac",
             "grad_norm", "logprob_diff/mean", "sync/tensors", "sync/bytes", "sync/verified"] + [
    f"timing/{p}_s" for p in ("rollout", "reward", "sleep", "train", "sync", "wake", "step")]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_dir = ROOT / "tests" / "gpu"
    for item in items:
        if gpu_dir in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
    if not any(item.get_closest_marker("gpu") for item in items):
        return  # importing torch just to skip nothing costs seconds
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


_SHM_SEEN: set[str] = set()  # colo_* / psm_* entries of /dev/shm when the session started
_SHM_OWNED: set[str] = set()  # psm_* segments colo took on (listed in a colo_<pid>_owned.json) during the session


def _shm_names() -> set[str]:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return set()
    names = {n for n in os.listdir(shm) if n.startswith(("colo_", "psm_"))}
    for n in names:
        if n.endswith("_owned.json"):
            try:
                _SHM_OWNED.update(json.loads((shm / n).read_text()))
            except (OSError, ValueError):
                pass
    return names


def pytest_sessionstart(session: pytest.Session) -> None:
    _SHM_SEEN.update(_shm_names())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The suite leaves colo's part of /dev/shm as it found it. Tests kill engines and trainers (ray.kill,
    failure tests, kill -9 of a run), as users' runs get killed; colo's answer is the sweep every run starts
    with (colo.host.shm), so the suite ends with one too, then fails on anything new of colo's that no live
    process holds: colo_* segments, and the psm_* segments colo took on (its engines register the vLLM queues
    their processes map). Other psm_* are vLLM's own (GPU hosts: processes vLLM starts outside an engine's
    process tree, e.g. Ray workers); they are named, not counted (tests/gpu/run.sh removes them)."""
    from colo.host.shm import alive, mapped_segments, owner_pid, sweep

    _shm_names()  # what colo took on, read before the sweep removes dead owners' lists
    sweep()
    new = _shm_names() - _SHM_SEEN
    if not new:
        return
    live = {n for p in os.listdir("/proc") if p.isdigit() for n in mapped_segments(int(p), children=False)}
    stale = sorted(n for n in new if n not in live and not (owner_pid(n) and alive(owner_pid(n))))
    left = [n for n in stale if n.startswith("colo_") or n in _SHM_OWNED]
    if len(stale) > len(left):
        print(f"\nconftest: vLLM left {len(stale) - len(left)} psm_* segment(s) no colo engine registered "
              f"(not colo's; not counted): {[n for n in stale if n not in left][:5]}", file=sys.stderr)
    if left:
        print(f"\nconftest: the suite left shared memory in /dev/shm: {left}", file=sys.stderr)
        session.exitstatus = 1


@pytest.fixture(autouse=True)
def _no_colo_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A COLO_* variable exported in the developer's shell must not change test results."""
    for name in list(os.environ):
        if name.startswith("COLO_"):
            monkeypatch.delenv(name)


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    imported: frozenset[str] = frozenset()  # top-level packages the process had imported when it exited


# Packages a `--help` or a config error must not import (prime-rl's rule: argparse and config first, so both
# answer in well under a second); tested by what the process imported, not by how long it took.
HEAVY = frozenset({"torch", "ray", "vllm", "transformers"})

# Runs `python -m MODULE ARGS` unchanged (exit code, stdout, stderr) and writes, at exit, every top-level
# package it imported into the file named by $IMPORTS_REPORT (not COLO_*: those are config overrides).
_IMPORTS_PROBE = """import atexit, os, runpy, sys
def _report():
    with open(os.environ["IMPORTS_REPORT"], "w") as f:
        f.write("\\n".join(sorted({m.partition(".")[0] for m in sys.modules})))
atexit.register(_report)
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without COLO_*, with the repo importable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLO_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def run_cli(*args: str, cwd: Path | str | None = None, env: dict[str, str] | None = None,
            timeout: float = 120, module: str = "colo.launch", imports: bool = False) -> CliResult:
    """Run `python -m colo.launch ARGS` (or `module`) as a user would, timed; with `imports`, also what the
    process imported (CliResult.imported), read at its exit."""
    import tempfile

    env = dict(env or clean_env())
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", module, *args]
        if imports:
            env["IMPORTS_REPORT"] = os.path.join(tmp, "imports")
            cmd = [sys.executable, "-c", _IMPORTS_PROBE, module, *args]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        seconds = time.perf_counter() - t0
        imported = frozenset(Path(env["IMPORTS_REPORT"]).read_text().split()) if imports else frozenset()
    return CliResult(p.returncode, p.stdout, p.stderr, seconds, imported)


@pytest.fixture(scope="session")
def default_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CliResult]:
    """The default job (`python -m colo.launch`, README command 1) to the end, once per session: what
    tests/test_loop.py checks learning on and tests/test_readme.py counts as that README command's run."""
    run_dir = tmp_path_factory.mktemp("default-job") / "run"
    return run_dir, run_cli(f"run.dir={run_dir}", timeout=900)  # measured ~90 s on an idle 2-core machine
