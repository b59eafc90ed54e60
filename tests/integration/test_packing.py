"""Packed and padded micro-batches give the same loss, metrics and gradients (2 FSDP2 ranks over gloo in Ray
actors, several micro-batches, uneven lengths, R3 routing replay on and off), and packing computes on less
padding.

    PYTHONPATH=. .venv/bin/python -m pytest tests/integration/test_packing.py -q
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from conftest import cpu_trainer_config

from colo.algo.batch import build_batch, shard_batch
from colo.host.net import free_port
from colo.rollout.sample import Sample, Status
from colo.trainer.worker import TrainWorker

METRICS = ("loss", "pg_loss", "kl_loss", "entropy", "tis_mean", "approx_kl", "clip_frac", "grad_norm",
           "logprob_diff/mean", "logprob_diff/max", "routing/mismatch")


@pytest.fixture(scope="module")
def workers(tiny_model: Path, ray_cluster):
    c = cpu_trainer_config(tiny_model)
    t = c.trainer
    # lr 0: every step sees the same weights, so the layouts can be compared step against step
    t.lr, t.micro_batch_size, t.max_tokens_per_micro_batch, t.epochs, t.logprob_chunk = 0.0, 2, 40, 1, 16
    c.rollout.temperature, c.algo.kl_coef, c.algo.tis_cap = 0.8, 0.05, 2.0
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    port = free_port()  # below the ephemeral range: a bind(0) port can be taken before gloo listens on it
    ws = [TrainWorker.options(num_cpus=0).remote(dataclasses.asdict(c), r, 2, "127.0.0.1", port) for r in range(2)]
    ray.get([w.setup.remote() for w in ws])
    yield ws


def _batch() -> dict:
    """11 samples of very uneven lengths (3 to 38 tokens), engine routing ids for R3, noisy rollout log-probs."""
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    samples = []
    for i in range(11):
        P, R = 2 + i % 4, [1, 30, 4, 2, 17, 9, 3, 25, 5, 1, 12][i]
        routing = np.stack([rng.permutation(8)[:2] for _ in range((P + R - 1) * 2)]).reshape(P + R - 1, 2, 2)
        samples.append(Sample(i, 0, 0, torch.randint(3, 500, (P,), generator=g).tolist(),
                              torch.randint(3, 500, (R,), generator=g).tolist(),
                              (-3.0 - torch.rand(R, generator=g)).tolist(), status=Status.COMPLETED,
                              routing=routing.astype(np.uint8)))
    adv = torch.randn(11, generator=g)
    return build_batch(samples, adv)


def _configure(trainer, packing: bool, replay: str) -> None:
    trainer.cfg.trainer.packing, trainer.cfg.algo.routing_replay = packing, replay
    trainer.grads = None
    step = type(trainer)._optim_step

    def capture(lr=None):  # the first update's local gradient shards, before the optimizer consumes them
        if trainer.grads is None:
            trainer.grads = torch.cat([(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).flatten()
                                       for p in trainer.model.parameters()]).clone()
        return step(trainer, lr)
    trainer._optim_step = capture


def _grads(trainer) -> torch.Tensor:
    return trainer.grads


def _step(ws: list, shards: list[dict], packing: bool, replay: str) -> tuple[dict, list[torch.Tensor]]:
    ray.get([w.__ray_call__.remote(_configure, packing, replay) for w in ws])
    metrics = ray.get([w.train_step.remote(s) for w, s in zip(ws, shards)])[0]
    return metrics, ray.get([w.__ray_call__.remote(_grads) for w in ws])


def test_packed_equals_padded_with_and_without_r3(workers) -> None:
    shards = shard_batch(_batch(), 2)
    got = {}
    for replay in ("off", "r3"):
        for packing in (True, False):
            got[packing, replay] = _step(workers, shards, packing, replay)
    for replay in ("off", "r3"):
        (packed, g_packed), (padded, g_padded) = got[True, replay], got[False, replay]
        for k in METRICS:
            assert packed[k] == pytest.approx(padded[k], rel=1e-5, abs=1e-6), (replay, k, packed[k], padded[k])
        for a, b in zip(g_packed, g_padded):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert packed["train/real_tokens"] == padded["train/real_tokens"]
        assert packed["train/padding_fraction"] < 0.5 * padded["train/padding_fraction"], (packed, padded)
    # R3 replays the given (random) ids: it changes the gradients, in both layouts alike
    assert not torch.allclose(got[True, "off"][1][0], got[True, "r3"][1][0])
    assert got[True, "off"][0]["routing/mismatch"] > 0.5  # random ids: most (token, layer) pairs differ


def _old_logprobs(trainer, mode: str | None) -> None:
    """trainer.old_logprobs = mode, counting the policy's forward-only passes (trainer.policy_passes); None: back to
    what the fixture's one update per step resolves to (update), uncounted."""
    trainer.__dict__.pop("_logprobs", None)
    trainer.cfg.trainer.old_logprobs = mode or "update"
    if mode is None:
        return
    trainer.policy_passes = 0
    run = type(trainer)._logprobs

    def counted(model, batch):
        trainer.policy_passes += model is trainer.model
        return run(trainer, model, batch)
    trainer._logprobs = counted


