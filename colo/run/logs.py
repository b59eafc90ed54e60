"""Where a run's output goes: colo's own lines on the terminal, everything else in <run.dir>/logs/.

    <run.dir>/logs/trainer-<r>.log    trainer rank r's stdout and stderr (FSDP, transformers, torch)
    <run.dir>/logs/engine-<e>.log     engine e's, vLLM's included (and its worker processes' on CPU)
    <run.dir>/logs/<role>-<i>.crash.log  the fatal signal that ended that actor's process, if one did (faulthandler):
                                      a dead actor is reported with it (died_of)
    <run.dir>/logs/ray-session_*/     Ray's own logs of the run, copied at its end from Ray's temp dir (which goes
                                      with the machine's /tmp), one per session (run, resume)
    <run.dir>/logs/ray-errors.log     what Ray's raylets report to the driver ("A worker died or was killed ..."),
                                      which Ray prints on the terminal whatever log_to_driver says (route_ray_errors)
    <run.dir>/error.log               the traceback of a failure that ended the run (colo.runlife.fail), and the
                                      line of a stop signal that ended it (the terminal may be gone: SIGHUP)

A log file that stayed empty (a trainer rank with nothing to say) is removed at the end: an empty file only
makes a reader open it.

Why file descriptors and not Python logging: vLLM, Ray, torch and their C++ parts write to fds 1 and 2
directly, and child processes (vLLM's engine core and workers) inherit them, so redirecting the fds at
the start of each actor catches all of it. The driver then starts Ray with log_to_driver off: nothing of
the actors reaches the terminal but what colo prints and an actor's error, which names its log file.
`--verbose` (run.verbose) leaves the fds alone and turns log_to_driver on: everything on the terminal.
"""
from __future__ import annotations

import os
import re
import shutil
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
    record_fatal(crash_log(path))
    return path


def crash_log(log: Path) -> Path:
    """Where an actor's fatal signal is written (beside its log)."""
    return log.with_name(log.name.removesuffix(".log") + ".crash.log")


_CRASH: list = []  # the open crash log: faulthandler writes to its descriptor when the process dies


def record_fatal(path: Path) -> None:
    """From now on a fatal signal (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) writes its name and every thread's
    stack to `path`, emptied now: what it holds was this process's death. A SIGKILL leaves nothing."""
    import faulthandler

    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "w")  # noqa: SIM115 (kept open for the process's life: faulthandler writes to its fd)
    faulthandler.enable(file=f, all_threads=True)
    _CRASH[:] = [f]


# faulthandler's names of the signals it handles -> (signal, what it usually means)
FATAL = {"Bus error": ("SIGBUS", "memory it had mapped went away: usually /dev/shm full (a larger one: docker "
                                 "--shm-size) or a mapped file truncated"),
         "Segmentation fault": ("SIGSEGV", "a crash in native code: a CUDA, NCCL, torch or vLLM library, an extension"),
         "Aborted": ("SIGABRT", "native code gave up: an uncaught C++ exception or a failed assertion (NCCL, CUDA, "
                                "torch)"),
         "Floating point exception": ("SIGFPE", "an integer division by zero in native code"),
         "Illegal instruction": ("SIGILL", "a binary built for another CPU (an instruction this one lacks)")}


def died_of(log: Path | None) -> str:
    """How an actor whose log is `log` died, as a clause to add to "<actor> died": the fatal signal its crash log
    holds and what it usually means, or that none was recorded (a SIGKILL). "" without a log (verbose runs)."""
    if log is None:
        return ""
    try:
        text = crash_log(log).read_text(errors="replace")
    except OSError:
        return ""
    for name, (sig, means) in FATAL.items():
        if f"Fatal Python error: {name}" in text:
            return f" of {sig} ({means}; its stack: {crash_log(log)})"
    return (" without a fatal signal recorded (a SIGKILL leaves none: usually the kernel's OOM killer, see dmesg or "
            "/proc/vmstat oom_kill, or a kill -9)")


