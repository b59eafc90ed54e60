"""The run dir: writable before anything starts, one run at a time, checkpoints whole or set aside."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import clean_env, tmpfs

from colo.config import ConfigError
from colo.run.rundir import RunDirError, check_writable, checkpoint_problem, held_by, lock, usable_checkpoint


def test_unwritable_run_dir_refused(tmp_path: Path) -> None:
    """Read-only and full filesystems are refused up front, naming the place and the fix."""
    check_writable(tmp_path / "runs" / "a")  # a dir that does not exist yet: its nearest ancestor is probed
    with tmpfs(tmp_path / "ro", "ro,size=4m") as ro:
        with pytest.raises(RunDirError, match=r"cannot write to .*/ro \(Read-only file system\); fix:"):
            check_writable(ro / "runs" / "x")
    with tmpfs(tmp_path / "full", "size=512k") as full:  # less than the 1 MiB probe: "full"
        with pytest.raises(RunDirError, match=r"No space left on device\); fix: free space there"):
            check_writable(full / "run")
        assert list(full.iterdir()) == [], "the probe is removed"


HOLD = "import sys, time\nfrom colo.run.rundir import lock\nlock(sys.argv[1])\nprint('locked', flush=True)\ntime.sleep(120)\n"


def test_second_launch_into_a_held_run_dir_refused(tmp_path: Path) -> None:
    from colo.config.loading import resolve_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("{}\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=clean_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert f"pid {holder.pid}" in held_by(run_dir)
        with pytest.raises(RunDirError, match=f"in use by another colo run \\(pid {holder.pid} on"):
            lock(run_dir)
        for resume in (False, True):  # a plain launch and a --resume alike, at config time
            with pytest.raises(ConfigError, match="is in use by another colo run .*; fix: wait for it to end"):
                resolve_run_dir(str(run_dir), resume)
    finally:
        holder.kill()
        holder.wait()
    assert held_by(run_dir) is None  # the kernel dropped the dead holder's lock
    lock(run_dir)
    assert resolve_run_dir(str(run_dir), True) == str(run_dir)  # this process's own lock does not refuse it


def checkpoint(run_dir: Path, step: int) -> Path:
    import torch.distributed.checkpoint as dcp

    path = run_dir / "checkpoints" / f"step_{step:06d}"
    dcp.save({"model": {"w": torch.arange(4096.0) + step}}, checkpoint_id=str(path))
    (path / "extra.json").write_text(json.dumps({"step": step, "data": {}}))
    return path


def test_damaged_newest_checkpoint_is_set_aside_or_refused(tmp_path: Path, capsys) -> None:
    """A truncated shard of the newest checkpoint: --resume goes back to the one before with one line; with no
    good one left it refuses naming the file. A step_*.tmp (a save cut off) is never a checkpoint."""
    from colo.materialize import set_aside_damaged

    old, new = checkpoint(tmp_path, 3), checkpoint(tmp_path, 7)
    (tmp_path / "checkpoints" / "step_000009.tmp").mkdir()
    assert usable_checkpoint(tmp_path) == (new, [])
    shard = next(new.glob("*.distcp"))
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    assert checkpoint_problem(new) == f"{shard} is truncated (100 of {size} bytes)"
    set_aside_damaged(tmp_path)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("colo: checkpoint step_000007 is damaged (") and \
        "resuming from step_000003 instead" in out[0], out
    assert usable_checkpoint(tmp_path) == (old, []) and (tmp_path / "checkpoints" / "step_000007.damaged").is_dir()
    next(old.glob("*.distcp")).unlink()
    with pytest.raises(ConfigError, match=r"every checkpoint .* is damaged; the newest, step_000003: .*distcp is "
                                          r"missing; fix:"):
        set_aside_damaged(tmp_path)


def test_a_clean_exit_leaves_no_lock_file_and_the_next_run_takes_the_dir(tmp_path: Path) -> None:
    from colo.run.rundir import unlock

    lock(tmp_path)
    assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on ")
    unlock(tmp_path)
    assert not (tmp_path / ".lock").exists() and held_by(tmp_path) is None
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], env=clean_env(), stdout=subprocess.PIPE,
                              text=True)
    try:  # a lock file removed and made again is a lock all the same
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=f"pid {holder.pid}"):
            lock(tmp_path)
    finally:
        holder.kill()
        holder.wait()


def test_checkpoints_pruned_to_the_newest_and_the_marked(tmp_path: Path) -> None:
    """run.keep_checkpoints: the newest N stay, and any with a `keep` file; a set-aside or unfinished one is not
    a checkpoint to count or remove; 0 keeps all."""
    from colo.run.rundir import complete_checkpoints, prune_checkpoints

    root = tmp_path / "checkpoints"
    for step in range(1, 8):
        (root / f"step_{step:06d}").mkdir(parents=True)
        (root / f"step_{step:06d}" / "extra.json").write_text("{}")
    (root / "step_000002" / "keep").touch()
    (root / "step_000001.damaged").mkdir()
    (root / "step_000008.tmp").mkdir()
    assert prune_checkpoints(tmp_path, 0) == []
    gone = prune_checkpoints(tmp_path, 3)
    assert [p.name for p in gone] == ["step_000001", "step_000003", "step_000004"]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000002", "step_000005", "step_000006",
                                                               "step_000007"]
    assert (root / "step_000001.damaged").is_dir() and (root / "step_000008.tmp").is_dir()
    assert prune_checkpoints(tmp_path, 3) == []


def test_ray_logs_copied_not_linked_and_empty_logs_removed(tmp_path: Path) -> None:
    """Ray's session folder lives in /tmp and goes with it: at the end the run copies what Ray wrote during this
    process's life (not a link into /tmp), and removes its own log files that stayed empty."""
    from colo.run import logs

    session = tmp_path / "ray" / "session_2026-11-28_11-34-36_1" / "logs"
    (session / "events").mkdir(parents=True)
    (session / "raylet.out").write_text("raylet\n")
    (session / "events" / "event_GCS.log").write_text("gcs\n")
    (session / "empty.err").touch()
    (session / "old.log").write_text("an earlier session's\n")
    os.utime(session / "old.log", (1, 1))  # written long before this process started
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "trainer-0.log").write_text("said something\n")
    (run_dir / "logs" / "trainer-1.log").touch()
    logs._RAY_LOGS[str(run_dir)] = session  # what note_ray_logs records while Ray runs
    copied = logs.keep_logs(run_dir)
    assert copied == run_dir / "logs" / "ray-session_2026-11-28_11-34-36_1" and not copied.is_symlink()
    assert sorted(str(p.relative_to(copied)) for p in copied.rglob("*") if p.is_file()) == [
        "events/event_GCS.log", "raylet.out"]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["ray-session_2026-11-28_11-34-36_1",
                                                                    "trainer-0.log"]
    assert logs.keep_logs(run_dir) is None  # once: nothing noted any more
