"""The step benchmark's reward: one that random weights earn in varying amounts, so every step trains.

    algo.rewards=[colo.bench.stepreward:even_share]     # colo.bench.step's default (an algo.rewards override wins)

Why: the benchmark's prompts are random token ids and its models mostly random weights; a reward that checks an
answer (exact_match) is 0 for every sample, so GRPO's group-relative advantages are 0, the loss and grad_norm are
0 and the optimizer never moves the weights (issue 47's re-run: 0.0 on nearly every measured step). Then the sync
pushes unchanged bytes and the async step's carried samples were sampled by the very weights that train on them.

`even_share` scores a response by the share of its sampled token ids that are even: a property of the tokens
themselves, not of their text (the 30B presets' ids mostly lie beyond the tiny tokenizer they decode with, so
their text is nearly empty). Under random weights about half the ids are even, with a spread between the samples
of a prompt of roughly 0.5 / sqrt(length), so every group has a non-zero spread of rewards (a group whose rewards
all tie, such as all one-token responses with the same parity, gets advantage 0 as GRPO gives it), every step's
gradient is non-zero, and the policy drifts toward even ids as it trains. The lengths stay the bench's
(colo.bench.engines.LengthEngine imposes them), so the workload does not change with the reward.
"""
from __future__ import annotations

BENCH_REWARD = "colo.bench.stepreward:even_share"


def even_share(responses: list[str], answers: list[str], prompts: list[str],
               response_ids: list[list[int]]) -> list[float]:
    """The share of each response's token ids that are even (0.0 for an empty response)."""
    return [sum(1 for t in ids if int(t) % 2 == 0) / len(ids) if len(ids) else 0.0 for ids in response_ids]
