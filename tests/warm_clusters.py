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

A job that an engine ended (it died, raised or stopped: the failure tests) leaves its trainers whole: the engine is
ended and its cluster kept, and the next job of the shape gets a new engine process in its place beside the others
reconfigured (WarmClusters.release, `replace` of reconfigure). A fresh two-pair cluster costs ~35 CPU-s more than one
new engine (both trainers' and the other engine's processes and imports). Anything less certain (a trainer failed,
an actor does not answer at once, another error) stops the whole cluster as before.

CPU only, engines of one process each (colocated, or disaggregated with rollout.tp_size=1: its weight group is
formed again for the new engines); any other job is refused before anything starts.
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import time
from typing import Any

import ray
import torch

from colo.cluster.liveness import HEARTBEAT_GROUP, Liveness
from colo.cluster.actors import (ActorDied, ActorError, ActorStalled, Cluster, connect_weight_group, engine_name,
                                 gather, leave, start_cluster)
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
        self._suffix: dict[int, str] = {}  # id(cluster) -> its actors' name suffix
        self._replace: dict[int, list[int]] = {}  # id(cluster) -> engines a failure ended: the next job starts them
        self._started = 0
        self._new_engines = 0  # engines started in place of ended ones (their names: colo-engine-<e>-warm<n>-r<k>)
        self.reused = 0  # jobs that ran on a warm cluster (tests read it)

    def check(self, cfg: ColoConfig) -> None:
        """ConfigError for a job warm clusters do not run (colo.launch asks before it writes the run dir)."""
        tp = int(cfg.rollout.tp_size) if cfg.placement.mode == "disaggregated" else 1
        if cfg.placement.device != "cpu" or tp != 1:
            raise ConfigError(f"warm clusters run CPU jobs with one-process engines only (this one: "
                              f"{cfg.placement.device}, {cfg.placement.mode}, rollout.tp_size={tp}); fix: run it as "
                              "its own job (python -m colo.launch)")

    def acquire(self, cfg: ColoConfig, plan: PlacementPlan) -> Cluster:
        """The job's cluster: the idle one of its shape, reconfigured for it (with new engines where a failure ended
        some), else a new one (idle clusters of other shapes are stopped first while Ray lacks the GPUs it needs)."""
        self.check(cfg)
        key = shape(cfg)
        c = self._idle.pop(key, None)
        if c is not None:
            try:
                replace = self._replace.pop(id(c), [])
                names = {}
                for e in replace:
                    self._new_engines += 1
                    names[e] = f"colo-engine-{e}{self._suffix[id(c)]}-r{self._new_engines}"
                c = reconfigure(c, cfg, names)
                self.reused += 1
                return c
            except (ActorDied, ActorError):  # a process of it is gone or broken: a new cluster instead
                self._stop(c)
        self._make_room(plan)
        self._started += 1
        suffix = f"-warm{self._started}"
        c = start_cluster(cfg, plan, trainer_cls=WarmTrainer, engine_cls=WarmEngine, name_suffix=suffix)
        self._shape[id(c)], self._suffix[id(c)] = key, suffix
        return c

    def release(self, c: Cluster | None, healthy: bool, stop: Any = None) -> None:
        """After a job: a healthy cluster waits for the next job of its shape. One that an engine ended keeps its
        trainers and other engines, the engine is ended (ended_engines); any other unhealthy one is stopped (its
        state is not trusted). Ray keeps running."""
        if c is None:
            return
        try:
            key = self._shape[id(c)]
            if not healthy:
                ended = ended_engines(c, sys.exc_info()[1])
                if ended is None:
                    self._stop(c)
                    return
                self._replace[id(c)] = ended
            old = self._idle.pop(key, None)
            if old is not None and old is not c:
                self._stop(old)
            self._idle[key] = c
        except Exception as err:  # noqa: BLE001 (the job's outcome stands; its cluster is lost to reuse)
            print(f"colo: could not return the cluster to the warm clusters: {err}", flush=True)

    def close(self) -> None:
        """Stop every idle cluster: its actors' own shutdown (sync buffers, vLLM), then their processes and groups."""
        while self._idle:
            self._stop(self._idle.pop(next(iter(self._idle))))
        self._shape.clear()

    def _stop(self, c: Cluster) -> None:
        for book in (self._shape, self._suffix, self._replace):
            book.pop(id(c), None)
        stop_cluster(c)

    def _make_room(self, plan: PlacementPlan, timeout_s: float = 30.0) -> None:
        """Stop idle clusters, the oldest first, until Ray has the GPUs and CPUs of the plan's placement groups (a
        group that cannot be placed would wait out create_placement's timeout)."""
        need = {"GPU": float(plan.num_gpus), "CPU": float(len(plan.rows) * plan.cpus_per_bundle)}

        def short() -> bool:
            free = ray.available_resources()
            return any(free.get(k, 0.0) < v for k, v in need.items())

        deadline = time.monotonic() + timeout_s
        while self._idle and short():
            self._stop(self._idle.pop(next(iter(self._idle))))
            while short() and time.monotonic() < deadline:
                time.sleep(0.2)  # Ray frees a removed group's resources a moment later


