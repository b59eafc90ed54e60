"""docs/environments.md's complete example runs: its environment, loaded as module:Class, plays a whole
conversation through colo's runner and framing, and its demonstration solves the row."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from colo.envs.base import Step, Turn, load_environment
from colo.envs.framing import ChatFraming, Conversation
from colo.envs.runner import EnvRunner

DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


@pytest.fixture
def hangman(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> type:
    code = re.search(r"## A complete example.*?```python\n(.*?)```", DOC.read_text(), re.DOTALL).group(1)
    (tmp_path / "hangman.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hangman", raising=False)
    return load_environment("hangman:Hangman")


def test_the_documented_environment_plays_a_conversation(hangman: type) -> None:
    from colo.models.tokenizer import build_tokenizer

    tok = build_tokenizer(512)
    f = ChatFraming(tok)
    runner, row = EnvRunner(hangman, f), {"prompt": "", "answer": "seed"}
    conv = Conversation(runner.reset(row))
    rewards = []
    for i, letter in enumerate(runner.env.solution(row)):
        ids = f.encode(letter) + [tok.eos_token_id]
        conv.add_model(ids, [0.0] * len(ids))
        step, obs = runner.step(Turn(letter, tuple(ids), i, "stop"), after_eos=True)
        rewards.append(step.reward)
        if step.done:
            break
        conv.add_env(obs)
    assert step == Step(None, 1.0, True) and rewards == [0.0, 0.0, 1.0]  # s, e, d
    assert tok.decode(conv.ids).endswith("user\ns e e _ (5 misses left)<|im_end|>\n<|im_start|>assistant\nd<|im_end|>")
