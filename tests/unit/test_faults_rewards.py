"""Reward faults: the math reward in a user's own unguarded script."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import clean_env

from colo.algo.rewards import RewardError, RewardRunner

UNGUARDED = """from colo.algo.rewards import RewardRunner
print(RewardRunner(["math"])(["so the answer is \\\\boxed{\\\\frac{1}{2}}", "7"], ["0.5", "8"], ["q", "q"]))
"""

OFF_MAIN_THREAD = """from colo.algo.rewards import RewardRunner
print(RewardRunner(["math"]).submit(["\\boxed{1}"], ["1"], ["q"]).result())
"""


def test_math_reward_in_unguarded_script(tmp_path: Path) -> None:
    """No `if __name__ == "__main__":`: scoring from the main thread needs no process pool (spawn re-imports
    the script, which used to break the pool with BrokenProcessPool)."""
    script = tmp_path / "score.py"
    script.write_text(UNGUARDED)
    p = subprocess.run([sys.executable, str(script)], env=clean_env(), capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "[1.0, 0.0]", p.stdout


def test_math_reward_off_main_thread_in_unguarded_script_names_fix(tmp_path: Path) -> None:
    """Off the main thread the pool is needed; when spawn's re-import breaks it, the error says the fix."""
    script = tmp_path / "score_async.py"
    script.write_text(OFF_MAIN_THREAD)
    p = subprocess.run([sys.executable, str(script)], env=clean_env(), capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode != 0 and 'if __name__ == "__main__":' in p.stderr, p.stderr[-2000:]


HANGING = '''
import time


def sleeps(responses, answers, prompts):
    try:
        time.sleep(3600)  # a judge server that never answers
    except Exception:  # a broad handler must not swallow the timeout
        pass
    return [0.0] * len(responses)


def spins(responses, answers, prompts):
    while True:
        pass
'''


@pytest.fixture
def hanging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "hanging_rewards.py").write_text(HANGING)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "hanging_rewards"


def test_reward_that_never_returns_times_out(hanging: str) -> None:
    """algo.reward_timeout_s: a function that blocks or spins is stopped, with a RewardError naming it and the key,
    in the main thread (the loop's) and off it (RewardRunner.submit)."""
    for fn in ("sleeps", "spins"):
        runner = RewardRunner([f"{hanging}:{fn}"], timeout_s=1.0)
        t0 = time.perf_counter()
        with pytest.raises(RewardError) as e:
            runner(["a"], ["a"], ["q"])
        assert time.perf_counter() - t0 < 10, fn
        assert f"'{hanging}:{fn}' did not return within 1 s" in str(e.value) and "algo.reward_timeout_s" in str(e.value)
        if fn == "sleeps":  # off the main thread the call is abandoned, not stopped: not one that spins
            with pytest.raises(RewardError, match="did not return within 1 s"):
                runner.submit(["a"], ["a"], ["q"]).result(timeout=30)
        runner.close()
    assert signal.getsignal(signal.SIGUSR2) in (signal.SIG_DFL, None), "the watchdog's handler is put back"
    ok = RewardRunner(["exact_match"], timeout_s=1.0)
    assert ok(["a"], ["a"], ["q"]) == [1.0]


def test_reward_timeout_in_config() -> None:
    from colo.config import ConfigError, load_config, validate

    assert load_config(None, [], {}).algo.reward_timeout_s == 600
    with pytest.raises(ConfigError, match="algo.reward_timeout_s"):
        validate(load_config(None, ["algo.reward_timeout_s=0"], {}), check_resources=False)


UNRULY = '''
import os
import signal
import sys


def exits(responses, answers, prompts):
    if "bad" in responses:
        sys.exit(0)  # a script's habit: would end the run with status 0, halfway
    return [1.0] * len(responses)


def interrupts(responses, answers, prompts):
    raise KeyboardInterrupt  # its own, not a Ctrl-C


def stopped_meanwhile(responses, answers, prompts):
    os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's stop while the reward runs: the run stops, no blame
    return [1.0] * len(responses)


def huge(responses, answers, prompts):
    return [1e39 if r == "big" else 1.0 for r in responses]  # finite in float64, inf in float32


def pops(responses, answers, prompts):
    answers.pop()  # changes the list it was given: the next function would score other data
    return [0.0] * len(responses)


def edits(responses, answers, prompts):
    answers[1] = answers[1].upper()
    return [0.0] * len(responses)
'''


@pytest.fixture
def unruly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "unruly_rewards.py").write_text(UNRULY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "unruly_rewards"


def test_a_reward_that_exits_or_interrupts_is_an_error_not_the_end(unruly: str) -> None:
    """sys.exit(0) in a reward function ended a run at step 3 of 5 with status 0; its own KeyboardInterrupt read as
    Ctrl-C. Both are the function's error now, with the sample; a real stop signal still stops."""
    from colo.run.signals import StopRequested, StopSignals

    with pytest.raises(RewardError) as e:
        RewardRunner([f"{unruly}:exits"])(["ok", "bad"], ["a", "b"], ["q", "q"])
    assert str(e.value).startswith(f"reward function '{unruly}:exits' called sys.exit(0)") and \
        "on sample 1: response='bad'" in str(e.value), e.value
    stop = StopSignals()
    stop.install()  # as in a run: the loop's handler holds SIGINT
    try:
        with pytest.raises(RewardError, match=f"'{unruly}:interrupts' raised KeyboardInterrupt"):
            RewardRunner([f"{unruly}:interrupts"])(["a"], ["a"], ["q"])
        with pytest.raises(StopRequested):
            RewardRunner([f"{unruly}:stopped_meanwhile"])(["a"], ["a"], ["q"])
        assert stop.name == "SIGTERM"
    finally:
        stop.restore()


def test_a_reward_beyond_float32_is_named_with_its_sample(unruly: str) -> None:
    with pytest.raises(RewardError) as e:
        RewardRunner([f"{unruly}:huge"])(["a", "big"], ["a", "a"], ["q", "q"])
    assert f"'{unruly}:huge' returned 1e+39 for sample 1, beyond float32's range" in str(e.value), e.value
    with pytest.raises(RewardError, match="the weighted sum of the reward functions is 4e\\+38 for sample 0"):
        RewardRunner(["exact_match"], weights=[4e38])(["a"], ["a"], ["q"])  # each fits, the sum does not


def test_a_reward_that_changes_its_inputs_is_blamed_not_the_next(unruly: str) -> None:
    """`pops` shortened the answers list, and exact_match, scored next on the same list, took the blame."""
    for fn, what in (("pops", "changed its input answers in place (its length 2 -> 1)"),
                     ("edits", "changed its input answers[1] in place, on sample 1: 'b' -> 'B'")):
        with pytest.raises(RewardError) as e:
            RewardRunner([f"{unruly}:{fn}", "exact_match"])(["a", "b"], ["a", "b"], ["q", "q"])
        assert f"reward function '{unruly}:{fn}' {what}" in str(e.value), e.value
    assert RewardRunner(["exact_match"])(["a", "b"], ["a", "b"], ["q", "q"]) == [1.0, 1.0]
