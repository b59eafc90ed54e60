"""colo.cluster.placement: the pure plan (both modes), and real placement groups on a local Ray with logical
GPUs: colocated (one group per GPU) and disaggregated (trainer groups + STRICT_PACK engine groups)."""
from __future__ import annotations

import time

import pytest
from conftest import release_shared_ray

from colo.config import ConfigError, load_config
from colo.cluster.placement import (create_disaggregated_placement, create_placement, init_ray, locate,
                            plan_placement, remove_placement, scheduling)


def plan_of(*overrides: str):
    return plan_placement(load_config(None, list(overrides), {}))


def test_plan_rows_cpu() -> None:
    cfg = load_config(None, ["placement.device=cpu", "placement.num_gpus=3", "rollout.kv_cache_mb=128",
                             "placement.train_gpu_fraction=0.3", "placement.vllm_gpu_fraction=0.6"], {})
    plan = plan_placement(cfg)
    assert (plan.device, plan.num_gpus, plan.dp_size, plan.ep_size) == ("cpu", 3, 3, 1)
    assert (plan.mode, plan.trainer_world, plan.num_engines, plan.tp_size) == ("colocated", 3, 3, 1)
    assert [(r.gpu, r.bundle, r.trainer_rank, r.dp_rank, r.ep_rank) for r in plan.rows] == \
        [(0, "pg0/0", 0, 0, 0), (1, "pg1/0", 1, 1, 0), (2, "pg2/0", 2, 2, 0)]
    assert {(r.role, r.tp_rank) for r in plan.rows} == {("trainer+engine", 0)}
    assert {(r.train_fraction, r.vllm_fraction, r.vllm_memory) for r in plan.rows} == \
        {(0.3, 0.6, "kv_cache=128MiB")}
    assert plan.bundle() == {"GPU": 1, "CPU": 2}
    table = plan.table().splitlines()
    assert table[0].startswith("placement plan: colocated, 3 Ray logical GPUs on CPU") and len(table) == 2 + 3
    assert table[1].split() == ["gpu", "bundle", "role", "trainer_rank", "dp_rank", "tp_rank", "ep_rank",
                                "train_frac", "vllm_frac", "vllm_memory"]
    assert table[4].split() == ["2", "pg2/0", "trainer+engine", "2", "2", "0", "0", "0.3", "0.6",
                                "kv_cache=128MiB"]


def test_plan_rows_cuda() -> None:
    cfg = load_config(None, ["placement.device=cuda", "placement.num_gpus=4",
                             "placement.cpus_per_bundle=6"], {})
    plan = plan_placement(cfg)  # pure: plans for GPUs this machine need not have
    assert (plan.ep_size, plan.dp_size) == (4, 4)
    assert [r.ep_rank for r in plan.rows] == [0, 1, 2, 3]
    assert plan.rows[3].vllm_memory == "gpu_memory_utilization=0.4"
    assert plan.bundle() == {"GPU": 1, "CPU": 6} and "one vLLM DP+EP group" in plan.table()
    assert (plan.train_gpu_fraction, plan.vllm_gpu_fraction) == (0.4, 0.4)


