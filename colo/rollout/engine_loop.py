"""The one generation loop: vLLM's engine stepped by hand over samples that start or resume, each finished model turn
handed to an environment when there is one, until `stop_after` whole groups ended or all of them did.

    run(llm.llm_engine, samples, budget, sampling, params)                       # sync: every sample to its end
    run(llm.llm_engine, samples, budget, sampling, params, stop_after=4)         # async: stop once 4 groups ended
    run(..., conversations=Conversations(env_cls, framing, rows, timeout_s))     # algo.environment

Per sample (colo.rollout.sample.Sample), one vLLM request at a time:

    start   prompt = every id so far (prompt + response), n=1, the rest of its budget (rollout.max_tokens, the
            model length, a conversation's max_turn_tokens), seed `request_seed(sample)`
    step    vLLM hands over each request's tokens and sampled log-probs: when it finishes, or, where a request may be
            stopped (`stop_after`) or may cut a stop string (a resumed turn), streamed (RequestOutputKind.DELTA)
    ends    single-turn: the sample ends (COMPLETED on EOS, TRUNCATED at the budget)
            conversation: the environment steps (colo.rollout.turns); the sample ends, or its observation is appended
            and its next request joins vLLM's running batch at once (no turn waits for another sample's)

Once `stop_after` groups have every sample ended, the requests still running are aborted (LLMEngine.abort_request):
what they streamed stays, with its log-probs and version, and the sample stays PENDING, to resume in a later call
whose prompt is the whole history, prefilled again under the weights of then (the engine drops its prefix cache at
every sync, colo.rollout.engine.Engine._drop_prefix_cache; tests/integration/test_engines_across_syncs.py fails if a
resumed sample reads old KV). vLLM's objects never leave the engine actor.

Seeds: a sample's request draws from `seed + TURN_SEED x turns finished + SEGMENT_SEED x segment`, so a sync step's
sample j of prompt i draws seed + i*n + j exactly as one `LLM.generate` request with n samples and that seed would
(vLLM gives its j-th child seed + j): the sync step's random streams are those of vLLM's own batch API.

Routing rows (GPU: vLLM's capture, LLM(enable_return_routed_experts=True)): each request asks for the rows of the
tokens it forwards that the sample does not hold (SamplingParams.routed_experts_prompt_start). vLLM 0.32 hands them
out only with a request's final output (its OutputProcessor's RequestState gathers each step's rows in
`routed_experts_chunks`), and abort_request drops that state without a final output in the synchronous LLMEngine, so
the rows of a stopped request are read from that state just before the abort (stopped_rows): by then every step's
output, tokens and rows alike, went through the output processor, so the rows cover exactly the tokens kept.
GPU with rollout.routing_capture=colo (colo.rollout.capture_cuda): requests are named with its REQUEST_PREFIX, its
workers keep each ended request's rows, and `take` fetches those of every request that ended, once at the end of the
call (and, in a conversation, before a sample's next turn starts from its rows). CPU engines capture by one more
prefill after the loop (colo.rollout.engine).
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from colo.rollout.capture_cuda import REQUEST_PREFIX
from colo.rollout.sample import STATUS, Sample, Status
from colo.rollout.turns import Budget, Conversations

TURN_SEED = 1_000_003  # a conversation's turn t draws from its sample's seed + TURN_SEED x t
SEGMENT_SEED = 7919  # a sample resumed for the k-th time (loop.mode=async) adds SEGMENT_SEED x k
_IDS = itertools.count()


def request_seed(s: Sample) -> int:
    """The vLLM seed of the sample's next request."""
    return s.seed + TURN_SEED * (len(s.turns.spans) if s.turns is not None else 0) + SEGMENT_SEED * s.segments


@dataclass(frozen=True)
class Sampling:
    """One call's sampling settings; temperature 0 is greedy."""

    temperature: float
    top_p: float
    version: int  # the engine's weights (RL updates they came from): stamped on every token this call appends


@dataclass(frozen=True)
class Ask:
    """What one request asks of vLLM (colo.bench.engines.LengthEngine imposes response lengths on top)."""

    max_tokens: int
    seed: int
    temperature: float
    top_p: float
    stops: tuple[str, ...] = ()  # the environment's stop strings


