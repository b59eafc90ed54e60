"""Node addressing: which node each rank runs on, and the addresses and ports its peers dial.

    nodes = gpu_nodes()                            # alive Ray nodes with GPUs, in a fixed order (by IP, then id)
    plan = on_nodes(plan, nodes)                   # rows filled node by node; row.node = that node's Ray id
    # placement: each GPU's bundle carries the label selector {"ray.io/node-id": <id>}, so Ray puts it there
    where = locate(pgs)                            # from a task inside each group: node IP, GPU ids, a port
    trainer rank 0's (node_ip, port) -> torch.distributed rendezvous; engine 0's -> vLLM's DP master

Nodes are told apart by Ray node id, never by IP: two Ray nodes may share an address (a
ray.cluster_utils.Cluster on one host, containers behind one host address), and keyed by it they
collapsed into one. Addresses serve the rendezvous only.

Every address is the node's own (Ray's node IP), and every port is picked on the node that will listen
on it: on one machine "127.0.0.1" and a port free on the driver happen to work, on two machines neither
does (a worker dialling 127.0.0.1 reaches itself). The weight group's TCPStore binds port 0 on trainer
rank 0's node (colo.sync.transport.WeightGroupHost), so its port needs no choosing at all.

Ports and addresses are picked with colo.host.net (free_port on the listening node; node_env in each actor, so
gloo and vLLM bind the node IP rather than a loopback).

When a run fails, `lost_nodes` asks which of its nodes are gone (dead to Ray's GCS, or not answering a
task pinned to them within a few seconds), so the error names the node and the ranks that were on it.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from colo.config import ConfigError
from colo.host.net import free_port

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from colo.cluster.placement import PlacementPlan

NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: a bundle selecting it lands on that node only
PROBE_S = 10.0  # a node whose raylet does not run a trivial task in this long counts as unreachable


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    gpus: int  # Ray's GPU resource of the node (logical GPUs on CPU)


def gpu_nodes() -> list[Node]:
    """Alive nodes with at least one GPU, ordered by IP address (then id): the order ranks fill them in.
    A head without GPUs (a driver-only head, `ray job submit` to a CPU head) is left out."""
    import ray

    nodes = [Node(n["NodeID"], n["NodeManagerAddress"], int(n.get("Resources", {}).get("GPU", 0)))
             for n in ray.nodes() if n.get("Alive")]
    return sorted((n for n in nodes if n.gpus > 0), key=lambda n: (_ip_key(n.ip), n.node_id))


def _ip_key(ip: str) -> tuple[int, int | str]:
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:
        return (1, ip)


def on_nodes(plan: PlacementPlan, nodes: list[Node]) -> PlacementPlan:
    """The plan with each row's node: GPUs are filled node by node in row order, so FSDP ranks and
    engine DP ranks are consecutive per node (rank r and r+1 share a node unless one fills up between
    them). Disaggregated: trainers first, then engines, each engine's TP GPUs on one node (a node
    without room for a whole engine is skipped). Raises ConfigError when the GPUs do not fit."""
    free = {n.node_id: n.gpus for n in nodes}  # by id: nodes may share an IP
    order = [n.node_id for n in nodes]
    ips = {n.node_id: n.ip for n in nodes}
    rows, cursor = list(plan.rows), 0

    def take(count: int) -> str:
        nonlocal cursor
        while cursor < len(order) and free[order[cursor]] < count:
            cursor += 1  # what is left on this node is too small: go on to the next
        if cursor == len(order):
            total = sum(n.gpus for n in nodes)
            fix = (f"placement.num_gpus={total} or add GPU nodes" if total < plan.num_gpus else
                   "placement.trainer_gpus that fills whole nodes, or a smaller rollout.tp_size")
            raise ConfigError(
                f"placement.num_gpus={plan.num_gpus} ({plan.mode}) does not fit the Ray cluster's GPU nodes "
                f"{', '.join(f'{node_label(n.ip, n.node_id, nodes)}: {n.gpus}' for n in nodes) or 'none'}" +
                (f" (each engine's {plan.tp_size} GPUs on one node)" if plan.tp_size > 1 else "") + f"; fix: {fix}")
        free[order[cursor]] -= count
        return order[cursor]

    out: list = []
    i = 0
    while i < len(rows):
        row = rows[i]
        width = plan.tp_size if row.role == "engine" else 1  # an engine's TP rows come together
        node = take(width)
        out += [replace(r, node=node, node_ip=ips[node], node_label=node_label(ips[node], node, nodes))
                for r in rows[i:i + width]]
        i += width
    return replace(plan, rows=tuple(out))


def node_label(ip: str, node_id: str, nodes: list[Node]) -> str:
    """How a node is shown: its IP, with the start of its Ray id where another node has the same IP."""
    shared = sum(n.ip == ip for n in nodes) > 1
    return f"{ip}/{node_id[:8]}" if shared else ip


def pin(node_id: str) -> dict[str, str]:
    """The bundle label selector that puts a bundle on this node ({} where the plan names no node)."""
    return {NODE_ID_LABEL: node_id} if node_id else {}


def locate(pgs: list[PlacementGroup]) -> list[dict[str, Any]]:
    """{"node_id", "node_ip", "gpu_ids", "port"} of each group's bundle 0, from a task running inside it:
    Ray pins a bundle's GPU when the group is created, so every actor placed there sees the same ids;
    `port` is free on that node, for a server an actor of the group starts a moment later."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def where() -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "gpu_ids": list(ray.get_gpu_ids()), "port": free_port()}

    return ray.get([where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0)).remote() for pg in pgs])


