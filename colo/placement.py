"""Where everything runs: one Ray placement group per GPU, a trainer rank and a vLLM rank in each.

    plan = plan_placement(cfg)           # pure: rows of (GPU, trainer rank, DP rank, EP rank, shares)
    init_ray(plan)                       # CPU: a local Ray whose logical GPUs stand in for real ones
    pgs = create_placement(plan)         # one PG per GPU, bundle {"GPU": 1, "CPU": k}, ready, ordered
    TrainWorker.options(num_gpus=plan.train_gpu_fraction, scheduling_strategy=scheduling(pgs[r]))

Invariant the loop relies on: trainer rank r, engine DP rank r (and on GPU, EP rank r) all live in
pgs[r], so they share one device; pgs are ordered by (node, GPU id) so rank order follows the
hardware. Why one PG per GPU and not one PG with N bundles: vLLM's Ray executor places its worker
in "bundle 0" of the placement group it is handed (VLLM_RAY_BUNDLE_INDICES), so each engine needs a
PG whose bundle 0 is its own GPU (DESIGN.md, measured in ../shared/gpu/dpep.py).

On CPU the "GPUs" are Ray logical GPU resources (ray.init(num_gpus=N)); fractions and bundles behave
exactly as on a GPU host, so this module is tested for real without one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from colo.config import ColoConfig, ConfigError, expert_parallel_size, resolve_device

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass(frozen=True)
class PlacementRow:
    gpu: int  # index of the GPU (and of its placement group) in rank order
    bundle: str  # "pg<gpu>/0": the only bundle of that GPU's placement group
    trainer_rank: int  # FSDP2 rank
    dp_rank: int  # vLLM data-parallel rank: this engine's share of the prompts
    ep_rank: int  # vLLM expert-parallel rank (0 on CPU: each engine holds all experts)
    train_fraction: float  # Ray num_gpus of the TrainWorker
    vllm_fraction: float  # Ray num_gpus of the engine (on GPU: VLLM_RAY_PER_WORKER_GPUS)
    vllm_memory: str  # "gpu_memory_utilization=0.4" (GPU) or "kv_cache=256MiB" (CPU)


@dataclass(frozen=True)
class PlacementPlan:
    device: str  # "cpu" | "cuda" (never "auto")
    num_gpus: int
    cpus_per_bundle: int
    dp_size: int  # engines that share the prompts (= num_gpus)
    ep_size: int  # num_gpus on GPU (one DP+EP group), 1 on CPU (independent replicas)
    rows: tuple[PlacementRow, ...]

    @property
    def train_gpu_fraction(self) -> float:
        return self.rows[0].train_fraction

    @property
    def vllm_gpu_fraction(self) -> float:
        return self.rows[0].vllm_fraction

    def bundle(self) -> dict[str, float]:
        return {"GPU": 1, "CPU": self.cpus_per_bundle}

    def table(self) -> str:
        """The plan as an aligned text table, one row per GPU (for --dry-run and logs)."""
        head = ("gpu", "bundle", "trainer_rank", "dp_rank", "ep_rank", "train_frac", "vllm_frac",
                "vllm_memory")
        body = [(str(r.gpu), r.bundle, str(r.trainer_rank), str(r.dp_rank), str(r.ep_rank),
                 f"{r.train_fraction:g}", f"{r.vllm_fraction:g}", r.vllm_memory) for r in self.rows]
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in (head, *body)]
        mode = ("one vLLM DP+EP group over all GPUs" if self.device == "cuda" else
                "independent vLLM replicas (CPU: DP size 1 each, EP size 1)")
        plural = "s" if self.num_gpus != 1 else ""
        kind = f"CUDA GPU{plural}" if self.device == "cuda" else f"Ray logical GPU{plural} on CPU"
        return (f"placement plan: {self.num_gpus} {kind}, bundle {self.bundle()} each, "
                f"dp_size={self.dp_size} ep_size={self.ep_size}, {mode}\n" + "\n".join(lines))


def plan_placement(cfg: ColoConfig) -> PlacementPlan:
    """The placement as plain data; starts nothing (device "auto" may import torch to decide)."""
    p = cfg.placement
    device = resolve_device(cfg)
    ep_size = expert_parallel_size(device, p.num_gpus)
    memory = (f"gpu_memory_utilization={p.vllm_gpu_fraction:g}" if device == "cuda"
              else f"kv_cache={cfg.rollout.kv_cache_mb}MiB")
    rows = tuple(PlacementRow(gpu=r, bundle=f"pg{r}/0", trainer_rank=r, dp_rank=r,
                              ep_rank=r if ep_size > 1 else 0, train_fraction=p.train_gpu_fraction,
                              vllm_fraction=p.vllm_gpu_fraction, vllm_memory=memory)
                 for r in range(p.num_gpus))
    return PlacementPlan(device=device, num_gpus=p.num_gpus, cpus_per_bundle=p.cpus_per_bundle,
                         dp_size=p.num_gpus, ep_size=ep_size, rows=rows)


def init_ray(plan: PlacementPlan, **kwargs: Any) -> None:
    """Start (or join) Ray. CPU: a local instance with plan.num_gpus logical GPUs and enough logical
    CPUs for every bundle plus the driver's tasks. GPU: ray.init() as usual (RAY_ADDRESS honoured by
    Ray itself). No-op when Ray is already initialized."""
    import ray

    if ray.is_initialized():
        return
    kwargs.setdefault("include_dashboard", False)
    if plan.device == "cpu":
        need = plan.num_gpus * plan.cpus_per_bundle + 2
        kwargs.setdefault("num_cpus", max(os.cpu_count() or 1, need))
        kwargs.setdefault("num_gpus", plan.num_gpus)
    ray.init(**kwargs)


def create_placement(plan: PlacementPlan, timeout_s: float = 120.0) -> list[PlacementGroup]:
    """One ready placement group per GPU, ordered by (node id, GPU id). Raises ConfigError when the
    Ray cluster lacks the GPUs, RuntimeError when the groups do not become ready in time."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    have = ray.cluster_resources().get("GPU", 0)
    if have < plan.num_gpus:
        raise ConfigError(f"placement.num_gpus={plan.num_gpus} but the Ray cluster has {have:g} GPU(s); "
                          f"fix: placement.num_gpus={int(have)} or add GPU nodes to the cluster")
    pgs = [placement_group([plan.bundle()], strategy="STRICT_PACK") for _ in range(plan.num_gpus)]
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
    if len(ready) < len(pgs):
        for pg in pgs:
            remove_placement_group(pg)
        raise RuntimeError(f"only {len(ready)}/{len(pgs)} placement groups of {plan.bundle()} were "
                           f"ready after {timeout_s:g} s; free resources: {ray.available_resources()}")
    where = locate(pgs)
    order = sorted(range(len(pgs)), key=lambda i: (where[i]["node_id"], where[i]["gpu_ids"]))
    return [pgs[i] for i in order]


def locate(pgs: list[PlacementGroup]) -> list[dict[str, Any]]:
    """{"node_id", "gpu_ids"} of each group's bundle, seen from a task running inside it (Ray pins a
    bundle's GPU when the group is created, so every actor placed there sees the same ids)."""
    import ray

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def where() -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "gpu_ids": list(ray.get_gpu_ids())}

    return ray.get([where.options(scheduling_strategy=scheduling(pg)).remote() for pg in pgs])


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