def sampling_params(ask: Ask) -> Any:
    """vllm.SamplingParams of one request. Log-probs of the sampled token only (logprobs=0). No text unless stop
    strings need it (SamplingParams.detokenize): colo reads token ids (the driver decodes what rewards need), and
    vLLM's detokenizer runs per token per request in the engine's process. Measured with colo.bench.decode
    --variants colo,detok (docs/benchmarks.md)."""
    from vllm import SamplingParams

    return SamplingParams(n=1, max_tokens=ask.max_tokens, temperature=ask.temperature,
                          top_p=ask.top_p if ask.temperature > 0 else 1.0, logprobs=0, seed=ask.seed,
                          detokenize=bool(ask.stops), stop=list(ask.stops) or None,
                          include_stop_str_in_output=bool(ask.stops))


ParamsFn = Callable[[Sample, Ask], Any]  # (sample, its request's settings) -> vllm.SamplingParams
RowsFn = Callable[[Any, int], "np.ndarray | None"]  # (vLLM's routed_experts of a request, rows expected) -> rows
TakeFn = Callable[[list[tuple[str, int, int]]], list["np.ndarray | None"]]  # colo's capture: (internal id, first row,
# rows expected) of ended requests -> their rows (colo.rollout.capture_cuda)


@dataclass
class _Request:
    sample: Sample
    room: int  # the budget left when it started
    prompt_len: int  # ids it prefilled
    first_row: int  # the first routing row it reports
    continued: bool  # it resumes a conversation's turn begun in an earlier call
    internal: str  # vLLM's request id (its output processor's key)
    got: int = 0  # tokens it produced


def stopped_rows(engine: Any, internal_id: str) -> np.ndarray | None:
    """The routing rows vLLM 0.32 recorded so far for a running request (None: none yet): its OutputProcessor
    RequestState's `routed_experts_chunks`, what it would concatenate into the final output (module docstring)."""
    state = engine.output_processor.request_states.get(internal_id)
    chunks = getattr(state, "routed_experts_chunks", None) if state is not None else None
    return np.concatenate(chunks, axis=0) if chunks else None


