"""colo.bench.spread and colo.bench.combine: the ratio of two variants per repeat, its median and spread, pooled
over calls (issue 47: one call of 8 steps could not tell 1.3x from 1.5x)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from colo.bench.combine import blocks_of, combine, last_json, main
from colo.bench.spread import block, compare, pairs, quantile, spread


def step(tokens: float, step_s: float, train_s: float = 1.0) -> dict:
    return {"bench/tokens": tokens, "timing/step_s": step_s, "timing/train_s": train_s, "timing/rollout_s": step_s / 2}


def test_quantiles_are_numpys_linear_ones() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 12):
        xs = rng.normal(size=n).tolist()
        for q in (0.0, 0.25, 0.5, 0.75, 1.0):
            assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)))
    assert spread([3.0, 1.0, 2.0]) == {"n": 3, "median": 2.0, "q1": 1.5, "q3": 2.5, "min": 1.0, "max": 3.0}
    assert spread([]) == {"n": 0}
    with pytest.raises(ValueError):
        quantile([], 0.5)
    with pytest.raises(ValueError):
        spread([1.0, float("nan")])


def test_a_block_weighs_its_steps_by_their_tokens() -> None:
    """A block's throughput is its tokens over its seconds (a long step counts for more), not the mean of its
    steps' throughputs; per GPU."""
    b = block([step(1000, 1.0, 0.5), step(3000, 1.0, 1.5)], "async", 0, gpus=2)
    assert b["tokens_per_s_per_gpu"] == 1000.0  # 4000 tokens / 2 s / 2 GPUs
    assert b["step_tokens_per_s_per_gpu"] == [500.0, 1500.0]  # mean 1000 here; tokens-weighted in general
    assert b["train_s_per_mtok"] == pytest.approx(500.0) and b["steps"] == 2


def blocks(ratios: list[float], b_rate: float = 100.0, call: int = 0) -> list[dict]:
    """Blocks of A and B per repeat with A's throughput ratios[r] x B's; A trains a token in 0.8 of B's time."""
    out = []
    for r, x in enumerate(ratios):
        out.append({**block([step(b_rate * x, 1.0, 0.8 * x)] * 2, "async", r, 1), "call": call})
        out.append({**block([step(b_rate, 1.0, 1.0), step(b_rate, 1.0, 1.0)], "sync", r, 1), "call": call})
    return out


def test_compare_takes_the_ratio_per_repeat_with_its_spread() -> None:
    got = compare(blocks([1.5, 1.3, 1.4]), "async", "sync")
    assert got["pairs"] == 3 and got["ratios"] == pytest.approx([1.5, 1.3, 1.4])
    assert got["ratio"]["median"] == pytest.approx(1.4) and got["ratio"]["min"] == pytest.approx(1.3)
    assert got["separated"] is True  # even the slowest pair says async is faster
    assert got["ratio_of_totals"] == pytest.approx(1.4)  # equal seconds per block: the mean of the ratios
    assert got["train_speedup"]["median"] == pytest.approx(1.25)  # B's 1.0 s per token-unit over A's 0.8
    assert got["per_step"]["async"]["n"] == 6 and got["ratio_of_step_medians"] == pytest.approx(1.4)
    assert compare(blocks([1.2, 0.9]), "async", "sync")["separated"] is False  # straddles 1: no claim


def test_an_unfinished_repeat_is_left_out() -> None:
    """A call cut short after A's block of its last repeat: that block has no partner and is not paired."""
    bl = blocks([1.5, 1.3])[:-1]
    assert [(a["repeat"], b["repeat"]) for a, b in pairs(bl, "async", "sync")] == [(0, 0)]
    assert compare(bl, "async", "sync")["ratio"]["n"] == 1


def output(ratios: list[float], call_rate: float = 100.0) -> dict:
    return {"compare": {"key": "loop.mode", "values": ["async", "sync"]}, "gpus": 1,
            "blocks": blocks(ratios, call_rate)}


def test_combine_pools_pairs_and_reports_each_calls_ratio() -> None:
    old = {"compare": {"key": "loop.mode", "values": ["async", "sync"]}, "gpus": 1, "steps": 8,
           "tokens_per_step": 150.0, "phases": {"step": 1.0, "train": 0.5, "rollout": 0.5},
           "tokens_per_s_per_gpu": 150.0,
           "versus": {"steps": 8, "tokens_per_step": 100.0, "phases": {"step": 1.0, "train": 0.6, "rollout": 0.4},
                      "tokens_per_s_per_gpu": 100.0}}  # a call from before --repeats: one pair of its totals
    assert [b["variant"] for b in blocks_of(old, 2)] == ["async", "sync"]
    got = combine([output([1.5, 1.3, 1.4]), output([1.2, 1.25], call_rate=50.0), old], goal=1.4)
    assert got["pairs"] == 6 and got["ratio"]["n"] == 6
    assert got["ratio"]["median"] == pytest.approx(1.35) and got["ratio"]["min"] == pytest.approx(1.2)
    assert got["calls"]["ratios"] == pytest.approx([1.4, 1.225, 1.5])
    assert got["calls"]["median"] == pytest.approx(1.4)
    assert got["goal"] == {"value": 1.4, "median_reached": True, "every_call_reached": False}
    with pytest.raises(ValueError, match="same KEY=A,B"):
        combine([output([1.5]), {**output([1.5]), "compare": {"key": "trainer.packing", "values": [True, False]}}])


def test_the_cli_reads_the_last_whole_json_line_of_each_file(tmp_path, capsys) -> None:
    """A call's stdout holds a JSON line per repeat (and maybe a line cut by its time limit): the last whole one
    counts."""
    files = []
    for i, ratios in enumerate(([1.5, 1.3, 1.4], [1.45, 1.35, 1.5], [1.6, 1.4, 1.5])):
        f = tmp_path / f"async-{i}.json"
        f.write_text(json.dumps(output(ratios[:1])) + "\n" + json.dumps(output(ratios)) + '\n{"cut": ')
        files.append(str(f))
    assert len(last_json(files[0])["blocks"]) == 6
    assert main([*files, "--goal", "1.4"]) == 0
    text = capsys.readouterr().out
    assert "median 1.450x over 9 pairs" in text and "every pair on one side of 1" in text
    assert "per call (3): 1.400x, 1.433x, 1.500x; median 1.433x" in text
    assert "goal 1.4x: median of the calls reached" in text
    assert main([*files, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calls"]["n"] == 3
    (tmp_path / "empty.json").write_text("no json here\n")
    assert main([str(tmp_path / "empty.json")]) == 2
    assert "no JSON line" in capsys.readouterr().err
