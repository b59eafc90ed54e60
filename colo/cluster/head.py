"""Ray's head, watched: a run whose GCS or raylet died ends with a checkpoint instead of going on without a word.

    watch_head()      # after ray.init: the head this driver started (gcs_server and raylet, by pid), or the
                      # GCS address of a cluster it joined
    check_head()      # before every call into the actors (colo.cluster.actors.gather): raises HeadLost, once

Measured (Ray 2.60, CPU): with the run's gcs_server and raylet killed, the actors it already holds
keep answering, so the run went on, its steps ~2x slower, and exited 0; but nothing can be started, placed or
restarted any more, the next actor failure is final, and Ray's core worker ends the driver ~60 s later ("Failed
to connect to GCS within 60 seconds"). So the first call after the loss raises HeadLost, the loop saves the last
trained step (the actors still answer) and ends with one `colo: error:` line and the --resume command. A local
head is checked by its processes' state (free); a joined cluster's GCS by a TCP connect, at most once per
PROBE_EVERY_S seconds.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

from colo.host.procs import start_ticks
from colo.host.shm import process_tree

PROBE_EVERY_S = 5.0


class HeadLost(RuntimeError):
    """Ray's head (GCS, raylet) of this run is gone; `name` is what failed, for colo.loop.fail."""

    name = "Ray's head"


@dataclass
class _Watch:
    local: dict[str, tuple[int, int]] = field(default_factory=dict)  # "gcs_server"/"raylet" -> (pid, start ticks)
    address: tuple[str, int] | None = None  # a joined cluster's GCS
    next_probe: float = 0.0
    reported: bool = False
    gcs: str = ""  # the GCS address of the Ray the watch was made in: a later Ray of this process is not its head


_WATCH: list[_Watch] = []


def watch_head() -> None:
    """Start watching the head of the Ray this process is connected to (call after ray.init)."""
    import ray

    w = _Watch()
    for pid in process_tree(os.getpid())[1:]:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        for name in ("gcs_server", "raylet"):
            if cmd.endswith(f"/{name}") and name not in w.local:
                w.local[name] = (pid, start_ticks(pid))
    w.gcs = ray.get_runtime_context().gcs_address
    if not w.local:  # not our own head: a cluster this driver joined
        host, _, port = w.gcs.rpartition(":")
        w.address = (host, int(port))
    _WATCH[:] = [w]


def unwatch_head() -> None:
    _WATCH.clear()


def check_head() -> None:
    """Raise HeadLost the first time the watched head is found gone; afterwards let calls go on (the loop saves
    the last step through the actors, which still answer)."""
    if not _WATCH or _WATCH[0].reported:
        return
    w = _WATCH[0]
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().gcs_address != w.gcs:  # Ray ended without shutdown_ray
        _WATCH.clear()  # (a plain ray.shutdown, then another ray.init): the head watched is not this Ray's
        return
    gone = [f"{name} (pid {pid})" for name, (pid, ticks) in sorted(w.local.items()) if start_ticks(pid) != ticks]
    if not gone and w.address is not None and time.monotonic() >= w.next_probe:
        w.next_probe = time.monotonic() + PROBE_EVERY_S
        try:
            socket.create_connection(w.address, timeout=3).close()
        except OSError as e:
            gone = [f"its GCS at {w.address[0]}:{w.address[1]} ({e.strerror or e})"]
    if gone:
        w.reported = True
        raise HeadLost(f"Ray's head of this run is gone: {', '.join(gone)} ended; the actors still answer, but nothing "
                       "can be started or restarted any more, and Ray ends this process within a minute")