def test_one_update_takes_the_old_logprobs_from_its_own_forward(workers) -> None:
    """trainer.old_logprobs=update (what auto resolves to for one update per step: epochs 1, mini_batches 1): the
    policy runs no forward-only
    pass, and the loss, every metric (the trainer-vLLM gap, TIS, routing/mismatch among them) and the gradients
    are those of the step with the pass (old_logprobs=pass), R3 on and off: the ratio is 1 in both, exactly in
    one, up to two forwards' rounding in the other."""
    shards = shard_batch(_batch(), 2)
    got = {}
    try:
        for replay in ("off", "r3"):
            for mode in ("pass", "update"):
                ray.get([w.__ray_call__.remote(_old_logprobs, mode) for w in workers])
                got[mode, replay] = _step(workers, shards, True, replay)
                passes = ray.get([w.__ray_call__.remote(lambda t: t.policy_passes) for w in workers])
                assert passes == ([1, 1] if mode == "pass" else [0, 0]), (mode, passes)
                assert got[mode, replay][0]["train/old_logprob_pass"] == (mode == "pass")
    finally:
        ray.get([w.__ray_call__.remote(_old_logprobs, None) for w in workers])
    for replay in ("off", "r3"):
        (own, g_own), (passed, g_passed) = got["update", replay], got["pass", replay]
        for k in METRICS:
            assert own[k] == pytest.approx(passed[k], rel=1e-5, abs=1e-6), (replay, k, own[k], passed[k])
        for a, b in zip(g_own, g_passed):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert own["logprob_diff/mean"] > 0.5  # the batch's rollout log-probs are noise: the gap is real
    assert got["update", "off"][0]["routing/mismatch"] > 0.5  # counted off the update's forward too


def _loss_in_lm_head(trainer, on: bool) -> None:
    trainer.cfg.trainer.loss_in_lm_head = on