ANSWER_S = 10.0  # how long ended_engines waits for the other actors of a failed job's cluster to answer


def _pid(actor: Any) -> int:
    return os.getpid()


def ended_engines(c: Cluster, err: BaseException | None) -> list[int] | None:
    """After a job that failed (release runs inside colo.runlife.RunLife.__exit__, so sys.exc_info() holds what ended
    it): the engines it names are ended here and their indices returned, for the next job to start anew; None where
    the whole cluster must go. Kept only when the failure is an engine's (colo.cluster.actors: ActorDied, ActorError,
    ActorStalled naming engines only, as the run's end named them) and every other actor answers a call within
    ANSWER_S: an actor's calls run one at a time outside the heartbeats, so a trainer that answers is inside no
    call, no collective of its process group waits on a peer, and the next job's reconfigure rebuilds its model,
    optimizer and sync buffers as after a healthy job. A trainer's failure, a lost node, a timeout: None."""
    if not isinstance(err, (ActorDied, ActorError, ActorStalled)):
        return None
    names = {engine_name(e, c.colocated): e for e in range(len(c.engines))}

    def engine(name: str) -> int | None:  # "engine DP rank 1", "engine 0 (seen by trainer rank 0 during the ...)"
        return next((e for n, e in names.items() if name == n or name.startswith(f"{n} (seen by ")), None)

    culprits = [engine(n) for n in {err.name, *c.lost}]
    if not culprits or None in culprits:
        return None
    ended = sorted(set(culprits))
    others = [a for name, a in c.actors() if name not in {engine_name(e, c.colocated) for e in ended}]
    refs = [a.__ray_call__.remote(_pid) for a in others]
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=ANSWER_S)
    if pending:
        leave(refs)  # collected once they end (colo.cluster.actors.leave): Ray prints an unread failure
        return None
    try:
        ray.get(done)
    except Exception:  # noqa: BLE001 (an actor died on the way out)
        return None
    for e in ended:  # its own shutdown first where it still answers (vLLM's engine core), as stop_cluster does
        name, a = engine_name(e, c.colocated), c.engines[e]
        pid = c.liveness.pids.pop(name, None)
        if name in c.lost and pid is not None:  # stopped (SIGSTOP) or stuck: it takes no part in its shutdown
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        else:
            ref = a.shutdown.remote()
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=ANSWER_S)
        with contextlib.suppress(Exception):
            ray.kill(a, no_restart=True)
    # gone: a stop_cluster before the next job (close, _make_room) calls nothing on them and kills no stale pid
    c.lost[:] = [engine_name(e, c.colocated) for e in ended]
    return ended


def new_engine(c: Cluster, e: int, cfg: ColoConfig, name: str) -> Any:
    """A WarmEngine actor for engine e of `c`, as start_cluster makes it on CPU: in e's placement group with its
    logical GPU (colocated: the vLLM fraction; disaggregated: one), no CPUs of its own, the heartbeat group. The DP
    master address and port are read only on CUDA, which warm clusters do not run (WarmClusters.check)."""
    from colo.cluster.placement import scheduling

    pg = c.placement_groups[e if c.colocated else len(c.trainers) + e]
    gpus = float(cfg.placement.vllm_gpu_fraction) if c.colocated else 1
    actor = ray.remote(concurrency_groups={HEARTBEAT_GROUP: 1})(WarmEngine)
    return actor.options(num_gpus=gpus, num_cpus=0, name=name, scheduling_strategy=scheduling(pg)).remote(
        to_dict(cfg), e, len(c.engines), 0)


def reconfigure(c: Cluster, cfg: ColoConfig, replace: dict[int, str] | None = None) -> Cluster:
    """Every trainer and engine of `c` on `cfg` (a job of the same shape): all calls issued before any is awaited,
    ranks checked as start_cluster checks them; c.setup says what it took. `replace`: engine index -> the actor
    name of a new engine started for `cfg` in place of one a failure ended (WarmClusters.release)."""
    t0 = time.perf_counter()
    d = to_dict(cfg)
    replace = replace or {}
    trefs = [t.reconfigure.remote(d) for t in c.trainers]
    for e, name in replace.items():
        c.engines[e] = new_engine(c, e, cfg, name)
    erefs = [e.ready.remote() if k in replace else e.reconfigure.remote(d) for k, e in enumerate(c.engines)]
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
    if replace:  # the new engines' pids, by which a stopped one is killed (as start_cluster notes every actor's)
        c.liveness.note_pids([(engine_name(e, c.colocated), c.engines[e]) for e in replace])
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
