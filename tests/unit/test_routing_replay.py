"""Rollout routing replay (R3) at model level, and the trainer-vs-engine metrics: transformers MoE models of
each family R3 supports (no Ray, no vLLM). The engine side is tests/integration/test_engines_across_syncs.py, the job
side tests/e2e/test_routing_job.py.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import experts_got

from colo.algo.batch import NO_EXPERT, build_batch, shard_batch
from colo.algo.parity import gap_metrics, logprob_gap
from colo.algo.replay import RouterTap, routers
from colo.rollout.sample import Sample

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


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replay_uses_given_ids_with_the_familys_weights(family: str) -> None:
    model = _hf_model(family)
    tap, got = RouterTap(model), experts_got(model)
    ids = torch.randint(0, 96, (3, 7))
    plain = model(input_ids=ids).logits
    own = torch.stack([got[layer].view(3, 7, 2) for layer, _ in routers(model)], dim=2)  # (b, T, M, K)
    tap.set(own.to(torch.uint8), replay=True)  # the model's own routing replayed: bit-identical logits
    assert torch.equal(model(input_ids=ids).logits, plain)
    other = (own + 3) % 8  # (b, T, M, K): a different set of experts at every pair
    other[0, 0, 0] = NO_EXPERT["uint8"]  # one pair with no engine id: the trainer keeps its own there
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
        samples.append(Sample(i, 0, 0, list(range(1, p + 1)), [7] * r, [-0.5] * r,
                              routing=rng.integers(0, 8, (p + r - 1, 2, 2)).astype(np.uint8)))
    batch = build_batch(samples, [1.0, 0.0, -1.0])
    assert batch["routed_experts"].shape == (3, 6, 2, 2) and batch["routed_experts"].dtype == torch.uint8
    for shard in shard_batch(batch, 2):  # 3 rows over 2 ranks: one shard gets a padding row
        for row, idx in enumerate(shard["sample_index"].tolist()):
            s = samples[idx] if idx >= 0 else None
            got = shard["routed_experts"][row]
            assert got.shape[0] == shard["input_ids"].shape[1]
            if s is None:
                continue
            n = len(s.prompt_ids) + len(s.response_ids) - 1
            assert torch.equal(got[:n], torch.from_numpy(s.routing))
            assert (got[n:] == NO_EXPERT["uint8"]).all()  # the last token and the padding: no engine id
    bad = replace(samples[0], routing=samples[0].routing[:-1])
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




def test_r3_with_async_on_gpu_is_refused_only_for_conversations(tmp_path: Path) -> None:
    """loop.mode=async reads a stopped request's routing from the GPU engine's capture (colo.rollout.engine_loop.
    stopped_rows), so R3 runs with it there; a carried conversation's routing is not checked on GPU yet."""
    import json

    from colo.config import ConfigError, load_config, validate

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
         "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}))
    args = [f"model.path={tmp_path / 'm'}", "model.dummy_weights=true", "algo.routing_replay=r3",
            "placement.device=cuda", "loop.mode=async", f"run.dir={tmp_path / 'run'}"]
    validate(load_config(None, args), check_gpus=False)
    with pytest.raises(ConfigError, match=r"r3 with loop.mode=async and algo.environment runs on CPU engines only"):
        validate(load_config(None, [*args, "algo.environment=calculator"]), check_gpus=False)
