"""colo.sync.probe's pure parts: the sequences, the measure and its two statistics, the schedule. The check against
real engines (and that it fails when vLLM's post-load refresh is skipped, or a weight is one step stale) is
tests/integration/test_families.py; the layer check's pure parts are tests/unit/test_sync_layercheck.py."""
from __future__ import annotations

import torch

from colo.sync.probe import (ENGINE_TOPK, FEW, FEW_TOLERANCE, TOLERANCE, ProbeSchedule, check, engine_scores,
                             probe_sequences, trainer_scores)


def _engine_view(logits: torch.Tensor, ids: torch.Tensor, k: int = ENGINE_TOPK) -> list[list[dict | None]]:
    """What vLLM's prompt_logprobs return for these logits: per position the top-k and the actual token."""
    lp = torch.log_softmax(logits.float(), -1)
    out = []
    for s in range(ids.shape[0]):
        rows: list[dict | None] = [None]
        for t in range(1, ids.shape[1]):
            v, i = lp[s, t - 1].topk(k)
            row = dict(zip(i.tolist(), v.tolist()))
            row[int(ids[s, t])] = float(lp[s, t - 1, ids[s, t]])
            rows.append(row)
        out.append(rows)
    return out


def _case(scale: float, seed: int = 0, vocab: int = 300):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(probe_sequences(vocab))
    logits = torch.randn(*ids.shape, vocab, generator=g) * scale  # (S, T, V)
    return ids, logits


def test_sequences_are_fixed_and_in_range() -> None:
    a, b = probe_sequences(100), probe_sequences(100)
    assert a == b and len(a) == 2 and all(0 <= t < 100 for s in a for t in s)
    assert probe_sequences(100, length=5)[0] != probe_sequences(100, seed=1, length=5)[0]


def test_same_logits_pass_and_rounding_passes_for_flat_and_peaked_models() -> None:
    for scale in (0.2, 5.0):  # a near-uniform random tiny model, a peaked trained one
        ids, logits = _case(scale)
        mine = trainer_scores(logits, ids)
        assert check(mine, engine_scores(_engine_view(logits, ids)), "float32").err < 1e-5
        bf16 = _engine_view(logits.to(torch.bfloat16).float(), ids)  # the engine computes in bf16
        res = check(mine, engine_scores(bf16), "bfloat16")
        assert res.ok and res.err < TOLERANCE["bfloat16"] / 3, (scale, res)


def test_other_weights_fail_for_flat_and_peaked_models() -> None:
    for scale in (0.2, 5.0):
        ids, logits = _case(scale)
        _, other = _case(scale, seed=1)
        res = check(trainer_scores(logits, ids), engine_scores(_engine_view(other, ids)), "bfloat16")
        assert not res.ok and res.err > 3 * TOLERANCE["bfloat16"], (scale, res)


def test_one_flipped_position_passes_and_a_few_wrong_ones_fail() -> None:
    """An MoE routing decision that rounding flips moves a position (measured: the worst single positions of correct
    bf16 syncs 0.02-0.09); a fault a few tokens reach (an expert few tokens route to) moves FEW or more: the median
    stays low, the FEW-th worst position does not."""
    ids, logits = _case(0.2)
    mine = trainer_scores(logits, ids)
    for wrong_positions, ok in ((1, True), (FEW - 1, True), (FEW, False), (8, False)):
        wrong = logits.clone()
        wrong[0, :wrong_positions] = torch.randn_like(wrong[0, :wrong_positions]) * 0.2
        res = check(mine, engine_scores(_engine_view(wrong, ids)), "bfloat16")
        assert res.ok == ok and res.err < TOLERANCE["bfloat16"], (wrong_positions, res.err, res.few)
        assert ok or res.few > FEW_TOLERANCE["bfloat16"]


def test_engine_tokens_the_trainer_ranks_low_count_as_error() -> None:
    """Where the engine's top tokens fall below the trainer's top-r, the trainer's r-th value bounds the error."""
    ids, logits = _case(5.0)
    mine = trainer_scores(logits, ids, top=4)
    res = check(mine, engine_scores(_engine_view(-logits, ids)), "bfloat16")  # the engine's favourites: its least
    assert not res.ok


def test_schedule_checks_the_first_sync_then_every_nth() -> None:
    s = ProbeSchedule(100, 128, 3)
    assert [s.next() is not None for _ in range(7)] == [True, False, False, True, False, False, True]
    once = ProbeSchedule(100, 128, 0)
    assert [once.next() is not None for _ in range(3)] == [True, False, False]
    probe = ProbeSchedule(100, 8, 1).next()
    assert len(probe["seqs"][0]) == 7 and probe["layers"]["max_len"] == 7  # shorter than the engine's context
