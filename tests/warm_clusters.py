"""Warm clusters: the test suite runs its short CPU jobs in turn on the same trainer and engine processes.

    warm = WarmClusters()
    colo.launch.main(["loop.steps=3"], clusters=warm)                      # starts a cluster
    colo.launch.main(["trainer.lr=1e-3", "loop.steps=3"], clusters=warm)   # same shape: the same processes
    warm.close()

Test machinery, not the product's: colo.launch.main and colo.loop.run take any `clusters` with check / acquire /
release (colo.runlife.Clusters; the product's OwnCluster starts a cluster per job and ends it). Starting a job is
most of what a short CPU job costs: ~51 CPU-s for a one-pair tiny job of one RL step, of which the steps take a few
(measured 2026-11-26 on the 2-core machine), the rest being processes starting: Ray's daemons, each actor's
imports (vLLM's alone ~12 CPU-s), the process group, vLLM's engine. A warm cluster keeps the processes: the next
job whose placement has the same shape gets them reconfigured (WarmTrainer.reconfigure, WarmEngine.reconfigure
build the model, optimizer and vLLM engine again for its config, its run dir and logs), and only a job of another
shape starts a cluster of its own (tests/conftest.py `run_job`). That a reconfigured cluster computes what a fresh
process does is tests/e2e/test_multinode.py's check: its warm reference equals its two-node process run.

CPU only, engines of one process each (colocated, or disaggregated with rollout.tp_size=1: its weight group is
formed again for the new engines); any other job is refused before anything starts.
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from typing import Any

import ray
import torch

from colo.cluster.liveness import Liveness
from colo.cluster.actors import ActorDied, ActorError, Cluster, connect_weight_group, engine_name, gather, start_cluster
from colo.cluster.placement import PlacementPlan
from colo.config import ColoConfig, ConfigError, check_resolved, from_dict, to_dict
from colo.host.shm import sweep
from colo.rollout.engine import Engine, check_model_dir
from colo.run.logs import actor_output
from colo.trainer.worker import Trainer


class WarmTrainer(Trainer):
    def reconfigure(self, cfg: dict) -> dict:
        """The next job: the same process, rank, world and process group, another config. The model, reference and
        optimizer are built again for it and the output goes to the new run's log; what a fresh actor would cost on
        top (the process, its imports, the process group: most of a tiny job's trainer start-up) is skipped. The
        placement (device, world size) cannot change here: WarmClusters only hands a cluster to a job of the same
        shape."""
        new = from_dict(cfg)
        check_resolved(new, "WarmTrainer.reconfigure")  # as Trainer.__init__: resolved on the driver
        if (new.placement.device, new.placement.mode) != (self.cfg.placement.device, self.cfg.placement.mode):
            raise ValueError(f"reconfigure: placement {new.placement.device}/{new.placement.mode} but this trainer "
                             f"runs {self.cfg.placement.device}/{self.cfg.placement.mode}; start a new cluster")
        t0 = time.perf_counter()
        self.release_sync_buffers()
        if self._weight_group is not None:  # disaggregated rank 0: the engines' new workers join a new group
            self._weight_group.close()
            self._weight_group = self._group_host = None
        self.model = self.ref_model = self.optimizer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.cfg = new
        self.log = actor_output(str(new.run.dir), bool(new.run.verbose), "trainer", self.rank)
        sweep()
        self.offloaded, self.consecutive_skipped = False, 0
        self._slots, self._packed = [0.0, 0.0], None
        return {**self._build(), "seconds": time.perf_counter() - t0}


class WarmEngine(Engine):
    def reconfigure(self, cfg: dict) -> dict:
        """The next job: a new vLLM engine for another config in this process, whose environment, core binding and
        vLLM import stay (the import alone is ~12 CPU-s on the 2-core test machine). The placement cannot change;
        the engine before is gone, with its KV cache and prefix cache, before the next one starts. A disaggregated
        engine's weight group went with its vLLM worker: the caller joins it to a new one (reconfigure below)."""
        t0 = time.perf_counter()
        new = from_dict(cfg)
        check_resolved(new, "WarmEngine.reconfigure")  # as Engine.__init__: resolved on the driver
        fixed = ("device", "mode")
        if any(getattr(new.placement, k) != getattr(self.cfg.placement, k) for k in fixed) or \
                new.rollout.enforce_eager != self.cfg.rollout.enforce_eager:
            raise ValueError("reconfigure: another placement or rollout.enforce_eager than this engine started with "
                             "(both are set up once per process); start a new cluster")
        check_model_dir(new.model.path)
        self.cfg = new
        self.log = actor_output(new.run.dir, new.run.verbose, "engine", self.rank)
        sweep()
        del self.llm  # the old engine must be gone before the next one sets up (its memory, vLLM's state)
        gc.collect()
        self.__dict__.pop("_env", None)  # the environment and framing of the job before
        self._start_llm()
        self.sleeping = set()
        self.start_s = time.perf_counter() - t0
        return self.ready()


def shape(cfg: ColoConfig) -> tuple:
    """What a cluster's processes are set up for once, at their start: jobs that differ here need other processes."""
    p = cfg.placement
    return (p.device, p.mode, int(p.num_gpus), int(p.trainer_gpus), int(cfg.rollout.tp_size),
            float(p.train_gpu_fraction), float(p.vllm_gpu_fraction), bool(cfg.rollout.enforce_eager),
            cfg.run.ray_address or "")


class WarmClusters:
    """Idle clusters of this driver process, one per shape, oldest first (colo.runlife.Clusters)."""

    def __init__(self) -> None:
        self._idle: dict[tuple, Cluster] = {}
        self._shape: dict[int, tuple] = {}  # id(cluster) -> its shape
        self._started = 0
        self.reused = 0  # jobs that ran on a warm cluster (tests read it)

    def check(self, cfg: ColoConfig) -> None:
        """ConfigError for a job warm clusters do not run (colo.launch asks before it writes the run dir)."""
        tp = int(cfg.rollout.tp_size) if cfg.placement.mode == "disaggregated" else 1
        if cfg.placement.device != "cpu" or tp != 1:
            raise ConfigError(f"warm clusters run CPU jobs with one-process engines only (this one: "
                              f"{cfg.placement.device}, {cfg.placement.mode}, rollout.tp_size={tp}); fix: run it as "
                              "its own job (python -m colo.launch)")

    def acquire(self, cfg: ColoConfig, plan: PlacementPlan) -> Cluster:
        """The job's cluster: the idle one of its shape, reconfigured for it, else a new one (idle clusters of other
        shapes are stopped first while Ray lacks the GPUs it needs)."""
        self.check(cfg)
        key = shape(cfg)
        c = self._idle.pop(key, None)
        if c is not None:
            try:
                c = reconfigure(c, cfg)
                self.reused += 1
                return c
            except (ActorDied, ActorError):  # a process of it is gone or broken: a new cluster instead
                stop_cluster(c)
        self._make_room(plan)
        self._started += 1
        c = start_cluster(cfg, plan, trainer_cls=WarmTrainer, engine_cls=WarmEngine,
                          name_suffix=f"-warm{self._started}")
        self._shape[id(c)] = key
        return c

    def release(self, c: Cluster | None, healthy: bool, stop: Any = None) -> None:
        """After a job: a healthy cluster waits for the next job of its shape; one whose actor died or raised is
        stopped (its state is not trusted). Ray keeps running."""
        if c is None:
            return
        try:
            key = self._shape[id(c)]
            if not healthy:
                self._shape.pop(id(c))
                stop_cluster(c)
                return
            old = self._idle.pop(key, None)
            if old is not None and old is not c:
                self._shape.pop(id(old), None)
                stop_cluster(old)
            self._idle[key] = c
        except Exception as err:  # noqa: BLE001 (the job's outcome stands; its cluster is lost to reuse)
            print(f"colo: could not return the cluster to the warm clusters: {err}", flush=True)

    def close(self) -> None:
        """Stop every idle cluster: its actors' own shutdown (sync buffers, vLLM), then their processes and groups."""
        while self._idle:
            stop_cluster(self._idle.pop(next(iter(self._idle))))
        self._shape.clear()

    def _make_room(self, plan: PlacementPlan, timeout_s: float = 30.0) -> None:
        """Stop idle clusters, the oldest first, until Ray has the GPUs and CPUs of the plan's placement groups (a
        group that cannot be placed would wait out create_placement's timeout)."""
        need = {"GPU": float(plan.num_gpus), "CPU": float(len(plan.rows) * plan.cpus_per_bundle)}

        def short() -> bool:
            free = ray.available_resources()
            return any(free.get(k, 0.0) < v for k, v in need.items())

        deadline = time.monotonic() + timeout_s
        while self._idle and short():
            stop_cluster(self._idle.pop(next(iter(self._idle))))
            while short() and time.monotonic() < deadline:
                time.sleep(0.2)  # Ray frees a removed group's resources a moment later


def reconfigure(c: Cluster, cfg: ColoConfig) -> Cluster:
    """Every trainer and engine of `c` on `cfg` (a job of the same shape): all calls issued before any is awaited,
    ranks checked as start_cluster checks them; c.setup says what it took."""
    t0 = time.perf_counter()
    d = to_dict(cfg)
    trefs = [t.reconfigure.remote(d) for t in c.trainers]
    erefs = [e.reconfigure.remote(d) for e in c.engines]
    setups = gather(trefs, [f"trainer rank {r}" for r in range(len(trefs))])
    t_train = time.perf_counter() - t0
    readies = gather(erefs, [engine_name(e, c.colocated) for e in range(len(erefs))])
    if [s.get("rank") for s in setups] != list(range(len(setups))) or \
            [e.get("rank") for e in readies] != list(range(len(readies))):
        raise RuntimeError(f"rank misalignment after reconfigure: trainers {[s.get('rank') for s in setups]}, "
                           f"engines {[e.get('rank') for e in readies]}")
    c.setup = {"trainer_setup_s": t_train, "engine_start_s": max(float(e.get("start_s", 0.0)) for e in readies)}
    if not c.colocated:
        t = time.perf_counter()
        connect_weight_group(c.trainers[0], c.engines, 1)
        c.setup["weight_group_s"] = time.perf_counter() - t
    c.setup["cluster_s"] = time.perf_counter() - t0
    c.lost.clear()  # in place: the liveness records into the same list
    c.liveness = Liveness(cfg.run.heartbeat_s, cfg.run.stall_s, lost=c.lost,  # this job's settings, nothing measured
                          pids=c.liveness.pids, watched=c.liveness.watched, ping_every_s=c.liveness.ping_every_s)
    return c


def stop_cluster(c: Cluster, timeout_s: float = 30.0) -> None:
    """A cluster's actors and placement groups gone, bounded: each actor's shutdown first (it unlinks the sync
    buffers and stops vLLM's engine core, which ray.kill would not), then the processes and groups."""
    from ray.util.placement_group import remove_placement_group

    gone = set(c.lost)
    ends = [a.shutdown.remote() for name, a in c.actors() if name not in gone]
    if ends:
        ray.wait(ends, num_returns=len(ends), timeout=timeout_s)
    for name in gone:  # stopped or stuck (colo.cluster.liveness): ray.kill leaves a stopped process be
        pid = c.liveness.pids.get(name)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for _, a in c.actors():
        with contextlib.suppress(Exception):
            ray.kill(a, no_restart=True)
    for pg in c.placement_groups:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
