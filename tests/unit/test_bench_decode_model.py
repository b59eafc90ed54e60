"""colo.bench.decode's model of a rollout's decode: step time between measured batch sizes, and the tail ceiling it
predicts from the step benchmark's long-tail lengths (no vLLM: the measured table is given)."""
from __future__ import annotations

import pytest

from colo.bench.decode import fit_line, parse_args, predict, step_time, workload_lengths
from colo.bench.lengths import LengthModel


def test_step_time_interpolates_and_extends() -> None:
    table = [(1, 0.004), (8, 0.004), (64, 0.008)]
    assert step_time(0, table) == 0.0 and step_time(-3, table) == 0.0  # nothing in flight costs nothing
    assert step_time(1, table) == pytest.approx(0.004) and step_time(36, table) == pytest.approx(0.006)
    assert step_time(0.5, table) == pytest.approx(0.002)  # between 0 and the first point
    assert step_time(120, table) == pytest.approx(0.012)  # the last segment's slope past the largest B
    assert step_time(1000, [(1, 0.005), (8, 0.004)]) == pytest.approx(0.004)  # never below the last point


def test_fit_line() -> None:
    a, b = fit_line([(1, 0.0031), (10, 0.004), (100, 0.013)])
    assert a == pytest.approx(0.003, abs=1e-12) and b == pytest.approx(1e-4, abs=1e-12)
    assert fit_line([(4, 0.01)]) == (0.01, 0.0)


def test_flat_step_time_puts_the_whole_tail_in_the_ceiling() -> None:
    """A step that costs the same at any batch: the sync decode is max_len steps, the full batch needs only
    tokens / samples of them; a step proportional to the batch: the tail costs nothing, the ceiling is 1."""
    lengths = [10, 10, 10, 40]
    flat = predict(lengths, [(1, 0.01), (4, 0.01)])
    assert flat["decode_steps"] == 40 and flat["response_tokens"] == 70 and flat["mean_batch"] == pytest.approx(70 / 40)
    assert flat["sync_decode_s"] == pytest.approx(0.40)
    assert flat["full_batch_decode_s"] == pytest.approx(70 / 4 * 0.01)
    assert flat["tail_ceiling"] == pytest.approx(0.40 / 0.175)
    linear = predict(lengths, [(1, 0.01), (4, 0.04)])
    assert linear["tail_ceiling"] == pytest.approx(1.0) and linear["tail_share"] == pytest.approx(0.0, abs=1e-12)


def test_workload_lengths_follow_the_step_benchmark() -> None:
    iid = workload_lengths(16, 8, 4096, LengthModel())
    assert len(iid) == 128 and max(iid) <= 4096 and min(iid) >= 1
    assert 700 < sorted(iid)[64] < 1500  # median about max/4
    assert iid == workload_lengths(16, 8, 4096, LengthModel())  # deterministic
    per = workload_lengths(16, 8, 4096, LengthModel("per-prompt", 1.0))
    assert all(len(set(per[i * 8:(i + 1) * 8])) == 1 for i in range(16))  # rho 1: one length per prompt


def test_args(capsys) -> None:
    a = parse_args(["--device", "cpu"])
    assert a.batches == [1, 4, 16] and a.decode_lengths == [4, 20]
    assert parse_args(["--batches", "8,1,8"]).batches == [1, 8]
    assert parse_args(["--variants", "colo,detok"]).variants == ["colo", "detok"] and a.variants == ["colo"]
    for bad in (["--decode-lengths", "20,4"], ["--decode-lengths", "4"], ["--batches", "0,4"],
                ["--length-rho", "0.5"], ["--variants", "colo,fast"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
