"""Shared pieces of the GPU tests: a GPU config, the test trainer, a started cluster, greedy generation.

Imported by tests/gpu/test_*.py (pytest puts this folder on sys.path: tests/ has no __init__.py). The actors start
and stop as the CPU tests' do: colo.cluster.actors.start_cluster (tests/integration/test_disaggregated.py,
test_families.py, tests/warm_clusters.py) and warm_clusters.stop_cluster; the prompts, the tolerance and greedy
generation are colo.bench.sync's, which the CPU sync tests use. Importing this module needs only torch and Ray, so
collection works (and skips) on a CPU-only host.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import ray
import torch

from colo.bench.sync import LOGPROB_ATOL, MAX_TOKENS, PERTURB_SCALE, PROMPTS, greedy  # noqa: F401 (the tests')
from colo.host.net import free_port  # noqa: F401 (the tests import it from here)


def gpu_config(model_dir: str, num_gpus: int, **extra: Any) -> Any:
    """A validated, resolved ColoConfig for the tiny model on `num_gpus` real GPUs (eager vLLM: fast start), its
    trainer settings the plain ones the GPU tests were written for (colo.plan.settings.PLAIN: offloaded, eager),
    not what auto would pick for this GPU."""
    import tempfile

    from colo.config import load_config, validate
    from colo.plan.resolve import resolve
    from colo.plan.settings import PLAIN

    cfg = load_config(None, [], env={})  # defaults only: a COLO_* variable on the host must not leak in
    cfg.model.path, cfg.model.dummy_weights = model_dir, False
    cfg.placement.device, cfg.placement.num_gpus = "cuda", num_gpus
    cfg.rollout.max_model_len, cfg.rollout.max_tokens, cfg.rollout.enforce_eager = 256, 16, True
    cfg.rollout.temperature = 1.0  # the trainer's log-probs then compare with vLLM's greedy ones unscaled
    cfg.run.dir = tempfile.mkdtemp(prefix="run-")
    for key, value in {**{k.replace(".", "__"): v for k, v in PLAIN.items()}, **extra}.items():
        section, _, leaf = key.partition("__")
        setattr(getattr(cfg, section), leaf, value)
    validate(cfg, check_resources=False)
    return resolve(cfg).cfg  # as colo.launch hands it to the actors: no `auto` left


def gpu_trainer() -> type:
    """The benchmark's trainer (perturb_weights) plus what only the GPU tests read: memory probes."""
    from colo.bench.engines import BenchTrainer

    class GpuTestTrainer(BenchTrainer):
        def setup(self) -> dict:
            self._setup_report = super().setup()
            return self._setup_report

        def setup_report(self) -> dict:
            """What setup() returned (start_cluster checked it and kept none)."""
            return self._setup_report

        def gpu_free(self) -> int:
            """Free bytes on this GPU (device-wide: counts every process on it, vLLM's worker too)."""
            torch.cuda.synchronize()
            time.sleep(0.2)  # another process's cuMemUnmap/cudaFree is visible after it returns, but be safe
            return int(torch.cuda.mem_get_info()[0])

        def expert_local_bytes(self) -> int:
            """Bytes of this rank's local shards of the fused expert params."""
            return sum(p.to_local().numel() * p.to_local().element_size()
                       for n, p in self.model.named_parameters()
                       if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")))

    return GpuTestTrainer


@contextlib.contextmanager
def gpu_cluster(cfg: Any, trainer_cls: type | None = None, engine_cls: type | None = None) -> Iterator[Any]:
    """The job's actors as a run starts them (start_cluster: trainers and engines, the rank and device checks;
    `trainer_cls` default gpu_trainer()), stopped afterwards: every engine asleep at level 2 first (stop_engines),
    then stop_cluster, then Ray."""
    from warm_clusters import stop_cluster

    from colo.cluster.actors import start_cluster
    from colo.cluster.placement import init_ray, plan_placement

    plan = plan_placement(cfg)
    init_ray(plan)
    c = None
    try:
        c = start_cluster(cfg, plan, trainer_cls=trainer_cls or gpu_trainer(), engine_cls=engine_cls)
        ray.get([t.prepare_sync.remote(e) for t, e in zip(c.trainers, c.trainer_group.sync_engines())])
        yield c
    finally:
        if c is not None:
            stop_engines(c.engines)
            stop_cluster(c)
        ray.shutdown()


def stop_engines(engines: list) -> None:
    """Level-2 sleep of every engine at once: if vLLM's engine-core process outlives its actor, it then holds no
    weights or KV cache on the GPU. All at once, because the engines of one DP group step together: measured on
    2xH200 (vLLM 0.26), sleeping and killing DP rank 0 alone left rank 1 failing in its dummy-batch loop (gloo
    "Connection closed by peer") and its own sleep() hung."""
    try:
        ray.get([e.sleep.remote(2) for e in engines], timeout=120)
    except Exception:  # noqa: BLE001 -- an engine may already be gone; the stop that follows still runs
        pass
