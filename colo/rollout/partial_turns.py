"""Conversations carried across weight updates (loop.mode=async with algo.environment): vLLM's engine loop over
every conversation's turns until enough whole groups finished, the rest stopped mid-way and carried.

    outs, env_s, rows = converse_until(llm_engine, requests, need, budget, sampling, env_cls, framing, timeout_s)

A request is one conversation as colo.rollout.buffer carries it: {"group", "sample", "row" (the data row),
"seed", "segment", "prompt_ids" (None before its first segment), "response_ids", "model_mask" (1: the model
sampled the token), "conversation": {"turn_spans", "turn_reasons", "turn_tokens", "turns", "env_reward",
"tool_calls", "tool_errors", "env_error", "final_ids"}}. turn_spans are the model's finished turns as [start, end)
offsets into the response, turn_reasons their finish reasons, turn_tokens the tokens of the turn in progress at the
end of the response (0: the next turn has not begun).

Per conversation, as colo.rollout.multiturn does it (the same framing, budget and guarded environment), but turn by
turn as each finishes rather than all together: a finished model turn goes to the environment at once, and the next
turn's request (prompt = every id so far) joins vLLM's running batch. Once `need` groups have every conversation
ended, the requests still running are aborted: the tokens they streamed stay (vLLM's sampled log-probs with them),
and the next step continues that same turn under the new weights, its prompt the whole history (prefilled again: the
engine drops its prefix cache at every sync). So a carried conversation keeps its exact ids, every model token the
log-prob and the weight version that sampled it (the buffer numbers segments by step), and the environment's tokens
stay what the environment answered, never trained (model_mask 0).

The environment is rebuilt when a carried conversation resumes: a fresh instance, reset(row) and step() of every
finished turn again (its answers thrown away). Nothing of an environment lives across calls, so a resume from a
checkpoint continues exactly as the uninterrupted run, and engines keep no state between steps. The replay must
give the recorded prompt and observations back, token for token: an environment that answers differently ends its
conversation with an error (env_error) instead of training on a history it no longer has. So environments in async
runs must be deterministic functions of the row and the turns (the built-ins are; a step with side effects runs
again).

A turn continued across a stop may carry a stop string split by it (vLLM checks stop strings in the new text only):
stop_cut finds it in the whole turn and ends the turn there.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from colo.envs.base import EnvError, Turn
from colo.envs.framing import ChatFraming
from colo.envs.runner import EnvRunner, guarded
from colo.rollout.multiturn import Budget

_IDS = itertools.count()
TURN_SEED = 1_000_003  # a turn's seed: the sample's seed + TURN_SEED x turn index + 7919 x segment


@dataclass
class _Conv:
    """One conversation during a call: its ids, this segment's new tokens, and the carried bookkeeping."""

    req: dict
    runner: EnvRunner
    ids: list[int] = field(default_factory=list)  # prompt + response so far
    prompt_len: int = 0
    new: list[int] = field(default_factory=list)  # this segment's tokens (model and environment)
    new_lp: list[float] = field(default_factory=list)
    new_mask: list[int] = field(default_factory=list)
    state: dict = field(default_factory=dict)  # the request's "conversation", updated
    finish: str | None = None  # None: open (or carried at the end)
    room: int = 0  # the budget left when its running request started
    got: int = 0  # tokens that request produced
    continued: bool = False  # its turn began in an earlier segment (a stop string may straddle the two)

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len

    def add(self, ids: list[int], logprobs: list[float], model: bool) -> None:
        self.ids += ids
        self.new += ids
        self.new_lp += logprobs if model else [0.0] * len(ids)
        self.new_mask += [int(model)] * len(ids)


def stop_cut(tok: Any, before: list[int], new: list[int], stops: list[str]) -> int | None:
    """A turn continued from tokens `before` produced `new`: the count of new tokens up to and including the one that
    completes a stop string the whole turn's text holds and `before`'s text did not, or None when there is none."""
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


