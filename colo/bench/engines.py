"""The benchmark's actor classes: colo's Trainer and Engine plus what only a benchmark needs.

    start_cluster(cfg, plan, trainer_cls=BenchTrainer, engine_cls=BenchEngine)        # colo.bench.sync
    start_cluster(cfg, plan, trainer_cls=BenchTrainer, engine_cls=VllmIpcEngine)      # ... timing vLLM's engine

BenchTrainer runs the yardsticks (colo.bench.yardsticks) and perturbs its shards, so that a sync that
changes nothing cannot pass for one that works; BenchEngine reads back what vLLM holds (parameter
digests); VllmIpcEngine also builds vLLM's own CUDA-IPC weight-transfer engine. Only VllmIpcEngine
switches on VLLM_ALLOW_INSECURE_SERIALIZATION (vLLM's IPC handles carry Python classes, which its
msgpack RPC refuses otherwise); colo's own sync sends plain data and never needs it.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from colo.bench.yardsticks import broadcast_weights_baseline, push_weights_baseline, push_weights_vllm_ipc
from colo.rollout.engine import Engine
from colo.rollout.extension import WorkerExtension
from colo.sync.verify import tensor_digest
from colo.trainer.worker import Trainer


class BenchTrainer(Trainer):
    def sync_baseline(self, engines: list) -> dict:
        """The straightforward colocated sync into engines[0] (this rank's engine)."""
        self._check_ready()
        return push_weights_baseline(self.model, engines[0], self.cfg.sync)

    def broadcast_baseline(self, engines: list) -> dict:
        """The straightforward disaggregated sync: a broadcast and a load_weights per tensor."""
        self._check_ready()
        return broadcast_weights_baseline(self.model, engines, self._weight_group, self.cfg.sync)

    def sync_vllm_ipc(self, engines: list) -> dict:
        """vLLM's own packed CUDA-IPC weight transfer into every engine (rank 0 sends the handles)."""
        self._check_ready()
        return push_weights_vllm_ipc(self.model, engines, self.cfg.sync)

    @torch.no_grad()
    def perturb_weights(self, seed: int, scale: float) -> int:
        """Add noise to this rank's shards (no collectives); returns elements touched. The benchmark's --check
        and the GPU tests use it so a sync that changes nothing cannot pass for one that works."""
        gen = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + self.rank)
        n = 0
        for _, p in self.model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p.data
            if local.numel() == 0:  # uneven expert split: an empty shard
                continue
            std = local.float().std(correction=0).clamp_min(0.02)  # norms are all 1.0: std 0
            noise = torch.randn(local.shape, generator=gen, device=local.device)
            local.add_((noise * scale * std).to(local.dtype))
            n += local.numel()
        return n


class BenchWorkerExtension(WorkerExtension):
    """colo's worker extension plus what only the benchmark reads back from vLLM's workers."""

    def colo_param_digest(self) -> dict[str, float]:
        """tensor_digest of every live vLLM parameter (whatever layout vLLM keeps it in)."""
        return {n: tensor_digest(p.data) for n, p in self.model_runner.model.named_parameters()}  # type: ignore[attr-defined]


class BenchEngine(Engine):
    extension = BenchWorkerExtension

    def param_digest(self) -> list[dict[str, float]]:
        """Per worker, a checksum of every vLLM parameter as it is now: tells whether two sync paths wrote
        the same values (colo.bench.sync checks vLLM's IPC engine against colo's sync with it)."""
        return self._rpc_all("colo_param_digest")


class VllmIpcEngine(BenchEngine):
    """BenchEngine that also builds vLLM's own weight-transfer engine (`LLM(weight_transfer_config=...)` and
    the LLM's weight-update methods). CUDA only: it moves CUDA IPC handles."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # read by vLLM's msgpack encoder in every process it starts: set before vLLM is imported
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        super().__init__(*args, **kwargs)

    def _llm_kwargs(self) -> dict[str, Any]:
        from colo.rollout.vllm_compat import require_weight_transfer

        require_weight_transfer(self.device)
        return {**super()._llm_kwargs(), "weight_transfer_config": {"backend": "ipc"}}

    def vllm_init_weight_transfer(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})  # the trainer's wire params (packed)

    def vllm_start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def vllm_update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def vllm_finish_weight_update(self) -> None:
        self.llm.finish_weight_update()
        self._drop_prefix_cache()  # as the product sync does after every update
