"""A non-finite gradient norm: the optimizer step is skipped and counted; enough in a row end the run."""
from __future__ import annotations

import pytest
import torch

from colo.trainer.optim import clip_and_step


def test_non_finite_grad_norm_skips_the_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    for bad in (float("inf"), float("nan")):
        model(torch.full((1, 4), bad)).sum().backward()
        norm = clip_and_step(model.parameters(), opt, clip=1.0)
        assert not torch.isfinite(torch.tensor(norm))
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "a skipped step moved weights"
        assert not opt.state, "a skipped step touched AdamW's moments"
        assert all(p.grad is None for p in model.parameters())
    model(torch.ones(1, 4)).sum().backward()  # a finite one steps as before
    assert clip_and_step(model.parameters(), opt, clip=1.0) > 0
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_consecutive_skips_end_the_run() -> None:
    from colo.loop import TrainingDiverged, check_skipped

    check_skipped({"step": 4, "train/consecutive_skipped": 2}, limit=3)
    with pytest.raises(TrainingDiverged) as e:
        check_skipped({"step": 5, "train/consecutive_skipped": 3}, limit=3)
    assert "\n" not in str(e.value) and "up to step 5" in str(e.value) and "fix:" in str(e.value)
