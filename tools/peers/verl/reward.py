"""verl's reward for the side-by-side (custom_reward_function.path): the share of even code points in the response.

Random weights never answer anything, so an answer-checking reward is 0 on every sample and GRPO's advantages vanish;
like colo.bench.stepreward's even_share (the share of even token ids), this one varies from sample to sample, so
both systems' updates move the weights that their syncs then push. verl hands the reward the decoded text, not ids:
hence code points. Its cost is nothing beside a step.
"""
from __future__ import annotations


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs) -> float:
    if not solution_str:
        return 0.0
    return sum(ord(c) % 2 == 0 for c in solution_str) / len(solution_str)
