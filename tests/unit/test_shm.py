"""colo.host.shm: segments of killed processes are found and removed by the next run, live ones never touched."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import torch

from colo.host.shm import SHM, sweep
from colo.sync.transport import SenderBuffers

CHILD = textwrap.dedent('''
    import os, sys, time
    from multiprocessing import resource_tracker, shared_memory
    from colo.host.shm import register_mapped
    from colo.sync.transport import SenderBuffers
    import torch

    bufs = SenderBuffers(4096, 2, "cpu")  # colo's own: colo_<pid>_<tag>_<i>
    # a segment someone else made for this process (vLLM's queues): not tagged, mapped while it runs;
    # unregistered from Python's resource tracker, which would otherwise clean it up (vLLM's leak, shown)
    other = shared_memory.SharedMemory(name=f"psm_colotest{os.getpid()}", create=True, size=4096)
    resource_tracker.unregister(other._name, "shared_memory")
    print(" ".join([h["name"] for h in bufs.handles()] + register_mapped()), flush=True)
    time.sleep(600)  # until killed
''')


def test_sweep_removes_a_killed_processs_segments_and_keeps_live_ones() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    left = p.stdout.readline().split()
    # SIGKILL to the whole process group, as `kill -9` of a run's group or an OOM kill of its tree: Python's
    # resource tracker, which would unlink the child's segments after a lone kill, dies with it
    os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    pid = left[0].split("_")[1]
    assert len(left) == 3 and left[2] == f"psm_colotest{pid}", left  # 2 sync buffers, the registered one
    assert all((SHM / n).exists() for n in left) and (SHM / f"colo_{pid}_owned.json").exists()
    mine = SenderBuffers(4096, 1, "cpu")  # a live owner's segment
    try:
        removed = sweep()
        assert set(left) | {f"colo_{pid}_owned.json"} <= set(removed), removed
        assert not any((SHM / n).exists() for n in left)
        (own,) = [h["name"] for h in mine.handles()]
        assert own.startswith(f"colo_{os.getpid()}_") and (SHM / own).exists() and own not in removed
        assert torch.equal(mine.tensors[0], mine.tensors[0])  # still mapped and usable
    finally:
        mine.close()
