"""colo.host.shm: segments of killed processes are found and removed by the next run, live ones never touched."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
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
    owned = "_".join(left[0].split("_")[:4]) + "_owned.json"  # colo_<pid>_<start>_<scope>_owned.json
    assert all((SHM / n).exists() for n in left) and (SHM / owned).exists()
    mine = SenderBuffers(4096, 1, "cpu")  # a live owner's segment
    try:
        removed = sweep()
        assert set(left) | {owned} <= set(removed), removed
        assert not any((SHM / n).exists() for n in left)
        (own,) = [h["name"] for h in mine.handles()]
        assert own.startswith(f"colo_{os.getpid()}_") and (SHM / own).exists() and own not in removed
        assert torch.equal(mine.tensors[0], mine.tensors[0])  # still mapped and usable
    finally:
        mine.close()


SWEEP = "from colo.host.shm import sweep; print(' '.join(sweep()))"


def test_a_start_in_another_pid_namespace_leaves_live_segments_be() -> None:
    """Two colo starts share /dev/shm but not a PID namespace (two containers with --ipc=host): the second start's
    sweep took the first run's live sync buffers for dead (their owner's pid is not visible from it) and unlinked
    them; the first run died at its next sync. Its names now carry their scope (boot, PID namespace), and a sweep
    judges only its own."""
    import shutil

    from colo.host.shm import provably_dead, scope

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"],
                                                        capture_output=True).returncode:
        pytest.skip("needs unshare of a PID namespace (root)")
    mine = SenderBuffers(4096, 1, "cpu")
    (own,) = [h["name"] for h in mine.handles()]
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        r = subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", SWEEP], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert own not in r.stdout.split() and (SHM / own).exists(), r.stdout
        assert torch.equal(mine.tensors[0], mine.tensors[0])
    finally:
        mine.close()
    # the same name from the other side: a segment of another scope is never this sweep's to judge
    other = own.replace(scope(), "0" * 12)
    assert not provably_dead(other) and not provably_dead(f"colo_{os.getpid() + 10**6}_sync_0")  # an older colo's


def test_a_reused_pid_is_not_the_owner() -> None:
    """A segment whose owner's pid now names another process (a later start time) is the dead owner's."""
    from colo.host.shm import provably_dead, scope, start_ticks

    me = os.getpid()
    assert not provably_dead(f"colo_{me}_{start_ticks(me)}_{scope()}_sync_0")  # this process: alive
    assert provably_dead(f"colo_{me}_{start_ticks(me) - 1}_{scope()}_sync_0")  # an earlier process with this pid


ENGINE_START = """import os, sys, tempfile, time
import torch.distributed as dist
from colo.host.shm import remove_scratch, scratch
with scratch():  # as colo.rollout.engine starts vLLM: its rendezvous file goes where tempfile says
    store = dist.FileStore(os.path.join(tempfile.gettempdir(), "vllm_dist_colotest"), 1)
print(store.path, tempfile.gettempdir(), flush=True)
if sys.argv[1] == "shutdown":
    remove_scratch()
    print("done", flush=True)
time.sleep(600)
"""


def test_vllms_rendezvous_file_goes_with_its_engine(tmp_path) -> None:
    """Every run left one vllm_dist_* file per engine in TMPDIR (vLLM's file-store rendezvous, never removed). It is
    made in the engine's scratch folder now, which the engine's shutdown removes, and a sweep once it was killed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TMPDIR": str(tmp_path)}
    for how in ("shutdown", "killed"):
        p = subprocess.Popen([sys.executable, "-c", ENGINE_START, how], stdout=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
        store, tmp = p.stdout.readline().split()
        folder = Path(store).parent
        assert folder.parent == tmp_path and folder.name.startswith(f"colo_{p.pid}_") and tmp == str(tmp_path)
        if how == "shutdown":
            assert p.stdout.readline().strip() == "done" and not folder.exists()
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
        if how == "killed":
            assert Path(store).exists()
            r = subprocess.run([sys.executable, "-c", SWEEP], env=env, capture_output=True, text=True, timeout=120)
            assert str(folder) in r.stdout.split() and not folder.exists(), r.stdout
    assert list(tmp_path.iterdir()) == []
