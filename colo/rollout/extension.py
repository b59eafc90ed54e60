"""colo's vLLM worker extension: what colo adds to every vLLM worker, in one class.

    LLM(..., worker_extension_cls=qualname(WorkerExtension))     # colo.rollout.engine passes Engine.extension
    llm.collective_rpc("colo_describe" | "colo_load_bucket" | "colo_routing_start" | ...)

vLLM imports the class by its qualified name in each worker process and makes it an extra base of its
Worker, so the methods run beside the model (`self.model_runner.model`). It is composed of three parts, each
owned by its own concern:
- SyncReceiver (colo.sync.receiver): the engine side of the weight sync (describe, begin/load/end sync,
  the disaggregated broadcast group);
- RoutingCapture (colo.rollout.capture): the experts the engine routes each token to (a CPU capture pass);
- SlotRouting (colo.rollout.capture_cuda): the same on CUDA with rollout.routing_capture=colo, kept beside the KV
  cache. Importing this module in a CUDA worker installs that capture's binding (capture_cuda.install), which has
  to happen before vLLM builds the worker's model runner; vLLM imports the extension just then.
A benchmark that needs more (parameter digests, colo.bench.engines) subclasses WorkerExtension and gives
its Engine subclass `extension = ThatClass`; product code never carries benchmark methods.
"""
from __future__ import annotations

from colo.rollout.capture import RoutingCapture
from colo.rollout.capture_cuda import SlotRouting, install
from colo.sync.receiver import SyncReceiver

install()  # a no-op outside a CUDA vLLM worker


class WorkerExtension(SyncReceiver, RoutingCapture, SlotRouting):
    """Every colo_* method vLLM's workers get (docs/contract.md, "Worker extension")."""


def qualname(cls: type) -> str:
    """The dotted path vLLM's worker resolves (`worker_extension_cls` takes a string, not a class)."""
    return f"{cls.__module__}.{cls.__qualname__}"
