"""Liveness of the actors (colo.cluster.liveness) on real Ray actors and real signals: a slow call is waited for, a
stopped process (SIGSTOP: what a hung host, or on GPU a process that holds the GIL, looks like) is named after
run.heartbeat_s, a call stuck in an actor that still answers heartbeats (a hung CUDA kernel or NCCL collective) is
named at its deadline from the measured calls, and a trainer waiting on a stopped engine names the engine.
A plain actor stands in for the engine and the trainer: the waits are the same gather the loop's groups use."""
from __future__ import annotations

import os
import signal
import time

import pytest

from colo.cluster.actors import ActorStalled, gather
from colo.cluster.liveness import HEARTBEAT_GROUP, Liveness


class Worker:
    def pid(self) -> int:
        return os.getpid()

    def work(self, seconds: float) -> float:
        time.sleep(seconds)  # as a CUDA kernel or a collective waits: the GIL released
        return seconds

    def via(self, other, seconds: float) -> float:
        """A trainer's sync: a call that waits on another actor."""
        import ray

        return ray.get(other.work.remote(seconds))


@pytest.fixture(scope="module")
def actors(ray_cluster):
    """Two actors for the module (each test's long call ends within seconds of the test), killed at the end."""
    remote = ray_cluster.remote(concurrency_groups={HEARTBEAT_GROUP: 1})(Worker)
    made = [remote.options(num_cpus=0).remote() for _ in range(2)]
    pids = ray_cluster.get([a.pid.remote() for a in made])
    yield list(zip(made, pids))
    for a in made:
        ray_cluster.kill(a, no_restart=True)


def wait(live: Liveness, kind: str, actor, seconds: float, name: str = "engine DP rank 0") -> float:
    live.note_pids([(name, actor)])  # as start_cluster does for its actors: made with the heartbeat group
    return gather([actor.work.remote(seconds)], [name], watch=live.watch(kind, [(name, actor)]))[0]


def test_slow_is_waited_for_stuck_is_named_at_its_deadline(actors) -> None:
    (a, _), _ = actors
    live = Liveness(heartbeat_s=30, stall_s=2, ping_every_s=0.5)
    assert wait(live, "generate", a, 0.5) == 0.5  # the first of its kind: 3 x stall_s
    assert 0.5 <= live.longest["generate"] < 5 and live.deadline("generate") == max(2, 10 * live.longest["generate"])
    assert wait(live, "generate", a, 3.0) == 3.0  # six times longer than before: slow, not stuck
    live.longest["generate"] = 0.5
    t0 = time.monotonic()
    with pytest.raises(ActorStalled) as e:
        wait(live, "generate", a, 15)  # ends seconds after the test: the next waits for it first
    assert 5 <= time.monotonic() - t0 < 15, time.monotonic() - t0
    assert str(e.value).startswith("engine DP rank 0 did not return from generate in ") and \
        "(10x the longest generate so far (0.5 s)), though it answers heartbeats: stuck (a hung CUDA kernel" in \
        str(e.value), e.value
    assert e.value.callers_free and live.lost == ["engine DP rank 0"]


def test_a_stopped_process_is_named_after_the_heartbeat_timeout(actors) -> None:
    (a, pid), _ = actors
    live = Liveness(heartbeat_s=5, stall_s=600, ping_every_s=0.5)
    wait(live, "generate", a, 0.1)  # answers while it runs
    ref = a.work.remote(15)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(ActorStalled) as e:
            gather([ref], ["engine DP rank 0"], watch=live.watch("generate", [("engine DP rank 0", a)]))
        assert 5 <= time.monotonic() - t0 < 60, time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert str(e.value).startswith("engine DP rank 0 answered no heartbeat for ") and \
        "while the driver waited for its generate (a stopped process: SIGSTOP" in str(e.value), e.value


def test_a_trainer_waiting_on_a_stopped_engine_names_the_engine(actors) -> None:
    """The sync: trainer rank 0 waits inside its call on engine 0, which stopped; the trainer still answers. The
    engine is named, and the trainers are not free to save (they are inside the sync)."""
    (trainer, _), (engine, pid) = actors
    live = Liveness(heartbeat_s=5, stall_s=600, ping_every_s=0.5)
    live.note_pids([("trainer rank 0", trainer), ("engine DP rank 0", engine)])
    ref = trainer.via.remote(engine, 15)
    time.sleep(1)  # the engine's call has begun
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(ActorStalled) as e:
            gather([ref], ["trainer rank 0"], engines=[engine], watch=live.watch(
                "sync_weights", [("trainer rank 0", trainer), ("engine DP rank 0", engine)]))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert e.value.name == "engine DP rank 0" and not e.value.callers_free, e.value
    assert "while the driver waited for its sync_weights" in str(e.value)


def test_an_actor_made_without_the_heartbeat_group_is_not_sent_heartbeats(ray_cluster) -> None:
    """A call into a concurrency group an actor lacks kills its worker process (Ray 2.60): actors that no cluster
    start made (a test's own, a benchmark's) are waited for without heartbeats, and live on."""
    plain = ray_cluster.remote(Worker).options(num_cpus=0).remote()
    live = Liveness(heartbeat_s=5, stall_s=600, ping_every_s=0.5)
    assert gather([plain.work.remote(2)], ["engine 9"], watch=live.watch("generate", [("engine 9", plain)])) == [2]
    assert ray_cluster.get(plain.work.remote(0)) == 0
    ray_cluster.kill(plain, no_restart=True)
