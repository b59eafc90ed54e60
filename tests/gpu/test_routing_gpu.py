"""Routing replay on one GPU with the Qwen3-30B-A3B shape (2 layers, 128 experts top-8, random weights).

    bash tests/gpu/run.sh                      # STEPS="routing" for this one alone
    PYTHONPATH=. python -m pytest tests/gpu/test_routing_gpu.py -x -q -s    (~3 min on one H100/H200)

A TrainWorker (FSDP2, bf16 compute) and a RolloutEngine (vLLM 0.26, started with
enable_return_routed_experts) share the GPU; the trainer's weights are synced into the engine, so both
hold the same bytes. 16 prompts x 4 samples at T=1; the trainer recomputes their log-probs with
algo.routing_replay off and r3 over the same batch. Checked: vLLM returns ids for every prompt and response
token but the last (P+R-1 rows x 2 MoE layers x top-8, uint8); with r3 the log-prob gap is no larger
than without. The `[gpu]` lines carry the figures for docs/routing.md.
"""
from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

from gpu_helpers import gpu_config, start_engines, stop_engines

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from colo.config import to_dict
    from colo.models.tiny import make_tiny_model
    from colo.cluster.placement import create_placement, init_ray, plan_placement, remove_placement, scheduling
    from colo.trainer.worker import Trainer

    class RoutingTrainer(Trainer):
        def logprobs_as(self, batch: dict, mode: str) -> tuple[torch.Tensor, list[float]]:
            """Old log-probs with algo.routing_replay=mode, and (pairs differing, pairs compared)."""
            self.cfg.algo.routing_replay = mode
            return self.compute_logprobs(batch), list(self._routing_counts)

    model = make_tiny_model(tmp_path_factory.mktemp("colo-gpu") / "l2", "qwen3-30b-a3b-L2", 0)
    cfg = gpu_config(str(model), num_gpus=1, model__dummy_weights=True, placement__vllm_gpu_fraction=0.3)
    plan = plan_placement(cfg)
    init_ray(plan)
    pgs = create_placement(plan)
    engines: list = []
    try:
        trainer = ray.remote(RoutingTrainer).options(
            num_gpus=cfg.placement.train_gpu_fraction, num_cpus=1, scheduling_strategy=scheduling(pgs[0])).remote(
            to_dict(cfg), 0, 1, "127.0.0.1", __import__("gpu_helpers").free_port())
        setup = ray.get(trainer.setup.remote())
        engines, _ = start_engines(cfg, pgs, [setup])
        ray.get(trainer.prepare_sync.remote([engines[0]]))
        assert ray.get(trainer.sync_weights.remote(engines[0]))["verified"]
        yield {"trainer": trainer, "engine": engines[0]}
    finally:
        stop_engines(engines)
        remove_placement(pgs)
        ray.shutdown()


def test_routing_mismatch_and_gap_with_and_without_r3(pair) -> None:
    from colo.algo.batch import build_batch
    from colo.algo.parity import gap_metrics, logprob_gap

    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 500, (16, 64)).tolist()
    from colo.rollout.generation import Generation

    samples, _ = ray.get(pair["engine"].generate.remote(Generation(prompts, 4, 32, 1.0, 1.0, 0, True)))
    for s in samples:
        ids = s["routing"]
        assert ids.dtype == np.uint8 and ids.shape == (64 + len(s["response_ids"]) - 1, 2, 8), ids.shape
        assert ids.max() < 128 and all(len(set(r)) == 8 for r in ids.reshape(-1, 8).tolist())
    batch = build_batch(samples, [0.0] * len(samples))
    res = {}
    for mode in ("off", "r3"):
        old, (differ, pairs) = ray.get(pair["trainer"].logprobs_as.remote(batch, mode))
        res[mode] = {**gap_metrics(logprob_gap(old, batch["rollout_logprobs"], batch["loss_mask"])),
                     "routing/mismatch": differ / max(pairs, 1.0)}
        print(f"[gpu] routing {mode}: " + ", ".join(f"{k}={v:.5g}" for k, v in res[mode].items()))
    ratio = res["off"]["logprob_diff/mean"] / max(res["r3"]["logprob_diff/mean"], 1e-12)
    print(f"[gpu] routing: gap mean off/r3 = {ratio:.2f}x over {int(batch['loss_mask'].sum())} tokens")
    assert 0.0 <= res["off"]["routing/mismatch"] < 0.5
    assert res["r3"]["logprob_diff/mean"] <= res["off"]["logprob_diff/mean"] * 1.05
