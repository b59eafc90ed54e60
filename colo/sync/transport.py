"""The transport of the weight sync: reusable byte buffers, their handles, and the broadcast group.

    sender (trainer rank r)                                  receiver (vLLM worker)
    SenderBuffers(nbytes, B, device).handles() ──plain data──▶ ReceiverBuffers.set_active(handles)
    buffer k: packed by the sender ───────────────────────────▶ ReceiverBuffers.get(k): the same bytes

One interface, three transports:
- CPU: POSIX shared memory (`multiprocessing.shared_memory`); the handle is the segment name.
- CUDA: CUDA IPC via `torch.multiprocessing.reductions.reduce_tensor`; its arguments hold classes, a
  dtype and the sender's device index, which vLLM's RPC refuses to serialize (measured,
  docs/vllm-notes.md). We send `CudaIpcArgs` with names instead and rebuild them on the receiver,
  replacing the device index by the receiver's own (the two processes may see the same GPU under
  different indices, so the handle carries the device UUID and the receiver checks it).
- broadcast (disaggregated mode): sender and receivers each own a plain buffer; the receiver allocates
  its own once and fills it by a broadcast from trainer rank 0 (`WeightGroup`, below) before unpacking.

Handles are plain dicts (contract.md): {"kind": "shm", "name", "nbytes", "buffer_id"} or
{"kind": "cuda_ipc", "buffer_id", "nbytes", "device_uuid", "args"} or {"kind": "broadcast", "buffer_id", "nbytes"}.

The broadcast group (disaggregated mode): one process group of trainer rank 0 + every engine worker.

    host = WeightGroupHost(node_ip, world)            # trainer rank 0: a TCPStore on a port the OS picked
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

import _posixshmem
import atexit
import contextlib
import datetime
import mmap
import os
import secrets
import weakref
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import NamedTuple

import torch
import torch.distributed as dist

from colo.models.dtypes import dtype_name, torch_dtype
from colo.host.shm import segment_name

ALIGN = 256  # byte alignment of every piece in a buffer (covers any dtype, and CUDA's 256-byte rule)


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def device_uuid(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


class SenderBuffers:
    """`count` uint8 buffers of `nbytes` each, allocated once and reused by every sync.

    The sender owns the segments: it unlinks them on close() and at interpreter exit, so a crashed
    receiver cannot leak /dev/shm space, and a crashed sender leaks at most `count` segments.
    """

    def __init__(self, nbytes: int, count: int, device: torch.device | str, shared: bool = True) -> None:
        self.nbytes, self.count, self.device = int(nbytes), int(count), torch.device(device)
        self.tensors: list[torch.Tensor] = []  # each (nbytes,) uint8
        self._shm: list[shared_memory.SharedMemory] = []
        self._handles: list[dict] = []
        if not shared:  # broadcast: only this process touches them; receivers hold their own
            self.tensors = [torch.empty(self.nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.count)]
            self._handles = [{"kind": "broadcast", "buffer_id": i, "nbytes": self.nbytes} for i in range(self.count)]
        elif self.device.type == "cpu":
            tag = secrets.token_hex(4)
            for i in range(self.count):
                seg = shared_memory.SharedMemory(name=segment_name(tag, i), create=True, size=self.nbytes)
                self._shm.append(seg)
                self.tensors.append(torch.frombuffer(seg.buf, dtype=torch.uint8, count=self.nbytes))
                self._handles.append({"kind": "shm", "name": seg.name, "nbytes": self.nbytes, "buffer_id": i})
            self._finalizer = weakref.finalize(self, _unlink_all, list(self._shm), list(self.tensors))
            atexit.register(self._finalizer)
        elif self.device.type == "cuda":
            uuid = device_uuid(self.device)
            for i in range(self.count):
                with _no_expandable_segments():
                    buf = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                self.tensors.append(buf)
                self._handles.append({"kind": "cuda_ipc", "buffer_id": i, "nbytes": self.nbytes,
                                      "device_uuid": uuid, "args": _cuda_ipc_args(buf)})
        else:
            raise ValueError(f"no buffer transport for device {self.device}")

    def handles(self) -> list[dict]:
        return [dict(h) for h in self._handles]

    def close(self) -> None:
        self.tensors = []
        if self._shm:
            self._finalizer()
            self._shm = []


@contextlib.contextmanager
def _no_expandable_segments():
    """Allocate from classic segments even where the user runs PyTorch's expandable segments
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True). Those are mapped through CUDA's VMM API, which
    cudaIpcGetMemHandle cannot export; whether torch shares them another way depends on its version and
    the container. The transfer buffers are allocated once, so classic segments cost nothing here
    (tests/gpu/test_ipc_alloc.py)."""
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    on = "expandable_segments:true" in conf.replace(" ", "").lower()
    if on:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        if on:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def _unlink_all(segs: list[shared_memory.SharedMemory], tensors: list[torch.Tensor]) -> None:
    tensors.clear()  # frombuffer tensors export the mmap; drop them before close() or it raises BufferError
    for seg in segs:
        try:
            seg.close()
        except BufferError:  # a tensor view still alive somewhere: leave the mapping, still unlink the name
            pass
        try:
            seg.unlink()
        except FileNotFoundError:
            pass


class CudaIpcArgs(NamedTuple):
    """The arguments of torch.multiprocessing.reductions.rebuild_cuda_tensor, in its order, as plain data:
    the one place colo depends on torch's CUDA-IPC layout (tests/unit/test_sync_pack.py compares these
    names with rebuild_cuda_tensor's signature, so a torch that changes it fails on CPU). Classes and the
    dtype travel as None / names; the device index is replaced by the receiver's own."""

    tensor_cls: None  # torch.Tensor on the receiver
    tensor_size: list[int]
    tensor_stride: list[int]
    tensor_offset: int
    storage_cls: None  # torch.storage.UntypedStorage on the receiver
    dtype: str  # "bfloat16"
    storage_device: int  # the sender's index; the receiver puts its own
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    requires_grad: bool
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


