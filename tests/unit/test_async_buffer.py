"""loop.mode=async bookkeeping without engines: the config, the RolloutBuffer (carry, versions, staleness
drops, whole groups only, routing per segment) and the decoupled-PPO loss on tokens from several versions.

    .venv/bin/python -m pytest tests/unit/test_async_buffer.py -q
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from colo.algo.batch import build_batch
from colo.algo.loss import LossOptions, policy_loss
from colo.config import ConfigError, load_config, validate
from colo.rollout.buffer import RolloutBuffer
from colo.rollout.sample import STATUS, Sample, Turns


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["placement.device=cpu", *overrides], {}), check_resources=False)
    msg = str(e.value)
    assert "\n" not in msg and "fix:" in msg, msg
    return msg


def test_config_defaults_and_refusals() -> None:
    cfg = load_config(None, [], {})
    assert (cfg.loop.mode, cfg.loop.max_staleness, cfg.rollout.oversample) == ("sync", 1, 1.5)
    validate(load_config(None, ["placement.device=cpu", "loop.mode=async", "loop.max_staleness=2"], {}),
             check_resources=False)
    disaggregated = ["loop.mode=async", "placement.mode=disaggregated", "placement.num_gpus=2", "placement.trainer_gpus=1"]
    validate(load_config(None, ["placement.device=cpu", *disaggregated], {}), check_resources=False)  # one step off
    msg = _error([*disaggregated, "loop.max_staleness=0"])
    assert "one weight version behind" in msg and "loop.max_staleness=1" in msg
    assert "algo.tis_cap=2.0" in _error(["loop.mode=async", "algo.tis_cap=0"])
    assert "rollout.oversample=0.5 must be >= 1" in _error(["rollout.oversample=0.5"])
    assert "loop.max_staleness=-1 must be >= 0" in _error(["loop.max_staleness=-1"])
    assert "did you mean 'async'" in _error(["loop.mode=asynch"])
    validate(load_config(None, ["placement.device=cpu", "loop.mode=async", "algo.environment=calculator"], {}),
             check_resources=False)  # conversations carried across weight updates (colo.rollout.turns)
    msg = _error([*disaggregated, "algo.environment=calculator"])
    assert "runs colocated" in msg and "placement.mode=colocated" in msg


def _prompts(k: int, start: int = 0) -> list[dict]:
    return [{"prompt_ids": [10 + i, 11 + i, 12 + i], "answer": str(i), "prompt_text": f"p{i}"}
            for i in range(start, start + k)]


def _result(tokens: list[int], finish: str | None, lp: float = -1.0, routing: np.ndarray | None = None) -> dict:
    return {"tokens": tokens, "logprobs": [lp] * len(tokens), "finish_reason": finish, "routing": routing}


def _absorb(buf: RolloutBuffer, reqs: list[Sample], results: list[dict], version: int) -> None:
    """What the engine loop (colo.rollout.engine_loop) makes of each request, as the engines hand it back."""
    assert len(reqs) == len(results)
    for r, out in zip(reqs, results):
        r.extend(out["tokens"], out["logprobs"], version, model=True)
        if out.get("model_mask") is not None:  # a conversation's segment: the environment's tokens too
            r.model_mask[len(r.model_mask) - len(out["tokens"]):] = out["model_mask"]
            r.logprobs[len(r.logprobs) - len(out["tokens"]):] = out["logprobs"]
            r.prompt_ids, r.turns = out["prompt_ids"], out["turns"]
        if out["routing"] is not None:
            r.add_rows(out["routing"])
        r.status = STATUS[out["finish_reason"]] if out["finish_reason"] else r.status
        r.segments += 1
    buf.absorb(reqs)


def test_carry_versions_and_whole_groups() -> None:
    buf = RolloutBuffer(n=2, max_staleness=1)
    buf.drop_stale(0)
    assert buf.wanted(3) == 3
    buf.add(_prompts(3), seed=100)
    reqs = buf.requests()
    assert [(r.group, r.index, r.seed, r.segments) for r in reqs] == [
        (0, 0, 100, 0), (0, 1, 101, 0), (1, 0, 102, 0), (1, 1, 103, 0), (2, 0, 104, 0), (2, 1, 105, 0)]
    assert buf.need(1) == 1
    # step 0: group 1 finishes; groups 0 and 2 are stopped part-way (group 2: one sample done)
    _absorb(buf, reqs, [_result([1, 2], None), _result([3], None), _result([4], "stop"), _result([5, 6], "length"),
                        _result([7], "stop"), _result([8, 9], None)], version=0)
    assert buf.counts["completed"] == 3 and buf.counts["carried"] == 3 and buf.counts["resumed"] == 0
    prompts, samples = buf.take(1, version=0)
    assert prompts[0]["answer"] == "1" and [s.response_ids for s in samples] == [[4], [5, 6]]
    assert [s.group for s in samples] == [0, 0] and samples[0].versions == [0]
    m = buf.metrics(samples, 0)
    assert m["async/staleness_max"] == 0 and m["async/offpolicy_frac"] == 0.0 and m["async/carried"] == 3
    # step 1: the carried samples resume from their own tokens (prompt + tokens so far), one more segment each
    assert buf.drop_stale(1) == 0 and buf.wanted(3) == 1
    buf.add(_prompts(1, start=3), seed=200)
    reqs = buf.requests()
    assert [(r.group, r.index, r.response_ids, r.segments) for r in reqs] == [
        (0, 0, [1, 2], 1), (0, 1, [3], 1), (2, 1, [8, 9], 1), (3, 0, [], 0), (3, 1, [], 0)]
    _absorb(buf, reqs, [_result([21], "stop", -2.0), _result([22, 23], "stop", -2.0), _result([24], "stop", -2.0),
                        _result([25], None), _result([], None)], version=1)
    assert buf.counts["resumed"] == 3 and buf.counts["completed"] == 3 and buf.counts["carried"] == 2
    prompts, samples = buf.take(2, version=1)
    assert [p["answer"] for p in prompts] == ["0", "2"]  # oldest first
    s0 = samples[0]
    assert s0.response_ids == [1, 2, 21] and s0.versions == [0, 0, 1] and s0.logprobs == [-1, -1, -2]
    m = buf.metrics(samples, 1)
    tokens = [v for s in samples for v in s.versions]  # 3, 3, 1, 3 tokens
    assert m["async/staleness_max"] == 1
    assert m["async/staleness_mean"] == pytest.approx(sum(1 - v for v in tokens) / len(tokens))
    assert m["async/offpolicy_frac"] == pytest.approx(sum(v == 0 for v in tokens) / len(tokens))
    with pytest.raises(RuntimeError, match="0 whole groups finished, 1 needed"):
        buf.take(1, version=1)


def test_staleness_drop_is_counted_and_bounds_every_trained_token() -> None:
    buf = RolloutBuffer(n=2, max_staleness=1)
    buf.drop_stale(0)
    buf.add(_prompts(2), seed=0)
    _absorb(buf, buf.requests(), [_result([1], None), _result([2], "stop"), _result([3, 4], None),
                                  _result([5], None)], version=0)
    buf.drop_stale(1)
    reqs = buf.requests()
    _absorb(buf, reqs, [_result([6], "stop")] + [_result([7], None)] * 2, version=1)  # group 0 completes
    _, samples = buf.take(1, version=1)  # within the bound: trained
    assert buf.metrics(samples, 1)["async/staleness_max"] == 1
    buf.drop_stale(1)
    buf.add(_prompts(1, start=5), seed=9)
    _absorb(buf, buf.requests(), [_result([8], "stop")] * 2 + [_result([9], "stop")] * 2, version=1)
    with pytest.raises(RuntimeError, match="spans 2 weight versions"):  # take() checks, should one slip through
        buf.take(1, version=2)
    assert buf.drop_stale(2) == 2 and buf.counts["dropped_tokens"] == 7  # group 1: version-0 tokens
    assert [g.prompt["answer"] for g in buf.groups.values()] == ["5"]  # version-1 tokens only: kept
    # max_staleness 0: nothing carried survives the next step
    buf = RolloutBuffer(n=2, max_staleness=0)
    buf.drop_stale(0)
    buf.add(_prompts(1), seed=0)
    _absorb(buf, buf.requests(), [_result([1], None), _result([], None)], version=0)
    assert buf.drop_stale(1) == 2 and not buf.groups


def test_routing_rows_per_segment_make_one_batch() -> None:
    """Rows of each segment concatenate to the (P + R - 1, M, K) a one-segment sample has; batch_build takes them."""
    buf = RolloutBuffer(n=2, max_staleness=2)
    buf.drop_stale(0)
    buf.add(_prompts(1), seed=0)  # P = 3
    rows = lambda k, v: np.full((k, 2, 1), v, dtype=np.uint8)  # noqa: E731
    _absorb(buf, buf.requests(), [_result([1, 2], None, routing=rows(4, 0)),
                                  _result([3], "stop", routing=rows(3, 0))], version=0)  # P + 2 - 1 = 4 rows, then 3
    (req,) = buf.requests()
    assert req.routing is None and req.routed_from == 4  # only the count of the rows the driver holds travels
    _absorb(buf, [req], [_result([4, 5], "stop", routing=rows(2, 1))], version=1)  # rows of tokens 2..3
    _, samples = buf.take(1, version=1)
    assert samples[0].routing.shape == (3 + 4 - 1, 2, 1)
    assert samples[0].routing[:, 0, 0].tolist() == [0, 0, 0, 0, 1, 1]
    batch = build_batch(samples, torch.zeros(2))
    assert batch["routed_experts"].shape == (2, 7, 2, 1)
    assert batch["rollout_logprobs"][0, 3:].tolist() == [-1.0, -1.0, -1.0, -1.0]


def test_decoupled_loss_on_tokens_of_two_versions_matches_a_plain_loop() -> None:
    """Tokens sampled by two weight versions in one sequence: ratio against pi_old (the trainer's recompute),
    behaviour weight pi_old / behaviour truncated at tis_cap, per token, with the behaviour log-prob of the
    version that sampled it."""
    g = torch.Generator().manual_seed(0)
    B, T = 3, 6
    logp = (torch.randn(B, T, generator=g) * 0.3 - 1.0).requires_grad_(True)
    old = logp.detach() + torch.randn(B, T, generator=g) * 0.2
    # behaviour log-probs: the first tokens from an older version (far off), the rest near pi_old
    behaviour = old + torch.where(torch.arange(T) < 3, torch.randn(B, T, generator=g) * 1.5,
                                  torch.randn(B, T, generator=g) * 0.05)
    adv = torch.tensor([1.0, -0.5, 0.3])
    mask = torch.ones(B, T)
    mask[2, 4:] = 0
    loss, m = policy_loss(logp, old, adv, mask,
                          LossOptions(clip_low=0.2, clip_high=0.28, tis_cap=2.0), rollout_logprobs=behaviour)
    total, count, ws = 0.0, 0, []
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            ratio = math.exp(float(logp[b, t] - old[b, t]))
            a = float(adv[b])
            pg = max(-a * ratio, -a * min(max(ratio, 0.8), 1.28))
            w = min(math.exp(float(old[b, t] - behaviour[b, t])), 2.0)
            ws.append(w)
            total += w * pg
            count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
    assert m["tis_mean"].item() == pytest.approx(sum(ws) / len(ws), rel=1e-5)
    assert any(w == 2.0 for w in ws) and any(w < 1.0 for w in ws)  # some stale tokens truncated, some down-weighted
    # the naive loss (ratio against the behaviour log-probs, no pi_old) is a different objective
    naive, _ = policy_loss(logp, behaviour, adv, mask, LossOptions(clip_low=0.2, clip_high=0.28))
    assert abs(naive.item() - loss.item()) > 1e-3


def test_state_dict_round_trips_through_json() -> None:
    """What a checkpoint's extra.json holds: the carried groups, their versions, log-probs and routing rows."""
    import json

    buf = RolloutBuffer(n=2, max_staleness=1)
    buf.drop_stale(0)
    buf.add(_prompts(2), seed=5)
    rows = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
    _absorb(buf, buf.requests(), [_result([1, 2], None, -0.5, rows), _result([3], "stop", -0.25, rows[:3]),
                                  _result([4], None, routing=rows[:3]), _result([], None)], version=0)
    state = json.loads(json.dumps(buf.state_dict()))
    back = RolloutBuffer(n=2, max_staleness=1)
    back.load_state_dict(state)
    assert back.next_id == buf.next_id and back.requests() == buf.requests()
    for gid, g in buf.groups.items():
        assert back.groups[gid].prompt == g.prompt
        for a, b in zip(g.samples, back.groups[gid].samples):
            assert replace(a, routing=None) == replace(b, routing=None)
            assert (a.routing is None) == (b.routing is None)
            assert a.routing is None or (np.array_equal(a.routing, b.routing) and a.routing.dtype == b.routing.dtype)
    buf.groups[0].samples[0].response_ids.append(9)
    assert back.groups[0].samples[0].response_ids == [1, 2]
    with pytest.raises(ValueError, match="layout before colo.rollout.sample"):
        back.load_state_dict({"next_id": 2, "groups": []})  # a checkpoint of the dict samples


def test_generate_ahead_hands_over_one_batch_a_step_and_checkpoints_it() -> None:
    """Disaggregated async (colo.rollout.ahead): the batch generated during step s is trained at step s + 1,
    one version behind; its state (routing rows too) survives a checkpoint's JSON."""
    import json

    from colo.rollout.ahead import AheadBatch, GenerateAhead

    ahead = GenerateAhead()
    assert ahead.take() is None  # the first step generates its own batch
    routing = np.arange(12, dtype=np.int16).reshape(3, 2, 2)
    samples = [Sample(0, 0, 0, [1], [5, 6, 7], [-1.0] * 3, [3] * 3, routing=routing, status=STATUS["stop"])]
    ahead.put(AheadBatch(_prompts(1), samples, version=3))
    with pytest.raises(RuntimeError, match="not trained on yet"):
        ahead.put(AheadBatch(_prompts(1), samples, version=4))
    state = json.loads(json.dumps(ahead.state_dict()))
    again = GenerateAhead()
    again.load_state_dict(state)
    batch = again.take()
    assert batch.version == 3 and batch.prompts == _prompts(1) and again.take() is None
    assert np.array_equal(batch.samples[0].routing, routing)
    assert replace(batch.samples[0], routing=None) == replace(samples[0], routing=None)
    m = GenerateAhead.metrics(batch, step=4, max_staleness=1)
    assert (m["async/staleness_mean"], m["async/staleness_max"], m["async/offpolicy_frac"]) == (1.0, 1, 1.0)
    assert m["async/completed"] == 1 and m["async/carried"] == m["async/dropped"] == 0
    with pytest.raises(RuntimeError, match="loop.max_staleness"):
        GenerateAhead.metrics(batch, step=5, max_staleness=1)
    assert GenerateAhead().state_dict() == {"kind": "ahead", "batch": None}


def test_share_gives_each_engine_its_groups_and_a_quota_it_can_meet() -> None:
    """colo.rollout.schedule.share: groups round robin over the engines, oldest first, each sample with its group;
    the groups still needed shared the same way, so no engine is asked to finish more groups than it holds."""
    from colo.rollout.schedule import share

    reqs = [Sample(g, j, 0, [1]) for g in (7, 3, 9, 4, 5) for j in range(2)]  # insertion order: oldest first
    per_engine, quota = share(reqs, need=4, engines=2)
    assert [[r.group for r in rs] for rs in per_engine] == [[7, 7, 9, 9, 5, 5], [3, 3, 4, 4]]
    assert quota == [2, 2]
    for need in range(8):
        for engines in (1, 2, 3, 4, 6):
            per_engine, quota = share(reqs, need, engines)
            held = [len({r.group for r in rs}) for rs in per_engine]
            assert sum(quota) == min(need, 5) and all(q <= h for q, h in zip(quota, held)), (need, engines)
            assert sorted(r.group for rs in per_engine for r in rs) == sorted(r.group for r in reqs)


def _turns(tokens: list[int], mask: list[int], finish: str | None, turns: Turns, prompt: list[int],
           lp: float = -1.0) -> dict:
    """A conversation's segment as the engine loop makes it (log-probs 0 on the environment's tokens)."""
    return {"tokens": tokens, "logprobs": [lp if m else 0.0 for m in mask], "model_mask": mask,
            "finish_reason": finish, "prompt_ids": prompt, "turns": turns, "routing": None}


def test_conversations_carry_their_history_and_count_only_the_models_tokens() -> None:
    """algo.environment: a request carries the conversation's own prompt ids ([] before its reset) and its Turns; a
    segment's environment tokens keep model_mask 0 and never count for staleness, the drop or the metrics; a finished
    conversation's sample holds what the batch and the rewards read; the state survives JSON."""
    import json

    buf = RolloutBuffer(n=2, max_staleness=1, turns=True)
    buf.drop_stale(0)
    buf.add(_prompts(1), seed=0)
    reqs = buf.requests()
    assert [r.prompt_ids for r in reqs] == [[], []] and buf.rows([0])[0]["answer"] == "0"
    assert reqs[0].turns == Turns() and reqs[0].model_mask == []
    one = Turns(spans=[[0, 2]], reasons=["stop"], in_progress=1, tool_calls=1, final_ids=[5, 6])
    done = Turns(spans=[[0, 1]], reasons=["stop"], env_reward=0.5, final_ids=[9])
    # sample 0: a turn, the tool's two tokens, one token of its next turn, then stopped; sample 1: one turn, done
    _absorb(buf, reqs, [_turns([5, 6, 90, 91, 7], [1, 1, 0, 0, 1], None, one, [1, 2]),
                        _turns([9], [1], "stop", done, [1, 2, 3])], version=0)
    buf.drop_stale(1)
    (r,) = buf.requests()
    assert r.prompt_ids == [1, 2] and r.response_ids == [5, 6, 90, 91, 7] and r.model_mask == [1, 1, 0, 0, 1]
    assert r.turns == one and r.segments == 1
    state = json.loads(json.dumps(buf.state_dict()))
    back = RolloutBuffer(n=2, max_staleness=1, turns=True)
    back.load_state_dict(state)
    assert back.requests() == [r] and back.drop_stale(1) == 0
    end = Turns(spans=[[0, 2], [4, 6]], reasons=["stop", "stop"], tool_calls=1, final_ids=[7, 8])
    _absorb(back, [r], [_turns([8], [1], "stop", end, [1, 2], lp=-2.0)], version=1)
    prompts, samples = back.take(1, version=1)
    s0, s1 = samples
    assert s0.prompt_ids == [1, 2] and s1.prompt_ids == [1, 2, 3]  # each conversation's own reset
    assert s0.response_ids == [5, 6, 90, 91, 7, 8] and s0.versions == [0, 0, 0, 0, 0, 1]
    assert s0.logprobs == [-1.0, -1.0, 0.0, 0.0, -1.0, -2.0] and s0.model_mask == [1, 1, 0, 0, 1, 1]
    assert (len(s0.turns.spans), s0.turns.tool_calls, s0.final_ids, s1.turns.env_reward) == (2, 1, [7, 8], 0.5)
    m = back.metrics(samples, 1)
    assert m["async/offpolicy_frac"] == pytest.approx(4 / 5)  # the model's 4 tokens of s0, 1 of s1: 4 from version 0
    batch = build_batch(samples, torch.tensor([1.0, -1.0]))
    assert batch["loss_mask"][0, 2:8].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]  # the tool's tokens: no loss
    # the environment's tokens never make a group stale: only the model's versions count
    buf = RolloutBuffer(n=1, max_staleness=1, turns=True)
    buf.drop_stale(0)
    buf.add(_prompts(1), seed=0)
    _absorb(buf, buf.requests(), [_turns([5], [1], None, one, [1])], version=0)
    _absorb(buf, buf.requests(), [_turns([80, 81], [0, 0], None, one, [1])], version=1)
    assert buf.groups[0].oldest() == 0 and buf.drop_stale(2) == 1


