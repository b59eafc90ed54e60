"""Wall-clock spans of verl's timed phases, for the GPU memory per phase (tools/peers/verl/run_verl.py).

verl times its phases with verl.utils.profiler.performance.marked_timer, which looks up the module's `_timer` at each
call; install() wraps that `_timer` so every span also appends {"name", "t0", "t1", "pid"} (time.time()) to the file
named by $PEERS_PHASES. It runs in every Ray worker process as Ray's worker_process_setup_hook (run_verl.py passes
`+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=tools.peers.verl.phase_hook.install`), so the trainer's
spans land wherever verl creates it. Durations are left to verl's own metrics (timing_s/*): only the spans come from
here.
"""
from __future__ import annotations

import json
import os
import time


def install() -> None:
    path = os.environ.get("PEERS_PHASES")
    if not path:
        return
    from verl.utils.profiler import performance

    inner = performance._timer  # a generator function: marked_timer does `yield from _timer(name, timing_raw)`
    if getattr(inner, "_peers", False):
        return

    def _timer(name: str, timing_raw: dict):
        t0 = time.time()
        yield from inner(name, timing_raw)
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, "t0": t0, "t1": time.time(), "pid": os.getpid()}) + "\n")

    _timer._peers = True
    performance._timer = _timer