def _cuda_ipc_args(buf: torch.Tensor) -> list:
    """reduce_tensor's argument tuple with classes and dtype replaced by names (plain data)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(buf)
    a = CudaIpcArgs(*args)
    return list(a._replace(tensor_cls=None, tensor_size=list(a.tensor_size), tensor_stride=list(a.tensor_stride),
                           storage_cls=None, dtype=dtype_name(a.dtype)))


def _rebuild_cuda_ipc(args: list, device_index: int) -> torch.Tensor:
    """The sender's buffer, mapped into this process on our own index of the same GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    a = CudaIpcArgs(*args)
    a = a._replace(tensor_cls=torch.Tensor, tensor_size=torch.Size(a.tensor_size),
                   tensor_stride=tuple(a.tensor_stride), storage_cls=torch.storage.UntypedStorage,
                   dtype=torch_dtype(a.dtype), storage_device=device_index)
    return rebuild_cuda_tensor(*a)


def _open(handle: dict, device: torch.device) -> tuple[torch.Tensor, mmap.mmap | None]:
    if handle["kind"] == "broadcast":  # our own buffer, filled by a broadcast before each unpack
        return torch.empty(int(handle["nbytes"]), dtype=torch.uint8, device=device), None
    if handle["kind"] == "shm":
        # Attach without multiprocessing.shared_memory: Python 3.11 registers attached segments with the
        # resource tracker, which then unlinks them (and warns about "leaks") when this process exits,
        # or, when sender and receiver share a tracker, makes the sender's own unlink fail. The sender
        # owns the segment; the receiver only maps it.
        fd = _posixshmem.shm_open("/" + handle["name"].lstrip("/"), os.O_RDWR, mode=0o600)
        try:
            mm = mmap.mmap(fd, int(handle["nbytes"]))
        finally:
            os.close(fd)
        return torch.frombuffer(mm, dtype=torch.uint8, count=int(handle["nbytes"])), mm
    if handle["kind"] == "cuda_ipc":
        if device.type != "cuda":
            raise ValueError("a cuda_ipc handle needs a CUDA receiver device")
        mine = device_uuid(device)
        if handle.get("device_uuid") and mine != handle["device_uuid"]:
            raise ValueError(f"cuda_ipc buffer lives on {handle['device_uuid']}, receiver is on {mine}: "
                             "trainer and engine are not colocated on one GPU")
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _rebuild_cuda_ipc(handle["args"], index), None
    raise ValueError(f"unknown buffer kind {handle['kind']!r}")


