"""Ray nodes that share an IP address (a ray.cluster_utils.Cluster on one host, containers behind one address)
stay apart: nodes are keyed by Ray node id, the address serves the rendezvous only."""
from __future__ import annotations

from colo.cluster.nodes import NODE_ID_LABEL, Node, on_nodes, pin
from colo.cluster.placement import plan_placement
from colo.config import load_config


def test_nodes_sharing_an_address_stay_apart() -> None:
    nodes = [Node("id-aaaaaaaa-1", "192.0.2.2", 1), Node("id-bbbbbbbb-2", "192.0.2.2", 1)]
    plan = plan_placement(load_config(None, ["placement.device=cuda", "placement.num_gpus=2"], {}))
    placed = on_nodes(plan, nodes)  # used to be refused: "does not fit ... 192.0.2.2: 1, 192.0.2.2: 1"
    assert [r.node for r in placed.rows] == ["id-aaaaaaaa-1", "id-bbbbbbbb-2"]
    assert [r.node_ip for r in placed.rows] == ["192.0.2.2", "192.0.2.2"]
    assert placed.node_order == ["id-aaaaaaaa-1", "id-bbbbbbbb-2"]
    assert "on 2 nodes of the Ray cluster" in placed.table()
    assert "192.0.2.2/id-aaaaa" in placed.table() and "192.0.2.2/id-bbbbb" in placed.table()
    assert pin(placed.rows[1].node) == {NODE_ID_LABEL: "id-bbbbbbbb-2"}  # each bundle selects its node by id
