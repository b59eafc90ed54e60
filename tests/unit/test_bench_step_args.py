"""colo.bench.step's arguments: one --compare KEY=A,B per run, which owns the setting it varies."""
from __future__ import annotations

import pytest

from colo.bench.step import COMPARABLE, parse_args


def test_compare_takes_one_setting_and_two_of_its_values() -> None:
    assert parse_args(["--compare"]).compare == ("trainer.packing", (True, False))  # bare: packed, then padded
    assert parse_args(["--compare", "loop.mode=async,sync"]).compare == ("loop.mode", ("async", "sync"))
    assert parse_args(["--compare", "trainer.old_logprobs=update,pass"]).compare == ("trainer.old_logprobs",
                                                                                    ("update", "pass"))
    assert parse_args(["--compare", "trainer.gather_once=false,true", "--json"]).compare == (
        "trainer.gather_once", (False, True))
    assert parse_args([]).compare is None


@pytest.mark.parametrize("value, says", [("trainer.lr=1e-3,1e-4", "KEY is one of"),
                                         ("loop.mode=async", "two different values"),
                                         ("loop.mode=async,async", "two different values"),
                                         ("trainer.compile=yes,no", "true/false")])
def test_compare_refuses_what_it_cannot_vary(value: str, says: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--compare", value])
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("key", sorted(COMPARABLE))
def test_compare_owns_its_setting(key: str, capsys) -> None:
    a, b = COMPARABLE[key]
    with pytest.raises(SystemExit):
        parse_args(["--compare", f"{key}={a},{b}", f"{key}={a}"])
    assert "drop the override" in capsys.readouterr().err


def test_compare_compile_warms_up_and_packing_measures_the_padded_path_itself(capsys) -> None:
    """A compile falls in unmeasured warm-up steps; --no-packing next to the packed/padded comparison is redundant."""
    with pytest.raises(SystemExit):
        parse_args(["--compare", "trainer.compile=true,false", "--warmup", "0"])
    assert "--warmup 1 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--compare", "--no-packing"])
    assert "drop --no-packing" in capsys.readouterr().err


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
    assert (parse_args(["--lengths", "fixed"]).lengths, parse_args(["--lengths", "fixed"]).length_rho) == ("fixed", None)
    with pytest.raises(SystemExit):
        parse_args(["--lengths", "fixed", "--length-rho", "0.5"])
    assert "applies to --lengths per-prompt" in capsys.readouterr().err
