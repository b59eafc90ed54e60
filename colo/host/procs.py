"""The processes a run starts on this host, recorded by id: stopped by their ids when the run ends, however it
ends, and swept by the next start when it ended by SIGKILL.

    before = children()
    ray.init(...)
    record([p for p in children() if p not in before])   # Ray's head processes, and all they started so far
    record()          # again once the actors run: the raylet's agents, the actors, vLLM's engine cores,
                      # each as (pid, start time)
    stop_recorded()   # at the end, after ray.shutdown(): whatever of them still runs (SIGTERM, then SIGKILL)
    sweep()           # at a start: the records of drivers that are gone; their processes that still run

Why: ray.shutdown() stops Ray's own processes, but ray::DashboardAgent and ray::RuntimeEnvAgent, children of the
raylet, outlive it for 30 s or more after a driver is killed or its raylet dies (Ray issues #52385, #59162), and a
driver killed with SIGKILL runs no cleanup at all. A process is stopped only when its pid still names the process
that was recorded (the start time in /proc/<pid>/stat matches): pid reuse can delay a sweep, never make it kill
another process. Records live in the system's temporary folder (colo-procs-<uid>/<owner pid>-<start>.json), so a
sweep sees the runs of this host's user that used the same TMPDIR.
"""
from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

from colo.host.shm import process_tree, start_ticks


def records_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"colo-procs-{os.getuid()}"


def _own_record() -> Path:
    return records_dir() / f"{os.getpid()}-{start_ticks(os.getpid())}.json"


def children(pid: int | None = None) -> list[int]:
    """The direct children of `pid` (this process by default)."""
    out: list[int] = []
    pid = os.getpid() if pid is None else pid
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except OSError:
        pass
    return out


_ROOTS: list[int] = []  # the processes this run started itself (Ray's head): what record() follows


def record(roots: list[int] | None = None) -> Path | None:
    """Add `roots` and every process under them to this process's record; without `roots`, the roots given before
    (again: more run under them now). Only these: the driver's other children (its multiprocessing resource tracker,
    an environment's worker) end with it and are not the run's to stop. None when there is nothing to follow (a
    cluster this driver joined: its processes are the cluster's)."""
    if roots is not None:
        _ROOTS[:] = roots
    if not _ROOTS:
        return None
    path = _own_record()
    procs = _read(path).get("procs", {})
    for pid in (p for root in _ROOTS for p in process_tree(root)):
        ticks = start_ticks(pid)
        if ticks is not None:
            procs[str(pid)] = ticks
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"procs": procs}))
    tmp.replace(path)
    return path


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _live(procs: dict[str, int]) -> list[int]:
    return [int(pid) for pid, ticks in procs.items() if start_ticks(int(pid)) == ticks]


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_recorded(grace_s: float = 5.0) -> list[int]:
    """Stop what this process recorded and still runs: SIGTERM, SIGKILL after `grace_s`; the record goes. Returns
    the pids that had to be stopped."""
    path = _own_record()
    procs = _read(path).get("procs", {})
    left = _live(procs)
    _kill(left, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _live({str(p): procs[str(p)] for p in left}) and time.monotonic() < deadline:
        time.sleep(0.1)
    _kill(_live({str(p): procs[str(p)] for p in left}), signal.SIGKILL)
    path.unlink(missing_ok=True)
    _ROOTS.clear()
    return left


def sweep() -> list[int]:
    """For each record whose owner is gone (a driver killed with SIGKILL): SIGKILL its processes that still run,
    and remove the record. Returns the pids killed."""
    killed: list[int] = []
    for path in records_dir().glob("*-*.json"):
        owner, _, ticks = path.stem.partition("-")
        if not owner.isdigit() or start_ticks(int(owner)) == int(ticks or -1):
            continue  # a live driver's record
        live = _live(_read(path).get("procs", {}))
        _kill(live, signal.SIGKILL)
        killed += live
        path.unlink(missing_ok=True)
    return killed