def _replay(c: _Conv, framing: ChatFraming) -> None:
    """Rebuild a carried conversation's environment: reset and every finished turn again; its answers must be the
    recorded ones (EnvError otherwise)."""
    req, st = c.req, c.req["conversation"]
    ids = c.runner.reset(req["row"])
    if ids != list(req["prompt_ids"]):
        raise EnvError("on resume, reset() gave another first prompt than the one recorded; loop.mode=async replays a "
                       "carried conversation's environment, which must answer the same row and turns the same way")
    resp = list(req["response_ids"])
    starts = [s for s, _ in st["turn_spans"][1:]] + [len(resp) - int(st["turn_tokens"])]
    for k, ((s, e), reason, nxt) in enumerate(zip(st["turn_spans"], st["turn_reasons"], starts)):
        ended = bool(resp[s:e]) and resp[e - 1] == framing.eos_id
        step, obs = c.runner.step(_turn(framing, resp[s:e], k, reason), ended)
        if step.done or obs != resp[e:nxt]:
            raise EnvError(f"on resume, the environment's answer to turn {k} differs from the one recorded; "
                           "loop.mode=async replays a carried conversation's environment, which must answer the same "
                           "row and turns the same way")


def _turn(framing: ChatFraming, ids: list[int], index: int, reason: str) -> Turn:
    ended = bool(ids) and ids[-1] == framing.eos_id
    text = framing.tok.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
    return Turn(text, tuple(ids), index, reason)


def converse_until(engine: Any, requests: list[dict], need: int, budget: Budget, temperature: float, top_p: float,
                   env_cls: type, framing: ChatFraming, timeout_s: float,
                   fail: bool = False) -> tuple[list[dict], float, list[tuple[int, list[int], int]]]:
    """Run the conversations until `need` groups (requests sharing "group") ended, carry the rest (module docstring).

    Returns one output per request, {"tokens", "logprobs", "model_mask" (this segment's), "finish_reason" (None:
    carried), "prompt_ids", "conversation" (the request's, updated)}; the seconds spent in environments; and per
    request with new tokens (index, the ids these weights forwarded, the first of them new), the rows of its routing
    capture. need <= 0 runs nothing."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    convs = [_Conv(r, EnvRunner(env_cls, framing), state=dict(r["conversation"])) for r in requests]
    stops = list(getattr(env_cls, "stop", ()) or ())
    env_s = 0.0

    def failed(c: _Conv, err: EnvError, when: str) -> None:
        msg = f"group {c.req['group']} sample {c.req['sample']}, {when}: {err}"
        if fail:
            raise EnvError(f"environment {getattr(env_cls, '__name__', env_cls)}: {msg}") from err
        c.state["env_error"], c.finish = msg, "error"

    def timed(calls: list, scale: list[int] | None = None) -> list:
        nonlocal env_s
        t0 = time.perf_counter()
        out = guarded(calls, timeout_s * max(scale or [1]))
        env_s += time.perf_counter() - t0
        return out

    if need <= 0:
        convs = []
    fresh = [c for c in convs if c.req["prompt_ids"] is None]
    carried = [c for c in convs if c.req["prompt_ids"] is not None]
    for c, got in zip(fresh, timed([lambda c=c: c.runner.reset(c.req["row"]) for c in fresh])):
        if isinstance(got, EnvError):
            c.ids = list(c.req["row"]["prompt_ids"])
            failed(c, got, "reset")
        else:
            c.ids = list(got)
        c.prompt_len = len(c.ids)
    for c in carried:
        c.ids, c.prompt_len = list(c.req["prompt_ids"]) + list(c.req["response_ids"]), len(c.req["prompt_ids"])
        c.continued = int(c.state["turn_tokens"]) > 0
    replays = timed([lambda c=c: _replay(c, framing) for c in carried],
                    [1 + len(c.state["turn_spans"]) for c in carried])  # a deadline per call replayed
    for c, got in zip(carried, replays):
        if isinstance(got, EnvError):
            failed(c, got, "replay")
    left = Counter(r["group"] for r in requests)
    finished = 0
    by_id: dict[str, _Conv] = {}

    def end(c: _Conv, reason: str) -> None:
        nonlocal finished
        c.finish = reason
        left[c.req["group"]] -= 1
        finished += left[c.req["group"]] == 0

    def start(c: _Conv) -> None:
        """The conversation's next request (its turn in progress, or a new one), or its end by the budget."""
        st = c.state
        room = min(budget.max_tokens - c.response_len, budget.max_model_len - len(c.ids))
        cap = max(1, (budget.max_turn_tokens or budget.max_tokens) - int(st["turn_tokens"]))  # >= 1: a lowered cap
        if room <= 0 or len(st["turn_spans"]) >= budget.max_turns:
            end(c, "length" if room <= 0 else "stop")
            return
        c.room, c.got = room, 0
        p = SamplingParams(n=1, max_tokens=min(room, cap), temperature=temperature,
                           top_p=top_p if temperature > 0 else 1.0, logprobs=0, stop=stops or None,
                           include_stop_str_in_output=True,
                           seed=int(c.req["seed"]) + TURN_SEED * len(st["turn_spans"]) + 7919 * int(c.req["segment"]))
        p.output_kind = RequestOutputKind.DELTA
        rid = f"colo-turns-{next(_IDS)}"
        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(c.ids)), p)
        by_id[rid] = c

    for c in convs:
        if c.finish is not None:  # reset or replay failed
            end(c, c.finish)
        else:
            start(c)
    while finished < need and engine.has_unfinished_requests():
        done: list[tuple[_Conv, str]] = []
        for o in engine.step():
            c = by_id.get(o.request_id)
            if c is None:  # a request ended here by a straddled stop string
                continue
            (co,) = o.outputs
            toks = list(co.token_ids)
            lps = [float(lp[t].logprob) for t, lp in zip(toks, co.logprobs or [])]
            reason = co.finish_reason if o.finished else None
            if c.continued and stops and toks:
                turn = c.ids[len(c.ids) - int(c.state["turn_tokens"]):]
                k = stop_cut(framing.tok, turn, toks, stops)
                if k is not None:
                    toks, lps, reason = toks[:k], lps[:k], "stop"
                    if not o.finished:
                        engine.abort_request([o.request_id])
            c.add(toks, lps, model=True)
            c.got += len(toks)
            c.state["turn_tokens"] = int(c.state["turn_tokens"]) + len(toks)
            if reason is not None:
                del by_id[o.request_id]
                done.append((c, reason))
        if done:
            _finish_turns(done, budget, framing, timed, failed, end)
            for c, _ in done:
                if c.finish is None and finished < need:
                    start(c)
    running = list(by_id)
    if running:
        engine.abort_request(running)
    while engine.has_unfinished_requests():  # aborts reach the core; DP peers may still be running
        engine.step()
    outs = [{"tokens": c.new, "logprobs": c.new_lp, "model_mask": c.new_mask, "finish_reason": c.finish,
             "prompt_ids": c.ids[:c.prompt_len] if c.ids else None, "conversation": c.state} for c in convs]
    for r in requests[len(convs):]:  # need <= 0: nothing ran
        outs.append({"tokens": [], "logprobs": [], "model_mask": [], "finish_reason": None,
                     "prompt_ids": r["prompt_ids"], "conversation": dict(r["conversation"])})
    rows = [(i, c.ids[:-1], 0 if c.req["prompt_ids"] is None else len(c.ids) - len(c.new) - 1)
            for i, c in enumerate(convs) if c.new]
    return outs, env_s, rows


