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