def test_a_segment_without_its_routing_rows_leaves_none_and_the_next_asks_for_every_row() -> None:
    """A GPU segment whose rows vLLM did not hand back (routing/mismatch does without; R3 raises in the engine): the
    sample keeps no rows, so the batch gets none for it, and its next request asks from row 0 again (a complete
    set, since a resumed sample prefills its whole history)."""
    buf = RolloutBuffer(n=1, max_staleness=2)
    buf.drop_stale(0)
    buf.add(_prompts(1), seed=0)  # P = 3
    rows = lambda k: np.zeros((k, 2, 1), dtype=np.uint8)  # noqa: E731
    _absorb(buf, buf.requests(), [_result([1, 2], None, routing=rows(4))], version=0)
    (req,) = buf.requests()
    req.extend([3], [-1.0], 1)
    req.add_rows(None)  # what Engine._vllm_rows gives for a segment vLLM recorded too few rows of
    req.segments += 1
    buf.absorb([req])
    (again,) = buf.requests()
    assert buf.groups[0].samples[0].routing is None and again.routed_from == 0  # every row asked for again
    _absorb(buf, [again], [_result([4], "stop", routing=rows(3 + 4 - 1))], version=2)
    _, (s,) = buf.take(1, version=2)
    assert s.routing.shape == (3 + 4 - 1, 2, 1) and s.complete_routing() is s.routing
