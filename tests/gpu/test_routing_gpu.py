"""Routing replay on one GPU with the Qwen3-30B-A3B shape (2 layers, 128 experts top-8, random weights).

    bash tests/gpu/run.sh                      # STEPS="routing" for this one alone
    PYTHONPATH=. python -m pytest tests/gpu/test_routing_gpu.py -x -q -s    (~3 min on one H100/H200 with an eager
                                                                            engine and vLLM's capture alone; these
                                                                            CUDA-graph runs of both are not timed yet)

A TrainWorker (FSDP2, bf16 compute) and a RolloutEngine (vLLM 0.32 with CUDA graphs) share the GPU; the trainer's
weights are synced into the engine, so both hold the same bytes. The engine runs both routing captures on the same
forwards: vLLM's own (enable_return_routed_experts) and colo's (rollout.routing_capture=colo,
colo.rollout.capture_cuda, whose router hooks call vLLM's after their own); `use` picks whose rows a generation
returns, and each test runs with both. 16 prompts x 4 samples at T=1; the trainer recomputes their log-probs with
algo.routing_replay off and r3 over the same batch. Checked: the engine returns ids for every prompt and response
token but the last (P+R-1 rows x 2 MoE layers x top-8, uint8); with r3 the log-prob gap is no larger than without.
The `[gpu]` lines carry the figures for docs/routing.md. Two greedy calls, one per capture, give the same rows
where their samples hold the same tokens (up to 1% of rows, for near-ties the two calls' kernels may flip). And
loop.mode=async's partial rollouts with R3: a request stopped mid-way keeps the rows recorded for its tokens
(vLLM's: read from its output processor before the abort, colo.rollout.engine_loop.stopped_rows; colo's: gathered
from the request's blocks before any step can reuse them), its resumed segment gets its own rows from its last kept
token on, and the two together are the rows of the whole sample; the trainer replays them.
"""
from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

from gpu_helpers import gpu_cluster, gpu_config

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from colo.models.tiny import make_tiny_model
    from colo.rollout.engine import Engine
    from colo.trainer.worker import Trainer

    class RoutingTrainer(Trainer):
        def logprobs_as(self, batch: dict, mode: str) -> tuple[torch.Tensor, list[float]]:
            """Old log-probs with algo.routing_replay=mode, and (pairs differing, pairs compared)."""
            self.cfg.algo.routing_replay = mode
            return self.compute_logprobs(batch), list(self._routing_counts)

    class BothCaptures(Engine):
        """rollout.routing_capture=colo with vLLM's capture on too; `use` picks whose rows generate returns, on an
        empty prefix cache (the calls compared then compute the same tokens the same way)."""

        def _llm_kwargs(self) -> dict:
            return {**super()._llm_kwargs(), "enable_return_routed_experts": True}

        def use(self, capture: str) -> None:
            self.routing = capture
            self._drop_prefix_cache()

        def _rpc(self, method: str, *args):
            out = super()._rpc(method, *args)
            if method == "colo_take_routing":  # what colo's capture answered, for the assertion messages
                self.answered = [(rid, first, want, None if got is None else len(got))
                                 for (rid, first, want), got in zip(args[0], out)]
            return out

        def slot_state(self) -> dict:
            """The last take's first answers (request, first row, rows wanted, rows held) and what TP worker 0's slot
            capture holds: whether it is bound, its rows written since start, requests kept or taken early."""
            def state(worker) -> dict:
                s = getattr(worker.model_runner, "_colo_slots", None)
                if s is None:
                    return {"bound": False, "runner": type(worker.model_runner).__module__}
                from colo.algo.batch import no_expert

                written = int((s.rows[:-1] != no_expert(s.rows.dtype)).any(dim=2).any(dim=1).sum())
                return {"bound": True, "answers": s.answers, "kept": len(s.kept), "early": len(s.taken_early),
                        "written": written}
            return {"answered": getattr(self, "answered", [])[:4], "worker": self.llm.collective_rpc(state)[0]}

    model = make_tiny_model(tmp_path_factory.mktemp("colo-gpu") / "l2", "qwen3-30b-a3b-L2", 0)
    cfg = gpu_config(str(model), num_gpus=1, model__dummy_weights=True, placement__vllm_gpu_fraction=0.3,
                     rollout__routing_capture="colo", rollout__enforce_eager=False)  # colo's hooks inside the graphs
    with gpu_cluster(cfg, trainer_cls=RoutingTrainer, engine_cls=BothCaptures) as c:
        assert all(r["verified"] for r in c.trainer_group.sync_weights())  # both hold the trainer's bytes
        yield {"trainer": c.trainers[0], "engine": c.engines[0]}


