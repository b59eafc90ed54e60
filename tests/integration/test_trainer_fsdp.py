"""TrainWorker on CPU: real FSDP2 over gloo in Ray actors (2 ranks) vs a 1-rank run and plain HF.

    .venv/bin/python -m pytest tests/integration/test_trainer_fsdp.py -q

One module-wide story, so actors start once: pair A (2 ranks, HF weights) and single S (1 rank)
train on the same global batch; A goes through offload/onload and a checkpoint; pair B (2 ranks,
meta-device dummy init) resumes from it; B exports to HF. fp32 params make the comparisons tight.
Rank shards deliberately hold different row and token counts (3 + 2 rows, micro-batch 2): a
per-rank token mean or a missing dummy micro-batch would make A differ from S (or hang).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import ray
import torch

from conftest import cpu_trainer_config

from colo.algo.batch import build_batch
from colo.algo.loss import gather_logprobs
from colo.host.net import free_port
from colo.rollout.sample import Sample
from colo.models.archs import expert_shard_range
from colo.trainer.worker import Trainer

EXPERTS = "model.layers.{}.mlp.experts.gate_up_proj"


class ShardTrainer(Trainer):
    """Trainer plus a read of one rank's shard (a test hook: the product trainer has no use for it)."""

    def local_shard(self, name: str) -> torch.Tensor:
        p = self.model.get_parameter(name)
        return (p.to_local() if hasattr(p, "to_local") else p).detach().cpu().clone()


def _cfg(tiny_model: Path, dummy: bool = False) -> dict:
    c = cpu_trainer_config(tiny_model, lr=5e-3, micro_batch_size=2, mini_batches=1, epochs=2)
    c.model.dummy_weights = dummy
    return dataclasses.asdict(c)


def _start(cfg: dict, world: int) -> list:
    port = free_port()  # below the ephemeral range: a bind(0) port can be taken before gloo listens
    ws = [ray.remote(ShardTrainer).options(num_cpus=0).remote(cfg, r, world, "127.0.0.1", port)
          for r in range(world)]
    ray.get([w.setup.remote() for w in ws])
    return ws


def _all(ws: list, method: str, *args) -> list:
    return ray.get([getattr(w, method).remote(*a) for w, a in zip(ws, args)])


def _hf_logprobs(model, batch: dict) -> torch.Tensor:
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
    return gather_logprobs(logits, batch["input_ids"])  # (B, T)


def _same(x: dict, y: dict, keys: tuple[str, ...], rel: float = 1e-4) -> None:
    for k in keys:
        assert x[k] == pytest.approx(y[k], rel=rel, abs=1e-6), (k, x[k], y[k])


