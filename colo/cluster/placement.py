"""Where everything runs, for both placement modes.

colocated: one Ray placement group per GPU, a trainer rank and a vLLM rank in each.

    plan = plan_placement(cfg)           # pure: rows of (GPU, role, trainer/DP/TP/EP rank, shares)
    init_ray(plan)                       # CPU: a local Ray whose logical GPUs stand in for real ones
    pgs = create_placement(plan)         # one PG per GPU, bundle {"GPU": 1, "CPU": k}, ready, ordered
    TrainWorker.options(num_gpus=plan.train_gpu_fraction, scheduling_strategy=scheduling(pgs[r]))

Invariant the loop relies on: trainer rank r, engine DP rank r (and on GPU, EP rank r) all live in
pgs[r], so they share one device; pgs are ordered by (node, GPU id) so rank order follows the
hardware. With rows placed on nodes (colo.cluster.nodes.on_nodes: filled node by node), each bundle also selects
its node by Ray node id (label ray.io/node-id), and the node order is the plan's.
Why one PG per GPU and not one PG with N bundles: vLLM's Ray executor places its worker
in "bundle 0" of the placement group it is handed (VLLM_RAY_BUNDLE_INDICES), so each engine needs a
PG whose bundle 0 is its own GPU (measured: docs/vllm-notes.md, "DP+EP inside Ray").

disaggregated: trainer ranks and engines on different GPUs; weights go from trainer rank 0 to the
engines by broadcast, so no trainer needs to share a device with an engine.

    trainer_pgs, engine_pgs = create_disaggregated_placement(plan)
    # trainer_pgs[r]: one bundle, trainer rank r takes the whole GPU
    # engine_pgs[e]:  plan.tp_size bundles, STRICT_PACK (one node: TP traffic stays on NVLink);
    #                 bundle t is the GPU of engine e's TP worker t

On CPU the "GPUs" are Ray logical GPU resources (ray.init(num_gpus=N)); fractions and bundles behave
exactly as on a GPU host, so this module is tested for real without one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from colo.config import ColoConfig, ConfigError, expert_parallel_size, resolve_device
from colo.cluster.nodes import locate, pin

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass(frozen=True)
class PlacementRow:
    gpu: int  # index of the GPU in plan order (trainers first, then engine 0's TP GPUs, engine 1's, ...)
    bundle: str  # colocated "pg<gpu>/0"; disaggregated "trainer-pg<r>/0" or "engine-pg<e>/<tp_rank>"
    trainer_rank: int  # FSDP2 rank (-1: no trainer on this GPU)
    dp_rank: int  # vLLM data-parallel rank = engine index: this engine's share of the prompts (-1: none)
    ep_rank: int  # vLLM expert-parallel rank (0 where EP is 1: each engine holds all experts; -1: none)
    train_fraction: float  # Ray num_gpus of the TrainWorker (disaggregated: 1.0, 0.0 on engine GPUs)
    vllm_fraction: float  # Ray num_gpus of the engine (on GPU: VLLM_RAY_PER_WORKER_GPUS)
    vllm_memory: str  # "gpu_memory_utilization=0.4" (GPU) or "kv_cache=256MiB" (CPU); "-": no engine
    role: str  # colocated "trainer+engine"; disaggregated "trainer" or "engine"
    tp_rank: int  # rank within the engine's tensor-parallel group (-1: no engine on this GPU)
    node: str = ""  # Ray node id of the node this GPU is on (colo.cluster.nodes.on_nodes); "": wherever Ray puts it
    node_ip: str = ""  # that node's IP (several nodes may share one)
    node_label: str = ""  # how tables and errors show the node: its IP, plus the id's start where IPs repeat


@dataclass(frozen=True)
class PlacementPlan:
    device: str  # "cpu" | "cuda" (never "auto")
    num_gpus: int  # all GPUs, trainer and engine ones
    cpus_per_bundle: int
    dp_size: int  # engines that share the prompts (= num_engines)
    ep_size: int  # colocated: num_gpus on GPU (one DP+EP group), 1 on CPU; disaggregated: 1
    rows: tuple[PlacementRow, ...]
    mode: str  # "colocated" | "disaggregated"
    trainer_world: int  # FSDP ranks: num_gpus colocated, placement.trainer_gpus disaggregated
    num_engines: int  # colocated: num_gpus; disaggregated: (num_gpus - trainer_world) // tp_size
    tp_size: int  # GPUs per engine (colocated: 1)

    @property
    def train_gpu_fraction(self) -> float:
        return next(r.train_fraction for r in self.rows if r.trainer_rank >= 0)

    @property
    def vllm_gpu_fraction(self) -> float:
        return next(r.vllm_fraction for r in self.rows if r.dp_rank >= 0)

    def bundle(self) -> dict[str, float]:
        return {"GPU": 1, "CPU": self.cpus_per_bundle}

    def table(self) -> str:
        """The plan as an aligned text table, one row per GPU (for --dry-run and logs)."""
        def rank(x: int) -> str:
            return "-" if x < 0 else str(x)

        nodes = any(r.node for r in self.rows)  # a column only when a cluster was asked (colo.cluster.nodes)
        head = ("gpu", *("node",) * nodes, "bundle", "role", "trainer_rank", "dp_rank", "tp_rank", "ep_rank",
                "train_frac", "vllm_frac", "vllm_memory")
        body = [(str(r.gpu), *(r.node_label,) * nodes, r.bundle, r.role, rank(r.trainer_rank), rank(r.dp_rank),
                 rank(r.tp_rank), rank(r.ep_rank), f"{r.train_fraction:g}", f"{r.vllm_fraction:g}", r.vllm_memory)
                for r in self.rows]
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in (head, *body)]
        plural = "s" if self.num_gpus != 1 else ""
        kind = f"CUDA GPU{plural}" if self.device == "cuda" else f"Ray logical GPU{plural} on CPU"
        if self.mode == "disaggregated":
            t, e = self.trainer_world, self.num_engines
            layout = (f"{t} trainer GPU{'s' if t != 1 else ''} (FSDP), {e} engine{'s' if e != 1 else ''} "
                      f"x TP {self.tp_size}, weights broadcast from trainer rank 0")
        else:
            layout = (f"dp_size={self.dp_size} ep_size={self.ep_size}, " +
                      ("one vLLM DP+EP group over all GPUs" if self.device == "cuda" else
                       "independent vLLM replicas (CPU: DP size 1 each, EP size 1)"))
        where = ""
        if nodes:
            count = len({r.node for r in self.rows})
            where = f", on {count} node{'s' if count != 1 else ''} of the Ray cluster"
        return (f"placement plan: {self.mode}, {self.num_gpus} {kind}{where}, bundle {self.bundle()} each, "
                f"{layout}\n" + "\n".join(lines))

    @property
    def node_order(self) -> list[str]:
        """The nodes (Ray ids) of the rows in the order ranks fill them ([] when no row names one)."""
        return list(dict.fromkeys(r.node for r in self.rows if r.node))


def plan_placement(cfg: ColoConfig) -> PlacementPlan:
    """The placement as plain data; starts nothing (device "auto" may import torch to decide).
    Assumes a validated config (colo.config.validate checks how the GPUs split)."""
    p = cfg.placement
    device = resolve_device(cfg)
    ep_size = expert_parallel_size(device, p.num_gpus, p.mode)
    memory = (f"gpu_memory_utilization={p.vllm_gpu_fraction:g}" if device == "cuda"
              else f"kv_cache={cfg.rollout.kv_cache_mb}MiB")
    common = dict(device=device, num_gpus=p.num_gpus, cpus_per_bundle=p.cpus_per_bundle, mode=p.mode)
    if p.mode == "colocated":
        rows = tuple(PlacementRow(gpu=r, bundle=f"pg{r}/0", trainer_rank=r, dp_rank=r,
                                  ep_rank=r if ep_size > 1 else 0, train_fraction=p.train_gpu_fraction,
                                  vllm_fraction=p.vllm_gpu_fraction, vllm_memory=memory,
                                  role="trainer+engine", tp_rank=0)
                     for r in range(p.num_gpus))
        return PlacementPlan(**common, dp_size=p.num_gpus, ep_size=ep_size, rows=rows,
                             trainer_world=p.num_gpus, num_engines=p.num_gpus, tp_size=1)
    trainers, tp = p.trainer_gpus, cfg.rollout.tp_size
    engines = (p.num_gpus - trainers) // tp
    trainer_rows = [PlacementRow(gpu=r, bundle=f"trainer-pg{r}/0", trainer_rank=r, dp_rank=-1, ep_rank=-1,
                                 train_fraction=1.0, vllm_fraction=0.0, vllm_memory="-", role="trainer",
                                 tp_rank=-1)
                    for r in range(trainers)]
    engine_rows = [PlacementRow(gpu=trainers + e * tp + t, bundle=f"engine-pg{e}/{t}", trainer_rank=-1,
                                dp_rank=e, ep_rank=0, train_fraction=0.0, vllm_fraction=1.0,
                                vllm_memory=memory, role="engine", tp_rank=t)
                   for e in range(engines) for t in range(tp)]
    return PlacementPlan(**common, dp_size=engines, ep_size=1, rows=tuple(trainer_rows + engine_rows),
                         trainer_world=trainers, num_engines=engines, tp_size=tp)


def job_env() -> dict[str, Any] | None:
    """The runtime environment of a job that joins a cluster: the driver's PYTHONPATH. The actors of a Ray
    that the driver starts inherit its environment; a joined cluster's workers inherit `ray start`'s instead,
    so a reward function or environment the driver imports from its PYTHONPATH (`algo.environment=mine:Env`,
    run by the engines) would not import there. Each node must hold those paths (a shared file system). A job
    that `ray job submit` started is left as submitted: its workers get the runtime environment its driver got,
    and Ray refuses a ray.init runtime_env that names a variable the submitted one names too."""
    path = os.environ.get("PYTHONPATH", "")
    if not path or "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:  # ray._private.runtime_env.constants' name
        return None
    return {"env_vars": {"PYTHONPATH": path}}


def init_ray(plan: PlacementPlan, address: str = "", **kwargs: Any) -> None:
    """Start (or join) Ray. `address` (run.ray_address): join that cluster, whose nodes bring their own
    (logical) GPUs and CPUs. CPU: a local instance with plan.num_gpus logical GPUs and enough logical
    CPUs for every bundle (one per GPU, in both modes) plus the driver's tasks. GPU: ray.init() as
    usual, as a new local instance even where `ray start` runs a cluster on this machine. No-op when Ray is
    already initialized (but for watching its head). A local instance's processes are recorded by id
    (colo.host.procs), and its head is watched (colo.cluster.head)."""
    import ray

    from colo.cluster.head import watch_head
    from colo.host.procs import children, record
    from colo.run.signals import hangup_blocked

    if ray.is_initialized():
        watch_head()
        return
    if address:  # Ray refuses resource counts and dashboard settings for a cluster it joins
        ray.init(address=address, runtime_env=job_env(),
                 **{k: v for k, v in kwargs.items() if k in ("log_to_driver", "logging_level")})
        watch_head()
        return
    kwargs.setdefault("include_dashboard", False)
    # "local": a new instance of our own. Without an address ray.init() joins the newest cluster `ray start`
    # left on this machine (/tmp/ray/ray_current_cluster), then refuses our resource counts; joining is
    # run.ray_address's job (RAY_ADDRESS sets it)
    kwargs.setdefault("address", "local")
    if plan.device == "cpu":
        need = len(plan.rows) * plan.cpus_per_bundle + 2
        kwargs.setdefault("num_cpus", max(os.cpu_count() or 1, need))
        kwargs.setdefault("num_gpus", plan.num_gpus)
    before = set(children())
    with hangup_blocked():  # Ray's head would die of a terminal's hangup before the driver saves (colo.run.signals)
        ray.init(**kwargs)
    watch_head()  # a lost GCS or raylet ends the run with a checkpoint (colo.cluster.head)
    record([p for p in children() if p not in before])  # Ray's head: stopped by id at the end (colo.host.procs)


def create_placement(plan: PlacementPlan, timeout_s: float = 120.0) -> list[PlacementGroup]:
    """colocated: one ready placement group per GPU, ordered by (node, GPU id). Raises ConfigError
    when the Ray cluster lacks the GPUs, RuntimeError when the groups do not become ready in time."""
    if plan.mode != "colocated":
        raise ValueError(f"create_placement is for placement.mode=colocated, not {plan.mode}; "
                         "use create_disaggregated_placement")
    specs = [[(plan.bundle(), pin(r.node))] for r in plan.rows]
    return _in_hardware_order(_ready_groups(plan, specs, timeout_s), plan.node_order)


def create_disaggregated_placement(plan: PlacementPlan, timeout_s: float = 120.0
                                   ) -> tuple[list[PlacementGroup], list[PlacementGroup]]:
    """disaggregated: (trainer groups, engine groups), all ready. Trainer group r is one bundle, one
    GPU, ordered by (node id, GPU id) like create_placement. Engine group e holds plan.tp_size bundles
    packed onto one node (STRICT_PACK: tensor parallelism needs the fast intra-node link), ordered by
    its bundle 0. Same errors as create_placement."""
    if plan.mode != "disaggregated":
        raise ValueError(f"create_disaggregated_placement is for placement.mode=disaggregated, not "
                         f"{plan.mode}; use create_placement")
    trainers = [r for r in plan.rows if r.trainer_rank >= 0]
    engines = [[r for r in plan.rows if r.dp_rank == e] for e in range(plan.num_engines)]
    specs = [[(plan.bundle(), pin(r.node))] for r in trainers] + \
        [[(plan.bundle(), pin(r.node)) for r in rows] for rows in engines]
    pgs = _ready_groups(plan, specs, timeout_s)
    return (_in_hardware_order(pgs[:plan.trainer_world], plan.node_order),
            _in_hardware_order(pgs[plan.trainer_world:], plan.node_order))


def _ready_groups(plan: PlacementPlan, specs: list[list[tuple[dict[str, float], dict[str, str]]]],
                  timeout_s: float) -> list[PlacementGroup]:
    """One STRICT_PACK group per list of (bundle, label selector) in specs, in that order, once all are ready;
    removes them all and raises when they are not ready within timeout_s."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    have = ray.cluster_resources().get("GPU", 0)
    if have < plan.num_gpus:
        raise ConfigError(f"placement.num_gpus={plan.num_gpus} but the Ray cluster has {have:g} GPU(s); "
                          f"fix: placement.num_gpus={int(have)} or add GPU nodes to the cluster")
    pgs = [placement_group([b for b, _ in spec], strategy="STRICT_PACK",
                           bundle_label_selector=[sel for _, sel in spec] if any(sel for _, sel in spec) else None)
           for spec in specs]
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
    if len(ready) < len(pgs):
        for pg in pgs:
            remove_placement_group(pg)
        shapes = sorted({f"{len(b)} x {b[0][0]}" for b in specs})
        packed = " (a multi-bundle group must fit on one node)" if any(len(b) > 1 for b in specs) else ""
        raise RuntimeError(f"only {len(ready)}/{len(pgs)} placement groups of {', '.join(shapes)} were "
                           f"ready after {timeout_s:g} s{packed}; free resources: "
                           f"{ray.available_resources()}")
    return pgs


def _in_hardware_order(pgs: list[PlacementGroup], node_order: list[str]) -> list[PlacementGroup]:
    """Groups sorted by (node, GPU id): nodes (Ray ids) in the plan's order when it names them (colo.cluster.nodes),
    else by node id, which still keeps each node's groups together."""
    where = locate(pgs)

    def node_key(w: dict[str, Any]) -> tuple[int, str]:
        return (node_order.index(w["node_id"]), "") if w["node_id"] in node_order else (len(node_order), w["node_id"])

    order = sorted(range(len(pgs)), key=lambda i: (node_key(where[i]), where[i]["gpu_ids"]))
    return [pgs[i] for i in order]


def scheduling(pg: PlacementGroup, bundle_index: int = 0) -> PlacementGroupSchedulingStrategy:
    """Put an actor into the GPU's bundle; capture_child_tasks keeps what the actor starts (vLLM's
    Ray executor workers) inside the same group, hence on the same GPU."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle_index,
                                            placement_group_capture_child_tasks=True)


def remove_placement(pgs: list[PlacementGroup]) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in pgs:
        remove_placement_group(pg)
