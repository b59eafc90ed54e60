"""colo.bench.lengths: the iid and per-prompt length models have the same marginal (median max/4, 5% cut at
max_tokens, 5% at or below max/16), per-prompt correlates the samples of one prompt by rho and iid does not, and
every length is a pure function of (request seed, prompt ids).

Tolerances: 20,000 independent draws per marginal check, so the standard error of the median is ~0.8% (a 4% band
is 5 errors wide) and of a 5% share 0.15 points (a 1-point band: 6.5 errors); a model with the wrong spread (say
sigma x sqrt(2), what adding z_prompt and z_sample without the square roots gives) puts 12% past max_tokens.
Correlations from 5,000 prompts x 2 samples: standard error ~0.01 at rho 0.7 (band 0.06), ~0.014 at 0 (band 0.05).
"""
from __future__ import annotations

import math
import random
import statistics

import pytest

from colo.bench.lengths import DEFAULT_RHO, LengthModel, prompt_key, response_length

MAX = 4096
N_PROMPTS = 8  # the loop's samples per prompt in the seeds below (seed * 1_000_003 + i * n + j)


def seed_of(i: int, j: int, step_seed: int = 11) -> int:
    return step_seed * 1_000_003 + i * N_PROMPTS + j


def prompt(i: int) -> list[int]:
    """Prompt i's token ids: 16 random ids below 512, as colo.bench.step's RandomPrompts draws them."""
    rng = random.Random(i)
    return [rng.randrange(3, 512) for _ in range(16)]


MODELS = [LengthModel(), LengthModel("per-prompt", DEFAULT_RHO), LengthModel("per-prompt", 0.3),
          LengthModel("per-prompt", 1.0)]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"{m.kind}-{m.rho}")
def test_marginal_is_the_same(model: LengthModel) -> None:
    """One sample of each of 20,000 prompts: the marginal distribution, whatever the model."""
    lengths = [model.length(seed_of(i, i % N_PROMPTS), MAX, prompt(i)) for i in range(20_000)]
    assert all(1 <= x <= MAX for x in lengths)
    assert abs(statistics.median(lengths) / (MAX / 4) - 1) < 0.04
    cut = sum(x == MAX for x in lengths) / len(lengths)
    assert abs(cut - 0.05) < 0.01, cut
    low = sum(x <= MAX / 16 for x in lengths) / len(lengths)  # the mirror of the cut in log space
    assert abs(low - 0.05) < 0.01, low


def log_pairs(model: LengthModel, prompts: int = 5_000) -> tuple[list[float], list[float]]:
    a = [math.log(model.length(seed_of(i, 0), MAX, prompt(i))) for i in range(prompts)]
    b = [math.log(model.length(seed_of(i, 1), MAX, prompt(i))) for i in range(prompts)]
    return a, b


@pytest.mark.parametrize("rho", [DEFAULT_RHO, 0.3])
def test_per_prompt_samples_correlate_by_rho(rho: float) -> None:
    """corr(log L) of two samples of one prompt is rho (a little less: the cut at max_tokens flattens the top 5%)."""
    r = statistics.correlation(*log_pairs(LengthModel("per-prompt", rho)))
    assert rho - 0.06 < r < rho + 0.02, r


def test_iid_samples_do_not_correlate() -> None:
    r = statistics.correlation(*log_pairs(LengthModel()))
    assert abs(r) < 0.05, r


def test_lengths_are_pure_functions_of_the_keys() -> None:
    """The same (seed, prompt ids) give the same length in any order, from a list or a tuple (a carried sample's
    request and a sync rollout's prompt); another prompt gives another z_prompt; iid ignores the prompt."""
    pp, iid = LengthModel("per-prompt", DEFAULT_RHO), LengthModel()
    keys = [(i, j) for i in range(50) for j in range(N_PROMPTS)]
    first = {(i, j): pp.length(seed_of(i, j), MAX, prompt(i)) for i, j in keys}
    again = {(i, j): pp.length(seed_of(i, j), MAX, tuple(prompt(i))) for i, j in reversed(keys)}
    assert first == again
    assert prompt_key(prompt(1)) == prompt_key(tuple(prompt(1))) != prompt_key(prompt(2))
    assert len({prompt_key(prompt(i)) for i in range(1000)}) == 1000
    assert prompt_key([1, 2, 3]) == 8307104907112060024  # blake2b: the same in every process and Python version
    assert [iid.length(seed_of(0, j), MAX, prompt(0)) for j in range(4)] == \
        [iid.length(seed_of(0, j), MAX, prompt(5)) for j in range(4)] == \
        [response_length(seed_of(0, j), MAX) for j in range(4)]


def test_rho_ends() -> None:
    """rho 0 draws iid's lengths (the same z from the same seed); rho 1 gives every sample of a prompt one length."""
    iid, zero, one = LengthModel(), LengthModel("per-prompt", 0.0), LengthModel("per-prompt", 1.0)
    for i in range(200):
        for j in range(N_PROMPTS):
            assert abs(zero.length(seed_of(i, j), MAX, prompt(i)) - iid.length(seed_of(i, j), MAX, prompt(i))) <= 1
        assert len({one.length(seed_of(i, j), MAX, prompt(i)) for j in range(N_PROMPTS)}) == 1


def test_model_checks_its_settings() -> None:
    with pytest.raises(ValueError, match="one of"):
        LengthModel("lognormal")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        LengthModel("per-prompt", 1.5)
    with pytest.raises(ValueError, match="per-prompt model only"):
        LengthModel("iid", 0.5)
    assert LengthModel("per-prompt", 0.7).describe() == {"model": "per-prompt", "rho": 0.7, "median_frac": 0.25,
                                                        "tail_frac": 0.05}


def test_fixed_is_max_tokens_without_a_draw():
    """--lengths fixed (a side-by-side with a system that ignores EOS up to its limit: tools/peers/verl): every
    response is max_tokens long, whatever the seed or prompt; it takes no rho."""
    model = LengthModel.of("fixed")
    assert {model.length(seed_of(i, j), MAX, prompt(i)) for i in range(50) for j in range(N_PROMPTS)} == {MAX}
    assert model.describe()["model"] == "fixed"
    with pytest.raises(ValueError, match="per-prompt model only"):
        LengthModel("fixed", rho=0.5)
