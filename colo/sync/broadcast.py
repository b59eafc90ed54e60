"""The disaggregated transport: one process group of trainer rank 0 + every engine worker, for broadcasts.

    host = WeightGroupHost.open(node_ip)              # trainer rank 0: a TCPStore on a port the OS picked
    addr = host.address                               # {"host", "port", "world"} -> plain data to the engines
    group = host.join(device)                         # rank 0; every engine worker calls join_group(addr, rank, device)
    group.broadcast(buf[:nbytes])                     # root sends, the others receive into their own buffer

Why a group of its own: the trainers already have their FSDP world (torch.distributed's default group) and
each vLLM engine has its TP world; a torch default group cannot be widened to processes outside it. Like
vLLM's own RLHF examples, we build a separate group from a TCPStore: on GPU vLLM's `PyNcclCommunicator`
over a `StatelessProcessGroup` (what vLLM's NCCL weight-transfer engine uses), on CPU a gloo process group
made directly from the store (so CI runs the same path without a GPU). The store's port is chosen by the
OS when rank 0 binds it, and handed to the others: no port is guessed, so none can be taken in between.

Ranks: trainer rank 0 is 0; engine e's TP worker t is 1 + e * tp_size + t.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

PREFIX = "colo-weights"
TIMEOUT = datetime.timedelta(minutes=10)  # a rank that never joins or never posts its receive fails the others


@dataclass
class WeightGroup:
    """A member of the weight-broadcast group; `broadcast` is called by every member in the same order."""

    rank: int
    world: int
    device: torch.device
    _gloo: object | None = None  # dist.ProcessGroupGloo (CPU)
    _nccl: object | None = None  # vllm PyNcclCommunicator (GPU)
    _pending: object | None = None  # the last gloo Work not yet waited for

    def broadcast(self, tensor: torch.Tensor, wait: bool = True) -> None:
        """Root 0 sends `tensor`; the others receive into theirs. wait=False (root, gloo) returns at once;
        the next `broadcast` or `wait()` completes it. On GPU the call is ordered on the current stream."""
        self.wait()
        if self._nccl is not None:
            self._nccl.broadcast(tensor, src=0, stream=torch.cuda.current_stream(self.device))
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = self._gloo.broadcast([tensor], opts)
        if wait:
            work.wait()
        else:
            self._pending = work

    def wait(self) -> None:
        if self._pending is not None:
            work, self._pending = self._pending, None
            work.wait()

    def close(self) -> None:
        self.wait()
        self._gloo = self._nccl = None


class WeightGroupHost:
    """Rank 0's side of the rendezvous: owns the TCPStore the other members connect to."""

    def __init__(self, host: str, world: int) -> None:
        self.host, self.world = host, int(world)
        # port 0: the OS picks a free port as it binds, so nothing can take it between choice and use
        self.store = dist.TCPStore(host, 0, self.world, is_master=True, timeout=TIMEOUT, wait_for_workers=False)

    @property
    def address(self) -> dict:
        return {"host": self.host, "port": int(self.store.port), "world": self.world}

    def join(self, device: torch.device) -> WeightGroup:
        return _make_group(self.store, 0, self.world, device)


def join_group(address: dict, rank: int, device: torch.device) -> WeightGroup:
    """A non-root member joins (blocks until every member has: gloo connects all pairs up front)."""
    if not 0 < rank < int(address["world"]):
        raise ValueError(f"weight-group rank {rank} outside 1..{int(address['world']) - 1}")
    store = dist.TCPStore(address["host"], int(address["port"]), int(address["world"]), is_master=False,
                          timeout=TIMEOUT)
    return _make_group(store, rank, int(address["world"]), device)


def _make_group(store: dist.Store, rank: int, world: int, device: torch.device) -> WeightGroup:
    device = torch.device(device)
    if device.type == "cuda":
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        pg = StatelessProcessGroup(rank=rank, world_size=world, store=dist.PrefixStore(PREFIX, store))
        comm = PyNcclCommunicator(pg, device=device)  # blocks until every member has joined
        if comm.disabled:  # vLLM turns broadcasts into silent no-ops then: refuse instead
            raise RuntimeError("vLLM's PyNcclCommunicator is disabled (VLLM_DISABLE_PYNCCL set, or no NCCL "
                               "library found); fix: unset VLLM_DISABLE_PYNCCL / install NCCL")
        return WeightGroup(rank, world, device, _nccl=comm)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore(PREFIX, store), rank, world, TIMEOUT)
    return WeightGroup(rank, world, device, _gloo=gloo)
