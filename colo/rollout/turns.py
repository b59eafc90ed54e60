"""Conversations in the engine loop (algo.environment, docs/environments.md): each sample's environment, reset or
rebuilt when a generate call begins, handed every model turn as it finishes.

    conv = Conversations(env_cls, framing, rows, timeout_s, fail=False)
    conv.begin(samples)                       # fresh: reset(row) -> prompt ids; carried: rebuilt (replay)
    k = conv.cut(sample, new_ids, continued)  # a stop string split by a stop (see stop_cut)
    again = conv.end_turns(finished, budget)  # env.step(turn) for each; the samples whose next turn starts now

Per turn (colo.rollout.engine_loop runs them):

    model:        sampled ids, log-probs            (kept exactly, model_mask 1)
    environment:  step(text of the turn)  ->  observation, reward, done   (each call under algo.env_timeout_s,
                                                                           colo.envs.runner)
    sample:       ids += observation framed and tokenized once              (model_mask 0, log-prob 0.0)

A conversation ends when the environment says done, after rollout.max_turns model turns, or when the budget runs out:
rollout.max_tokens response tokens (model and environment together) or max_model_len in all; a turn cut by the
budget, or an observation that would not fit, ends it TRUNCATED (a turn cut by rollout.max_turn_tokens only goes to
the environment like any other). An environment that raises, hangs or answers something malformed ends its sample
FAILED with the error in Turns.env_error (`fail`: raises EnvError instead, ending the run).

A conversation carried across weight updates (loop.mode=async) keeps its exact ids, and its environment is rebuilt
when it resumes: a fresh instance, reset(row) and step() of every finished turn again (answers thrown away). Nothing of
an environment lives across calls, so a resume from a checkpoint continues exactly as the uninterrupted run, and
engines keep no state between steps. The replay must give the recorded prompt and observations back token for
token: an environment that answers differently ends its sample FAILED instead of training on a history it no longer
has. So environments in async runs must be deterministic functions of the row and the turns (the built-ins are).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from colo.envs.base import EnvError, Turn
from colo.envs.framing import ChatFraming
from colo.envs.runner import EnvRunner, guarded
from colo.rollout.sample import Sample, Status, Turns


@dataclass(frozen=True)
class Budget:
    max_tokens: int  # response tokens per sample, the model's and the environment's
    max_turns: int  # model turns per conversation
    max_model_len: int
    max_turn_tokens: int = 0  # one model turn at most (0: no cap but the budget)


def stop_cut(tok: Any, before: list[int], new: list[int], stops: list[str]) -> int | None:
    """A turn continued from tokens `before` produced `new`: the count of new tokens up to and including the one that
    completes a stop string the whole turn's text holds and `before`'s text did not, or None when there is none.
    vLLM checks stop strings in a request's own output only, so a turn resumed after '...</tool' would run past
    '_call>'."""
    if not stops or not new:
        return None
    old = tok.decode(before, skip_special_tokens=False)
    whole = tok.decode(before + new, skip_special_tokens=False)
    if not any(s in whole and s not in old for s in stops):
        return None
    for k in range(1, len(new) + 1):
        text = tok.decode(before + new[:k], skip_special_tokens=False)
        if any(s in text and s not in old for s in stops):
            return k
    return None


def model_turn(framing: ChatFraming, ids: list[int], index: int, reason: str) -> Turn:
    """What the environment gets of a model turn: its text (without the EOS that ended it) and its ids."""
    ended = bool(ids) and ids[-1] == framing.eos_id
    text = framing.tok.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
    return Turn(text, tuple(ids), index, reason)


def replay(s: Sample, runner: EnvRunner, row: dict, framing: ChatFraming) -> None:
    """Rebuild a carried conversation's environment: reset and every finished turn again; its answers must be the
    recorded ones (EnvError otherwise)."""
    if runner.reset(row) != s.prompt_ids:
        raise EnvError("on resume, reset() gave another first prompt than the one recorded; loop.mode=async replays a "
                       "carried conversation's environment, which must answer the same row and turns the same way")
    t, resp = s.turns, s.response_ids
    starts = [a for a, _ in t.spans[1:]] + [len(resp) - t.in_progress]  # where each observation ends
    for k, ((a, e), reason, nxt) in enumerate(zip(t.spans, t.reasons, starts)):
        ended = bool(resp[a:e]) and resp[e - 1] == framing.eos_id
        step, obs = runner.step(model_turn(framing, resp[a:e], k, reason), ended)
        if step.done or obs != resp[e:nxt]:
            raise EnvError(f"on resume, the environment's answer to turn {k} differs from the one recorded; "
                           "loop.mode=async replays a carried conversation's environment, which must answer the same "
                           "row and turns the same way")


class Conversations:
    """The environments of one generate call's conversations. `rows`: group -> the data row its reset() gets."""

    def __init__(self, env_cls: type, framing: ChatFraming, rows: dict[int, dict], timeout_s: float,
                 fail: bool = False) -> None:
        self.env_cls, self.framing, self.rows, self.timeout_s, self.fail = env_cls, framing, rows, timeout_s, fail
        self.stops: list[str] = list(getattr(env_cls, "stop", ()) or ())
        self.runners: dict[tuple[int, int], EnvRunner] = {}
        self.env_s = 0.0  # seconds spent waiting for environments

    def _timed(self, calls: list[Callable[[], Any]], scale: int = 1) -> list:
        t0 = time.perf_counter()
        out = guarded(calls, self.timeout_s * scale)
        self.env_s += time.perf_counter() - t0
        return out

    def _runner(self, s: Sample) -> EnvRunner:
        return self.runners.setdefault((s.group, s.index), EnvRunner(self.env_cls, self.framing))

    def failed(self, s: Sample, err: EnvError, when: str) -> None:
        msg = f"row {s.group} sample {s.index}, {when}: {err}"  # the step's prompt (async: its group) and sample
        if self.fail:
            raise EnvError(f"environment {getattr(self.env_cls, '__name__', self.env_cls)}: {msg}") from err
        s.turns.env_error, s.status = msg, Status.FAILED

    def begin(self, samples: list[Sample]) -> None:
        """Fresh conversations get their prompt from reset(row); carried ones their environment rebuilt."""
        for s in samples:
            if s.turns is None:
                s.turns, s.model_mask = Turns(), []
        fresh = [s for s in samples if not s.started]
        carried = [s for s in samples if s.started]
        for s, got in zip(fresh, self._timed([lambda s=s: self._runner(s).reset(self.rows[s.group]) for s in fresh])):
            if isinstance(got, EnvError):
                s.prompt_ids = list(self.rows[s.group]["prompt_ids"])  # its row's own prompt, no response
                self.failed(s, got, "reset")
            else:
                s.prompt_ids = list(got)
        scale = max([1 + len(s.turns.spans) for s in carried], default=1)  # a deadline per call replayed
        replays = self._timed([lambda s=s: replay(s, self._runner(s), self.rows[s.group], self.framing)
                               for s in carried], scale)
        for s, got in zip(carried, replays):
            if isinstance(got, EnvError):
                self.failed(s, got, "replay")

    def cut(self, s: Sample, new: list[int], continued: bool) -> int | None:
        """For a turn resumed in this call (`continued`): stop_cut of its new tokens."""
        if not continued or not self.stops:
            return None
        return stop_cut(self.framing.tok, s.response_ids[len(s.response_ids) - s.turns.in_progress:], new, self.stops)

    def end_turns(self, finished: list[tuple[Sample, str, bool]], budget: Budget, version: int) -> list[Sample]:
        """Model turns that just finished, (sample, vLLM's finish reason, the budget cut it): every environment steps
        at once; each sample ends (done, the budget, max_turns, an error) or gets its observation. Returns those whose
        next turn starts now."""
        turns = []
        for s, reason, _ in finished:
            t = s.turns
            e = len(s.response_ids)
            ids = s.response_ids[e - t.in_progress:]
            t.spans.append([e - t.in_progress, e])
            t.reasons.append(reason)
            t.in_progress, t.final_ids = 0, ids
            turns.append((model_turn(self.framing, ids, len(t.spans) - 1, reason),
                          bool(ids) and ids[-1] == self.framing.eos_id))
        steps = self._timed([lambda s=s, tn=tn, e=e: self._runner(s).step(tn, e)
                             for (s, _, _), (tn, e) in zip(finished, turns)])
        again = []
        for (s, reason, cut), (tn, _), res in zip(finished, turns, steps):
            if isinstance(res, EnvError):
                self.failed(s, res, f"step of turn {tn.index}")
                continue
            step, obs = res
            t = s.turns
            t.env_reward += step.reward
            t.tool_calls += step.tool_calls
            t.tool_errors += step.tool_errors
            if cut:
                s.status = Status.TRUNCATED
            elif step.done or len(t.spans) >= budget.max_turns:
                s.status = Status.COMPLETED
            elif len(s.response_ids) + len(obs) >= budget.max_tokens or \
                    len(s.prompt_ids) + len(s.response_ids) + len(obs) >= budget.max_model_len:
                s.status = Status.TRUNCATED  # no room for the observation and a reply
            else:
                s.extend(list(obs), None, version, model=False)
                again.append(s)
        return again
