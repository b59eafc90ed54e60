"""Start the Ray actors of a job, and the typed handles the loop calls them through.

    c = start_cluster(cfg, plan)                      # trainer_cls=/engine_cls=: subclasses (bench, tests)
    c.trainer_group.train_step(shards)                # every rank at once; a failure names its actor
    c.engine_group.sleep(2)

Colocated: per GPU r, trainer rank r and engine r (vLLM DP rank r) in placement group r. Disaggregated:
trainer ranks on GPUs of their own, engines (TP over their own GPUs) on the others, joined by the
weight-broadcast group of trainer rank 0 (colo.sync.transport).

Rank alignment is the invariant the whole weight path rests on (trainer rank r pushes over CUDA IPC /
shared memory to the engine on the same GPU, and FSDP's expert shard r is engine r's expert slice), so it
is checked here from what the actors report, not assumed from the order we created them in.

Actors are named `colo-trainer-{r}` / `colo-engine-{r}` in the job's (anonymous, per-driver) Ray namespace,
so `ray.get_actor` finds them from driver-side code (debugging, the failure tests' reward functions).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from colo.algo.batch import to_wire
from colo.config import ColoConfig, to_dict
from colo.cluster.head import check_head, unwatch_head
from colo.cluster.liveness import HEARTBEAT_GROUP, Liveness, Watch
from colo.host.procs import record, stop_recorded
from colo.cluster.nodes import Lost, gpu_nodes, locate, lost_nodes, on_nodes
from colo.cluster.placement import PlacementPlan, create_disaggregated_placement, create_placement, scheduling

if TYPE_CHECKING:  # the actor classes import torch / vLLM helpers: start_cluster imports them when called
    from colo.rollout.engine import Engine
    from colo.rollout.generation import Generation
    from colo.trainer.worker import Trainer


@dataclass
class Cluster:
    """The actors of one job. Colocated: index r = rank r = placement group r. Disaggregated: trainers[r]
    is FSDP rank r, engines[e] is engine e, placement_groups holds the trainers' groups then the engines'."""

    trainers: list
    engines: list
    placement_groups: list
    setup: dict = field(default_factory=dict)  # start-up seconds: trainer_setup_s, engine_start_s, cluster_s
    mode: str = "colocated"
    ranks_by_node: dict = field(default_factory=dict)  # Ray node id -> (node IP, ["trainer rank 0", ...])
    lost: list = field(default_factory=list)  # names of the actors on nodes found lost (node_loss), stopped or stuck
    liveness: Liveness = field(default_factory=Liveness)  # heartbeats and deadlines of its calls (run.heartbeat_s)

    def __post_init__(self) -> None:
        self.liveness.lost = self.lost  # one list: what the run's end does not wait for

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"

    def actors(self) -> list[tuple[str, Any]]:
        """(name, handle) of every actor, named as failures name them (ranks_by_node, lost nodes)."""
        return [(f"trainer rank {r}", t) for r, t in enumerate(self.trainers)] + \
            [(engine_name(e, self.colocated), a) for e, a in enumerate(self.engines)]

    @property
    def trainer_group(self) -> TrainerGroup:
        return TrainerGroup(self.trainers, self.engines, self.colocated, self.liveness)

    @property
    def engine_group(self) -> EngineGroup:
        return EngineGroup(self.engines, self.colocated, self.liveness)


def engine_name(e: int, colocated: bool) -> str:
    """How failures name engine e: colocated engines are one vLLM DP group, disaggregated ones are not."""
    return f"engine DP rank {e}" if colocated else f"engine {e}"


def start_cluster(cfg: ColoConfig, plan: PlacementPlan, trainer_cls: type[Trainer] | None = None,
                  engine_cls: type[Engine] | None = None, name_suffix: str = "") -> Cluster:
    """Create placement groups, then trainers and engines in them; returns once every actor is ready.

    Colocated: trainer rank r and engine r share placement group r, each with its GPU fraction. On GPU
    the engine actor itself takes 0 GPUs: vLLM's Ray executor places its worker into bundle 0 with the
    vLLM fraction (measured: an engine actor holding its own fraction hangs at start-up). On CPU the
    engines are independent replicas and hold Ray's logical GPU fraction themselves.
    Disaggregated: trainers take a whole GPU each in groups of their own; on GPU an engine actor again
    takes none (its TP workers go into the engine group's bundles), on CPU a TP-1 engine holds its
    logical GPU; then the weight-broadcast group is connected.

    `trainer_cls` / `engine_cls`: plain subclasses of Trainer / Engine (colo.bench.engines adds the
    yardsticks, tests add hooks); made into Ray actors here, like the product classes. `name_suffix` is added to
    the actors' names, so several clusters can live in one namespace (the test suite's warm clusters)."""
    from colo.rollout.engine import Engine
    from colo.trainer.worker import Trainer

    trainer_cls, engine_cls = trainer_cls or Trainer, engine_cls or Engine
    if not (issubclass(trainer_cls, Trainer) and issubclass(engine_cls, Engine)):
        raise TypeError(f"start_cluster takes subclasses of Trainer and Engine, got {trainer_cls} and {engine_cls}")
    # heartbeats run on a thread of their own beside each actor's calls (colo.cluster.liveness)
    groups = {HEARTBEAT_GROUP: 1}
    TrainWorker = ray.remote(concurrency_groups=groups)(trainer_cls)  # noqa: N806
    RolloutEngine = ray.remote(concurrency_groups=groups)(engine_cls)  # noqa: N806
    t0 = time.perf_counter()
    colocated, cuda = plan.mode == "colocated", cfg.placement.device == "cuda"
    if not plan.node_order:  # ranks fill the cluster's GPU nodes in order (colo.cluster.nodes)
        plan = on_nodes(plan, gpu_nodes())
    if colocated:
        trainer_pgs = engine_pgs = create_placement(plan)
        train_gpus, engine_gpus = cfg.placement.train_gpu_fraction, cfg.placement.vllm_gpu_fraction
    else:
        trainer_pgs, engine_pgs = create_disaggregated_placement(plan)
        train_gpus, engine_gpus = 1, 1
    # addresses and ports from the nodes that use them: trainer rank 0's node hosts the torch.distributed
    # rendezvous, engine 0's node vLLM's DP master (colocated GPU only: CPU engines and disaggregated TP
    # engines form no DP group)
    at_trainer, at_engine = locate(trainer_pgs), locate(engine_pgs)
    master_addr, master_port = at_trainer[0]["node_ip"], at_trainer[0]["port"]
    dp_addr, dp_port = (at_engine[0]["node_ip"], at_engine[0]["port"]) if colocated else ("", 0)
    local = [sum(w["node_id"] == at_engine[e]["node_id"] for w in at_engine[:e]) for e in range(len(at_engine))]
    cfg_dict, world = to_dict(cfg), len(trainer_pgs)
    trainers = [TrainWorker.options(num_gpus=train_gpus, num_cpus=1, name=f"colo-trainer-{r}{name_suffix}",
                                    scheduling_strategy=scheduling(pg)).remote(cfg_dict, r, world, master_addr,
                                                                               master_port)
                for r, pg in enumerate(trainer_pgs)]
    engines = [RolloutEngine.options(num_gpus=0 if cuda else engine_gpus, num_cpus=0,
                                     name=f"colo-engine-{e}{name_suffix}",
                                     scheduling_strategy=scheduling(pg)).remote(
                                         cfg_dict, e, len(engine_pgs), dp_port, dp_master_addr=dp_addr,
                                         dp_local_rank=local[e])
               for e, pg in enumerate(engine_pgs)]
    ranks_by_node: dict[str, tuple[str, list[str]]] = {}
    for name, w in [(f"trainer rank {r}", w) for r, w in enumerate(at_trainer)] + \
            [(engine_name(e, colocated), w) for e, w in enumerate(at_engine)]:
        ranks_by_node.setdefault(w["node_id"], (w["node_ip"], []))[1].append(name)
    setups = gather([t.setup.remote() for t in trainers], [f"trainer rank {r}" for r in range(world)])
    t_train = time.perf_counter() - t0
    readies = gather([e.ready.remote() for e in engines], [engine_name(e, colocated) for e in range(len(engines))])
    check_alignment(setups, readies, colocated)
    setup = {"trainer_setup_s": t_train,
             "engine_start_s": max(float(e.get("start_s", 0.0)) for e in readies)}
    if colocated:
        pgs = trainer_pgs
    else:
        t = time.perf_counter()
        connect_weight_group(trainers[0], engines, plan.tp_size)
        setup["weight_group_s"] = time.perf_counter() - t
        pgs = trainer_pgs + engine_pgs
    setup["cluster_s"] = time.perf_counter() - t0
    record()  # the actors' processes, and what they started, stopped by id when the run ends (colo.host.procs)
    c = Cluster(trainers, engines, pgs, setup, mode=plan.mode, ranks_by_node=ranks_by_node,
                liveness=Liveness(cfg.run.heartbeat_s, cfg.run.stall_s))
    c.liveness.note_pids(c.actors())
    return c


def check_alignment(setups: list[dict], readies: list[dict], colocated: bool) -> None:
    """What the actors report against what the weight path assumes (trainers' setup(), engines' ready(), in rank
    order): ranks in placement group order; colocated, trainer rank r and engine r on one GPU (CUDA IPC between
    them; None on CPU); disaggregated, no GPU shared. Raises RuntimeError naming the misfit."""
    if [s.get("rank") for s in setups] != list(range(len(setups))) or \
            [e.get("rank") for e in readies] != list(range(len(readies))):
        raise RuntimeError(f"rank misalignment: trainers report {[s.get('rank') for s in setups]}, "
                           f"engines {[e.get('rank') for e in readies]} (placement group order)")
    if colocated:
        for r, (s, e) in enumerate(zip(setups, readies)):
            if s.get("device_uuid") != e.get("device_uuid"):
                raise RuntimeError(f"trainer rank {r} is on GPU {s.get('device_uuid')} but {engine_name(r, True)} is "
                                   f"on {e.get('device_uuid')}: CUDA IPC needs them on the same GPU")
        return
    shared = {s.get("device_uuid") for s in setups} & {e.get("device_uuid") for e in readies} - {None}
    if shared:
        raise RuntimeError(f"disaggregated mode, but a trainer and an engine share GPU {sorted(shared)}")


def connect_weight_group(trainer0: Any, engines: list, tp_size: int) -> None:
    """Trainer rank 0 (group rank 0) and every engine worker (rank 1 + e * tp + t) form one group; all of
    them must join at once, so every call is issued before any is awaited."""
    world = 1 + len(engines) * tp_size
    address = ray.get(trainer0.open_weight_group.remote(world))
    refs = [e.join_weight_group.remote(address, 1 + i * tp_size) for i, e in enumerate(engines)]
    gather([trainer0.join_weight_group.remote(), *refs], ["trainer rank 0"] + [f"engine {i}" for i in range(len(engines))],
           timeout=600)


def gather(refs: list, who: list[str], timeout: float | None = None, engines: list | None = None,
           paired: bool = True, colocated: bool = True, watch: Watch | None = None) -> list:
    """ray.get of all refs that fails on the first failure, naming the actor: ActorDied when it is gone,
    ActorError when its method raised, ActorStalled when it stopped or is stuck (`watch`: colo.cluster.liveness;
    the callees and `engines` are watched, and the call's time is measured when it returns). `engines`: the engines
    the callees talk to (the sync), so an engine that died or raised under a trainer's call is named by its index;
    `paired`: callee i talks to engine i only (colocated), the fallback when Ray's error does not carry the dead
    engine's id; `colocated`: how engines are named (colo.cluster.actors.engine_name).

    Results are taken in completion order, not rank order: when rank 1 dies, rank 0 may be blocked in a
    collective waiting for it (gloo's default timeout is 30 min), so ray.get(rank 0) first would hang."""
    out, pending = {}, {ref: i for i, ref in enumerate(refs)}
    try:
        check_head()  # a lost head ends the run here, once (colo.cluster.head)
        _gather(out, pending, who, timeout, engines, paired, colocated, watch)
    except BaseException:
        leave(list(pending))  # the other ranks' calls: collected when they end, never dropped unread
        raise
    if watch is not None:
        watch.live.measured(watch.kind, time.monotonic() - watch.started)
    return [out[i] for i in range(len(refs))]


_LEFT: list = []  # (Ray job, reference) a failure left unfinished (collect_failed)


def leave(refs: list) -> None:
    """Keep `refs` until they end and collect them then (collect_failed): a reference that ends in an error and is
    dropped unread makes Ray print its "Unhandled error" dump (108 lines after a trainer rank died: the other rank's
    failed collective) on the terminal, after colo's own line."""
    job = _ray_job() if ray.is_initialized() else None
    _LEFT.extend((job, r) for r in refs)
    collect_failed()


def _ray_job() -> tuple[str, str]:
    """This driver's Ray: its cluster's session and its job. Job ids alone repeat: every fresh Ray numbers its first
    job 01000000."""
    return ray._private.worker.global_worker.node.session_name, ray.get_runtime_context().get_job_id()


def collect_failed(timeout: float = 0.0) -> None:
    """ray.get every reference left by a failure that has ended, its error dropped (colo already reported the
    failure); the rest stay kept. The run's end calls it before its actors and Ray are stopped. References of an
    earlier Ray of this process (stopped without shutdown_ray: a test's own ray.shutdown) went with it: Ray refuses
    to wait on them ("owner is unknown"), so they are dropped. Never raises: it runs while a failure is reported."""
    if not _LEFT or not ray.is_initialized():
        return
    job = _ray_job()
    refs = [r for j, r in _LEFT if j == job]
    try:
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
    except Exception:  # noqa: BLE001 (Ray refused a reference: drop them all rather than hide the failure)
        _LEFT.clear()
        return
    for ref in done:
        try:
            ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 (read, so that Ray counts it handled)
            pass
    _LEFT[:] = [(job, r) for r in pending]


def shutdown_ray() -> None:
    """The end of a run's Ray: the failed references collected, ray.shutdown(), then every process the run recorded
    (colo.host.procs: Ray's agents outlive a shutdown) stopped by its id."""
    collect_failed()
    ray.shutdown()
    _LEFT.clear()  # references of a Ray that is gone: nothing reports them now
    unwatch_head()
    stop_recorded()


def _gather(out: dict, pending: dict, who: list[str], timeout: float | None, engines: list | None, paired: bool,
            colocated: bool, watch: Watch | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        every = None if watch is None else watch.live.ping_every_s
        wait = left if every is None else min(every, every if left is None else left)
        done, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
        if not done:
            if deadline is not None and time.monotonic() >= deadline:
                late = ", ".join(who[i] for i in pending.values())
                raise TimeoutError(f"{late} did not answer in {timeout:.0f} s")
            stalled = watch.check([who[i] for i in pending.values()]) if watch is not None else None
            if stalled is not None:
                raise ActorStalled(stalled.names, stalled.why, stalled.callers_free)
            continue
        i = pending.pop(done[0])
        try:
            out[i] = ray.get(done[0])
        except ray.exceptions.RayTaskError as e:
            # Checked first: Ray raises a task's error as an instance of its cause's class too, so a live
            # trainer whose call into a dead engine failed would otherwise read as a dead trainer.
            cause = getattr(e, "cause", None)
            if isinstance(cause, ray.exceptions.RayActorError) and who[i].startswith("trainer"):
                dead = _engine_index(cause, engines)  # trainers only call engines (the sync)
                dead = i if dead is None and paired else dead
                name = "an engine" if dead is None else engine_name(dead, colocated)
                raise ActorDied(f"{name} (seen by {who[i]} during the weight sync)") from e
            raised = _raising_engine(e, engines) if who[i].startswith("trainer") else None
            name = (who[i] if raised is None
                    else f"{engine_name(raised, colocated)} (seen by {who[i]} during the weight sync)")
            raise ActorError(name, e) from e
        except ray.exceptions.RayActorError as e:
            raise ActorDied(who[i]) from e


def _engine_index(err: Exception, engines: list | None) -> int | None:
    dead = getattr(err, "actor_id", None)
    for k, e in enumerate(engines or []):
        if dead is not None and dead == e._actor_id.hex():
            return k
    return None


def _raising_engine(err: Exception, engines: list | None) -> int | None:
    """The engine whose method raised inside a trainer's call. Ray folds the chain of remote errors into
    one message with a header per actor ("ray::Engine.load_bucket() (pid=.., actor_id=<hex>, ..)");
    the actor id is the one stable name in it (the nested RayTaskError objects are not kept)."""
    text = str(err)
    for k, e in enumerate(engines or []):
        if f"actor_id={e._actor_id.hex()}" in text:
            return k
    return None


class ActorError(RuntimeError):
    """An actor's method raised (the actor lives on). `name` says which actor, e.g. "engine DP rank 0";
    the message is one line: the original exception's type and first line. The remote traceback stays in
    the RayTaskError this is raised from (its __cause__)."""

    def __init__(self, name: str, err: Exception) -> None:
        cause = getattr(err, "cause", None) or err  # Ray keeps the innermost original exception here
        first = (str(cause).strip().splitlines() or [""])[0]
        super().__init__(f"{name} raised {type(cause).__name__}: {first}")
        self.name = name


class ActorStalled(RuntimeError):
    """An actor stopped answering (no heartbeat) or is stuck in a call (past its deadline): colo.cluster.liveness.
    `name` is the first such actor; `callers_free`: the trainers are not inside a call, so they can still save."""

    def __init__(self, names: list[str], why: str, callers_free: bool) -> None:
        super().__init__(f"{' and '.join(names)} {why}")
        self.name = names[0]
        self.callers_free = callers_free


class NodeLost(RuntimeError):
    """One or more of the job's nodes died or cannot be reached; `name` is "node <ip>" (the first one)."""

    def __init__(self, lost: list[Lost], seen: Exception) -> None:
        super().__init__("; ".join(n.describe() for n in lost) + f" (first noticed as: {seen})")
        self.name = f"node {lost[0].ip}"
        self.trainers = [r for n in lost for r in n.ranks if r.startswith("trainer")]


def node_loss(c: Cluster, err: Exception) -> NodeLost | None:
    """After an actor died or raised: NodeLost when any of the job's nodes is gone, else None. Asked only
    on failure (a probe of each node, seconds at most); records the lost actors in c.lost."""
    try:
        lost = lost_nodes(c.ranks_by_node)
    except Exception:  # noqa: BLE001 (Ray itself in trouble: the original error is still the best news)
        return None
    if not lost:
        return None
    c.lost[:] = [r for n in lost for r in n.ranks]  # in place: c.liveness records into the same list
    return NodeLost(lost, err)


class ActorDied(RuntimeError):
    """An actor process is gone (crash, OOM kill, node loss); `name` says which, e.g. "engine DP rank 1"."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name} died")  # colo.runlife.fail names its log file
        self.name = name


class TrainerGroup:
    """Every trainer rank, called at once (the methods are collective); results in rank order. A failure
    raises ActorDied / ActorError naming the trainer, or the engine it was talking to in a sync."""

    def __init__(self, trainers: list, engines: list, colocated: bool, liveness: Liveness | None = None) -> None:
        self.trainers, self.engines, self.colocated = trainers, engines, colocated
        self.liveness = liveness

    def _gather(self, refs: list, kind: str, timeout: float | None = None, sync: bool = False) -> list:
        """`kind`: the call, for its deadline (colo.cluster.liveness); `sync`: the engines are watched too."""
        names = [f"trainer rank {r}" for r in range(len(refs))]
        watched = list(zip(names, self.trainers)) + \
            ([(engine_name(e, self.colocated), a) for e, a in enumerate(self.engines)] if sync else [])
        watch = self.liveness.watch(kind, watched) if self.liveness is not None else None
        return gather(refs, names, timeout, engines=self.engines, paired=self.colocated, colocated=self.colocated,
                      watch=watch)

    def sync_engines(self) -> list[list]:
        """Per rank, the engines its sync writes: colocated, the one on its GPU; disaggregated, all."""
        return [[e] for e in self.engines] if self.colocated else [self.engines] * len(self.trainers)

    def memory(self) -> list[dict]:
        return self._gather([t.memory.remote() for t in self.trainers], "memory")

    def onload(self) -> list[dict]:
        return self._gather([t.onload.remote() for t in self.trainers], "onload")

    def offload(self) -> list[dict]:
        return self._gather([t.offload.remote() for t in self.trainers], "offload")

    def sft_step(self, shards: list[dict]) -> list[dict]:
        return self._gather([t.sft_step.remote(to_wire(b)) for t, b in zip(self.trainers, shards)], "sft_step")

    def train_step(self, shards: list[dict]) -> list[dict]:
        """Each shard crosses Ray as numpy arrays (colo.algo.batch.to_wire: no pickling of the tensors)."""
        return self._gather([t.train_step.remote(to_wire(b)) for t, b in zip(self.trainers, shards)], "train_step")

    def prepare_sync(self) -> list[dict]:
        return self._gather([t.prepare_sync.remote(e) for t, e in zip(self.trainers, self.sync_engines())],
                            "prepare_sync", sync=True)

    def sync_weights(self, probe: dict | None = None) -> list[dict]:
        """Every rank's sync report; with `probe` (colo.sync.probe.ProbeSchedule's), each also holds the policy's
        scores and layer check records."""
        return self._gather([t.sync_weights.remote(e, probe) for t, e in zip(self.trainers, self.sync_engines())],
                            "sync_weights", sync=True)

    def save_checkpoint(self, path: str, extra: dict, timeout: float | None = None) -> None:
        self._gather([t.save_checkpoint.remote(path, extra) for t in self.trainers], "save_checkpoint", timeout)

    def load_checkpoint(self, path: str) -> dict:
        return self._gather([t.load_checkpoint.remote(path) for t in self.trainers], "load_checkpoint")[0]

    def export_hf(self, path: str) -> None:
        self._gather([t.export_hf.remote(path) for t in self.trainers], "export_hf")


class EngineGroup:
    """Every engine, called at once; results in engine order; a failure names the engine."""

    def __init__(self, engines: list, colocated: bool, liveness: Liveness | None = None) -> None:
        self.engines, self.colocated = engines, colocated
        self.liveness = liveness

    def _gather(self, refs: list, kind: str, which: list[int] | None = None) -> list:
        """`kind`: the call, for its deadline (colo.cluster.liveness); `which`: the engines called (all)."""
        which = list(range(len(refs))) if which is None else which
        names = [engine_name(e, self.colocated) for e in which]
        watch = (self.liveness.watch(kind, [(n, self.engines[e]) for n, e in zip(names, which)])
                 if self.liveness is not None else None)
        return gather(refs, names, watch=watch)

    def submit(self, gens: list[Generation]) -> list:
        """Engine e starts gens[e] (colo.rollout.generation: single-turn, multi-turn or partial); one Ray reference
        per engine for collect(), so a caller can work while they generate (loop.mode=async, disaggregated)."""
        return [e.generate.remote(g) for e, g in zip(self.engines, gens)]

    def collect(self, refs: list) -> list[tuple[list[dict], dict]]:
        """Per engine, Engine.generate's (outputs, stats)."""
        return self._gather(refs, "generate")

    def probe(self, probe: dict) -> list[dict]:
        """Each engine's scores and layer check records (Engine.probe), all at once (a DP group steps together)."""
        return self._gather([e.probe.remote(probe) for e in self.engines], "probe")

    def sleep(self, level: int) -> list[float]:
        return self._gather([e.sleep.remote(level) for e in self.engines], "sleep")

    def wake_up(self, tags: list[str] | None) -> list[float]:
        return self._gather([e.wake_up.remote(tags) for e in self.engines], "wake_up")
