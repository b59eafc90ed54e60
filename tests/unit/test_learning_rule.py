"""The learning rule's table (tests/learning.py, tests/learning_table.json) is complete and still rejects its controls:
every job is asserted by its test, has the trajectories its bounds need, and every control run of the table fails
every asserted statistic. Pure Python: reads the table, runs nothing."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from learning import ASSERTED, JOBS, MIN_KERNEL_SETTINGS, MIN_TRAJECTORIES, bounds, load_table, statistics

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("job", sorted(JOBS))
def test_each_job_is_asserted_by_its_test_and_measured(job: str) -> None:
    path, _, name = JOBS[job].test.partition("::")
    source = (ROOT / path).read_text()
    body = re.search(rf"\ndef {name}\(.*?(?=\n(?:def |@|class )|\Z)", source, re.S)
    assert body and f'assert_learns("{job}"' in body.group(0), f"{JOBS[job].test} does not call assert_learns({job!r})"
    table = load_table()
    entry = table["jobs"][job]
    assert entry["args"] == list(JOBS[job].args), "the table was measured for other arguments: re-measure"
    learners = [t for t in entry["trajectories"] if t["role"] == "learns"]
    assert len(learners) >= MIN_TRAJECTORIES
    assert len({t["setting"] for t in learners}) >= MIN_KERNEL_SETTINGS
    assert all(v > 0 for v in bounds(job, table).values())


@pytest.mark.parametrize("job", sorted(JOBS))
def test_the_rule_fails_every_control(job: str) -> None:
    """A frozen policy and a random drift (tests/learning_margins.py) fall below a bound: the rule still fails a
    policy that does not learn. The sampled eval rejects each of them; the training reward's 10-step means move with
    the prompts (a frozen LoRA policy's by +0.008 over 60 steps, at its bound), so it need not."""
    table = load_table()
    limit = bounds(job, table)
    controls = [t for t in table["jobs"][job]["trajectories"] if t["role"] != "learns"]
    assert {t["role"] for t in controls} >= {"frozen", "drift"}
    for t in controls:
        assert t["stats"]["sampled_eval"] < limit["sampled_eval"], (t["role"], t["seed"], t["setting"], t["stats"])
        assert any(t["stats"][k] < limit[k] for k in ASSERTED)


def test_statistics_are_the_second_half_evals_and_the_10_step_means() -> None:
    warm = {"step": -1, "eval/sampled_reward": 0.2, "eval/reward": 0.4}
    steps = [{"step": s, "reward/mean": 0.1 + 0.01 * s} for s in range(30)]
    for s, sampled, greedy in ((9, 0.9, 0.9), (19, 0.3, 0.5), (29, 0.4, 0.3)):  # step 9: first half, not counted
        steps[s].update({"eval/sampled_reward": sampled, "eval/reward": greedy})
    got = statistics([warm, *steps])
    assert got["sampled_eval"] == pytest.approx(0.35 - 0.2)
    assert got["greedy_eval"] == pytest.approx(0.4 - 0.4)
    assert got["training_reward"] == pytest.approx(0.2)  # mean of steps 20-29 minus steps 0-9: 20 steps of 0.01
    assert got["training_trend"] == pytest.approx(0.3)  # slope 0.01 x 30 steps
