"""What Ray leaves (issue 49, section 4), through real runs of `python -m colo.launch` on the tiny job: a run whose
GCS and raylet are killed ends with a checkpoint and one line instead of going on without a word, and none of its
processes is left when it ends; what a SIGKILL of the driver left is swept by the next start. Each test watches the
run's process tree while it runs (pid and start time: a reused pid is not counted). Ray's "Unhandled error" dump
after a rank died: tests/integration/test_faults_refs.py."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import clean_env, run_cli

from colo.host.procs import start_ticks
from colo.host.shm import process_tree

pytestmark = pytest.mark.slow

JOB = ["loop.sft_warmup_steps=2", "loop.eval_every=0", "loop.eval_samples=0", "data.prompts_per_step=4", "rollout.n=4",
       "data.eval_size=8"]
class Run:
    """`python -m colo.launch ARGS` in a process of its own, its process tree noted as it grows."""

    def __init__(self, run_dir: Path, *args: str, env: dict | None = None) -> None:
        self.run_dir = run_dir
        self.p = subprocess.Popen([sys.executable, "-m", "colo.launch", f"run.dir={run_dir}", *JOB, *args],
                                  env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.seen: dict[int, int] = {}

    def note(self) -> None:
        for pid in process_tree(self.p.pid)[1:]:
            ticks = start_ticks(pid)
            if ticks is not None:
                self.seen.setdefault(pid, ticks)

    def wait_for_step(self, step: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while step not in self.steps():
            assert self.p.poll() is None, f"the run ended first: {self.p.communicate()[1][-3000:]}"
            assert time.monotonic() < deadline, f"no step {step} after {timeout} s"
            self.note()
            time.sleep(0.5)
        self.note()

    def steps(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(ln)["step"] for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        deadline = time.monotonic() + timeout
        while self.p.poll() is None and time.monotonic() < deadline:
            self.note()
            time.sleep(0.5)
        _, err = self.p.communicate(timeout=30)
        return self.p.returncode, err

    def alive(self) -> list[str]:
        """The noted processes that still run (the same process: its start time matches)."""
        out = []
        for pid, ticks in self.seen.items():
            if start_ticks(pid) == ticks:
                try:
                    out.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes().split(bytes(1))[0].decode()}")
                except OSError:
                    pass
        return out


def test_a_lost_head_ends_the_run_with_a_checkpoint(tmp_path: Path) -> None:
    """The run's gcs_server and raylet are killed after step 0: the run went on without a word, 2x slower, and
    exited 0. Now the next call into the actors ends it: one line, the last trained step saved (the actors still
    answer), the --resume command, and none of its processes left."""
    run = Run(tmp_path / "run", "loop.steps=40", "placement.num_gpus=1")
    run.wait_for_step(0)
    head = [pid for pid in process_tree(run.p.pid)
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(bytes(1))[0].endswith((b"/gcs_server", b"/raylet"))]
    assert len(head) == 2, head
    for pid in head:
        os.kill(pid, signal.SIGKILL)
    code, err = run.finish(timeout=300)
    assert code == 1, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("colo: error:")]
    # both were killed: the line names whichever the watch saw gone first
    assert len(errors) == 1 and re.search(r"Ray's head of this run is gone: (gcs_server|raylet) \(pid \d+\)",
                                          errors[0]), err[-3000:]
    saved = sorted(p.name for p in (run.run_dir / "checkpoints").iterdir())
    assert saved and f"newest checkpoint {run.run_dir / 'checkpoints' / saved[-1]}" in err, (saved, err[-2000:])
    assert f"--resume run.dir={run.run_dir}" in err and max(run.steps()) < 39
    assert run.alive() == [], run.alive()


def test_what_a_killed_driver_left_is_swept_by_the_next_start(tmp_path: Path) -> None:
    """kill -9 of the driver alone: Ray's agents (ray::DashboardAgent, ray::RuntimeEnvAgent) and others outlived it
    for 30 s or more. The next `python -m colo.launch` (here one refused in its data check, a few seconds in) stops
    them by the ids the killed run recorded."""
    run = Run(tmp_path / "run", "loop.steps=40", "placement.num_gpus=1")
    run.wait_for_step(0)
    run.p.kill()
    run.p.wait()
    # no wait here: on an idle machine some of Ray's processes notice the driver's death within 2 s (2026-11-28),
    # the agents 30 s or more later (issue 49); right after the kill they all still run
    assert run.alive(), "nothing outlived the driver: the sweep below would prove nothing"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    r = run_cli(f"data.path={bad}", f"run.dir={tmp_path / 'next'}", timeout=120)
    assert r.returncode == 2 and "missing field 'answer'" in r.stderr, r.stderr
    deadline = time.monotonic() + 5
    while run.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run.alive() == [], run.alive()
