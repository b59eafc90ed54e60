"""The ways to fit on the trainer side (colo.trainer.optim): AdamW state on the host, bf16 AdamW state, and
gradient checkpointing, each training like the default.

Pure-torch checks of the optimizer math, then real FSDP2 (2 ranks over gloo, Ray actors) with every option
on, against the default computed in one process (plain HF + torch AdamW on both ranks' data): the losses
match within tolerance and go down; the host-kept state is not moved by offload/onload and survives a
DCP checkpoint round trip.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import ray
import torch

from conftest import cpu_trainer_config

from colo.trainer.optim import StreamedAdamW, make_optimizer, round_to_bf16


def _regression(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 16, generator=g)
    y = x @ torch.randn(16, 4, generator=g) + 0.01 * torch.randn(128, 4, generator=g)
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)), x, y


def _train(opt_fn, steps: int = 60) -> tuple[list[float], torch.nn.Module]:
    model, x, y = _regression()
    opt = opt_fn(model.parameters())
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, model


def test_streamed_fp32_on_host_is_torch_adamw() -> None:
    ref, m_ref = _train(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))
    got, m_got = _train(lambda p: make_optimizer(p, lr=1e-2, weight_decay=0.1, on_host=True))
    assert got == pytest.approx(ref, rel=1e-5)
    for a, b in zip(m_ref.parameters(), m_got.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_parameter_stepped_by_pieces_is_stepped_whole() -> None:
    """StreamedAdamW updates large parameters piece_elements at a time (colo.trainer.optim._pieces): the same
    fp32 AdamW as torch's, to rounding, with pieces that cut every parameter (and leave a short last piece)."""
    from colo.trainer.optim import _pieces

    w = torch.nn.Parameter(torch.zeros(16, 32))
    w.grad = torch.zeros(16, 32)
    assert len(_pieces(w, 7)) == 74 and _pieces(w, 7)[-1] == slice(511, 512) and _pieces(w, 512) == [None]

    def by_sevens(params):
        opt = make_optimizer(params, lr=1e-2, weight_decay=0.1, on_host=True)
        opt.piece_elements = 7  # the 16x32 weight in 74 pieces, the last one of 1 element
        return opt

    ref, m_ref = _train(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))
    got, m_got = _train(by_sevens)
    assert got == pytest.approx(ref, rel=1e-5)
    for a, b in zip(m_ref.parameters(), m_got.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_state_trains_like_fp32() -> None:
    ref, _ = _train(lambda p: torch.optim.AdamW(p, lr=1e-2))
    got, _ = _train(lambda p: make_optimizer(p, lr=1e-2, weight_decay=0.0, state_dtype="bfloat16"))
    assert got[-1] < 0.1 * got[0]  # it learns
    assert got[-1] == pytest.approx(ref[-1], rel=0.15)
    opt = make_optimizer(torch.nn.Linear(2, 2).parameters(), lr=1e-2, weight_decay=0.0, state_dtype="bfloat16")
    assert isinstance(opt, StreamedAdamW) and opt.state_dtype == torch.bfloat16


def test_stochastic_rounding_keeps_small_decays() -> None:
    """exp_avg_sq * 0.999 rounds back to itself in bf16 (round to nearest): the state would never decay."""
    x = torch.full((200_000,), 1.0 + 2**-9, dtype=torch.float32)  # between two bf16 neighbours (1, 1 + 2^-7)
    assert float(x.to(torch.bfloat16).float().mean()) == 1.0
    sr = round_to_bf16(x, torch.Generator().manual_seed(0)).float()
    assert set(sr.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert float(sr.mean()) == pytest.approx(1.0 + 2**-9, abs=2e-5)
    neg = round_to_bf16(-x, torch.Generator().manual_seed(1)).float()
    assert float(neg.mean()) == pytest.approx(-(1.0 + 2**-9), abs=2e-5)


# ---- real FSDP2 through the TrainWorker ------------------------------------------------------------------


def _cfg(model_dir: Path, **trainer) -> dict:
    return dataclasses.asdict(cpu_trainer_config(model_dir, lr=5e-3, sft_lr=5e-3, micro_batch_size=2, **trainer))


@pytest.fixture(scope="module")
def setup(tiny_model: Path, ray_cluster):
    from colo.host.net import free_port
    from colo.trainer.worker import TrainWorker

    port, opts = free_port(), dict(optimizer_offload=True, optimizer_dtype="bfloat16", gradient_checkpointing=True)
    ws = [TrainWorker.options(num_cpus=0).remote(_cfg(tiny_model, **opts), r, 2, "127.0.0.1", port) for r in range(2)]
    ray.get([w.setup.remote() for w in ws])
    yield tiny_model, ws


def _reference_losses(model_dir: Path, batches: list[dict], steps: int) -> list[float]:
    """The default: one process, plain HF model, torch AdamW, the ranks' batches together (a 2-rank FSDP2
    sft_step equals this: tests/integration/test_trainer_fsdp.py)."""
    from transformers import AutoModelForCausalLM

    from colo.algo.loss import gather_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    tokens = sum(float(b["loss_mask"].sum()) for b in batches)
    out = []
    for _ in range(steps):
        total = 0.0
        for b in batches:
            lp = gather_logprobs(model(b["input_ids"], attention_mask=b["attention_mask"]).logits, b["input_ids"])
            loss = -(lp * b["loss_mask"]).sum() / tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(total)
    return out


def _batch(rank: int) -> dict:
    from colo.algo.batch import build_batch
    from colo.rollout.sample import Sample

    g = torch.Generator().manual_seed(rank)
    samples = [Sample(i, 0, 0, torch.randint(3, 500, (4,), generator=g).tolist(),
                      torch.randint(3, 500, (5,), generator=g).tolist(), [0.0] * 5)
               for i in range(3)]
    return build_batch(samples, torch.zeros(3))


def test_every_option_trains_like_the_default(setup, tmp_path: Path) -> None:
    model_dir, ws = setup
    got = []
    for step in range(6):
        off = ray.get([w.offload.remote() for w in ws])  # as the loop does between steps
        if step:  # the host-kept state is not moved by the offload: 0 bytes of it
            assert off[0]["optim_bytes"] == 0 and off[0]["param_bytes"] > 0
        ray.get([w.onload.remote() for w in ws])
        got.append(ray.get([w.sft_step.remote(_batch(r)) for r, w in enumerate(ws)])[0]["sft_loss"])
    ref = _reference_losses(model_dir, [_batch(0), _batch(1)], 6)
    assert ref[-1] < 0.8 * ref[0] and got[-1] < 0.8 * got[0], (ref, got)
    assert got[0] == pytest.approx(ref[0], rel=1e-4)  # same model, same data: the first loss is the same
    assert got == pytest.approx(ref, rel=0.05), (ref, got)  # bf16 state, stochastic rounding: close
    # checkpoints round-trip the streamed optimizer (its state back on the host, in bf16)
    ray.get([w.save_checkpoint.remote(str(tmp_path / "ck"), {"step": 6}) for w in ws])
    before = ray.get([w.sft_step.remote(_batch(r)) for r, w in enumerate(ws)])[0]["sft_loss"]
    ray.get([w.load_checkpoint.remote(str(tmp_path / "ck")) for w in ws])
    again = ray.get([w.sft_step.remote(_batch(r)) for r, w in enumerate(ws)])[0]["sft_loss"]
    assert again == pytest.approx(before, rel=1e-6)
