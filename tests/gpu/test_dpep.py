"""Two GPUs: one vLLM DP+EP engine group (dp size 2) beside FSDP2 world 2; the expert sync is gather-free.

    PYTHONPATH=. python -m pytest tests/gpu/test_dpep.py -x -q          (skips with fewer than 2 GPUs)

FSDP2's dim-0 shard of HF's fused expert tensors on rank r is exactly what vLLM's expert parallelism
(linear placement, same world size) keeps on rank r, so the sync reads experts from `to_local()` and
all-gathers only the dense part. Verified by counting bytes (colo.sync.sender's counters, reported by
Sender.push): no expert byte comes out of a collective, every rank's expert bytes equal its own FSDP
shard, and each engine receives exactly its own parameters over same-GPU CUDA IPC. Digest mode checks
the bytes that arrived against the bytes that were packed, tensor by tensor.
"""
from __future__ import annotations

import pytest
import ray
import torch

from gpu_helpers import PERTURB_SCALE, PROMPTS, greedy, gpu_cluster, gpu_config

pytestmark = pytest.mark.gpu
WORLD = 2


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory):
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs")
    from colo.cluster.placement import plan_placement
    from colo.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("colo-gpu2") / "tiny", "tiny", 0)
    cfg = gpu_config(str(model), num_gpus=WORLD, sync__digest=True)
    assert plan_placement(cfg).ep_size == WORLD
    with gpu_cluster(cfg) as c:
        setups = ray.get([t.setup_report.remote() for t in c.trainers])  # what start_cluster checked
        readies = ray.get([e.ready.remote() for e in c.engines])
        yield {"cfg": cfg, "trainers": c.trainers, "engines": c.engines, "setups": setups, "readies": readies}


def test_ranks_share_gpus_and_experts_are_split_linearly(group):
    uuids = [s["device_uuid"] for s in group["setups"]]
    assert len(set(uuids)) == WORLD
    assert uuids == [r["device_uuid"] for r in group["readies"]]
    described = ray.get([e.describe.remote() for e in group["engines"]])
    for r, d in enumerate(described):
        assert (d["ep_rank"], d["ep_size"]) == (r, WORLD), d["vllm_version"]
        held = set(tuple(ids) for ids in d["experts"].values())
        assert held == {tuple(range(r * 4, r * 4 + 4))}, held  # tiny: 8 experts over 2 ranks
        assert group["setups"][r]["experts"] is not None


def test_expert_sync_gathers_no_expert_bytes(group):
    trainers, engines = group["trainers"], group["engines"]
    before = greedy(engines)
    ray.get([t.perturb_weights.remote(1, PERTURB_SCALE) for t in trainers])
    reps = ray.get([t.sync_weights.remote([e]) for t, e in zip(trainers, engines)])
    described = ray.get([e.describe.remote() for e in engines])
    own = ray.get([t.expert_local_bytes.remote() for t in trainers])
    for r, (rep, d) in enumerate(zip(reps, described)):
        counters = {k: rep[k] for k in ("gathered_bytes", "expert_gathered_bytes", "expert_local_bytes",
                                        "bytes", "seconds")}
        print(f"\n[gpu] rank {r}: {counters}, fast path {rep['expert_fast_path']} ({rep['expert_fast_reason']})")
        assert rep["verified"] and rep["digest_checked"], rep["errors"]
        assert rep["expert_fast_path"], rep["expert_fast_reason"]
        assert rep["expert_gathered_bytes"] == 0
        assert rep["expert_local_bytes"] == own[r] > 0
        assert rep["gathered_bytes"] > 0  # the dense part is gathered: the counter does count
        engine_bytes = sum(torch.Size(p["shape"]).numel() * getattr(torch, p["dtype"]).itemsize
                           for p in d["params"].values())
        assert rep["bytes"] == engine_bytes  # this engine's own params, every one exactly once
    after = greedy(engines)
    assert after[0] != before[0], "perturbation invisible: the test could not fail"
    assert [t for t, _ in after[0]] == [t for t, _ in after[1]]  # one DP group: same weights, same tokens
    group["after"] = after


def test_trainer_and_engines_agree_on_logprobs(group):
    """The oracle without a second engine: the trainer's own log-probs of the engines' greedy tokens."""
    samples = group["after"][0]
    seqs = [p + t for p, (t, _) in zip(PROMPTS, samples)]
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    am = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], am[i, :len(s)] = torch.tensor(s), 1
    batch = {"input_ids": ids, "attention_mask": am, "loss_mask": am.clone()}
    lps = ray.get([t.compute_logprobs.remote(batch) for t in group["trainers"]])
    diffs = []
    for i, (p, (toks, vlp)) in enumerate(zip(PROMPTS, samples)):
        mine = lps[0][i, len(p): len(p) + len(toks)].tolist()
        diffs += [abs(a - b) for a, b in zip(mine, vlp)]
    mean = sum(diffs) / len(diffs)
    print(f"\n[gpu] trainer vs DP+EP engines: mean |dlogprob| {mean:.4f}, max {max(diffs):.4f}")
    assert mean < 0.05 and max(diffs) < 0.5