@dataclass(frozen=True)
class Lost:
    ip: str
    node_id: str
    ranks: tuple[str, ...]  # "trainer rank 1", "engine DP rank 1", ...
    dead: bool  # Ray's GCS marked it dead (False: alive to the GCS, but a task there did not run)

    def describe(self) -> str:
        how = "died" if self.dead else f"cannot be reached (no answer in {PROBE_S:g} s)"
        return f"node {self.ip} {how}; on it: {', '.join(self.ranks)}"


def lost_nodes(ranks_by_node: dict[str, tuple[str, list[str]]], timeout: float = PROBE_S) -> list[Lost]:
    """Which of a job's nodes ({node_id: (ip, rank names)}) are gone: dead to the GCS, or not running a
    trivial task pinned to them within `timeout` (a raylet that is hung or cut off)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    lost = [Lost(ip, nid, tuple(names), True) for nid, (ip, names) in ranks_by_node.items() if nid not in alive]

    @ray.remote(num_cpus=0)
    def ping() -> bool:
        return True

    probes = {ping.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(): nid
              for nid in ranks_by_node if nid in alive}
    done, _ = ray.wait(list(probes), num_returns=len(probes), timeout=timeout) if probes else ([], [])
    answered = set()
    for ref in done:
        try:
            ray.get(ref)
            answered.add(probes[ref])
        except Exception:  # noqa: BLE001 (unschedulable: the node died while we asked)
            pass
    for ref, nid in probes.items():
        if nid not in answered:
            ip, names = ranks_by_node[nid]
            dead = nid not in {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            lost.append(Lost(ip, nid, tuple(names), dead))
    for ref in set(probes) - set(done):
        ray.cancel(ref)
    return lost


def plan_on_cluster(plan: PlacementPlan, address: str) -> tuple[PlacementPlan, str | None]:
    """For --dry-run with run.ray_address: the plan with the node of every row, read from the cluster
    (joined as a driver for a moment, nothing started); (plan, note) when the cluster does not answer.
    Raises ConfigError when the plan does not fit its GPU nodes, as the run would."""
    import logging

    import ray

    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        return plan, f"colo: note: the Ray cluster at {address} did not answer ({first}); nodes not shown"
    try:
        return on_nodes(plan, gpu_nodes()), None
    finally:
        ray.shutdown()
