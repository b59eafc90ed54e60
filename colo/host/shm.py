"""Named shared-memory segments on this host (/dev/shm): owner-tagged names, and a sweep of dead owners'.

A process killed with SIGKILL (an OOM kill, `kill -9` of a run, ray.kill of an actor) runs no cleanup,
and POSIX shared memory outlives it: each colocated CPU run leaked one colo sync buffer per rank, and
every CPU engine with tensor parallelism a few hundred MB of vLLM `psm_*` message queues. So:

    colo_<pid>_<start>_<scope>_<tag>_<i>     colo's own segments carry their owner (segment_name)
    colo_<pid>_<start>_<scope>_owned.json    segments someone else created for that process and its children
                                             (vLLM's queues), listed by register_mapped() once they exist

and sweep() unlinks both kinds where it can prove the owner dead. Every run calls it at start, on the driver's host
and in every actor (multi-node: each node sweeps itself), before it creates its own segments.

A pid alone proves nothing where /dev/shm is shared beyond one PID namespace (two containers with --ipc=host, the
common case): a start in one container took the other's live run's sync buffers for dead, because their pids are
not visible from it, and unlinked them; that run died at its next sync. So the owner is named by its pid, its start
time (clock ticks since boot: a reused pid is not the owner) and its scope, a digest of the host name, the boot id
and the PID namespace: a sweep judges only segments of its own scope, where the owner's pid means what it says, and
leaves every other one be (those of a process it cannot see; names of an older colo that carried the pid alone too).

An engine's scratch folder, named the same way in the system's temporary folder, holds what vLLM writes there while
the engine starts (its `vllm_dist_*` rendezvous file, sockets): every run left one such file per engine, for good.

    with scratch():                 # tempfile's folder is <tmp>/colo_<pid>_<start>_<scope>_tmp meanwhile
        llm = LLM(...)
    remove_scratch()                # at the engine's end; sweep() removes those of dead owners
"""
from __future__ import annotations

import contextlib
import functools
import getpass
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

SHM = Path("/dev/shm")
PREFIX = "colo_"
_OWNED = re.compile(r"colo_(\d+)_")
_OWNER = re.compile(r"colo_(\d+)_(\d+)_([0-9a-f]{12})_")  # pid, start ticks, scope


@functools.lru_cache(maxsize=1)
def scope() -> str:
    """Where a pid means a process: this host (its name), this boot of its kernel, this PID namespace (12 hex
    digits). The name only narrows it: two containers of one PID namespace under other host names leave each other's
    segments be, which costs a leak, never a live segment."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(Path(path).read_text().strip() if path.endswith("boot_id") else os.readlink(path))
        except OSError:
            parts.append("?")
    return hashlib.sha256(":".join(parts).encode()).hexdigest()[:12]


def start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _owner_tag() -> str:
    pid = os.getpid()
    return f"{PREFIX}{pid}_{start_ticks(pid) or 0}_{scope()}_"


def segment_name(tag: str, index: int) -> str:
    """A colo segment owned by this process (the name shared_memory.SharedMemory is given)."""
    return f"{_owner_tag()}{tag}_{index}"


def owner_pid(name: str) -> int | None:
    """The owner's pid of a colo segment name (colo_<pid>_...), None for any other name."""
    m = _OWNED.match(name)
    return int(m.group(1)) if m else None


def provably_dead(name: str) -> bool:
    """The owner of a colo segment named by segment_name (or register_mapped) is gone: it is of this scope, and its
    pid names no process or another one (a later start time). False for a name of another scope, or of an older
    colo (the pid alone), whose owner this process may not be able to see."""
    m = _OWNER.match(name)
    if m is None or m.group(3) != scope():
        return False
    now = start_ticks(int(m.group(1)))
    return now is None or now != int(m.group(2))


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
    path = SHM / f"{_owner_tag()}owned.json"
    if names:
        path.write_text(json.dumps(names))
    return names


SCRATCH = "tmp"  # the suffix of a scratch folder's name


def _scratch_path() -> Path:
    return Path(tempfile.gettempdir()) / f"{_owner_tag()}{SCRATCH}"


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """tempfile's folder is this process's scratch folder while the block runs. TorchInductor's compile cache, whose
    default lives in the temporary folder too, is pinned to that default first: it is meant to outlast runs."""
    base = Path(tempfile.gettempdir())
    path = _scratch_path()
    path.mkdir(exist_ok=True)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (containers)
        user = str(os.getuid())
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(base / f"torchinductor_{user}"))
    saved, tempfile.tempdir = tempfile.tempdir, str(path)
    try:
        yield path
    finally:
        tempfile.tempdir = saved


def remove_scratch() -> None:
    """This process's scratch folder, gone (at an engine's end)."""
    shutil.rmtree(_scratch_path(), ignore_errors=True)


def sweep() -> list[str]:
    """Unlink colo segments, and segments registered by register_mapped, whose owner is provably dead; remove the
    scratch folders of such owners from the temporary folder."""
    removed: list[str] = []
    try:
        for entry in Path(tempfile.gettempdir()).glob(f"{PREFIX}*_{SCRATCH}"):
            if entry.is_dir() and provably_dead(entry.name):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(str(entry))
    except OSError:
        pass
    try:
        entries = sorted(SHM.iterdir())
    except OSError:  # no /dev/shm (not Linux): nothing of ours can be there
        return removed
    for entry in entries:
        if not provably_dead(entry.name):
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
