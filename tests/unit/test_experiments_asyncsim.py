"""tools.experiments.asyncsim: the async step's own bookkeeping (RolloutBuffer) replayed against a decode curve."""
from __future__ import annotations

import json

import pytest

from tools.experiments.asyncsim import decode_phase, main, simulate
from colo.bench.decode import step_time
from colo.bench.lengths import LengthModel

TABLE = [(1, 0.003), (32, 0.005), (128, 0.009), (256, 0.016)]


def test_decode_phase_stops_at_the_needed_group() -> None:
    # groups 0, 1, 2 finish after 5, 9 and 20 steps; 2 groups needed -> 9 steps
    steps, seconds = decode_phase([5, 3, 9, 9, 20, 1], [0, 0, 1, 1, 2, 2], need=2, table=TABLE)
    assert steps == 9
    active = [sum(r > t for r in [5, 3, 9, 9, 20, 1]) for t in range(9)]
    assert seconds == pytest.approx(sum(step_time(a, TABLE) for a in active))
    assert decode_phase([5], [0], need=0, table=TABLE) == (0, 0.0)
    assert decode_phase([5, 7], [0, 1], need=9, table=TABLE)[0] == 7  # more than there are: all of them


def test_sync_finishes_every_group_and_carries_nothing() -> None:
    out = simulate("sync", steps=3, k=4, n=4, max_tokens=256, prompt_len=8, model=LengthModel(), table=TABLE,
                   prefill_s_per_token=0.0, train_s_per_token=0.0, fixed_s=0.0)
    for row in out["steps"]:
        assert row["carried"] == 0 and row["dropped"] == 0 and row["completed"] == 16
        assert row["rollout_s"] >= row["decode_steps"] * step_time(1, TABLE)  # at least one sequence every step
        assert row["trained_tokens"] > 16 * 8  # prompts plus responses


@pytest.mark.parametrize("oversample,staleness", [(1.5, 1), (3.0, 2)])
def test_async_carries_within_the_bound(oversample: float, staleness: int) -> None:
    out = simulate("async", steps=12, k=4, n=4, max_tokens=256, prompt_len=8, model=LengthModel(), table=TABLE,
                   prefill_s_per_token=1e-6, train_s_per_token=1e-5, fixed_s=0.1, oversample=oversample,
                   max_staleness=staleness, warmup=2)
    rows = out["steps"]
    assert len(rows) == 12 and sum(r["carried"] for r in rows) > 0  # samples really cross steps
    assert all(r["decode_steps"] <= 256 for r in rows)
    assert out["tokens_per_s"] > 0  # RolloutBuffer.take raised had a sample been staler than the bound


def test_cli(tmp_path, capsys) -> None:
    dec = tmp_path / "decode.json"
    dec.write_text("vLLM log line\n" + json.dumps({"step_ms": {"1": 3.0, "32": 5.0, "128": 9.0, "256": 16.0},
                                                   "prefill_us_per_token": 4.0}) + "\n")
    assert main(["--decode-json", str(dec), "--prompts", "4", "--n", "4", "--max-tokens", "256", "--steps", "6",
                 "--warmup", "2", "--oversample", "2", "--staleness", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model_not_measurement"] is True and out["async_over_sync"] > 0 and len(out["async_steps"]) == 6


def test_shapes_the_trainer_gets_per_mode(capsys) -> None:
    """--shapes: both modes train the same tokens per step on average (every group is trained once, whenever it
    finishes); micro-batches at the budget cover them (issue 47: the shapes bound what async's
    batches can cost the train phase)."""
    from tools.experiments.asyncsim import train_shapes

    common = dict(steps=60, k=4, n=4, max_tokens=256, prompt_len=8, model=LengthModel(), table=[(1, 0.0)],
                  prefill_s_per_token=0.0, train_s_per_token=0.0, fixed_s=0.0, warmup=10)
    sync = train_shapes(simulate("sync", **common)["steps"], 512)
    asy = train_shapes(simulate("async", oversample=3.0, max_staleness=3, **common)["steps"], 512)
    assert asy["tokens_mean"] == pytest.approx(sync["tokens_mean"], rel=0.1)
    for t in (sync, asy):
        assert t["micro_batches_mean"] >= t["tokens_mean"] / 512 and sum(t["micro_batches"].values()) == 60
    assert main(["--shapes", "512", "--prompts", "4", "--n", "4", "--max-tokens", "256", "--steps", "20",
                 "--warmup", "5", "--oversample", "3", "--staleness", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "asyncsim-shapes" and out["async"]["micro_batches_mean"] > 0
    with pytest.raises(SystemExit):
        main(["--steps", "5"])  # neither a decode curve nor --shapes
