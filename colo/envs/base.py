"""The environment interface: what a multi-turn rollout asks of the world the model acts in.

    class MyEnv(Environment):
        def reset(self, row):                 # the data row: {"prompt", "answer", ...}
            return [{"role": "user", "content": row["prompt"]}]   # messages (or token ids)
        def step(self, turn):                 # turn.text: what the model just said
            return "observation text", 0.0, False                 # or Step(observation, reward, done, ...)

`algo.environment` names the class: a built-in ("calculator", "python") or "module:Class"; colo makes one
instance per conversation (so an instance may keep state between turns), calls reset once and step after
every model turn, until step says done, rollout.max_turns is reached or rollout.max_tokens (the response's
whole budget, the model's and the environment's tokens) runs out. An observation is a string (framed as one
message of the environment's `role`), a list of chat messages, or token ids appended verbatim; None appends
nothing. Rewards of every step are summed into the sample's reward, on top of algo.rewards scored on the
model's last turn. docs/environments.md has a complete example.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import NamedTuple, Union

Message = dict  # {"role": str, "content": str}
Observation = Union[str, list, None]  # text | list[Message] | list[int] (token ids) | nothing
Prompt = list  # list[Message] | list[int]


@dataclass(frozen=True)
class Turn:
    """One model turn as the environment sees it: the exact ids vLLM sampled, and their text (special tokens
    kept, the end-of-turn token dropped)."""

    text: str
    token_ids: tuple[int, ...]
    index: int  # 0 for the model's first turn
    finish_reason: str  # "stop" (end of turn or a stop string) | "length" (out of tokens)


class Step(NamedTuple):
    """What step() returns; a plain (observation, reward, done) tuple means the same with no tool counts."""

    observation: Observation = None
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0  # tool calls this turn made (rollout/tool_calls metric)
    tool_errors: int = 0  # of those, calls whose tool failed (bad input, an exception, a timeout)


class Environment:
    """Base class (optional: any class with reset and step will do). `stop`: strings that end a model turn
    besides its end-of-turn token (e.g. a tool call's closing tag); `role`: the chat role a string observation
    is framed with."""

    stop: tuple[str, ...] = ()
    role: str = "tool"

    def reset(self, row: dict) -> Prompt:
        """The first prompt: chat messages (rendered with the chat template and its generation prompt) or token
        ids (used as they are). Default: the row's messages (a chat-format data row), else its prompt as one user
        message."""
        if row.get("messages"):
            return [dict(m) for m in row["messages"]]
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, turn: Turn) -> Step | tuple:
        """The environment's answer to the model's turn: (observation, reward, done)."""
        raise NotImplementedError

    def solution(self, row: dict) -> list[str] | None:
        """Optional: a demonstration, the model turns that solve `row` (text, end-of-turn token not
        included), for the supervised warm-up (loop.sft_warmup_steps); None: the environment has none."""
        return None


class EnvError(RuntimeError):
    """An environment raised, hung past algo.env_timeout_s or answered something malformed."""


BUILTINS = {"calculator": "colo.envs.calculator:CalculatorEnv", "python": "colo.envs.sandbox:PythonEnv"}


def load_environment(spec: str) -> type:
    """The environment class `spec` names: a built-in (BUILTINS) or "module:Class". Raises ValueError naming
    the problem (colo.config.checks turns it into one `colo: error:` line)."""
    path = BUILTINS.get(spec, spec)
    if ":" not in path:
        raise ValueError(f"algo.environment={spec!r} is neither a built-in ({', '.join(BUILTINS)}) nor module:Class")
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"algo.environment={spec!r}: cannot import {name} from {module} "
                         f"({type(e).__name__}: {e})") from e
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"algo.environment={spec!r} is not a class with reset(row) and step(turn) "
                         f"(missing: {', '.join(missing) or 'a class'})")
    return cls


def as_step(out: object) -> Step:
    """step()'s answer as a Step; raises EnvError for anything else (the runner ends the sample)."""
    if isinstance(out, Step):
        step = out
    elif isinstance(out, tuple) and len(out) == 3:
        step = Step(*out)
    else:
        raise EnvError(f"step() returned {type(out).__name__} {str(out)[:80]!r}; expected (observation, reward, done) "
                       "or colo.envs.base.Step")
    obs, reward, done = step.observation, step.reward, step.done
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or reward != reward:
        raise EnvError(f"step() returned reward {reward!r}; expected a number")
    if not isinstance(done, bool):
        raise EnvError(f"step() returned done={done!r}; expected True or False")
    check_observation(obs, "step()")
    return Step(obs, float(reward), done, int(step.tool_calls), int(step.tool_errors))


def check_observation(obs: object, who: str) -> None:
    """An observation (or reset's prompt) is None, a str, a list of ints, or a list of {"role", "content"}."""
    if obs is None or isinstance(obs, str):
        return
    if isinstance(obs, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in obs):
        return
    if isinstance(obs, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                     and isinstance(m.get("content"), str) for m in obs):
        return
    raise EnvError(f"{who} returned {type(obs).__name__} {str(obs)[:80]!r}; expected text, token ids or "
                   "chat messages [{'role': ..., 'content': ...}]")