def test_plan_rows_disaggregated_cuda() -> None:
    """4 trainer GPUs + 2 engines x TP 2: trainers first, then each engine's TP GPUs in a row."""
    plan = plan_of("placement.device=cuda", "placement.mode=disaggregated", "placement.num_gpus=8",
                   "placement.trainer_gpus=4", "rollout.tp_size=2", "placement.vllm_gpu_fraction=0.85")
    assert (plan.mode, plan.num_gpus, plan.trainer_world, plan.num_engines, plan.tp_size) == \
        ("disaggregated", 8, 4, 2, 2)
    assert (plan.dp_size, plan.ep_size) == (2, 1)  # engines are replicas; TP shards each expert
    assert [(r.gpu, r.bundle, r.role, r.trainer_rank, r.dp_rank, r.tp_rank, r.ep_rank) for r in plan.rows] == [
        (0, "trainer-pg0/0", "trainer", 0, -1, -1, -1), (1, "trainer-pg1/0", "trainer", 1, -1, -1, -1),
        (2, "trainer-pg2/0", "trainer", 2, -1, -1, -1), (3, "trainer-pg3/0", "trainer", 3, -1, -1, -1),
        (4, "engine-pg0/0", "engine", -1, 0, 0, 0), (5, "engine-pg0/1", "engine", -1, 0, 1, 0),
        (6, "engine-pg1/0", "engine", -1, 1, 0, 0), (7, "engine-pg1/1", "engine", -1, 1, 1, 0)]
    shares = [(r.train_fraction, r.vllm_fraction, r.vllm_memory) for r in plan.rows]
    assert shares == [(1.0, 0.0, "-")] * 4 + [(0.0, 1.0, "gpu_memory_utilization=0.85")] * 4
    assert (plan.train_gpu_fraction, plan.vllm_gpu_fraction) == (1.0, 1.0)  # whole GPUs from Ray
    table = plan.table().splitlines()
    assert table[0] == ("placement plan: disaggregated, 8 CUDA GPUs, bundle {'GPU': 1, 'CPU': 2} each, "
                        "4 trainer GPUs (FSDP), 2 engines x TP 2, weights broadcast from trainer rank 0")
    assert table[2].split() == ["0", "trainer-pg0/0", "trainer", "0", "-", "-", "-", "1", "0", "-"]
    assert table[-1].split() == ["7", "engine-pg1/1", "engine", "-", "1", "1", "0", "0", "1",
                                 "gpu_memory_utilization=0.85"]


def test_plan_rows_disaggregated_cpu() -> None:
    plan = plan_of("placement.device=cpu", "placement.mode=disaggregated", "placement.trainer_gpus=1")
    assert [(r.bundle, r.role, r.vllm_memory) for r in plan.rows] == \
        [("trainer-pg0/0", "trainer", "-"), ("engine-pg0/0", "engine", "kv_cache=256MiB")]
    assert "1 trainer GPU (FSDP), 1 engine x TP 1" in plan.table()


def test_ranks_fill_nodes_in_order() -> None:
    """colo.cluster.nodes.on_nodes (pure): colocated ranks fill node after node, so FSDP rank r and engine DP rank r
    stay on one GPU and consecutive ranks share a node; disaggregated, the trainers fill first and each
    engine's TP GPUs land on one node, skipping a node with too little room; a plan that does not fit the
    cluster is refused naming its nodes."""
    from colo.cluster.nodes import Node, on_nodes

    nodes = [Node("a", "10.0.0.1", 2), Node("b", "10.0.0.2", 3)]
    plan = on_nodes(plan_of("placement.device=cuda", "placement.num_gpus=4"), nodes)
    assert [(r.trainer_rank, r.dp_rank, r.node, r.node_ip) for r in plan.rows] == [
        (0, 0, "a", "10.0.0.1"), (1, 1, "a", "10.0.0.1"), (2, 2, "b", "10.0.0.2"), (3, 3, "b", "10.0.0.2")]
    table = plan.table().splitlines()
    assert "on 2 nodes of the Ray cluster" in table[0] and table[1].split()[:2] == ["gpu", "node"]
    assert table[4].split()[:3] == ["2", "10.0.0.2", "pg2/0"]
    assert plan.node_order == ["a", "b"]
    assert "node" not in plan_of("placement.device=cuda").table().splitlines()[1].split()  # no cluster: as before
    with pytest.raises(ConfigError, match=r"placement\.num_gpus=8 \(colocated\) does not fit .* fix: "
                                          r"placement\.num_gpus=5 or add GPU nodes"):
        on_nodes(plan_of("placement.device=cuda", "placement.num_gpus=8"), nodes)

    dis5 = plan_of("placement.device=cuda", "placement.mode=disaggregated", "placement.num_gpus=5",
                   "placement.trainer_gpus=1", "rollout.tp_size=2")
    # the trainer takes a's first GPU; engine 0 needs 2 GPUs on one node: a has 1 left, so b; engine 1 too
    dis = on_nodes(dis5, [Node("a", "10.0.0.1", 2), Node("b", "10.0.0.2", 4)])
    assert [(r.role, r.dp_rank, r.node_ip) for r in dis.rows] == [
        ("trainer", -1, "10.0.0.1"), ("engine", 0, "10.0.0.2"), ("engine", 0, "10.0.0.2"),
        ("engine", 1, "10.0.0.2"), ("engine", 1, "10.0.0.2")]
    with pytest.raises(ConfigError, match=r"GPU nodes 10\.0\.0\.1: 2, 10\.0\.0\.2: 3 \(each engine's 2 GPUs on one "
                                          r"node\); fix: placement\.trainer_gpus that fills whole nodes"):
        on_nodes(dis5, nodes)  # 5 GPUs, but a's left-over one cannot hold half an engine


