"""Start the Ray actors of a colocated job: per GPU r, TrainWorker rank r and RolloutEngine DP rank r in
placement group r.

Rank alignment is the invariant the whole weight path rests on (trainer rank r pushes over CUDA IPC /
shared memory to the engine on the same GPU, and FSDP's expert shard r is engine r's expert slice), so it
is checked here from what the actors report, not assumed from the order we created them in.

Actors are named `colo-trainer-{r}` / `colo-engine-{r}` in the job's (anonymous, per-driver) Ray namespace,
so `ray.get_actor` finds them from driver-side code (debugging, the failure tests' reward functions).
"""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from colo.config import ColoConfig, to_dict
from colo.placement import PlacementPlan, create_placement, scheduling


@dataclass
class Cluster:
    """The actors of one job, index r = rank r = placement group r."""

    trainers: list
    engines: list
    placement_groups: list
    setup: dict = field(default_factory=dict)  # start-up seconds: trainer_setup_s, engine_start_s, cluster_s


def free_port() -> int:
    """A free TCP port for a server that another process will open a moment later.

    Taken from below the kernel's ephemeral range: a port handed out by bind(0) is an ephemeral one,
    and in the gap before the server binds it, any outgoing connection (Ray, gloo, vLLM start dozens)
    may be given the same number; CI hit exactly that (EADDRINUSE in init_process_group)."""
    lo = _ephemeral_low()
    for _ in range(200):
        port = _RNG.randrange(max(1024, lo - 12000), lo) if lo > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free TCP port below the ephemeral range ({lo}) after 200 tries")


_RNG = random.SystemRandom()  # independent of any seeding the job does: two runs must not pick alike


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux default


def start_cluster(cfg: ColoConfig, plan: PlacementPlan, trainer_cls: Any = None) -> Cluster:
    """Create placement groups, then trainers and engines in them; returns once every actor is ready.

    `trainer_cls`: a Ray actor class with TrainWorker's interface (the benchmark adds its baseline sync)."""
    from colo.rollout.engine import RolloutEngine
    from colo.trainer.worker import TrainWorker

    TrainWorker = trainer_cls or TrainWorker  # noqa: N806
    t0 = time.perf_counter()
    pgs = create_placement(plan)
    cfg_dict = to_dict(cfg)
    world = len(pgs)
    master_port, dp_port = free_port(), free_port()
    trainers = [
        TrainWorker.options(num_gpus=cfg.placement.train_gpu_fraction, num_cpus=1, name=f"colo-trainer-{r}",
                            scheduling_strategy=scheduling(pg)).remote(cfg_dict, r, world, "127.0.0.1", master_port)
        for r, pg in enumerate(pgs)
    ]
    # On GPU the engine actor itself takes 0 GPUs: vLLM's Ray executor places its worker into bundle 0 with
    # the vLLM fraction (measured: an engine actor holding its own fraction hangs at start-up). On CPU the
    # engines are independent replicas and hold Ray's logical GPU fraction themselves.
    engine_gpus = 0 if cfg.placement.device == "cuda" else cfg.placement.vllm_gpu_fraction
    engines = [
        RolloutEngine.options(num_gpus=engine_gpus, num_cpus=0, name=f"colo-engine-{r}",
                              scheduling_strategy=scheduling(pg)).remote(cfg_dict, r, world, dp_port)
        for r, pg in enumerate(pgs)
    ]
    setups = gather([t.setup.remote() for t in trainers], [f"trainer rank {r}" for r in range(world)])
    t_train = time.perf_counter() - t0
    readies = gather([e.ready.remote() for e in engines], [f"engine DP rank {r}" for r in range(world)])
    for r, (s, e) in enumerate(zip(setups, readies)):
        if s.get("rank") != r or e.get("rank") != r:
            raise RuntimeError(f"rank misalignment at placement group {r}: trainer {s.get('rank')}, engine {e.get('rank')}")
        if cfg.placement.device == "cuda" and s.get("device_uuid") != e.get("device_uuid"):
            raise RuntimeError(f"trainer rank {r} is on GPU {s.get('device_uuid')} but engine DP rank {r} is on "
                               f"{e.get('device_uuid')}: CUDA IPC needs them on the same GPU")
    setup = {"trainer_setup_s": t_train, "cluster_s": time.perf_counter() - t0,
             "engine_start_s": max(float(e.get("start_s", 0.0)) for e in readies)}
    return Cluster(trainers, engines, pgs, setup)


def gather(refs: list, who: list[str], timeout: float | None = None) -> list:
    """ray.get of all refs that fails on the first failure, naming the actor that died.

    Results are taken in completion order, not rank order: when rank 1 dies, rank 0 may be blocked in a
    collective waiting for it (gloo's default timeout is 30 min), so ray.get(rank 0) first would hang."""
    out, pending = {}, {ref: i for i, ref in enumerate(refs)}
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        if not done:
            late = ", ".join(who[i] for i in pending.values())
            raise TimeoutError(f"{late} did not answer in {timeout:.0f} s")
        i = pending.pop(done[0])
        try:
            out[i] = ray.get(done[0])
        except ray.exceptions.RayActorError as e:
            raise ActorDied(who[i]) from e
        except ray.exceptions.RayTaskError as e:
            # a live trainer whose call into a dead actor failed: trainers only call their own engine (sync)
            if isinstance(getattr(e, "cause", None), ray.exceptions.RayActorError) and who[i].startswith("trainer"):
                raise ActorDied(f"engine DP rank {i} (seen by {who[i]} during the weight sync)") from e
            raise
    return [out[i] for i in range(len(refs))]


class ActorDied(RuntimeError):
    """An actor process is gone (crash, OOM kill, node loss); `name` says which, e.g. "engine DP rank 1"."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name} died; see its log above")
        self.name = name


def on_trainers(c: Cluster, method: str, *args_per_rank, timeout: float | None = None) -> list:
    """Call one method on every trainer; per-rank arguments are given as lists."""
    refs = [getattr(t, method).remote(*(a[r] for a in args_per_rank)) for r, t in enumerate(c.trainers)]
    return gather(refs, [f"trainer rank {r}" for r in range(len(refs))], timeout)


def on_engines(c: Cluster, method: str, *args) -> list:
    refs = [getattr(e, method).remote(*args) for e in c.engines]
    return gather(refs, [f"engine DP rank {r}" for r in range(len(refs))])
