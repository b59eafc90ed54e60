import math

import pytest
import torch

from colo.algo.advantages import grpo_advantages, grpo_advantages_by_index, overlong_penalty, step_advantages
from colo.rollout.sample import Sample


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


def test_by_index_checks_the_expected_group_size():
    # two groups that each lost a sample are still equal in size: only the expected size catches it
    with pytest.raises(ValueError, match="expected 4"):
        grpo_advantages_by_index([1.0, 0.0, 0.0, 1.0, 0.0, 1.0], [0, 0, 0, 1, 1, 1], group_size=4)
    got = grpo_advantages_by_index([1.0, 0.0, 0.0, 1.0], [1, 0, 1, 0], group_size=2)
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5, -0.5, 0.5]) / (math.sqrt(0.5) + 1e-6))


def test_overlong_penalty_by_hand():
    # max_tokens 10, buffer 4: free up to 6 tokens, then -0.25 per token down to -1 at 10
    got = overlong_penalty([0, 6, 7, 8, 10], max_tokens=10, buffer=4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    torch.testing.assert_close(overlong_penalty([9], 10, 4, factor=0.5), torch.tensor([-0.375]))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty([1], max_tokens=10, buffer=11)


def test_step_advantages_adds_the_overlong_penalty_then_groups_by_prompt():
    from colo.config import AlgoConfig

    # two prompts x 2 samples, interleaved as engines return them; max_tokens 8, buffer 4
    samples = [Sample(i, 0, 0, [1], [0] * length) for i, length in ((1, 8), (0, 3), (1, 2), (0, 6))]
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    algo = AlgoConfig(overlong="penalty", overlong_buffer=4, overlong_penalty=1.0, std_normalize=False)
    adv, pen = step_advantages(samples, rewards, 2, algo, max_tokens=8)
    torch.testing.assert_close(pen, torch.tensor([-1.0, 0.0, 0.0, -0.5]))
    shaped = torch.tensor([0.0, 0.0, 1.0, 0.5])  # by hand: reward + penalty
    want = torch.tensor([shaped[0] - (shaped[0] + shaped[2]) / 2, shaped[1] - (shaped[1] + shaped[3]) / 2,
                         shaped[2] - (shaped[0] + shaped[2]) / 2, shaped[3] - (shaped[1] + shaped[3]) / 2])
    torch.testing.assert_close(adv, want)
    none, pen0 = step_advantages(samples, rewards, 2, AlgoConfig(std_normalize=False), max_tokens=8)
    assert torch.equal(pen0, torch.zeros(4)) and torch.equal(none, torch.tensor([0.0, -0.5, 0.0, 0.5]))
    with pytest.raises(ValueError, match="expected 3"):  # the loop asked for 3 samples per prompt
        step_advantages(samples, rewards, 3, algo, max_tokens=8)
