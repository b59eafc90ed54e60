"""Start the Ray actors of a colocated job: per GPU r, TrainWorker rank r and RolloutEngine DP rank r in
placement group r.

Rank alignment is the invariant the whole weight path rests on (trainer rank r pushes over CUDA IPC /
shared memory to the engine on the same GPU, and FSDP's expert shard r is engine r's expert slice), so it
is checked here from what the actors report, not assumed from the order we created them in.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import ray

from colo.config import ColoConfig, to_dict
from colo.placement import PlacementPlan, create_placement, scheduling


@dataclass
class Cluster:
    """The actors of one job, index r = rank r = placement group r."""

    trainers: list
    engines: list
    placement_groups: list


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(cfg: ColoConfig, plan: PlacementPlan) -> Cluster:
    """Create placement groups, then trainers and engines in them; returns once every actor is ready."""
    from colo.rollout.engine import RolloutEngine
    from colo.trainer.worker import TrainWorker

    pgs = create_placement(plan)
    cfg_dict = to_dict(cfg)
    world = len(pgs)
    master_port, dp_port = _free_port(), _free_port()
    trainers = [
        TrainWorker.options(num_gpus=cfg.placement.train_gpu_fraction, num_cpus=1,
                            scheduling_strategy=scheduling(pg)).remote(cfg_dict, r, world, "127.0.0.1", master_port)
        for r, pg in enumerate(pgs)
    ]
    # On GPU the engine actor itself takes 0 GPUs: vLLM's Ray executor places its worker into bundle 0 with
    # the vLLM fraction (measured: an engine actor holding its own fraction hangs at start-up). On CPU the
    # engines are independent replicas and hold Ray's logical GPU fraction themselves.
    engine_gpus = 0 if cfg.placement.device == "cuda" else cfg.placement.vllm_gpu_fraction
    engines = [
        RolloutEngine.options(num_gpus=engine_gpus, num_cpus=0,
                              scheduling_strategy=scheduling(pg)).remote(cfg_dict, r, world, dp_port)
        for r, pg in enumerate(pgs)
    ]
    setups = ray.get([t.setup.remote() for t in trainers])
    readies = ray.get([e.ready.remote() for e in engines])
    for r, (s, e) in enumerate(zip(setups, readies)):
        if s.get("rank") != r or e.get("rank") != r:
            raise RuntimeError(f"rank misalignment at placement group {r}: trainer {s.get('rank')}, engine {e.get('rank')}")
        if cfg.placement.device == "cuda" and s.get("device_uuid") != e.get("device_uuid"):
            raise RuntimeError(f"trainer rank {r} is on GPU {s.get('device_uuid')} but engine DP rank {r} is on "
                               f"{e.get('device_uuid')}: CUDA IPC needs them on the same GPU")
    return Cluster(trainers, engines, pgs)