@pytest.fixture(scope="module")
def hf(tiny_model: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def batches(hf) -> list[tuple[dict, list[dict]]]:
    """Three global batches of 5 samples: (whole batch for 1 rank, per-rank shards for 2)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(3):
        samples = []
        for i in range(5):
            p = torch.randint(3, 500, (3 + (i * 7 + step) % 5,), generator=g).tolist()
            r = torch.randint(3, 500, (2 + (i * 5 + step) % 7,), generator=g).tolist()
            samples.append(Sample(i, 0, 0, p, r, [0.0] * len(r)))
        adv = torch.randn(5, generator=g)
        whole = build_batch(samples, adv)
        with torch.no_grad():  # vLLM-like sampling log-probs: the true ones plus small noise
            lp = _hf_logprobs(hf, whole)
        noisy = (lp + 0.05 * torch.randn(lp.shape, generator=g)) * whole["loss_mask"]
        for b, s in enumerate(samples):
            P = len(s.prompt_ids)
            s.logprobs = noisy[b, P:P + len(s.response_ids)].tolist()
        # uneven on purpose (colo.algo.batch.shard_batch would balance them)
        out.append((build_batch(samples, adv),
                    [build_batch(samples[:3], adv[:3]), build_batch(samples[3:], adv[3:])]))
    return out


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, ray_cluster):  # workers import ShardTrainer from this module (tests/integration)
    pair = _start(_cfg(tiny_model), 2)
    single = _start(_cfg(tiny_model), 1)
    yield {"A": pair, "S": single}


def test_expert_shard_range_is_torch_chunk() -> None:
    for E in range(1, 13):
        for W in range(1, 6):
            chunks = torch.arange(E).chunk(W)
            for r in range(W):
                start, stop = expert_shard_range(E, W, r)
                want = chunks[r].tolist() if r < len(chunks) else []
                assert list(range(start, stop)) == want, (E, W, r)


def test_sharded_forward_and_expert_shards(cluster, hf, batches) -> None:
    whole, shards = batches[0]
    assert [s["input_ids"].shape[0] for s in shards] == [3, 2]
    lp_a = _all(cluster["A"], "compute_logprobs", (whole,), (whole,))
    with torch.no_grad():
        ref = _hf_logprobs(hf, whole)
    valid = whole["attention_mask"].bool()
    for lp in lp_a:
        torch.testing.assert_close(lp[valid], ref[valid], rtol=1e-5, atol=1e-5)
    for layer in range(hf.config.num_hidden_layers):
        full = hf.get_parameter(EXPERTS.format(layer)).detach()  # (E, 2I, H)
        for r, w in enumerate(cluster["A"]):
            start, stop = expert_shard_range(full.shape[0], 2, r)
            torch.testing.assert_close(ray.get(w.local_shard.remote(EXPERTS.format(layer))),
                                       full[start:stop], rtol=0, atol=0)


def test_train_step_matches_single_process(cluster, batches) -> None:
    whole, shards = batches[0]
    (m_single,) = _all(cluster["S"], "train_step", (whole,))
    m_pair = _all(cluster["A"], "train_step", (shards[0],), (shards[1],))
    assert m_pair[0] == m_pair[1]  # every rank reports the same global metrics
    _same(m_pair[0], m_single, ("loss", "grad_norm", "entropy", "clip_frac", "approx_kl",
                                "tis_mean", "logprob_diff/mean"))
    assert m_single["grad_norm"] > 0 and m_single["updates"] == 2
    (after_s,) = _all(cluster["S"], "compute_logprobs", (whole,))
    after_a = _all(cluster["A"], "compute_logprobs", (whole,), (whole,))
    torch.testing.assert_close(after_a[0], after_s, rtol=1e-4, atol=1e-5)


def test_sft_step_matches_single_process(cluster, batches) -> None:
    whole, shards = batches[1]
    (m_single,) = _all(cluster["S"], "sft_step", (whole,))
    m_pair = _all(cluster["A"], "sft_step", (shards[0],), (shards[1],))
    _same(m_pair[0], m_single, ("sft_loss", "grad_norm", "tokens"))


def test_offload_onload_keeps_training_identical(cluster, batches) -> None:
    whole, shards = batches[1]
    off = _all(cluster["A"], "offload", (), ())
    assert off[0]["param_bytes"] > 0 and off[0]["optim_bytes"] == 2 * off[0]["param_bytes"]
    with pytest.raises(ray.exceptions.RayTaskError, match="offloaded"):
        ray.get(cluster["A"][0].compute_logprobs.remote(whole))
    _all(cluster["A"], "onload", (), ())
    (m_single,) = _all(cluster["S"], "train_step", (whole,))
    m_pair = _all(cluster["A"], "train_step", (shards[0],), (shards[1],))
    _same(m_pair[0], m_single, ("loss", "grad_norm", "entropy", "clip_frac"))


def test_checkpoint_resume_and_hf_export(cluster, tiny_model, batches, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = str(tmp_path / "ckpt")
    _all(cluster["A"], "save_checkpoint", (ckpt, {"step": 2, "data": [7, 1]}), (ckpt, {}))
    for w in cluster.pop("S"):
        ray.kill(w)
    # the resumed pair starts from meta-device random weights: everything must come from the ckpt
    fresh = _start(_cfg(tiny_model, dummy=True), 2)
    whole, shards = batches[2]
    lp_dummy = _all(fresh, "compute_logprobs", (whole,), (whole,))[0]
    lp_before = _all(cluster["A"], "compute_logprobs", (whole,), (whole,))[0]
    assert torch.isfinite(lp_dummy).all() and not torch.allclose(lp_dummy, lp_before, atol=1e-3)
    assert _all(fresh, "load_checkpoint", (ckpt,), (ckpt,)) == [{"step": 2, "data": [7, 1]}] * 2
    m_old = _all(cluster["A"], "train_step", (shards[0],), (shards[1],))[0]
    m_new = _all(fresh, "train_step", (shards[0],), (shards[1],))[0]
    # identical, not close: same shards, same optimizer state, same reduction order
    for k in ("loss", "grad_norm", "entropy", "clip_frac"):
        assert m_new[k] == m_old[k], (k, m_new[k], m_old[k])

    out = tmp_path / "hf"
    _all(fresh, "export_hf", (str(out),), (str(out),))
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        lp_hf = _hf_logprobs(exported, whole)
    lp_tr = _all(fresh, "compute_logprobs", (whole,), (whole,))[0]
    valid = whole["attention_mask"].bool()
    torch.testing.assert_close(lp_hf[valid], lp_tr[valid], rtol=1e-5, atol=1e-5)
    for w in fresh:
        ray.kill(w)