DISAGGREGATED = ("placement.device=cpu", "placement.mode=disaggregated", "placement.num_gpus=4",
                 "placement.trainer_gpus=2", "rollout.tp_size=2")  # TP on logical GPUs: groups only


@pytest.fixture(scope="module")
def ray_four_gpus():
    """One local Ray for the module, sized by init_ray from a 4-GPU disaggregated plan."""
    import ray

    plan = plan_of(*DISAGGREGATED)
    release_shared_ray()  # init_ray's own sizing is under test, not the suite's shared instance's
    init_ray(plan)
    total = ray.cluster_resources()
    assert total["GPU"] == 4 and total["CPU"] >= 4 * plan.cpus_per_bundle  # every bundle fits
    yield plan
    ray.shutdown()


def test_placement_groups_colocate_trainer_and_engine(ray_four_gpus) -> None:
    import ray

    plan = plan_of("placement.device=cpu", "placement.num_gpus=2")
    pgs = create_placement(plan)
    try:
        assert len(pgs) == 2
        gpu_ids = [w["gpu_ids"] for w in locate(pgs)]
        assert sorted(gpu_ids) == gpu_ids and len({tuple(g) for g in gpu_ids}) == 2  # rank order

        @ray.remote(num_gpus=0.1, num_cpus=0)
        def child_gpu() -> list:
            return ray.get_gpu_ids()

        @ray.remote(num_cpus=0)
        class Probe:  # stands in for TrainWorker / RolloutEngine: which GPU did Ray give me?
            def gpu(self) -> list:
                return ray.get_gpu_ids()

            def child(self) -> list:  # like vLLM's Ray executor starting its worker
                return ray.get(child_gpu.remote())

        pairs = [(Probe.options(num_gpus=plan.train_gpu_fraction, scheduling_strategy=scheduling(pg)).remote(),
                  Probe.options(num_gpus=plan.vllm_gpu_fraction, scheduling_strategy=scheduling(pg)).remote())
                 for pg in pgs]
        seen = ray.get([actor.gpu.remote() for pair in pairs for actor in pair])
        # rank r's trainer and engine share placement group r's GPU, and ranks differ
        assert seen == [gpu_ids[0], gpu_ids[0], gpu_ids[1], gpu_ids[1]]
        # two of the four GPUs are reserved by the groups, and 0.4 + 0.4 of each is taken: 0.2 left in each
        free = ray.available_resources()
        assert free.get("GPU", 0) == 2
        left = [v for k, v in free.items() if k.startswith("GPU_group_") and k.count("_") == 2]
        assert sorted(left) == pytest.approx([0.2, 0.2])
        # a task started by the engine (no strategy of its own) lands in the same group, same GPU
        assert ray.get(pairs[1][1].child.remote()) == gpu_ids[1]
        for pair in pairs:
            for actor in pair:
                ray.kill(actor)
    finally:
        remove_placement(pgs)


def test_disaggregated_groups(ray_four_gpus) -> None:
    """Trainer groups of one bundle each, one engine group of TP bundles (STRICT_PACK), on four distinct
    logical GPUs; each trainer rank and each TP worker can take a whole GPU."""
    import ray
    from ray.util.placement_group import placement_group_table

    plan = ray_four_gpus
    trainer_pgs, engine_pgs = create_disaggregated_placement(plan)
    try:
        assert (len(trainer_pgs), len(engine_pgs)) == (2, 1)
        assert [pg.bundle_specs for pg in trainer_pgs] == [[{"GPU": 1, "CPU": 2}]] * 2
        assert engine_pgs[0].bundle_specs == [{"GPU": 1, "CPU": 2}] * 2
        assert {placement_group_table(pg)["strategy"] for pg in trainer_pgs + engine_pgs} == {"STRICT_PACK"}
        trainer_gpus = [w["gpu_ids"] for w in locate(trainer_pgs)]
        assert sorted(trainer_gpus) == trainer_gpus  # rank order follows the GPU ids

        @ray.remote(num_cpus=0)
        class Probe:  # stands in for TrainWorker / a vLLM TP worker
            def gpu(self) -> list:
                return ray.get_gpu_ids()

        probes = [Probe.options(num_gpus=1, scheduling_strategy=scheduling(pg)).remote() for pg in trainer_pgs]
        probes += [Probe.options(num_gpus=1, scheduling_strategy=scheduling(engine_pgs[0], t)).remote()
                   for t in range(plan.tp_size)]
        seen = ray.get([p.gpu.remote() for p in probes])
        assert seen[:2] == trainer_gpus and len({tuple(g) for g in seen}) == 4  # four distinct GPUs
        assert ray.available_resources().get("GPU", 0) == 0
        for probe in probes:
            ray.kill(probe)
        with pytest.raises(ValueError, match="create_placement"):
            create_disaggregated_placement(plan_of("placement.device=cpu"))
        with pytest.raises(ValueError, match="create_disaggregated_placement"):
            create_placement(plan)
    finally:
        remove_placement(trainer_pgs + engine_pgs)


