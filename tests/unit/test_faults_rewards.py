"""Reward faults: the math reward in a user's own unguarded script."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import clean_env

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