@pytest.mark.parametrize("capture", ["vllm", "colo"])
def test_routing_mismatch_and_gap_with_and_without_r3(pair, capture: str) -> None:
    from colo.algo.batch import build_batch
    from colo.algo.parity import gap_metrics, logprob_gap
    from colo.rollout.generation import Generation

    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 500, (16, 64)).tolist()
    ray.get(pair["engine"].use.remote(capture))
    arrays, _ = ray.get(pair["engine"].generate.remote(Generation.fresh(prompts, 4, 32, 1.0, 1.0, 0, True)))
    samples = arrays.unpack()
    missing = sum(s.routing is None for s in samples)
    assert missing == 0, (f"{missing} of {len(samples)} samples without rows from {capture}'s capture",
                          ray.get(pair["engine"].slot_state.remote()) if capture == "colo" else None)
    for s in samples:
        ids = s.routing
        assert ids.dtype == np.uint8 and ids.shape == (64 + len(s.response_ids) - 1, 2, 8), ids.shape
        assert ids.max() < 128 and all(len(set(r)) == 8 for r in ids.reshape(-1, 8).tolist())
    batch = build_batch(samples, [0.0] * len(samples))
    res = {}
    for mode in ("off", "r3"):
        old, (differ, pairs) = ray.get(pair["trainer"].logprobs_as.remote(batch, mode))
        res[mode] = {**gap_metrics(logprob_gap(old, batch["rollout_logprobs"], batch["loss_mask"])),
                     "routing/mismatch": differ / max(pairs, 1.0)}
        print(f"[gpu] routing ({capture}'s capture) {mode}: " + ", ".join(f"{k}={v:.5g}" for k, v in res[mode].items()))
    ratio = res["off"]["logprob_diff/mean"] / max(res["r3"]["logprob_diff/mean"], 1e-12)
    print(f"[gpu] routing ({capture}'s capture): gap mean off/r3 = {ratio:.2f}x over {int(batch['loss_mask'].sum())} "
          "tokens")
    assert 0.0 <= res["off"]["routing/mismatch"] < 0.5
    assert res["r3"]["logprob_diff/mean"] <= res["off"]["logprob_diff/mean"] * 1.05


def test_colo_capture_gives_vllms_rows(pair) -> None:
    """The same greedy generation (8 prompts of 64 tokens and 4 of 200, 4 samples each, up to 48 new tokens: prefill
    and CUDA-graph decode steps), rows from vLLM's capture, then from colo's. Two calls need not decode alike on a GPU
    (on an H100 one sample of 48 parted at its 14th token: bf16 near-ties and kernels that are not bitwise
    deterministic), so rows are compared where the two samples hold the same tokens: the prompt and the response up
    to their first difference, the rows of tokens whose inputs were the same. A capture that wrote rows at the wrong
    slots, layers or requests differs in most of them (random ids of 128 experts); the two calls' kernels may flip a
    near-tie in the routing too, so up to 1% of the rows compared may differ. Then colo's again with the prefix cache
    kept: the prompts' whole blocks are hits, never forwarded again, and their rows are the ones stored with those
    blocks by the call before: equal to its rows exactly (the rest are recomputed, in other batch shapes)."""
    from colo.rollout.generation import Generation

    rng = np.random.default_rng(3)
    prompts = rng.integers(3, 500, (8, 64)).tolist() + rng.integers(3, 500, (4, 200)).tolist()
    g = Generation.fresh(prompts, 4, 48, 0.0, 1.0, 0, True)
    got = {}
    for capture in ("vllm", "colo"):
        ray.get(pair["engine"].use.remote(capture))
        got[capture] = ray.get(pair["engine"].generate.remote(g))[0].unpack()
    compared = differing = parted = 0
    for i, (v, c) in enumerate(zip(got["vllm"], got["colo"])):
        assert c.routing is not None and c.routed_from == 0
        rows = len(c.prompt_ids) + len(c.response_ids) - 1  # every token's but the last
        assert c.routing.dtype == v.routing.dtype == np.uint8 and c.routing.shape == (rows, 2, 8), (
            i, c.routing.shape, v.routing.shape)
        same = next((t for t, (a, b) in enumerate(zip(v.response_ids, c.response_ids)) if a != b),
                    min(len(v.response_ids), len(c.response_ids)))
        parted += same < max(len(v.response_ids), len(c.response_ids))
        n = min(len(c.prompt_ids) + same, rows, len(v.routing))  # rows of tokens both calls forwarded alike
        compared += n
        differing += int((c.routing[:n] != v.routing[:n]).any(axis=(1, 2)).sum())
    print(f"[gpu] routing capture: colo's rows against vLLM's where the samples agree: {differing} of {compared} "
          f"rows differ ({len(got['colo'])} samples, {parted} parted between the calls)")
    assert compared > 0.5 * sum(len(s.routing) for s in got["colo"])
    assert differing <= 0.01 * compared, f"{differing} of {compared} rows differ: a capture fault"
    cached = ray.get(pair["engine"].generate.remote(g))[0].unpack()  # colo's, the prefix cache as the call left it
    whole_blocks = 32  # of each 64-token prompt: whole blocks of 16 or 32 tokens, short of its last token
    for i, (c, h) in enumerate(zip(got["colo"], cached)):
        if len(c.prompt_ids) == 64:
            assert np.array_equal(h.routing[:whole_blocks], c.routing[:whole_blocks]), f"sample {i}"
    same = np.mean([(h.routing == c.routing).all(axis=(1, 2)).mean() for c, h in zip(got["colo"], cached)
                    if h.routing.shape == c.routing.shape])
    print(f"[gpu] routing capture: prefix-cache hits give the stored rows; rows equal to the uncached call's: "
          f"{same:.4f}")


