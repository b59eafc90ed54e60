"""Where a run's output goes: colo's own lines on the terminal, everything else in <run.dir>/logs/.

    <run.dir>/logs/trainer-<r>.log    trainer rank r's stdout and stderr (FSDP, transformers, torch)
    <run.dir>/logs/engine-<e>.log     engine e's, vLLM's included (and its worker processes' on CPU)
    <run.dir>/logs/ray-session_*      Ray's own logs, one link into Ray's temp dir per session (run, resume)
    <run.dir>/error.log               the traceback of a failure that ended the run (colo.runlife.fail)

Why file descriptors and not Python logging: vLLM, Ray, torch and their C++ parts write to fds 1 and 2
directly, and child processes (vLLM's engine core and workers) inherit them, so redirecting the fds at
the start of each actor catches all of it. The driver then starts Ray with log_to_driver off: nothing of
the actors reaches the terminal but what colo prints and an actor's error, which names its log file.
`--verbose` (run.verbose) leaves the fds alone and turns log_to_driver on: everything on the terminal.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path


def actor_log(run_dir: str | os.PathLike, role: str, index: int) -> Path:
    """<run_dir>/logs/<role>-<index>.log ("trainer" or "engine")."""
    return Path(run_dir) / "logs" / f"{role}-{index}.log"


def log_of(run_dir: str | os.PathLike, who: str) -> Path | None:
    """The log file of an actor named as colo.cluster.actors names them ("engine DP rank 1", "trainer rank 0",
    "engine 2"); None for anything else."""
    m = re.match(r"(engine|trainer)\D*?(\d+)", who)
    return actor_log(run_dir, m.group(1), int(m.group(2))) if m else None


def actor_output(run_dir: str, verbose: bool, role: str, index: int) -> Path | None:
    """Called first thing in a trainer or engine actor: its output to its log file unless the run is verbose.
    Only inside a Ray actor of a run with a run dir (a plain Trainer in a test process keeps its output)."""
    import ray

    if verbose or "{time}" in run_dir or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None
    path = actor_log(run_dir, role, index)
    redirect_output(path)
    return path


def redirect_output(path: Path) -> None:
    """From now on this process's (and its future children's) stdout and stderr append to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def link_ray_logs(run_dir: str | os.PathLike) -> Path | None:
    """<run_dir>/logs/ray-<session> -> this Ray session's log dir on the driver's node (None when Ray does not
    say where)."""
    try:
        from ray._private import worker  # Ray keeps the session's node object here (no public API)

        target = Path(worker._global_node.get_logs_dir_path())
    except Exception:  # noqa: BLE001 (a Ray without that attribute: the logs stay where Ray puts them)
        return None
    link = Path(run_dir) / "logs" / f"ray-{target.parent.name}"  # one per Ray session: a resume adds one
    link.parent.mkdir(parents=True, exist_ok=True)
    if not (link.is_symlink() or link.exists()):
        link.symlink_to(target)
    return link
