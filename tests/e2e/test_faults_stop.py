"""Stopping and breaking a real run (`python -m colo.launch`): Ctrl-C, a closed terminal (SIGHUP), a second launch
into the same run dir, a damaged newest checkpoint, a disk that fills mid-run. Each ends with one line, saves what
the trainers hold, and leaves no process and no /dev/shm segment of the run behind.

Two small jobs on one trainer/engine pair (~1-2 min each on 2 cores): the first is stopped with Ctrl-C after
step 1 (a second launch into its dir is refused meanwhile); its newest checkpoint is then truncated and the run
resumed on a terminal of its own (a pty), which falls back to the checkpoint before and is stopped by closing that
terminal: the pty hangs up and SIGHUP goes to the run's process group, Ray's head included, as a shell sends it
(a SIGTERM takes the same path: colo.run.signals; tests/unit/test_faults_signals.py). The full-disk job (root only:
a tmpfs) is a third.
"""
from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import clean_env, run_cli

from colo.host.shm import SHM, owner_pid, process_tree
from colo.run.rundir import checkpoint_problem, complete_checkpoints

pytestmark = pytest.mark.slow

JOB = ["loop.steps=8", "loop.sft_warmup_steps=2", "loop.eval_every=0", "loop.eval_samples=0", "loop.checkpoint_every=1",
       "data.prompts_per_step=4", "rollout.n=4", "data.eval_size=8", "placement.num_gpus=1"]


def launch(run_dir: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "colo.launch", f"run.dir={run_dir}", *JOB, *args], env=clean_env(),
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class OnTerminal:
    """`python -m colo.launch ARGS` on a terminal of its own (a pty, the run its session leader), as from a shell;
    what it shows is read as it comes (a full pty would block the run)."""

    def __init__(self, run_dir: Path, *args: str) -> None:
        pid, self.master = pty.fork()
        if pid == 0:  # the child: exec at once, SIGHUP as a terminal's shell leaves it (`nohup pytest` ignores it)
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            os.execve(sys.executable, [sys.executable, "-m", "colo.launch", f"run.dir={run_dir}", *JOB, *args],
                      clean_env())
        self.pid, self.returncode, self.shown = pid, None, b""
        self._open = True
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while self._open:
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.shown += os.read(self.master, 65536)
                except OSError:  # the run ended: its side of the pty is closed
                    return

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def communicate(self) -> tuple[str, str]:
        return self.shown.decode(errors="replace"), ""

    def hang_up(self) -> None:
        """The terminal window closes (the pty hangs up), and its shell sends SIGHUP to the job's process group."""
        self._open = False
        self._reader.join()
        os.close(self.master)
        os.killpg(self.pid, signal.SIGHUP)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            assert time.monotonic() < deadline, f"the run did not end {timeout} s after the hangup"
            time.sleep(0.3)
        return self.returncode


def steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(ln)["step"] for ln in lines if ln.strip()]