@pytest.mark.parametrize("capture", ["vllm", "colo"])
def test_async_partial_rollouts_keep_the_routing_of_stopped_requests(pair, capture: str) -> None:
    """Group 0 (252 prompt tokens: room for 4 new in max_model_len 256) finishes first; group 1 (64 prompt tokens,
    up to 48 new) is stopped then. Its rows cover the prompt and the tokens kept but the last (P + k - 1); resumed
    greedily on the same weights, the next segment's rows start at the last kept token (48 - k more), and the two
    concatenated agree with the rows of the same sample generated whole, but for decode-vs-prefill near-ties. The
    carried sample's batch replays with r3."""
    from colo.algo.batch import build_batch
    from colo.rollout.buffer import RolloutBuffer
    from colo.rollout.generation import Generation
    from colo.rollout.sample import pack

    e = pair["engine"]
    ray.get(e.use.remote(capture))
    cramped = np.random.default_rng(2).integers(3, 500, 256 - 4).tolist()
    long = np.random.default_rng(1).integers(3, 500, 64).tolist()
    greedy = dict(temperature=0.0, top_p=1.0, routing=True, stop_after=1)

    def generate(reqs: list, version: int) -> list:
        return ray.get(e.generate.remote(Generation(pack(reqs), 48, version=version, **greedy)))[0].unpack()

    buf = RolloutBuffer(n=1, max_staleness=1)
    buf.drop_stale(0)
    buf.add([{"prompt_ids": cramped}, {"prompt_ids": long}], seed=5)
    out = generate(buf.requests(), 0)
    short, stopped = out
    assert short.finish_reason == "length" and short.routing.shape == (256 - 4 + 4 - 1, 2, 8)
    k = len(stopped.response_ids)
    assert stopped.finish_reason is None and 1 <= k < 48, k
    assert stopped.routing.shape == (64 + k - 1, 2, 8) and stopped.routing.max() < 128
    buf.absorb(out)
    buf.drop_stale(1)
    (rest,) = generate(buf.requests(), 1)
    assert rest.finish_reason == "length" and len(rest.response_ids) == 48
    assert rest.routed_from == 64 + k - 1 and rest.routing.shape == (48 - k, 2, 8)  # rows 64 + k - 1 .. 64 + 48 - 2
    buf.absorb([rest])
    _, samples = buf.take(2, version=1)
    carried = samples[1]
    whole = ray.get(e.generate.remote(Generation.fresh([long], 1, 48, 0.0, 1.0, 0, True)))[0].unpack()[0]
    rows, want = carried.routing, whole.routing
    assert rows.shape == want.shape == (64 + 48 - 1, 2, 8)
    same = (np.sort(rows, axis=-1) == np.sort(want, axis=-1)).all(axis=-1).mean()
    print(f"[gpu] async R3 ({capture}'s capture): stopped after {k} of 48 tokens; rows equal to the whole sample's: "
          f"{same:.4f}")
    assert same > 0.97 and carried.response_ids[:k] == whole.response_ids[:k]
    batch = build_batch(samples, [0.0, 0.0])
    old, (differ, pairs) = ray.get(pair["trainer"].logprobs_as.remote(batch, "r3"))
    assert pairs > 0 and differ / pairs < 0.5
