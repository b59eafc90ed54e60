"""colo's vLLM worker extension: what colo adds to every vLLM worker, in one class.

    LLM(..., worker_extension_cls=qualname(WorkerExtension))     # colo.rollout.engine passes Engine.extension
    llm.collective_rpc("colo_describe" | "colo_load_bucket" | "colo_routing_start" | ...)

vLLM imports the class by its qualified name in each worker process and makes it an extra base of its
Worker, so the methods run beside the model (`self.model_runner.model`). It is composed of two parts, each
owned by its own concern:
- SyncReceiver (colo.sync.receiver): the engine side of the weight sync (describe, begin/load/end sync,
  the disaggregated broadcast group);
- RoutingCapture (colo.rollout.capture): the experts the engine routes each token to.
A benchmark that needs more (parameter digests, colo.bench.engines) subclasses WorkerExtension and gives
its Engine subclass `extension = ThatClass`; product code never carries benchmark methods.
"""
from __future__ import annotations

from colo.rollout.capture import RoutingCapture
from colo.sync.receiver import SyncReceiver


class WorkerExtension(SyncReceiver, RoutingCapture):
    """Every colo_* method vLLM's workers get (docs/contract.md, "Worker extension")."""


def qualname(cls: type) -> str:
    """The dotted path vLLM's worker resolves (`worker_extension_cls` takes a string, not a class)."""
    return f"{cls.__module__}.{cls.__qualname__}"
