"""The placement side of a step: what the engines and trainers do around the train phase so that each GPU holds
one of them at a time (colocated), or nothing (disaggregated: each side has GPUs of its own).

    side = side_for(cluster, cfg)       # a PlacementSide, picked once per run (colo.loop.Job)
    side.release()       # 'sleep':   engines free KV cache and weights
    side.onload()        # 'train':   trainer state back on the GPU, before the update
    side.wake_weights()  # 'sync':    engines re-allocate their weights, for the sync to write into
    side.offload()       # 'offload': trainer state to the host
    side.wake_kv()       # 'wake':    engines re-allocate the KV cache and resume scheduling

The order is the loop's (colo.loop.rl_step): the trainer needs the memory vLLM frees in `release`, the weights
must be back in vLLM's memory before the push, and the KV cache is re-allocated only after the trainer left.
The two sides are siblings: each implements the PlacementSide protocol, neither inherits from the other.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from colo.cluster.actors import Cluster, EngineGroup, TrainerGroup
    from colo.config import ColoConfig


class PlacementSide(Protocol):
    """What a step asks of the placement around its train phase, in the module docstring's order."""

    def release(self) -> None:
        """'sleep': the engines give back the GPU memory the trainer needs to train."""

    def onload(self) -> None:
        """'train': the trainer's state back where it trains."""

    def wake_weights(self) -> None:
        """'sync': the engines' weights allocated again, for the sync to write into."""

    def offload(self) -> None:
        """'offload': the trainer's state off the GPU, for the engines' KV cache."""

    def wake_kv(self) -> None:
        """'wake': the engines' KV cache back, scheduling resumed."""


class Colocated:
    """Trainer rank r and engine r share GPU r. `offload` (trainer.offload): the trainer's state leaves the GPU
    while vLLM generates; `level`: rollout.sleep_level (resolved: 2 unless set to 1)."""

    def __init__(self, trainers: TrainerGroup, engines: EngineGroup, offload: bool, level: int) -> None:
        self.trainers, self.engines, self.offloads, self.level = trainers, engines, offload, level

    def release(self) -> None:
        self.engines.sleep(self.level)  # level 2: the sync overwrites the weights anyway

    def onload(self) -> None:
        if self.offloads:
            self.trainers.onload()

    def wake_weights(self) -> None:
        self.engines.wake_up(["weights"])

    def offload(self) -> None:
        if self.offloads:
            self.trainers.offload()

    def wake_kv(self) -> None:
        self.engines.wake_up(["kv_cache", "scheduling"])


class Disaggregated:
    """Trainers and engines on GPUs of their own: nothing sleeps, wakes or moves; the engines idle (or generate
    ahead, loop.mode=async) with weights and KV cache in place while the trainers train."""

    def release(self) -> None:
        pass

    def onload(self) -> None:
        pass

    def wake_weights(self) -> None:
        pass

    def offload(self) -> None:
        pass

    def wake_kv(self) -> None:
        pass


def side_for(c: Cluster, cfg: ColoConfig) -> PlacementSide:
    """The run's placement side, from the cluster's mode and the resolved trainer.offload / rollout.sleep_level."""
    if c.colocated:
        return Colocated(c.trainer_group, c.engine_group, bool(cfg.trainer.offload), int(cfg.rollout.sleep_level))
    return Disaggregated()
