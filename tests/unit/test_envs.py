"""The environment interface (colo.envs): loading, answers checked, calls under a deadline, the framing of
observations (token-in/token-out), the calculator and the Python sandbox. No Ray, no vLLM."""
from __future__ import annotations

import sys
import time

import pytest

from colo.envs.base import EnvError, Environment, Step, Turn, as_step, load_environment
from colo.envs.calculator import CalculatorEnv, calculate
from colo.envs.framing import ChatFraming, Conversation
from colo.envs.runner import EnvRunner, guarded
from colo.envs.sandbox import PythonEnv, run_python


class Echo(Environment):
    def step(self, turn: Turn):
        return f"you said {turn.text}", 0.5, turn.index >= 1


def turn(text: str, index: int = 0) -> Turn:
    return Turn(text, (), index, "stop")


def test_load_environment_builtins_and_module_class() -> None:
    assert load_environment("calculator") is CalculatorEnv and load_environment("python") is PythonEnv
    assert load_environment(f"{__name__}:Echo") is Echo
    for bad, needle in (("nope", "neither a built-in"), ("colo.envs.base:Nope", "cannot import"),
                        ("colo.envs.base:as_step", "not a class")):
        with pytest.raises(ValueError, match=needle):
            load_environment(bad)


def test_step_answers_are_checked() -> None:
    assert as_step(("obs", 1, False)) == Step("obs", 1.0, False)
    assert as_step(Step([1, 2], 0.0, False, tool_calls=1)).tool_calls == 1
    assert as_step(([{"role": "tool", "content": "x"}], 0.0, True)).done
    for bad, needle in ((("obs", 1.0), "expected \\(observation"), ({"obs": 1}, "expected"),
                        (("obs", "1", False), "reward"), (("obs", float("nan"), False), "reward"),
                        (("obs", 1.0, "yes"), "done"), ((3.5, 1.0, False), "expected text"),
                        (([{"role": "tool"}], 0.0, False), "expected text"), (([-1], 0.0, False), "expected text")):
        with pytest.raises(EnvError, match=needle):
            as_step(bad)


