"""The policy loss stays finite, with no runaway gradient, when one token's log-ratio runs away."""
from __future__ import annotations

import torch

from colo.algo.loss import LossOptions, policy_loss


def loss_and_grad(log_ratio: float, adv: float) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((1, 4), -3.0)  # (B, T)
    logp = (old + torch.tensor([[0.0, log_ratio, 0.0, 0.0]])).requires_grad_()  # token 1 runs away
    mask = torch.tensor([[0, 1, 1, 1]])
    loss, _ = policy_loss(logp, old, torch.tensor([adv]), mask, LossOptions(clip_low=0.2, clip_high=0.28))
    loss.backward()
    return loss.detach(), logp.grad


def test_huge_log_ratio_gives_finite_loss() -> None:
    """+-95 (exp overflows fp32): finite loss and gradient, dual-clip off."""
    for r, a in ((95.0, -1.0), (-95.0, 1.0), (95.0, 1.0)):
        loss, grad = loss_and_grad(r, a)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (r, a, loss, grad)


def test_past_the_clamp_no_gradient() -> None:
    """+25 with A < 0: the token gets no gradient (peers give 0; unclamped it was ~7e10 * |A|)."""
    loss, grad = loss_and_grad(25.0, -1.0)
    assert torch.isfinite(loss) and grad[0, 1].item() == 0.0, grad
    _, grad = loss_and_grad(0.1, -1.0)  # inside the clip range the token still learns
    assert grad[0, 1].item() != 0.0


def test_tis_weight_clamped_when_uncapped() -> None:
    """tis_cap=None (uncapped) with a rollout log-prob 95 below the trainer's: a finite weight."""
    old = torch.full((1, 3), -3.0)
    rollout = old.clone()
    rollout[0, 1] = -98.0
    logp = old.clone().requires_grad_()
    loss, m = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 3),
                          LossOptions(clip_low=0.2, clip_high=0.28, tis_cap=None), rollout_logprobs=rollout)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(m["tis_mean"]) and torch.isfinite(logp.grad).all()
