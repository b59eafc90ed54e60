"""Conversations carried across weight updates, the parts that need no engine (colo.rollout.turns): the environment
rebuilt on resume must give the recorded history back token for token, and a stop string split by the stop is still
found. The engine loop itself: tests/integration/test_engines_across_syncs.py ("async" section) and
tests/e2e/test_async_tools_job.py. No Ray, no vLLM."""
from __future__ import annotations

import pytest

from colo.envs.base import EnvError, Environment
from colo.envs.calculator import CalculatorEnv
from colo.envs.framing import ChatFraming
from colo.envs.runner import EnvRunner
from colo.models.tokenizer import build_tokenizer
from colo.rollout.sample import Sample, Turns
from colo.rollout.turns import model_turn, replay, stop_cut

ROW = {"prompt": "Question: 12*34+5=? Answer:", "answer": "413", "prompt_ids": [1, 2, 3]}


@pytest.fixture(scope="module")
def framing() -> ChatFraming:
    return ChatFraming(build_tokenizer(512, tools=True), None, chat=True)


def carried(framing: ChatFraming, env: type = CalculatorEnv) -> tuple[Sample, list[int]]:
    """A calculator conversation stopped in its second model turn: its first turn called the tool, the tool's answer
    followed, then two tokens of the answer turn; recorded as the buffer carries it."""
    runner = EnvRunner(env, framing)
    prompt = runner.reset(ROW)
    call = framing.encode("<tool_call>12*34+5</tool_call>") + [framing.eos_id]
    _, obs = runner.step(turn_of(framing, call), after_eos=True)
    partial = framing.encode("41")[:2]
    resp = call + obs + partial
    turns = Turns(spans=[[0, len(call)]], reasons=["stop"], in_progress=len(partial), tool_calls=1, final_ids=call)
    mask = [1] * len(call) + [0] * len(obs) + [1] * len(partial)
    return Sample(0, 0, 1, prompt, resp, [0.0] * len(resp), [0] * len(resp), mask, segments=1, turns=turns), obs


def turn_of(framing: ChatFraming, ids: list[int]):
    return model_turn(framing, ids, 0, "stop")


def test_replay_rebuilds_the_environment_from_the_recorded_turns(framing) -> None:
    s, obs = carried(framing)
    assert "tool\n413<|im_end|>" in framing.tok.decode(obs)  # the tool really answered 12*34+5
    runner = EnvRunner(CalculatorEnv, framing)
    replay(s, runner, ROW, framing)  # the same prompt, and the same observation after turn 0
    assert runner.env is not None


class Drifting(Environment):
    """Answers the first call with the time of day: not a function of the row and the turns."""

    calls = 0

    def step(self, turn):
        Drifting.calls += 1
        return f"call {Drifting.calls}", 0.0, False


def test_replay_refuses_an_environment_that_answers_differently(framing) -> None:
    s, _ = carried(framing, Drifting)  # recorded with "call 1"; the replay gets "call 2"
    with pytest.raises(EnvError, match="answer to turn 0 differs from the one recorded"):
        replay(s, EnvRunner(Drifting, framing), ROW, framing)
    s, _ = carried(framing)
    s.prompt_ids = s.prompt_ids[:-1]
    with pytest.raises(EnvError, match="another first prompt"):
        replay(s, EnvRunner(CalculatorEnv, framing), ROW, framing)


def test_stop_cut_finds_a_stop_string_split_by_the_stop(framing) -> None:
    """vLLM checks stop strings in a request's own output: a turn continued after a stop that ends '...</tool' then
    '_call>...' would run past its stop string. stop_cut ends it at the token that completes it."""
    tok = framing.tok
    before = framing.encode("<tool_call>2*3 ")
    new = framing.encode("is it")
    assert stop_cut(tok, before, new, ["it"]) is not None and stop_cut(tok, before, new, ["zz"]) is None
    text = "ab cd ef"
    ids = framing.encode(text)
    for cut in range(1, len(ids)):
        before, new = ids[:cut], ids[cut:]
        k = stop_cut(tok, before, new, ["cd"])
        if "cd" in tok.decode(before):
            assert k is None  # already there before: the turn would have ended then
        else:
            assert k is not None and "cd" in tok.decode(before + new[:k])
            assert "cd" not in tok.decode(before + new[:k - 1])
    assert stop_cut(tok, ids[:2], [], ["cd"]) is None and stop_cut(tok, ids[:2], ids[2:], []) is None
