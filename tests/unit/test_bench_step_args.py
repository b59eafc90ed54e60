"""colo.bench.step's arguments: the comparisons are one run each, and a comparison owns the setting it varies."""
from __future__ import annotations

import pytest

from colo.bench.step import parse_args


@pytest.mark.parametrize("flags", [["--compare", "--compare-async"], ["--compare", "--compare-gather-once"],
                                   ["--compare-async", "--compare-gather-once"], ["--compare", "--compare-compile"],
                                   ["--compare-gather-once", "--compare-compile"],
                                   ["--compare-compile", "--compare-old-logprobs"],
                                   ["--compare-old-logprobs", "--compare-loss-in-lm-head"]])
def test_one_comparison_per_run(flags: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert "give one" in capsys.readouterr().err


def test_compare_gather_once_owns_the_setting(capsys) -> None:
    assert parse_args(["--compare-gather-once"]).compare_gather_once
    with pytest.raises(SystemExit):
        parse_args(["--compare-gather-once", "trainer.gather_once=true"])
    assert "drop the override" in capsys.readouterr().err


def test_compare_old_logprobs_owns_the_setting(capsys) -> None:
    assert parse_args(["--compare-old-logprobs"]).compare_old_logprobs
    with pytest.raises(SystemExit):
        parse_args(["--compare-old-logprobs", "trainer.old_logprobs=pass"])
    assert "drop the override" in capsys.readouterr().err


def test_compare_loss_in_lm_head_owns_the_setting(capsys) -> None:
    assert parse_args(["--compare-loss-in-lm-head"]).compare_loss_in_lm_head
    with pytest.raises(SystemExit):
        parse_args(["--compare-loss-in-lm-head", "trainer.loss_in_lm_head=false"])
    assert "drop the override" in capsys.readouterr().err


def test_compare_compile_owns_the_setting_and_warms_up(capsys) -> None:
    """--compare-compile varies trainer.compile itself, and its compile must fall in unmeasured warm-up steps."""
    assert parse_args(["--compare-compile"]).compare_compile
    with pytest.raises(SystemExit):
        parse_args(["--compare-compile", "trainer.compile=true"])
    assert "drop the override" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--compare-compile", "--warmup", "0"])
    assert "--warmup 1 or more" in capsys.readouterr().err


def test_length_model_flags(capsys) -> None:
    """--lengths iid stays the default (earlier figures' workload); per-prompt takes rho 0.7 unless given, in [0, 1]."""
    a = parse_args([])
    assert (a.lengths, a.length_rho) == ("iid", None)
    a = parse_args(["--lengths", "per-prompt"])
    assert (a.lengths, a.length_rho) == ("per-prompt", 0.7)
    assert parse_args(["--lengths", "per-prompt", "--length-rho", "0.3"]).length_rho == 0.3
    with pytest.raises(SystemExit):
        parse_args(["--length-rho", "0.5"])
    assert "applies to --lengths per-prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--lengths", "per-prompt", "--length-rho", "1.5"])
    assert "[0, 1]" in capsys.readouterr().err
