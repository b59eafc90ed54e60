"""Partial rollouts (loop.mode=async): run vLLM's engine loop until enough whole groups finished, stop the rest.

    out = run_until(llm.llm_engine, prompts, params, groups, need=4)
    out[i] = {"tokens": [...], "logprobs": [...], "finish_reason": "stop" | "length" | None}   # None: stopped

vLLM's offline `LLM.generate` runs every request to its end. Here each request is added to the engine
(`LLMEngine.add_request`, one sample per request, RequestOutputKind.DELTA so every `step()` hands over the
tokens and sampled log-probs it produced), the loop calls `step()` itself, and once `need` groups have all
their requests finished it calls `LLMEngine.abort_request` on the rest. What an aborted request produced
was already streamed out, so its tokens and log-probs stay; vLLM frees its KV blocks. Full blocks may stay in
the prefix cache, computed by these weights: the engine resets the cache after every weight sync
(colo.rollout.engine.Engine._drop_prefix_cache), so a resumed sample's prefill recomputes its KV under the
new weights (tests/integration/test_engines_across_syncs.py fails if it does not).

Resuming is the caller's: a new request whose prompt is the old prompt plus the tokens so far
(`resume_prompt`). The data travel as plain lists; vLLM's objects never leave the engine actor.

With `routing` (GPU engines, vLLM's own capture: LLM(enable_return_routed_experts=True)) each output also carries
"routed_raw", the rows vLLM recorded for the request (from its SamplingParams.routed_experts_prompt_start on, one per
token forwarded). vLLM 0.32 hands them out only with a request's final output (OutputProcessor's RequestState gathers
each step's rows in `routed_experts_chunks` and concatenates them when the request finishes), and abort_request
drops that state without a final output in the synchronous LLMEngine (its queue is AsyncLLM's). So the rows of a
stopped request are read from that state just before the abort (stopped_rows): by then every step's output, the
tokens streamed and the rows alike, went through the output processor, so the rows cover exactly the tokens kept.
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

_IDS = itertools.count()


def resume_prompt(request: dict) -> list[int]:
    """The token ids a (possibly resumed) sample request prefills: its prompt, then the tokens it already has."""
    return [int(t) for t in request["prompt_ids"]] + [int(t) for t in request["response_ids"]]


def stopped_rows(engine: Any, internal_id: str) -> Any:
    """The routing rows vLLM 0.32 recorded so far for a running request (None: none yet): its OutputProcessor
    RequestState's `routed_experts_chunks`, what it would concatenate into the final output (module docstring)."""
    import numpy as np

    state = engine.output_processor.request_states.get(internal_id)
    chunks = getattr(state, "routed_experts_chunks", None) if state is not None else None
    return np.concatenate(chunks, axis=0) if chunks else None


def run_until(engine: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any], groups: Sequence[Hashable],
              need: int, routing: bool = False) -> list[dict]:
    """Generate until `need` groups (all requests sharing a `groups` key) have finished, then abort the others.

    `engine`: a vllm LLMEngine with no request of its own in flight; `params[i]`: request i's SamplingParams
    (n=1; its output_kind is set to DELTA here). need <= 0 generates nothing (every request comes back
    unfinished, with no tokens); need >= the number of groups runs every request to its end.
    Returns one dict per request, in order; with `routing`, each with "routed_raw" (rows or None)."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    out = [{"tokens": [], "logprobs": [], "finish_reason": None} for _ in prompts]
    left = Counter(groups)  # unfinished requests per group
    by_id: dict[str, int] = {}
    internal: dict[str, str] = {}  # our request id -> vLLM's own (its output processor's key)
    for i, (ids, p) in enumerate(zip(prompts, params) if need > 0 else ()):
        if p.n != 1:
            raise ValueError(f"run_until: request {i} has n={p.n}; every sample is a request of its own (n=1)")
        p.output_kind = RequestOutputKind.DELTA
        rid = f"colo-partial-{next(_IDS)}"
        internal[rid] = engine.add_request(rid, TokensPrompt(prompt_token_ids=[int(t) for t in ids]), p)
        by_id[rid] = i
    finished_groups = 0
    # Under a vLLM data-parallel group (GPU) has_unfinished_requests() is a collective and an engine without
    # requests steps dummy batches until every rank is done, as in LLM.generate: each rank therefore calls it
    # exactly once per step() here, also a rank that reached its quota first or has nothing to do.
    while finished_groups < need and engine.has_unfinished_requests():
        for o in engine.step():
            i = by_id[o.request_id]
            (c,) = o.outputs
            out[i]["tokens"] += list(c.token_ids)
            # logprobs=0: each position's dict holds just the sampled token
            out[i]["logprobs"] += [float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs or [])]
            if o.finished:
                out[i]["finish_reason"] = c.finish_reason
                if routing:
                    out[i]["routed_raw"] = c.routed_experts  # every row of the request, with its final output
                left[groups[i]] -= 1
                finished_groups += left[groups[i]] == 0
    running = [rid for rid, i in by_id.items() if out[i]["finish_reason"] is None]
    if routing:
        for rid in running:  # read before the abort drops them
            out[by_id[rid]]["routed_raw"] = stopped_rows(engine, internal[rid])
    if running:
        engine.abort_request(running)
    while engine.has_unfinished_requests():  # aborts reach the core; DP peers may still be running
        engine.step()
    for i, o in enumerate(out):
        if len(o["logprobs"]) != len(o["tokens"]):
            raise RuntimeError(f"run_until: request {i} streamed {len(o['tokens'])} tokens but "
                               f"{len(o['logprobs'])} log-probs")
    return out