def wait_for(p: subprocess.Popen, done, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if p.poll() is not None:
            out, err = p.communicate()
            pytest.fail(f"the run ended (exit {p.returncode}) before {what}\n{out[-2000:]}\n{err[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.3)


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # zombie: dead
    except OSError:
        return True


def assert_nothing_left(pids: list[int]) -> None:
    deadline = time.monotonic() + 30
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.3)
    left = [f"{p} {Path(f'/proc/{p}/cmdline').read_text()[:80]!r}" for p in pids if not gone(p)]
    assert not left, f"processes of the run left behind: {left}"
    segments = [n for n in os.listdir(SHM) if owner_pid(n) in set(pids)]
    assert not segments, f"/dev/shm segments of the run left behind: {segments}"
    import tempfile  # the engines' scratch folders, where vLLM's vllm_dist_* rendezvous files go (colo.host.shm)

    scratch = [n for n in os.listdir(tempfile.gettempdir()) if n.endswith("_tmp") and owner_pid(n) in set(pids)]
    assert not scratch, f"scratch folders of the run left behind: {scratch}"


def stop_line(err: str, sig: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("colo: stopped by")]
    assert len(lines) == 1 and lines[0].startswith(f"colo: stopped by {sig}: "), err[-3000:]
    return lines[0]


def test_ctrl_c_second_launch_damaged_checkpoint_closed_terminal(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    p = launch(run_dir)
    wait_for(p, lambda: 1 in steps(run_dir), "step 1")
    second = run_cli("--resume", f"run.dir={run_dir}", timeout=120)  # into the running run's dir
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert "is in use by another colo run (pid" in second.stderr and "fix:" in second.stderr
    pids = process_tree(p.pid)
    os.killpg(p.pid, signal.SIGINT)  # a terminal's Ctrl-C: the driver's whole process group
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, err[-3000:]
    line = stop_line(err, "SIGINT")
    last = max(steps(run_dir))
    assert f"saved step {last} in {run_dir / 'checkpoints' / f'step_{last:06d}'}" in line, (line, steps(run_dir))
    assert line.endswith(f"continue with: .venv/bin/python -m colo.launch --resume run.dir={run_dir}")
    assert_nothing_left(pids)
    saved = complete_checkpoints(run_dir)
    assert saved[-1].name == f"step_{last:06d}" and not any(checkpoint_problem(c) for c in saved)
    assert not list((run_dir / "checkpoints").glob("*.tmp"))

    # one shard of the newest checkpoint cut short: --resume says so and goes back to the one before
    shard = next(saved[-1].glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    t = OnTerminal(run_dir, "--resume")
    redone = run_dir / "checkpoints" / f"step_{last:06d}"  # once the damaged one is set aside, saved again
    aside = redone.with_name(redone.name + ".damaged")
    wait_for(t, lambda: aside.is_dir() and (redone / "extra.json").exists(), f"step {last} redone and saved")
    pids = process_tree(t.pid)
    shown = t.shown.decode(errors="replace")
    t.hang_up()
    assert t.wait(timeout=300) == 129, (shown[-2000:], (run_dir / "error.log").read_text()[-2000:])
    damaged = [ln for ln in shown.splitlines() if "is damaged" in ln]
    assert len(damaged) == 1 and damaged[0].startswith(f"colo: checkpoint step_{last:06d} is damaged ({shard} is "
                                                       "truncated") and \
        f"resuming from step_{last - 1:06d} instead" in damaged[0], shown[-2000:]
    # the terminal is gone: the line is in the run dir, and it says the last finished step was saved
    ends = [ln.split(" ", 3)[3] for ln in (run_dir / "error.log").read_text().splitlines() if "stopped by" in ln]
    assert [e.split(":")[1] for e in ends] == [" stopped by SIGINT", " stopped by SIGHUP"], ends  # each launch's end
    line = stop_line(ends[-1], "SIGHUP")
    last = max(steps(run_dir))
    assert f"saved step {last} in {run_dir / 'checkpoints' / f'step_{last:06d}'}" in line, (line, steps(run_dir))
    assert "continue with: .venv/bin/python -m colo.launch --resume" in line
    assert_nothing_left(pids)
    assert not any(checkpoint_problem(c) for c in complete_checkpoints(run_dir))


def test_disk_full_mid_run(tmp_path: Path) -> None:
    """run.dir on a 64 MiB filesystem, room for the run's three kept checkpoints (run.keep_checkpoints, checked at
    start: colo.plan.disk), which something else fills once step 0 is saved, leaving 4 MiB: less than one ~9 MB
    checkpoint. The run ends with one line naming the full disk, keeps no half-written checkpoint, and leaves nothing
    behind."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a small filesystem")
    try:
        run_dir = disk / "run"
        p = launch(run_dir)
        wait_for(p, (run_dir / "checkpoints" / "step_000000" / "extra.json").exists, "step 0 saved")
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as f:  # the run writes meanwhile: ENOSPC
            for _ in range(max(0, shutil.disk_usage(disk).free - (4 << 20)) >> 20):
                f.write(b"\0" * (1 << 20))
        pids = process_tree(p.pid)
        out, err = p.communicate(timeout=600)
        assert p.returncode == 1, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        errors = [ln for ln in err.splitlines() if ln.startswith("colo: error:")]
        assert len(errors) == 1 and errors[0].startswith(f"colo: error: the disk of {run_dir} is full ("), err[-3000:]
        assert f"--resume run.dir={run_dir}" in err
        assert_nothing_left(pids)
        saved = complete_checkpoints(run_dir)
        assert saved and not any(checkpoint_problem(c) for c in saved)
        assert not list((run_dir / "checkpoints").glob("*.tmp")), "a half-written checkpoint was left"
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["umount", "-l", str(disk)], check=False)
