"""The run dir as a resource: writable before anything starts, held by one colo run at a time, and its
checkpoints whole or not there.

    check_writable("runs/tiny-cpu/20261125-101500")   # OSError-free, or RunDirError naming the fix
    lock("runs/.../20261125-101500")                  # held until this process exits; RunDirError when taken
    unlock("runs/.../20261125-101500")                # given up and <run.dir>/.lock removed (a clean exit)
    usable_checkpoint(run_dir) -> (path, skipped)     # the newest checkpoint whose files are all there
    prune_checkpoints(run_dir, keep=3)                # the newest 3 and those marked with a `keep` file stay

The lock is an advisory flock on <run.dir>/.lock, which the driver holds until it exits (the kernel drops it
when the process dies, kill -9 included, so a stale lock cannot outlive its run); a run that ends normally
removes the file too, so a finished run dir holds no lock file naming a dead pid. Two launches into one run
dir used to run side by side, every step logged twice.

Checkpoints: a run keeps the newest run.keep_checkpoints (at 30B scale each is ~370 GB of params and AdamW state)
and every one a user marks by creating a file named `keep` in it (`touch <run.dir>/checkpoints/step_000099/keep`).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import IO

LOCK_NAME = ".lock"
STEP_DIR = re.compile(r"step_\d{6}$")  # a complete checkpoint's name; step_*.tmp is one being written
PROBE_BYTES = 1 << 20  # a run dir that cannot take 1 MiB cannot take a checkpoint or a metrics record either
_held: dict[str, IO[str]] = {}  # open lock files: closing one would release its lock


class RunDirError(Exception):
    """The run dir cannot be used: one line naming it and the fix (colo.launch turns it into a config error)."""


def check_writable(run_dir: str | Path) -> None:
    """Write and remove a 1 MiB probe in run_dir, or in its nearest existing ancestor when it does not exist yet:
    a read-only filesystem, a missing permission or a full disk is refused before anything starts."""
    run_dir = Path(run_dir).absolute()
    where = run_dir
    while not where.exists():
        where = where.parent
    probe = where / f".colo-write-probe-{os.getpid()}"
    try:
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(where))
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise RunDirError(f"run.dir={run_dir}: cannot write to {where} ({e.strerror or e}); fix: "
                          f"{'free space there' if e.errno == errno.ENOSPC else 'make it writable'}, or set "
                          "run.dir to a writable place (e.g. run.dir=/tmp/runs/{time})") from e
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def lock(run_dir: str | Path) -> None:
    """Take <run_dir>/.lock for this process (until it exits); RunDirError when another run holds it."""
    path = Path(run_dir) / LOCK_NAME
    if str(path) in _held:
        return
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            who = f.read().strip()
            f.close()
            raise RunDirError(f"run.dir={run_dir} is in use by another colo run ({who or 'its lock is held'}); "
                              "fix: wait for it to end (or stop it), or give this one another run.dir") from None
        try:  # the file we locked is still the one at `path`: unlock() of the run before us may have removed it
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _held[str(path)] = f


def unlock(run_dir: str | Path) -> None:
    """Give up this process's lock on run_dir (taken by lock()); a no-op when it holds none. For a process that
    runs several jobs in turn (colo.launch.main's `clusters`: the test suite's warm clusters); a process that exits
    gives its locks up anyway."""
    path = Path(run_dir) / LOCK_NAME
    f = _held.pop(str(path), None)
    if f is not None:
        try:
            path.unlink()  # while still held: a launch waiting on this file sees it gone and takes a new one (lock)
        except OSError:
            pass
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def held_by(run_dir: str | Path) -> str | None:
    """Who holds run_dir's lock ("pid 123 on host since ..."), or None when no live run does."""
    path = Path(run_dir) / LOCK_NAME
    if str(path) in _held or not path.is_file():
        return None
    try:
        with open(path) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return f.read().strip() or "its lock is held"
    except OSError:
        return None
    return None


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoints renamed into place (step_NNNNNN with extra.json), oldest first: a save writes
    step_NNNNNN.tmp and renames it only when every rank's files are written."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if STEP_DIR.match(p.name) and (p / "extra.json").is_file())


def checkpoint_problem(path: str | Path) -> str | None:
    """Why a checkpoint cannot be loaded, from its files alone (None: every shard the DCP metadata lists is there
    at its full length, and extra.json parses). Catches a truncated, missing or emptied shard, not a flipped bit."""
    path = Path(path)
    try:
        json.loads((path / "extra.json").read_text())
    except (OSError, ValueError) as e:
        return f"{path / 'extra.json'} is unreadable ({e})"
    for part in (path, path / "ref"):
        if part.name == "ref" and not part.exists():
            continue
        if not (part / ".metadata").is_file():
            return f"{part / '.metadata'} is missing"
        try:
            from torch.distributed.checkpoint import FileSystemReader

            storage = FileSystemReader(str(part)).read_metadata().storage_data
        except Exception as e:  # noqa: BLE001 (a truncated pickle raises whatever it raises)
            return f"{part / '.metadata'} is unreadable ({type(e).__name__}: {e})"
        need: dict[str, int] = {}
        for info in storage.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(need.items()):
            f = part / name
            have = f.stat().st_size if f.is_file() else -1
            if have < size:
                return f"{f} is {'missing' if have < 0 else f'truncated ({have} of {size} bytes)'}"
    return None


def usable_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that passes checkpoint_problem, and the newer ones skipped with their problem."""
    skipped = []
    for path in reversed(complete_checkpoints(run_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


KEEP_MARK = "keep"  # a file of this name in a checkpoint dir keeps it from prune_checkpoints


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Remove complete checkpoints beyond the newest `keep` (0: keep all), except those holding a KEEP_MARK file;
    returns the removed ones. Set-aside ones (step_N.damaged) and unfinished saves (step_N.tmp) are left alone."""
    if keep <= 0:
        return []
    older = complete_checkpoints(run_dir)[:-keep]
    gone = [p for p in older if not (p / KEEP_MARK).exists()]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