def test_guarded_calls_end_with_their_error_or_deadline_not_the_caller() -> None:
    def boom() -> None:
        raise KeyError("k")

    t0 = time.monotonic()
    ok, raised, hung = guarded([lambda: 7, boom, lambda: time.sleep(30)], timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    assert ok == 7
    assert isinstance(raised, EnvError) and "KeyError" in str(raised)
    assert isinstance(hung, EnvError) and "algo.env_timeout_s=0.5" in str(hung)


def test_calculator() -> None:
    assert calculate("12*34+56") == 464 and calculate("(7-9)*3") == -6 and calculate("7/2") == 3.5
    for bad in ("__import__('os')", "1/0", "9**99", "2**200000", "a+1", "1+"):
        with pytest.raises(ValueError):
            calculate(bad)
    env = CalculatorEnv()
    step = env.step(turn("<tool_call>2*3+4</tool_call>"))
    assert step == Step("10", 0.0, False, tool_calls=1, tool_errors=0)
    assert env.step(turn("<tool_call>2*</tool_call>")).tool_errors == 1
    assert env.step(turn("10")).done
    assert env.solution({"prompt": "Calculate 12*34+56.", "answer": "464"}) == ["<tool_call>12*34+56</tool_call>", "464"]


@pytest.fixture(scope="module")
def tok():
    from colo.models.tokenizer import build_tokenizer

    return build_tokenizer(512)


def test_observation_framing_is_the_chat_templates_own(tok) -> None:
    """Prompt + the model's turn + the framed observation is exactly the chat template's rendering of the
    whole conversation with its generation prompt, when the model's tokens are the canonical ones."""
    f = ChatFraming(tok)
    user = [{"role": "user", "content": "Question: 2+3=? Answer:"}]
    conv = Conversation(f.prompt(user))
    said = f.encode("5") + [tok.eos_token_id]
    conv.add_model(said, [-0.1] * len(said))
    conv.add_env(f.observation("the tool says 5", "tool", after_eos=True))
    whole = user + [{"role": "assistant", "content": "5"}, {"role": "tool", "content": "the tool says 5"}]
    assert conv.ids == f.encode(tok.apply_chat_template(whole, add_generation_prompt=True, tokenize=False))
    assert conv.model_mask == [0] * 0 + [1] * len(said) + [0] * (len(conv.response_ids) - len(said))
    assert conv.logprobs[len(said):] == [0.0] * (len(conv.response_ids) - len(said))
    # a turn cut by a stop string (no end-of-turn token): the framing closes the turn itself
    closed = f.observation("x", "tool", after_eos=False)
    assert closed[0] == tok.eos_token_id and closed[1:] == f.observation("x", "tool", after_eos=True)
    assert f.observation([5, 6], "tool", True) == [5, 6] and f.observation(None, "tool", True) == []


def test_the_sampled_ids_stay_even_where_re_encoding_changes_them(tok) -> None:
    """A model may sample a split BPE would never produce ("1","2" where the text encodes as one token, or
    byte pieces): the conversation keeps those ids, and decoding + re-encoding the history would not."""
    f = ChatFraming(tok)
    conv = Conversation(f.prompt([{"role": "user", "content": "Question: say hello"}]))
    canonical = f.encode(" the")
    assert len(canonical) == 1  # one merged token; the model samples its bytes one by one instead
    sampled = [t for ch in " the" for t in f.encode(ch)] + [tok.eos_token_id]
    conv.add_model(sampled, [0.0] * len(sampled))
    conv.add_env(f.observation("ok", "tool", after_eos=True))
    assert conv.response_ids[:len(sampled)] == sampled
    re_encoded = f.encode(tok.decode(conv.ids))
    assert re_encoded != conv.ids  # what a decode + re-encode of the history would have trained on


def test_runner_makes_one_environment_per_conversation_and_checks_reset(tok) -> None:
    f = ChatFraming(tok)
    a, b = EnvRunner(Echo, f), EnvRunner(Echo, f)
    ids = a.reset({"prompt": "hi", "answer": ""})
    assert ids == f.prompt([{"role": "user", "content": "hi"}])
    b.reset({"prompt": "hi", "answer": ""})
    assert a.env is not b.env
    step, obs = a.step(turn("x"), after_eos=True)
    assert step.reward == 0.5 and not step.done and obs == f.observation("you said x", "tool", True)
    step, obs = a.step(turn("y", 1), after_eos=True)
    assert step.done and obs == []

    class Empty(Environment):
        def reset(self, row):
            return []

    with pytest.raises(EnvError, match="empty prompt"):
        EnvRunner(Empty, f).reset({"prompt": "hi"})


@pytest.mark.sandbox
def test_sandbox_runs_code_in_a_subprocess_under_limits() -> None:
    r = run_python("import os; print(2**10, os.getpid())", timeout_s=10)
    assert r.error is None and r.stdout.split()[0] == "1024"
    import os

    assert int(r.stdout.split()[1]) != os.getpid()  # not in this process
    t0 = time.monotonic()
    r = run_python("while True: pass", timeout_s=1.5)
    assert "timed out" in r.error and time.monotonic() - t0 < 10
    r = run_python("x = bytearray(4 * 1024**3)", timeout_s=10, memory_mb=256)
    assert r.error == "MemoryError"
    r = run_python("print('before'); raise ValueError('boom')", timeout_s=10)
    assert r.stdout == "before\n" and r.error == "ValueError: boom"
    r = run_python("import os; os.kill(os.getpid(), 9)", timeout_s=10)
    assert r.error == "killed by SIGKILL"


@pytest.mark.sandbox
def test_python_environment_answers_with_the_output() -> None:
    env = PythonEnv()
    prompt = env.reset({"prompt": "What is 2**20?"})
    assert prompt[0]["role"] == "system" and prompt[1]["content"] == "What is 2**20?"
    step = env.step(turn('<tool_call>{"name": "python", "arguments": {"code": "print(2**20)"}}</tool_call>'))
    assert step == Step("1048576\n", 0.0, False, tool_calls=1, tool_errors=0)
    step = env.step(turn("<tool_call>1/0</tool_call>"))
    assert step.tool_errors == 1 and "ZeroDivisionError" in step.observation
    assert env.step(turn("\\boxed{1048576}")).done


def test_config_refuses_turns_without_an_environment_and_unknown_environments() -> None:
    from colo.config import ConfigError, load_config, validate
    from colo.config.checks import _check_environment

    with pytest.raises(ConfigError, match="rollout.max_turns=3 needs an environment"):
        validate(load_config(None, ["rollout.max_turns=3"], {}), check_resources=False)
    with pytest.raises(ConfigError, match="algo.env_timeout_s=0.0 must be > 0"):
        validate(load_config(None, ["algo.environment=calculator", "algo.env_timeout_s=0"], {}), check_resources=False)
    with pytest.raises(ConfigError, match="algo.env_errors='raise' is not one of"):
        validate(load_config(None, ["algo.env_errors=raise"], {}), check_resources=False)
    with pytest.raises(ConfigError, match="cannot import Nope.*fix: algo.environment=calculator"):
        _check_environment(load_config(None, ["algo.environment=colo.envs.base:Nope"], {}))
    _check_environment(load_config(None, ["algo.environment=calculator", "rollout.max_turns=3"], {}))


@pytest.mark.sandbox
def test_shipped_tool_configs_load() -> None:
    from pathlib import Path

    from colo.config import load_config, validate
    from colo.config.checks import _check_environment

    root = Path(__file__).resolve().parents[2]
    tiny = load_config(str(root / "configs" / "tiny-cpu-tools.yaml"), [], {})
    gpu = load_config(str(root / "configs" / "python-qwen3-30b-a3b.yaml"), [], {})
    assert (tiny.algo.environment, tiny.model.path, tiny.data.path) == ("calculator", "auto:tiny-tools", "auto:calc")
    assert (gpu.algo.environment, gpu.model.path, gpu.data.system_prompt) == ("python", "Qwen/Qwen3-30B-A3B", None)
    for cfg in (tiny, gpu):
        assert cfg.rollout.max_turns > 1
        validate(cfg, check_resources=False)
        _check_environment(cfg)


EXITING_ENV = '''
import sys

from colo.envs.base import Environment


class Exits(Environment):
    def reset(self, row):
        sys.exit(0)  # would end the driver with status 0, had the worker's SystemExit come through

    def step(self, turn):
        raise KeyboardInterrupt
'''


def test_environment_code_that_exits_is_its_error_not_the_end(tok, tmp_path, monkeypatch) -> None:
    """sys.exit() / KeyboardInterrupt from environment code: in the engine's threads (guarded) a SystemExit ended the
    thread without a word and read as a timeout; from the driver's environment process (EnvWorker) it came back to
    the driver and ended the run with status 0. Each is an EnvError naming what the environment did."""
    from colo.envs.offdriver import EnvWorker

    def exits() -> None:
        sys.exit(3)

    def interrupts() -> None:
        raise KeyboardInterrupt

    t0 = time.monotonic()
    gone, stopped = guarded([exits, interrupts], timeout_s=30)
    assert time.monotonic() - t0 < 10  # answered at once, not at the deadline
    assert isinstance(gone, EnvError) and str(gone).startswith("called sys.exit(3)"), gone
    assert isinstance(stopped, EnvError) and str(stopped).startswith("raised KeyboardInterrupt"), stopped
    (tmp_path / "exiting_env.py").write_text(EXITING_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    with EnvWorker("exiting_env:Exits", tok) as w:
        assert w.first_prompts([{"prompt": "p", "answer": "a"}]) == [
            "called sys.exit(0) (environment code cannot end the run; return a Step or raise)"]
        with pytest.raises(EnvError, match="while building the warm-up's demonstrations, called sys.exit\\(0\\)"):
            w.demonstrations([{"prompt": "p", "answer": "a"}])
