"""The layer check's design and naming (colo.sync.layercheck, colo.sync.forcing), on transformers models only: the
trainer's records against those of a copy with one weight one optimizer step behind must name that weight.
Against real vLLM engines (every CPU family, faults injected into the sync itself): tests/integration/test_families.py.

    .venv/bin/python -m pytest tests/unit/test_sync_layercheck.py -q
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from colo.models.archs import num_experts
from colo.sync.forcing import Forcing
from colo.sync.layercheck import (DOMINANT, TOLERANCE, bucket, compare, forced_logits, layer_spec, row_errors,
                                  sequences)

SPEC = layer_spec(300, 128)
LR = 4e-4  # the default CPU job's RL learning rate (configs/tiny-cpu.yaml)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    from colo.models.tiny import make_tiny_model

    path = make_tiny_model(Path(tmp_path_factory.mktemp("tiny")) / "m", "tiny", seed=0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def records(model) -> dict:
    with torch.no_grad(), Forcing(model, SPEC, "hf", model.config) as f:
        hidden = model.model(input_ids=torch.tensor(f.hf_ids), use_cache=False).last_hidden_state
        f.add_logits(hidden @ model.lm_head.weight.T)
    return f.records()


def one_step(model, names: list[str], index: int | None = None):
    """A copy of `model` whose named tensors (or row `index` of each) take one Adam-like step of LR: the value
    one optimizer step earlier or later (Adam's first step moves every element by ~lr)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n in names:
            p = other.get_parameter(n)
            target = p if index is None else p[index]
            target.add_(LR * torch.sign(torch.randn(target.shape, generator=g)))
    return other


def test_forced_routing_makes_every_expert_some_tokens_main_one() -> None:
    logits = forced_logits(40, 16, 4)  # (T, E)
    top = logits.topk(4, dim=-1)
    assert (top.indices[:, 0] == torch.arange(40) % 16).all() and (top.values[:, 0] == DOMINANT).all()
    grouped = forced_logits(32, 16, 4, group_size=8)
    chosen = grouped.topk(4, dim=-1).indices  # every token's experts inside its dominant's group of 8
    assert (chosen // 8 == (chosen[:, :1] // 8)).all()
    assert logits.to(torch.bfloat16).float().equal(logits)  # exact in the router's dtype
    with pytest.raises(ValueError, match="top_k > group"):
        forced_logits(8, 8, 4, group_size=2)


def test_sequences_cover_every_expert_within_the_context() -> None:
    assert [len(s) for s in sequences(SPEC, 8)] == [32]
    assert [len(s) for s in sequences(layer_spec(300, 50), 128)] == [49, 49, 49]  # 128 rows at most 49 a sequence
    assert sequences(SPEC, 8) == sequences(SPEC, 8) and all(0 <= t < 300 for s in sequences(SPEC, 8) for t in s)


def test_bucketing_sees_every_column() -> None:
    x = torch.randn(4, 1000)
    for j in (0, 17, 999):  # one column (one vocabulary row of lm_head) changed
        y = x.clone()
        y[:, j] += 1.0
        assert (row_errors(bucket(y, 64), bucket(x, 64)) > 1e-3).all(), j


def test_identical_models_agree_to_the_bit(model) -> None:
    res = compare(records(model), records(model), TOLERANCE["float32"])
    assert res.ok and res.err == 0.0, res.summary()
    rec = records(model)
    assert set(rec["order"]) == set(rec["sites"])  # every expected site was recorded
    assert all(sorted(set(d)) == list(range(num_experts(model.config))) for d in rec["routing"].values())


@pytest.mark.parametrize("fault, names, index, named", [
    ("one expert", ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"], 5,
     "model.layers.1.mlp expert 5"),
    ("one norm", ["model.layers.0.input_layernorm.weight"], None, "model.layers.0.input_layernorm"),
    ("a q/k norm", ["model.layers.1.self_attn.k_norm.weight"], None, "model.layers.1.self_attn"),
    ("the router", ["model.layers.0.mlp.gate.weight"], None, "model.layers.0.mlp.gate"),
    ("lm_head", ["lm_head.weight"], None, "lm_head"),
    ("the final norm", ["model.norm.weight"], None, "model.norm"),
    ("one embedding row", ["model.embed_tokens.weight"], 123, "model.embed_tokens (every row)"),
])
def test_a_weight_one_step_stale_is_named(model, fault, names, index, named) -> None:
    """float32, one step of the default job's learning rate on one tensor (or one expert, one row): the site is named
    first, and nothing downstream of it in the same block is named beside it."""
    if "lm_head.weight" in names and model.config.tie_word_embeddings:
        pytest.skip("the tiny preset ties lm_head to the embedding")
    res = compare(records(model), records(one_step(model, names, index)), TOLERANCE["float32"])
    assert not res.ok, fault
    assert res.summary().startswith(named), (fault, res.summary())
    if fault == "one norm":  # its attention fails too, downstream: not named
        assert "model.layers.0.self_attn" not in res.summary()
    if fault == "one expert":  # the other experts' tokens are clean
        assert "expert 5 " in res.summary() + " " and "every token" not in res.summary()


def test_records_cross_vllms_rpc_encoding_intact() -> None:
    """The engine's records come back through vLLM's collective_rpc, msgpack-encoded (the engine core is a process of
    its own on GPU): a numpy array arrives as an untyped (dtype, shape, buffer) triple there, so records carry each
    site as layercheck.packed's bytes and shape, which arrive as they left."""
    import numpy as np
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from colo.sync.layercheck import packed, unpacked

    values = torch.randn(37, 64)  # above vLLM's inline threshold: its buffer travels out of band
    values[0, :3] = torch.tensor([float("inf"), -0.0, 1e-40])
    wire = MsgpackDecoder().decode(MsgpackEncoder().encode({"sites": {"a": packed(values), "e": packed(values[:0])}}))
    assert torch.equal(unpacked(wire["sites"]["a"]), values) and unpacked(wire["sites"]["e"]).shape == (0, 64)
    raw = MsgpackDecoder().decode(MsgpackEncoder().encode({"a": values.numpy()}))["a"]
    assert not isinstance(raw, np.ndarray)  # why packed: an array does not survive the trip