def run(engine: Any, samples: list[Sample], budget: Budget, sampling: Sampling, params: ParamsFn | None = None,
        conversations: Conversations | None = None, stop_after: int | None = None, rows: RowsFn | None = None,
        take: TakeFn | None = None) -> None:
    """Generate the samples in place (module docstring); those ended already are left alone. `engine`: a vllm
    LLMEngine with no request of its own in flight; `params`: a request's SamplingParams (default
    `sampling_params`); `stop_after`: stop the rest once this many whole groups ended (<= 0: nothing runs; None:
    every sample runs to its end); `rows`: vLLM's routing capture, turned into rows; `take`: colo's (one of the
    two at most). Every sample handed in counts one more segment, run or not."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = params or (lambda s, ask: sampling_params(ask))
    todo = [s for s in samples if not s.done]
    left = Counter(s.group for s in todo)  # unended samples per group
    need = len(left) if stop_after is None else stop_after
    stops = tuple(conversations.stops) if conversations is not None else ()
    live: dict[str, _Request] = {}
    ended = 0
    untaken: list[tuple[_Request, int]] = []  # ended requests whose rows colo's capture holds, with their row count

    def end(s: Sample, status: Status | None = None) -> None:
        nonlocal ended
        s.status = status or s.status
        left[s.group] -= 1
        ended += left[s.group] == 0

    def start(s: Sample) -> None:
        """The sample's next request, or its end by the budget or max_turns."""
        room = min(budget.max_tokens - len(s.response_ids), budget.max_model_len - len(s.ids))
        in_turn = s.turns.in_progress if s.turns is not None else 0
        if room <= 0:
            return end(s, Status.TRUNCATED)
        if s.turns is not None and len(s.turns.spans) >= budget.max_turns:
            return end(s, Status.COMPLETED)
        cap = room if s.turns is None else max(1, (budget.max_turn_tokens or budget.max_tokens) - in_turn)
        p = params(s, Ask(min(room, cap), request_seed(s), sampling.temperature, sampling.top_p, stops))
        # Streaming costs a RequestOutput per request per engine step (host time in every decode step, measured by
        # colo.bench.rollout's `scheduling`): only requests that may be stopped, or cut, stream; the rest come whole,
        # as LLM.generate hands them over
        stream = stop_after is not None or in_turn > 0
        p.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        if rows is not None:
            p.routed_experts_prompt_start = s.routed_rows  # rows of the tokens these weights forward, no more
        rid = f"{REQUEST_PREFIX if take is not None else 'colo-'}{next(_IDS)}"
        internal = engine.add_request(rid, TokensPrompt(prompt_token_ids=s.ids), p)
        live[rid] = _Request(s, room, len(s.ids), s.routed_rows, in_turn > 0, internal)

    def take_rows(r: _Request, raw: Any) -> None:
        count = r.prompt_len + r.got - 1 - r.first_row
        if rows is not None and r.got:
            r.sample.add_rows(rows(raw, count))
        elif take is not None:  # also a request that produced nothing: the worker drops what it kept of it
            untaken.append((r, max(count, 0)))

    def take_untaken() -> None:
        """colo's capture: the rows of the requests that ended since the last call, in the order they ended."""
        if untaken:
            got = take([(r.internal, r.first_row, count) for r, count in untaken])
            for (r, _), ids in zip(untaken, got):
                if r.got:
                    r.sample.add_rows(ids)
            untaken.clear()

    if need > 0:
        if conversations is not None:
            conversations.begin(todo)
        for s in todo:
            if s.done:  # a conversation whose reset or replay failed
                end(s)
            else:
                start(s)
    # Under a vLLM data-parallel group (GPU) has_unfinished_requests() is a collective and an engine without requests
    # steps dummy batches until every rank is done, as in LLM.generate: each rank therefore calls it exactly once per
    # step() here, also a rank that reached its quota first or has nothing to do.
    while ended < need and engine.has_unfinished_requests():
        finished: list[tuple[_Request, str]] = []
        for o in engine.step():
            r = live.get(o.request_id)
            if r is None:  # a request ended here by a straddled stop string
                continue
            (c,) = o.outputs
            toks = list(c.token_ids)
            lps = [float(lp[t].logprob) for t, lp in zip(toks, c.logprobs or [])]  # logprobs=0: the sampled token's
            reason = c.finish_reason if o.finished else None
            raw = c.routed_experts if o.finished and rows is not None else None
            k = conversations.cut(r.sample, toks, r.continued) if conversations is not None else None
            if k is not None:
                toks, lps, reason = toks[:k], lps[:k], "stop"
                if not o.finished:
                    raw = stopped_rows(engine, r.internal) if rows is not None else None
                    engine.abort_request([o.request_id])
            r.sample.extend(toks, lps, sampling.version)
            r.got += len(toks)
            if r.sample.turns is not None:
                r.sample.turns.in_progress += len(toks)
            if reason is not None:
                del live[o.request_id]
                take_rows(r, raw)
                finished.append((r, reason))
        if not finished:
            continue
        if conversations is None:
            for r, reason in finished:
                if reason not in STATUS:
                    raise RuntimeError(f"vLLM ended a request with finish reason {reason!r}")
                end(r.sample, STATUS[reason])
            continue
        again = conversations.end_turns([(r.sample, reason, reason == "length" and r.got >= r.room)
                                         for r, reason in finished], budget, sampling.version)
        for r, _ in finished:
            if r.sample.done:
                end(r.sample)
        if again:  # a next turn starts from the rows its sample holds
            take_untaken()
        for s in again:
            if ended < need:
                start(s)
    running = list(live)
    for rid in running:  # read before the abort drops them
        take_rows(live[rid], stopped_rows(engine, live[rid].internal) if rows is not None else None)
    if running:
        engine.abort_request(running)
    while engine.has_unfinished_requests():  # aborts reach the core; DP peers may still be running
        engine.step()
    take_untaken()
    for s in samples:
        s.segments += 1