def _finish_turns(done: list[tuple[_Conv, str]], budget: Budget, framing: ChatFraming, timed, failed, end) -> None:
    """Model turns that just finished: every environment steps at once; each conversation ends (done, the budget,
    max_turns, an error) or gets its observation, the next turn's request made by the caller."""
    turns = []
    for c, reason in done:
        st = c.state
        n = int(st["turn_tokens"])
        e = c.response_len
        ids = c.ids[len(c.ids) - n:]
        st["turn_spans"] = [*st["turn_spans"], [e - n, e]]
        st["turn_reasons"] = [*st["turn_reasons"], reason]
        st["turn_tokens"], st["turns"], st["final_ids"] = 0, len(st["turn_spans"]), ids
        c.continued = False
        turns.append((_turn(framing, ids, len(st["turn_spans"]) - 1, reason), bool(ids) and ids[-1] == framing.eos_id))
    steps = timed([lambda c=c, tn=tn, e=e: c.runner.step(tn, e) for (c, _), (tn, e) in zip(done, turns)])
    for (c, reason), (tn, _), res in zip(done, turns, steps):
        st = c.state
        if isinstance(res, EnvError):
            failed(c, res, f"step of turn {tn.index}")
            end(c, "error")
            continue
        step, obs = res
        st["env_reward"] = float(st["env_reward"]) + step.reward
        st["tool_calls"] = int(st["tool_calls"]) + step.tool_calls
        st["tool_errors"] = int(st["tool_errors"]) + step.tool_errors
        if reason == "length" and c.got >= c.room:  # the budget, not the turn cap
            end(c, "length")
        elif step.done or len(st["turn_spans"]) >= budget.max_turns:
            end(c, "stop")
        elif c.response_len + len(obs) >= budget.max_tokens or len(c.ids) + len(obs) >= budget.max_model_len:
            end(c, "length")  # no room for the observation and a reply
        else:
            c.add(list(obs), [], model=False)
