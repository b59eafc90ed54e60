"""This host's network for servers colo starts: a free port, and the address gloo and vLLM bind.

    port = free_port()          # on the node that will listen (colo.cluster.nodes.locate runs it there)
    os.environ.update(node_env())   # in an actor, before any gloo group or vLLM engine exists

gloo binds the address its host name resolves to, often 127.0.0.1 or 127.0.1.1 (/etc/hosts): peers on
other nodes could not connect. Each actor therefore names the interface that holds its node IP
(GLOO_SOCKET_IFNAME, read by torch's gloo when a group is created) before any gloo group exists, and
gives vLLM the node IP (VLLM_HOST_IP) before vLLM starts.
"""
from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A free TCP port on this node for a server that another process will open a moment later.

    Taken from below the kernel's ephemeral range: a port handed out by bind(0) is an ephemeral one,
    and in the gap before the server binds it, any outgoing connection (Ray, gloo, vLLM start dozens)
    may be given the same number; CI hit exactly that (EADDRINUSE in init_process_group). Call it on
    the node that listens (colo.cluster.nodes.locate runs it there)."""
    lo = _ephemeral_low()
    for _ in range(200):
        port = _RNG.randrange(max(1024, lo - 12000), lo) if lo > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free TCP port below the ephemeral range ({lo}) after 200 tries")


_RNG = random.SystemRandom()  # independent of any seeding the job does: two runs must not pick alike


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux default


def interface_of(ip: str) -> str | None:
    """The network interface that holds `ip` on this machine (None: not found, e.g. behind NAT)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)):
            return name
    return None


def node_env() -> dict[str, str]:
    """What an actor sets before it creates a gloo group or starts vLLM, so both use this node's Ray IP:
    GLOO_SOCKET_IFNAME (the interface holding it; gloo would bind what the host name resolves to) and
    VLLM_HOST_IP (vLLM otherwise asks the routing table for a way to 8.8.8.8, which a node without a
    default route lacks). {} outside Ray."""
    import ray

    if not ray.is_initialized():
        return {}
    ip = ray.util.get_node_ip_address()
    name = interface_of(ip)
    return {"VLLM_HOST_IP": ip, **({"GLOO_SOCKET_IFNAME": name} if name else {})}


def unreachable(address: str, default_port: int, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers a TCP connect to "host:port" (or "scheme://host:port") within timeout_s; None when
    something listens. Ray's own join retries for minutes before it gives up, so colo asks first."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        host, port = hostport, str(default_port)
    host = host.strip("[]")  # [::1]:6379
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except socket.gaierror as e:
        return f"cannot resolve {host!r} ({e.strerror})"
    except socket.timeout:
        return f"no answer from {host}:{port} within {timeout_s:g} s"
    except OSError as e:
        return f"{host}:{port}: {e.strerror or type(e).__name__}"
