"""Shared pieces of the GPU tests: a GPU config, a test trainer actor, greedy generation, start/stop.

Imported by tests/gpu/test_*.py (pytest puts this folder on sys.path: tests/ has no __init__.py).
Importing it needs only torch and Ray, so collection works (and skips) on a CPU-only host.
"""
from __future__ import annotations

import time
from typing import Any

import ray
import torch

from colo.host.net import free_port  # noqa: F401 (the tests import it from here)

PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [200, 300, 11, 64, 8, 9]]  # ids < 512: valid for the tiny preset
MAX_TOKENS = 8
LOGPROB_ATOL = 0.05  # bf16 weights; two engines with the same bytes may still sum in a different order
PERTURB_SCALE = 0.5  # x each shard's std: large enough that greedy tokens change (asserted, not assumed)


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


def _trainer_cls() -> Any:
    from colo.bench.engines import BenchTrainer

    class GpuTestTrainer(BenchTrainer):
        """The benchmark's trainer (perturb_weights) plus what only the tests need: memory probes."""

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

    return ray.remote(GpuTestTrainer)


def start_trainers(cfg: Any, pgs: list) -> tuple[list, list[dict]]:
    from colo.config import to_dict
    from colo.cluster.placement import scheduling

    cls, d, port = _trainer_cls(), to_dict(cfg), free_port()
    trainers = [cls.options(num_gpus=cfg.placement.train_gpu_fraction, num_cpus=1,
                            scheduling_strategy=scheduling(pg)).remote(d, r, len(pgs), "127.0.0.1", port)
                for r, pg in enumerate(pgs)]
    return trainers, ray.get([t.setup.remote() for t in trainers])


def start_engines(cfg: Any, pgs: list, setups: list[dict]) -> tuple[list, list[dict]]:
    """One DP group over `pgs`, beside the trainers already started there (`setups`: their setup() reports); the
    engine actor takes 0 GPUs (its vLLM worker holds the fraction). Started after the trainers, not with them as
    colo.cluster.actors.start_cluster does, so a test can measure what the engine alone takes; then the product's
    own rank and device checks (check_alignment), which start_cluster runs."""
    from colo.cluster.actors import check_alignment
    from colo.config import to_dict
    from colo.cluster.placement import scheduling
    from colo.rollout.engine import RolloutEngine

    d, port = to_dict(cfg), free_port()
    engines = [RolloutEngine.options(num_gpus=0, num_cpus=0, scheduling_strategy=scheduling(pg))
               .remote(d, r, len(pgs), port) for r, pg in enumerate(pgs)]
    readies = ray.get([e.ready.remote() for e in engines])
    check_alignment(setups, readies, colocated=True)
    return engines, readies


def greedy(engines: list) -> list[list[tuple[list[int], list[float]]]]:
    """Per engine, per prompt: (greedy tokens, their log-probs); all engines at once (a DP group steps
    together)."""
    from colo.rollout.generation import Generation

    outs = ray.get([e.generate.remote(Generation(PROMPTS, 1, MAX_TOKENS, 0.0, 1.0, 0)) for e in engines])
    return [[(s["response_ids"], s["logprobs"]) for s in out] for out, _ in outs]


def stop_engines(engines: list) -> None:
    """Level-2 sleep of every engine at once, then the kills: if vLLM's engine-core process outlives its
    actor, it then holds no weights or KV cache on the GPU. All at once, because the engines of one DP
    group step together: measured on 2xH200 (vLLM 0.26), sleeping and killing DP rank 0 alone left rank 1
    failing in its dummy-batch loop (gloo "Connection closed by peer") and its own sleep() hung."""
    try:
        ray.get([e.sleep.remote(2) for e in engines], timeout=120)
    except Exception:  # noqa: BLE001 -- an engine may already be gone; the kills below still run
        pass
    for e in engines:
        ray.kill(e)