def test_loss_gradient_in_the_lm_head_equals_autograd(workers) -> None:
    """trainer.loss_in_lm_head (the default): the loss's gradient formed in the lm_head's chunk loop gives the loss,
    every metric and the gradients of autograd through policy_loss (false), packed with R3 and the update's own
    old log-probs, padded with the forward-only pass; the KL term and TIS on (the fixture's config)."""
    shards = shard_batch(_batch(), 2)
    got = {}
    try:
        for packing, replay, mode in ((True, "r3", "update"), (False, "off", "pass")):
            ray.get([w.__ray_call__.remote(_old_logprobs, mode) for w in workers])
            for on in (False, True):
                ray.get([w.__ray_call__.remote(_loss_in_lm_head, on) for w in workers])
                got[packing, on] = _step(workers, shards, packing, replay)
    finally:
        ray.get([w.__ray_call__.remote(_loss_in_lm_head, True) for w in workers])
        ray.get([w.__ray_call__.remote(_old_logprobs, None) for w in workers])
    for packing in (True, False):
        (m1, g1), (m0, g0) = got[packing, True], got[packing, False]
        for k in METRICS:
            assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), (packing, k, m1[k], m0[k])
        for a, b in zip(g1, g0):
            assert a.abs().sum() > 0
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _count_collectives(trainer, once: bool) -> None:
    """trainer.gather_once on or off, and count FSDP2's all-gathers and reduce-scatters from here on."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    trainer.cfg.trainer.gather_once = once
    trainer.collectives = {"all_gather": 0, "reduce": 0}
    for name, key in (("foreach_all_gather", "all_gather"), ("foreach_reduce", "reduce")):
        real = getattr(group, f"_colo_real_{name}", None) or getattr(group, name)
        setattr(group, f"_colo_real_{name}", real)

        def counted(*args, real=real, key=key, **kwargs):
            trainer.collectives[key] += 1
            return real(*args, **kwargs)
        setattr(group, name, counted)


def _collectives(trainer) -> dict:
    return trainer.collectives


def test_gather_once_equals_gathering_per_micro_batch(workers) -> None:
    """trainer.gather_once keeps every FSDP unit gathered across a pass's micro-batches and reduces the gradients
    once: the same metrics and gradients as gathering per micro-batch, in both layouts, with far fewer
    all-gathers and reduce-scatters (counted in FSDP2 itself)."""
    shards = shard_batch(_batch(), 2)
    got = {}
    for once in (False, True):
        for packing in (True, False):
            ray.get([w.__ray_call__.remote(_count_collectives, once) for w in workers])
            metrics, grads = _step(workers, shards, packing, "off")
            got[once, packing] = metrics, grads, ray.get(workers[0].__ray_call__.remote(_collectives))
    ray.get([w.__ray_call__.remote(_count_collectives, False) for w in workers])
    for packing in (True, False):
        (m1, g1, c1), (m0, g0, c0) = got[True, packing], got[False, packing]
        for k in METRICS:
            assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), (packing, k, m1[k], m0[k])
        for a, b in zip(g1, g0):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        # gather_once: each unit gathered once in each of the two passes (reference log-probs, update: the old
        # log-probs are the one update's own, trainer.old_logprobs) and reduced once. Per micro-batch (several:
        # 40-token budget / 2 rows on 11 samples), each unit is gathered in every forward and again in every
        # backward, and reduced after every backward.
        assert c1["reduce"] > 0 and c1["all_gather"] == 2 * c1["reduce"], (packing, c1)
        assert c0["reduce"] >= 2 * c1["reduce"] and c0["all_gather"] > c1["all_gather"], (packing, c1, c0)


def _grad_modes(trainer, once: bool) -> list[bool]:
    """Whether autograd recorded during each micro-batch of the log-prob pass (trainer.gather_once on or off)."""
    trainer.cfg.trainer.gather_once = once
    seen, score = [], type(trainer)._score

    def recording(model, mb, *args, **kwargs):
        seen.append(torch.is_grad_enabled())
        return score(trainer, model, mb, *args, **kwargs)
    trainer._score = recording
    try:
        trainer._logprobs(trainer.model, trainer.grad_probe_batch)
    finally:
        del trainer._score
        trainer.cfg.trainer.gather_once = False
    return seen


def test_logprob_pass_records_no_graph(workers) -> None:
    """The old-log-prob pass is forward-only: no autograd graph, with or without gather_once (whose micro-batch
    iterator sits next to it; a misplaced decorator once let the pass record one)."""
    shards = shard_batch(_batch(), 2)
    ray.get([w.__ray_call__.remote(lambda t, s: setattr(t, "grad_probe_batch", s), s) for w, s in zip(workers, shards)])
    for once in (False, True):
        modes = ray.get([w.__ray_call__.remote(_grad_modes, once) for w in workers])
        assert all(m and not any(m) for m in modes), (once, modes)


def _compile(trainer, on: bool) -> dict:
    """trainer.compile on the running policy, as parallelize sets it up (colo.trainer.compile.compile_layers and the
    log-prob chunks' backend) with aot_eager, or back to eager; returns this process's dynamo figures."""
    from colo.trainer.compile import compile_layers, compile_stats
    from colo.trainer.fsdp import decoder_layers

    layers = decoder_layers(trainer.model)
    trainer.model.colo_compile_backend = "aot_eager" if on else None  # the log-prob chunks' math, as parallelize sets it
    if on:
        compile_layers(layers, backend="aot_eager")
    else:
        for layer in layers:
            layer._compiled_call_impl = None  # what nn.Module.compile set: eager again for the tests after this one
    return compile_stats()


@pytest.mark.slow  # dynamo + AOT tracing: 41 to 87 s measured on 2 cores shared with other jobs (2026-11-26)
def test_compiled_layers_equal_eager(workers) -> None:
    """trainer.compile: the same metrics and gradients as eager, packed, with R3 replay through the compile-disabled
    routing hook, over micro-batches of different token counts (dynamic shapes). On CPU with aot_eager, not
    inductor: dynamo's graphs and AOT autograd's forward / backward split are what is checked here (they decide
    which ops run and what backward sees); inductor's C++ build of every graph would add minutes on CPU (the tiny
    bench's first compiled step: 45 s of train phase) to the tracing. Inductor's numbers (entropy, log-prob gap)
    are checked against eager on a GPU by colo.bench.step --compare-compile, in one run. Fails if no frame was
    compiled (dynamo's counters)."""
    shards = shard_batch(_batch(), 2)
    eager, g_eager = _step(workers, shards, True, "r3")
    before = ray.get([w.__ray_call__.remote(_compile, True) for w in workers])
    try:
        compiled, g_compiled = _step(workers, shards, True, "r3")
    finally:
        after = ray.get([w.__ray_call__.remote(_compile, False) for w in workers])
    for b, a in zip(before, after):  # every rank ran compiled frames
        assert a["frames"] > b["frames"] and a["graphs"] > b["graphs"], (before, after)
    for k in METRICS:
        assert compiled[k] == pytest.approx(eager[k], rel=1e-5, abs=1e-6), (k, compiled[k], eager[k])
    for a, b in zip(g_compiled, g_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
