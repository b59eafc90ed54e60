"""Multi-turn rollouts inside an engine: the model talks, the environment answers, until one of them stops.

    samples, stats = converse(llm, rows, n, Budget(...), sampling, env_cls, framing, timeout_s, fail=False)

Per turn, every live conversation is one vLLM request whose prompt is the conversation's ids so far, all
of them in one `LLM.generate` call (vLLM batches them; n conversations per row, each its own stream):

    turn t:  generate(prompt = ids so far)  ->  sampled ids, log-probs   (kept exactly, colo.envs.framing)
             env.step(text of the turn)      ->  observation, reward, done (all conversations at once, each
                                                 under algo.env_timeout_s, colo.envs.runner)
             ids += sampled ids + observation framed and tokenized once

A conversation ends when the environment says done, after rollout.max_turns model turns, or when the budget
runs out: rollout.max_tokens response tokens (model and environment together) or max_model_len in all; a
turn cut by the budget, or an observation that would not fit, ends it with finish_reason "length" (a turn
cut by rollout.max_turn_tokens only goes to the environment like any other). An
environment that raises, hangs or answers something malformed ends its conversation with finish_reason
"error" and the error in the sample (`fail`: raises EnvError instead, ending the run).

A sample is the single-turn sample (colo.algo.batch) plus: "model_mask" (R,) 1 where the model sampled the
token; "logprobs" 0.0 on the environment's tokens; "env_reward" (sum of the steps' rewards), "turns",
"tool_calls", "tool_errors", "env_error" (None or the message), "final_ids" (the model's last turn, which
algo.rewards score), and with routing the vLLM capture of the last turn ("routed_raw", "routed_len").
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from colo.envs.base import EnvError, Turn
from colo.envs.framing import ChatFraming, Conversation
from colo.envs.runner import EnvRunner, guarded


@dataclass(frozen=True)
class Budget:
    max_tokens: int  # response tokens per conversation, the model's and the environment's
    max_turns: int
    max_model_len: int
    max_turn_tokens: int = 0  # one model turn at most (0: no cap but the budget)


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    seed: int | None
    routing: bool = False  # keep vLLM's routed experts of each conversation's last turn


@dataclass
class _Live:
    k: int  # conversation index: row k // n, sample k % n
    runner: EnvRunner
    conv: Conversation | None = None
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    finish: str = "stop"
    error: str | None = None
    final_ids: tuple[int, ...] = ()
    routed: Any = None
    routed_len: int = 0
    open: bool = True


def converse(llm: Any, rows: list[dict], n: int, budget: Budget, sampling: Sampling, env_cls: type,
             framing: ChatFraming, timeout_s: float, fail: bool = False) -> tuple[list[dict], dict]:
    """n conversations per row (rows: {"prompt", "answer", "prompt_ids", ...}); samples in row then sample
    order, and {"env_s": seconds spent waiting for environments}."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    live = [_Live(k, EnvRunner(env_cls, framing)) for k in range(len(rows) * n)]
    env_s = 0.0

    def failed(c: _Live, err: EnvError, when: str) -> None:
        msg = f"row {c.k // n} sample {c.k % n}, {when}: {err}"
        if fail:
            raise EnvError(f"environment {getattr(env_cls, '__name__', env_cls)}: {msg}") from err
        c.error, c.finish, c.open = msg, "error", False

    t0 = time.perf_counter()
    starts = guarded([lambda c=c: c.runner.reset(rows[c.k // n]) for c in live], timeout_s)
    env_s += time.perf_counter() - t0
    for c, ids in zip(live, starts):
        if isinstance(ids, EnvError):
            failed(c, ids, "reset")
        else:
            c.conv = Conversation(ids)
    stop = list(getattr(env_cls, "stop", ()) or ()) or None
    for t in range(budget.max_turns):
        todo = []
        for c in live:
            if not c.open:
                continue
            room = min(budget.max_tokens - len(c.conv.response_ids), budget.max_model_len - len(c.conv.ids))
            if room <= 0:
                c.finish, c.open = "length", False
            else:
                todo.append((c, room))
        if not todo:
            break
        prompts = [TokensPrompt(prompt_token_ids=c.conv.ids) for c, _ in todo]
        cap = budget.max_turn_tokens or budget.max_tokens
        params = [SamplingParams(n=1, max_tokens=min(room, cap), temperature=sampling.temperature,
                                 top_p=sampling.top_p if sampling.temperature > 0 else 1.0, logprobs=0,
                                 seed=None if sampling.seed is None else sampling.seed + c.k + t * 1_000_003,
                                 stop=stop, include_stop_str_in_output=True)
                  for c, room in todo]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        turns = []
        for (c, _), out in zip(todo, outputs):
            o = out.outputs[0]
            ids = list(o.token_ids)
            c.conv.add_model(ids, [float(o.logprobs[i][tok].logprob) for i, tok in enumerate(ids)])
            c.final_ids = tuple(ids)
            if sampling.routing:
                c.routed, c.routed_len = getattr(o, "routed_experts", None), len(c.conv.ids) - 1
            ended = bool(ids) and ids[-1] == framing.eos_id
            text = framing.tok.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
            turns.append((Turn(text, tuple(ids), t, o.finish_reason), ended))
        t0 = time.perf_counter()
        steps = guarded([lambda c=c, tn=tn, e=e: c.runner.step(tn, e) for (c, _), (tn, e) in zip(todo, turns)],
                        timeout_s)
        env_s += time.perf_counter() - t0
        for (c, room), (tn, _), res in zip(todo, turns, steps):
            if isinstance(res, EnvError):
                failed(c, res, f"step of turn {t}")
                continue
            step, obs = res
            c.reward += step.reward
            c.tool_calls += step.tool_calls
            c.tool_errors += step.tool_errors
            if tn.finish_reason == "length" and len(tn.token_ids) >= room:  # the budget, not the turn cap
                c.finish, c.open = "length", False
            elif step.done or t + 1 == budget.max_turns:
                c.open = False
            elif len(c.conv.response_ids) + len(obs) >= budget.max_tokens or \
                    len(c.conv.ids) + len(obs) >= budget.max_model_len:
                c.finish, c.open = "length", False  # no room for the observation and a reply
            else:
                c.conv.add_env(obs)
    return [_sample(c, rows[c.k // n], c.k // n) for c in live], {"env_s": env_s}


def _sample(c: _Live, row: dict, i: int) -> dict:
    conv = c.conv or Conversation(list(row["prompt_ids"]))  # reset failed: the row's own prompt, no response
    out = {"prompt_index": i, "prompt_ids": conv.prompt_ids, "response_ids": conv.response_ids,
           "logprobs": conv.logprobs, "model_mask": conv.model_mask, "finish_reason": c.finish,
           "env_reward": c.reward, "turns": conv.turns, "tool_calls": c.tool_calls, "tool_errors": c.tool_errors,
           "env_error": c.error, "final_ids": list(c.final_ids)}
    if c.routed is not None:
        out["routed_raw"], out["routed_len"] = c.routed, c.routed_len
    return out