_KEEP_ALIVE: list[mmap.mmap] = []  # mappings that could not be closed (a view survived)


def open_transient(handle: dict, device: torch.device | str) -> tuple[torch.Tensor, mmap.mmap | None]:
    """Open a buffer for one bucket only (the straightforward baseline's fresh buffer per bucket), not
    cached. The caller drops every view of the tensor, then passes the mapping to close_transient."""
    return _open(handle, torch.device(device))


def close_transient(seg: mmap.mmap | None) -> None:
    if seg is None:
        return
    try:
        seg.close()
    except BufferError:  # a view survived: keep the mapping rather than crash
        _KEEP_ALIVE.append(seg)


def _handle_key(handle: dict) -> tuple:
    kind = handle["kind"]
    ident = (handle.get("name") if kind == "shm" else int(handle["nbytes"]) if kind == "broadcast"
             else bytes(CudaIpcArgs(*handle["args"]).storage_handle))
    return (handle["kind"], ident, int(handle["buffer_id"]))


class ReceiverBuffers:
    """Opens each sender buffer once and caches it; `set_active` picks the handles of this sync."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._cache: dict[tuple, torch.Tensor] = {}
        self._segs: dict[tuple, mmap.mmap] = {}
        self._active: dict[int, torch.Tensor] = {}
        self.kinds: dict[int, str] = {}  # buffer_id -> handle kind of this sync
        self.opened = 0  # how many opens happened (tests check that reuse does not reopen)

    def set_active(self, handles: list[dict]) -> None:
        keys = [_handle_key(h) for h in handles]
        self._active, self.kinds = {}, {}
        for key in [k for k in self._cache if k not in keys]:  # buffers of an earlier sender (or baseline)
            del self._cache[key]
            seg = self._segs.pop(key, None)
            if seg is not None:
                try:
                    seg.close()
                except BufferError:
                    _KEEP_ALIVE.append(seg)
        for h, key in zip(handles, keys):
            if key not in self._cache:
                self._cache[key], seg = _open(h, self.device)
                if seg is not None:
                    self._segs[key] = seg
                self.opened += 1
            self._active[int(h["buffer_id"])] = self._cache[key]
            self.kinds[int(h["buffer_id"])] = h["kind"]

    def get(self, buffer_id: int) -> torch.Tensor:
        return self._active[int(buffer_id)]


# ---------------------------------------------------------------- the broadcast group (disaggregated)

GROUP_PREFIX = "colo-weights"
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
        pg = StatelessProcessGroup(rank=rank, world_size=world, store=dist.PrefixStore(GROUP_PREFIX, store))
        comm = PyNcclCommunicator(pg, device=device)  # blocks until every member has joined
        if comm.disabled:  # vLLM turns broadcasts into silent no-ops then: refuse instead
            raise RuntimeError("vLLM's PyNcclCommunicator is disabled (VLLM_DISABLE_PYNCCL set, or no NCCL "
                               "library found); fix: unset VLLM_DISABLE_PYNCCL / install NCCL")
        return WeightGroup(rank, world, device, _nccl=comm)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore(GROUP_PREFIX, store), rank, world, TIMEOUT)
    return WeightGroup(rank, world, device, _gloo=gloo)
