"""Two Ray nodes on one host share its address: placement keyed by Ray node id puts one GPU's group on each."""
from __future__ import annotations

from conftest import release_shared_ray


def test_two_nodes_one_address_place_a_group_each() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from colo.cluster.nodes import gpu_nodes, locate, on_nodes
    from colo.cluster.placement import create_placement, plan_placement, remove_placement
    from colo.config import load_config

    release_shared_ray()  # a cluster of its own (tests/conftest.py: the suite's shared instance is one node)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    try:
        ids = [cluster.add_node(num_cpus=1, num_gpus=1).node_id for _ in range(2)]
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        cluster.wait_for_nodes()
        nodes = gpu_nodes()
        assert len(nodes) == 2 and nodes[0].ip == nodes[1].ip  # one host: one address
        cfg = load_config(None, ["placement.device=cpu", "placement.num_gpus=2", "placement.cpus_per_bundle=1"], {})
        plan = on_nodes(plan_placement(cfg), nodes)  # was refused: "does not fit ... <ip>: 1, <ip>: 1"
        pgs = create_placement(plan, timeout_s=60)
        where = locate(pgs)
        assert [w["node_id"] for w in where] == plan.node_order and sorted(plan.node_order) == sorted(ids)
        remove_placement(pgs)
    finally:
        ray.shutdown()
        cluster.shutdown()
