"""Named shared-memory segments on this host (/dev/shm): owner-tagged names, and a sweep of dead owners'.

A process killed with SIGKILL (an OOM kill, `kill -9` of a run, ray.kill of an actor) runs no cleanup,
and POSIX shared memory outlives it: each colocated CPU run leaked one colo sync buffer per rank, and
every CPU engine with tensor parallelism a few hundred MB of vLLM `psm_*` message queues. So:

    colo_<pid>_<tag>_<i>        colo's own segments carry their owner's pid (segment_name)
    colo_<pid>_owned.json       segments someone else created for process <pid> and its children
                                (vLLM's queues), listed by register_mapped() once they exist

and sweep() unlinks both kinds where <pid> is no longer alive. Every run calls it at start, on the
driver's host and in every actor (multi-node: each node sweeps itself), before it creates its own
segments. A live owner's segments are never touched; pid reuse can only delay a sweep, never make one
remove a live segment.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

SHM = Path("/dev/shm")
PREFIX = "colo_"
_OWNED = re.compile(r"colo_(\d+)_")


def segment_name(tag: str, index: int) -> str:
    """A colo segment owned by this process (the name shared_memory.SharedMemory is given)."""
    return f"{PREFIX}{os.getpid()}_{tag}_{index}"


def owner_pid(name: str) -> int | None:
    """The owner's pid of a colo segment name (colo_<pid>_...), None for any other name."""
    m = _OWNED.match(name)
    return int(m.group(1)) if m else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return out


def mapped_segments(pid: int, children: bool = True) -> set[str]:
    """Names of /dev/shm files that `pid` (or one of its descendants) has mapped, colo's own excepted."""
    names: set[str] = set()
    for p in process_tree(pid) if children else [pid]:
        try:
            maps = Path(f"/proc/{p}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = parts[5] if len(parts) == 6 else ""
            if path.startswith(f"{SHM}/") and not path.endswith(" (deleted)"):  # deleted: already unlinked
                name = path[len(str(SHM)) + 1:]
                if not name.startswith(PREFIX):
                    names.add(name)
    return names


def register_mapped() -> list[str]:
    """Record the shared memory this process tree has mapped (e.g. vLLM's multiprocess executor queues),
    so that a sweep after this process died removes it; returns the names recorded."""
    if not SHM.is_dir():
        return []
    names = sorted(mapped_segments(os.getpid()))
    path = SHM / f"{PREFIX}{os.getpid()}_owned.json"
    if names:
        path.write_text(json.dumps(names))
    return names


def sweep() -> list[str]:
    """Unlink colo segments, and segments registered by register_mapped, of processes that are gone."""
    removed: list[str] = []
    try:
        entries = sorted(SHM.iterdir())
    except OSError:  # no /dev/shm (not Linux): nothing of ours can be there
        return removed
    for entry in entries:
        pid = owner_pid(entry.name)
        if pid is None or alive(pid):
            continue
        if entry.name.endswith("_owned.json"):
            try:
                listed = json.loads(entry.read_text())
            except (OSError, ValueError):
                listed = []
            for name in listed:
                if "/" not in name and _unlink(SHM / name):
                    removed.append(name)
        if _unlink(entry):
            removed.append(entry.name)
    return removed


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
    except OSError:  # another user's segment: not ours to remove
        return False
