"""colo.placement: the pure plan, and real placement groups on a local Ray with logical GPUs."""
from __future__ import annotations

import pytest

from colo.config import ConfigError, load_config
from colo.placement import (create_placement, init_ray, locate, plan_placement, remove_placement,
                            scheduling)


def test_plan_rows_cpu() -> None:
    cfg = load_config(None, ["placement.device=cpu", "placement.num_gpus=3", "rollout.kv_cache_mb=128",
                             "placement.train_gpu_fraction=0.3", "placement.vllm_gpu_fraction=0.6"], {})
    plan = plan_placement(cfg)
    assert (plan.device, plan.num_gpus, plan.dp_size, plan.ep_size) == ("cpu", 3, 3, 1)
    assert [(r.gpu, r.bundle, r.trainer_rank, r.dp_rank, r.ep_rank) for r in plan.rows] == \
        [(0, "pg0/0", 0, 0, 0), (1, "pg1/0", 1, 1, 0), (2, "pg2/0", 2, 2, 0)]
    assert {(r.train_fraction, r.vllm_fraction, r.vllm_memory) for r in plan.rows} == \
        {(0.3, 0.6, "kv_cache=128MiB")}
    assert plan.bundle() == {"GPU": 1, "CPU": 2}
    table = plan.table().splitlines()
    assert "Ray logical GPUs on CPU" in table[0] and len(table) == 2 + 3
    assert table[1].split() == ["gpu", "bundle", "trainer_rank", "dp_rank", "ep_rank", "train_frac",
                                "vllm_frac", "vllm_memory"]


def test_plan_rows_cuda() -> None:
    cfg = load_config(None, ["placement.device=cuda", "placement.num_gpus=4",
                             "placement.cpus_per_bundle=6"], {})
    plan = plan_placement(cfg)  # pure: plans for GPUs this machine need not have
    assert (plan.ep_size, plan.dp_size) == (4, 4)
    assert [r.ep_rank for r in plan.rows] == [0, 1, 2, 3]
    assert plan.rows[3].vllm_memory == "gpu_memory_utilization=0.4"
    assert plan.bundle() == {"GPU": 1, "CPU": 6} and "one vLLM DP+EP group" in plan.table()


@pytest.fixture(scope="module")
def ray_two_gpus():
    import ray

    cfg = load_config(None, ["placement.device=cpu", "placement.num_gpus=2"], {})
    plan = plan_placement(cfg)
    init_ray(plan, num_cpus=6)  # 2 bundles x 2 CPUs + headroom
    assert ray.cluster_resources()["GPU"] == 2
    yield plan
    ray.shutdown()


def test_placement_groups_colocate_trainer_and_engine(ray_two_gpus) -> None:
    import ray

    plan = ray_two_gpus
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
        # both GPUs are reserved by the groups, and 0.4 + 0.4 of each is taken: 0.2 left in each
        free = ray.available_resources()
        assert free.get("GPU", 0) == 0
        left = [v for k, v in free.items() if k.startswith("GPU_group_") and k.count("_") == 2]
        assert sorted(left) == pytest.approx([0.2, 0.2])
        # a task started by the engine (no strategy of its own) lands in the same group, same GPU
        assert ray.get(pairs[1][1].child.remote()) == gpu_ids[1]
        for pair in pairs:
            for actor in pair:
                ray.kill(actor)
    finally:
        remove_placement(pgs)


def test_more_gpus_than_the_cluster_has(ray_two_gpus) -> None:
    cfg = load_config(None, ["placement.device=cpu", "placement.num_gpus=3"], {})
    with pytest.raises(ConfigError, match="Ray cluster has 2 GPU"):
        create_placement(plan_placement(cfg))