def test_disaggregated_not_ready_in_time_removes_its_groups(ray_four_gpus) -> None:
    import ray

    held = create_placement(plan_of("placement.device=cpu", "placement.num_gpus=2"))
    try:
        with pytest.raises(RuntimeError, match=r"placement groups of .*ready after 2 s.*one node"):
            create_disaggregated_placement(ray_four_gpus, timeout_s=2)
        deadline = time.monotonic() + 20  # removal is asynchronous
        while ray.available_resources().get("GPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ray.available_resources().get("GPU", 0) == 2  # the half-made groups were removed
    finally:
        remove_placement(held)


def test_more_gpus_than_the_cluster_has(ray_four_gpus) -> None:
    with pytest.raises(ConfigError, match="Ray cluster has 4 GPU"):
        create_placement(plan_of("placement.device=cpu", "placement.num_gpus=5"))
    with pytest.raises(ConfigError, match="Ray cluster has 4 GPU"):
        create_disaggregated_placement(plan_of(*DISAGGREGATED[:2], "placement.num_gpus=6",
                                               "placement.trainer_gpus=2", "rollout.tp_size=2"))


# colo.cluster.actors.gather reads Ray's errors to name who failed; the loop reports that name (tests/e2e/test_loop.py
# runs it against real engines). The actors here play the two roles only so that an engine's error can be
# raised inside a trainer's call on demand, with no vLLM to start.

def _roles():
    import ray

    @ray.remote(num_cpus=0)
    class Engine:
        def load_bucket(self, bad: bool) -> int:
            if bad:
                raise ValueError("bucket 3 does not fit\nsecond line")
            return 1

    @ray.remote(num_cpus=0)
    class Trainer:
        def sync(self, engines: list, bad: int) -> list:
            return ray.get([e.load_bucket.remote(i == bad) for i, e in enumerate(engines)])

        def step(self) -> None:
            raise KeyError("no such batch")

    return Engine, Trainer


def test_gather_names_the_actor_that_raised(ray_four_gpus) -> None:
    from colo.cluster.actors import ActorError, gather

    Engine, Trainer = _roles()
    engines, trainers = [Engine.remote(), Engine.remote()], [Trainer.remote(), Trainer.remote()]
    who = ["trainer rank 0", "trainer rank 1"]
    assert gather([t.sync.remote(engines, -1) for t in trainers], who, engines=engines) == [[1, 1], [1, 1]]
    # engine 1 raises under trainer 0's call (disaggregated: one trainer talks to every engine)
    with pytest.raises(ActorError) as err:
        gather([trainers[0].sync.remote(engines, 1)], who[:1], engines=engines, paired=False)
    assert str(err.value) == ("engine DP rank 1 (seen by trainer rank 0 during the weight sync) raised "
                              "ValueError: bucket 3 does not fit")
    assert err.value.name.startswith("engine DP rank 1") and "second line" in str(err.value.__cause__)
    with pytest.raises(ActorError, match=r"^trainer rank 1 raised KeyError: 'no such batch'$"):
        gather([trainers[1].step.remote()], who[1:], engines=engines)
    with pytest.raises(ActorError, match=r"^engine DP rank 0 raised ValueError: bucket 3 does not fit$"):
        gather([engines[0].load_bucket.remote(True)], ["engine DP rank 0"])
