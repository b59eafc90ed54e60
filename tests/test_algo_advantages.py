import math

import pytest
import torch

from colo.algo.advantages import grpo_advantages, grpo_advantages_by_index


def test_grpo_hand_computed_std_normalized():
    # group 0: [1, 0, 0, 1] mean 0.5, unbiased std sqrt(1/3); group 1: [0, 0, 0, 3] mean 0.75
    r = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 3.0]
    adv = grpo_advantages(r, group_size=4, std_normalize=True, eps=0.0)
    s0 = math.sqrt(1 / 3)
    s1 = math.sqrt((3 * 0.75**2 + 2.25**2) / 3)
    want = [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -0.75 / s1, -0.75 / s1, -0.75 / s1, 2.25 / s1]
    torch.testing.assert_close(adv, torch.tensor(want))
    assert adv.dtype == torch.float32 and adv.shape == (8,)


def test_grpo_mean_only_and_eps():
    adv = grpo_advantages(torch.tensor([2.0, 4.0, 0.0, 1.0]), group_size=2, std_normalize=False)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, -0.5, 0.5]))
    # eps enters the denominator: std of [0, 1] (unbiased) is sqrt(0.5)
    adv = grpo_advantages([0.0, 1.0], group_size=2, eps=0.5)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5]) / (math.sqrt(0.5) + 0.5))


def test_zero_variance_group_is_exactly_zero():
    # 0.1 * 3 groups: mean of identical floats can leave residue; must be exactly 0, never nan
    r = [0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.0, 1.0, 0.0]
    for std_norm in (True, False):
        adv = grpo_advantages(r, 3, std_normalize=std_norm)
        assert torch.equal(adv[:6], torch.zeros(6))
        assert adv[7] > 0 > adv[6]
    assert torch.equal(grpo_advantages([1.0, 2.0], 1), torch.zeros(2))  # singleton groups


def test_grpo_rejects_bad_input():
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages([1.0, 2.0, 3.0, 4.0], 3)
    with pytest.raises(ValueError, match="sample 1"):
        grpo_advantages([1.0, float("nan")], 2)


def test_by_index_matches_contiguous_layout():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 3.0])
    idx = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    perm = torch.tensor([5, 0, 7, 2, 1, 4, 6, 3])
    want = grpo_advantages(r, 4)
    got = grpo_advantages_by_index(r[perm], idx[perm])
    torch.testing.assert_close(got, want[perm])
    with pytest.raises(ValueError, match="unequal group sizes"):
        grpo_advantages_by_index([1.0, 2.0, 3.0], [0, 0, 1])
