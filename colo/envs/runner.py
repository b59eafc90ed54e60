"""Environments under guard: every call has a deadline and its answer is checked.

    runners = [EnvRunner(cls, framing) for _ in rows]
    prompts = guarded([lambda r=r, row=row: r.reset(row) for r, row in zip(runners, rows)], timeout_s)
    steps = guarded([lambda r=r, t=t: r.step(t, after_eos=True) for r, t in ...], timeout_s)
    # each: the value, or an EnvError (raised, hung past timeout_s, malformed): that sample ends, not the run

The calls of one turn run at once, each in a daemon thread of its own: a slow tool in one conversation costs
the others nothing, and a call that hangs is abandoned at its deadline (a Python thread cannot be killed; a
tool that may hang for good runs its work in a subprocess, as colo.envs.sandbox does).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from colo.envs.base import EnvError, Step, Turn, as_step, check_observation
from colo.envs.framing import ChatFraming


class EnvRunner:
    """One conversation's environment: an instance of `cls`, made at reset."""

    def __init__(self, cls: type, framing: ChatFraming) -> None:
        self.cls, self.framing = cls, framing
        self.env: Any = None
        self.role = str(getattr(cls, "role", "tool"))

    def reset(self, row: dict) -> list[int]:
        """The first prompt's ids."""
        self.env = self.cls()
        prompt = self.env.reset(row)
        check_observation(prompt, "reset()")
        if not prompt:
            raise EnvError(f"reset() returned an empty prompt ({prompt!r})")
        return self.framing.prompt(prompt)

    def step(self, turn: Turn, after_eos: bool) -> tuple[Step, list[int]]:
        """The environment's answer, and the ids of its observation (empty once done)."""
        step = as_step(self.env.step(turn))
        ids = [] if step.done else self.framing.observation(step.observation, self.role, after_eos)
        return step, ids


def ended_as(e: BaseException) -> str:
    """An environment's SystemExit / KeyboardInterrupt in words: it must not end the run (a thread swallows a
    SystemExit without a word, a process pool hands it to the driver, which would exit with its status)."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r}) (environment code cannot end the run; return a Step or raise)"
    return "raised KeyboardInterrupt (environment code cannot end the run; return a Step or raise)"


def guarded(calls: list[Callable[[], Any]], timeout_s: float) -> list[Any]:
    """Run every call at once; each result is its value or an EnvError: the call raised (the error names the
    exception), or had not returned timeout_s after the calls started."""
    results: list[Any] = [None] * len(calls)
    done = [False] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except EnvError as e:
            results[i] = e
        except Exception as e:  # noqa: BLE001 (a user environment may raise anything: that sample ends)
            results[i] = EnvError(f"{type(e).__name__}: {e}")
        except (SystemExit, KeyboardInterrupt) as e:  # in a thread no signal raises them: the environment did
            results[i] = EnvError(ended_as(e))
        done[i] = True

    threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"colo-env-{i}") for i in range(len(calls))]
    start = time.monotonic()
    for t in threads:
        t.start()
    out: list[Any] = []
    for i, t in enumerate(threads):
        t.join(max(0.0, start + timeout_s - time.monotonic()))
        # a copy: a call that answers after its deadline writes into `results`, never into what we return
        out.append(results[i] if done[i] else EnvError(f"no answer within algo.env_timeout_s={timeout_s:g} s"))
    return out