def note_end(run_dir: str | os.PathLike, line: str) -> None:
    """Append `line` (how the run ended) to <run_dir>/error.log with the time: after a hangup the terminal that
    would have shown it is gone. Never raises."""
    import time

    try:
        with open(Path(run_dir) / "error.log", "a") as f:
            f.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
    except OSError:
        pass


def redirect_output(path: Path) -> None:
    """From now on this process's (and its future children's) stdout and stderr append to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


RAY_LOG_MAX = 64 << 20  # a Ray log file larger than this is not copied (a long-lived cluster's raylet.out)
_RAY_LOGS: dict[str, Path] = {}  # run dir -> Ray's session log dir on the driver's node (note_ray_logs)


def note_ray_logs(run_dir: str | os.PathLike) -> Path | None:
    """Remember where this Ray session writes its logs on the driver's node, for keep_logs() at the run's end
    (None when Ray does not say)."""
    try:
        from ray._private import worker  # Ray keeps the session's node object here (no public API)

        target = Path(worker._global_node.get_logs_dir_path())
    except Exception:  # noqa: BLE001 (a Ray without that attribute: the logs stay where Ray puts them)
        return None
    _RAY_LOGS[str(Path(run_dir))] = target
    route_ray_errors(run_dir)
    return target


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def route_ray_errors(run_dir: str | os.PathLike) -> Path | None:
    """In a run whose actors log to files (log_to_driver off: not --verbose), the errors Ray's raylets report to the
    driver go to <run_dir>/logs/ray-errors.log, not the terminal: Ray's listener printed "(raylet) A worker died or
    was killed ..." beside colo's own line for the same death. Ray has no setting for it: its listener looks up
    ray._private.worker.print_to_stdstream at each message, and that name is pointed at the file (log_to_driver's
    printer holds its own reference, so a verbose run prints as before). Returns the file, None when verbose."""
    from ray._private import worker

    if hasattr(worker.global_worker, "logger_thread"):  # log_to_driver: everything goes to the terminal
        return None
    path = Path(run_dir) / "logs" / "ray-errors.log"

    def to_file(data: dict, ignore_prefix: bool = False) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.writelines(f"{_ANSI.sub('', str(line))}\n" for line in data.get("lines", []))
        except OSError:
            pass

    worker.print_to_stdstream = to_file
    return path


def keep_logs(run_dir: str | os.PathLike, ray_logs: bool = True) -> Path | None:
    """At the run's end (Ray shut down): with `ray_logs`, copy what Ray's session logged during this process's life
    into <run_dir>/logs/ray-<session>/ (files written since the driver started, but none empty or larger than
    RAY_LOG_MAX); then remove the empty log files of <run_dir>/logs. Returns the copy's folder. Never raises:
    the run's outcome stands whatever its logs do."""
    logs, copied = Path(run_dir) / "logs", None
    source = _RAY_LOGS.pop(str(Path(run_dir)), None)
    if ray_logs and source is not None and source.is_dir():
        try:
            import psutil

            since = psutil.Process().create_time()
        except Exception:  # noqa: BLE001
            since = 0.0
        copied = logs / f"ray-{source.parent.name}"
        try:
            files = sorted(source.rglob("*"))
        except OSError:  # Ray's temporary folder went meanwhile
            files = []
        for f in files:
            try:
                st = f.lstat()
                if f.is_symlink() or not f.is_file() or not 0 < st.st_size <= RAY_LOG_MAX or st.st_mtime < since:
                    continue
                (copied / f.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, copied / f.relative_to(source))
            except OSError:
                continue
    for f in logs.glob("*.log") if logs.is_dir() else ():
        try:
            if f.is_file() and f.stat().st_size == 0:
                f.unlink()
        except OSError:
            pass
    return copied if copied is not None and copied.is_dir() else None
