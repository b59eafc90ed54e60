"""colo.sync.probe's pure parts: the sequences, the measure and its tolerance, the sublayer traces, the schedule.
The check against real engines (and that it fails when vLLM's post-load refresh is skipped) is
tests/integration/test_families.py."""
from __future__ import annotations

import torch
from torch import nn

from colo.sync.probe import (ENGINE_TOPK, TOLERANCE, ProbeSchedule, check, engine_scores, first_difference,
                             probe_sequences, sublayers, traced, trainer_scores)


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


def test_a_few_flipped_positions_do_not_fail_a_correct_engine() -> None:
    """An MoE routing decision that rounding flips moves a position or two; the median does not move."""
    ids, logits = _case(0.2)
    wrong = logits.clone()
    wrong[0, :3] = torch.randn_like(wrong[0, :3]) * 0.2
    res = check(trainer_scores(logits, ids), engine_scores(_engine_view(wrong, ids)), "bfloat16")
    assert res.ok and res.worst > TOLERANCE["bfloat16"], res


def test_engine_tokens_the_trainer_ranks_low_count_as_error() -> None:
    """Where the engine's top tokens fall below the trainer's top-r, the trainer's r-th value bounds the error."""
    ids, logits = _case(5.0)
    mine = trainer_scores(logits, ids, top=4)
    res = check(mine, engine_scores(_engine_view(-logits, ids)), "bfloat16")  # the engine's favourites: its least
    assert not res.ok


class _Layer(nn.Module):
    def __init__(self, attn: str) -> None:
        super().__init__()
        setattr(self, attn, nn.Linear(8, 8))
        self.mlp = nn.Linear(8, 8)
        self.attn_name = attn

    def forward(self, x):
        return self.mlp(getattr(self, self.attn_name)(x))


class _Model(nn.Module):
    def __init__(self, attn: str = "self_attn") -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(20, 8)
        self.model.layers = nn.ModuleList([_Layer(attn), _Layer("linear_attn")])

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return x


def test_sublayer_labels_match_across_naming() -> None:
    """vLLM's GPT-OSS calls its attention `attn`, transformers `self_attn`: one label."""
    assert [lab for lab, _ in sublayers(_Model("self_attn"))] == [lab for lab, _ in sublayers(_Model("attn"))] == [
        "embedding", "layer 0 attention", "layer 0 mlp", "layer 1 linear attention", "layer 1 mlp"]


def test_traces_name_the_first_sublayer_that_differs() -> None:
    torch.manual_seed(0)
    a = _Model()
    b = _Model("attn")
    b.load_state_dict({k.replace("self_attn", "attn"): v for k, v in a.state_dict().items()})
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with traced(a, 5) as ta:
        a(ids)
    with traced(b, 5) as tb:
        b(ids)
    assert first_difference(ta, tb) is None
    with torch.no_grad():
        b.model.layers[1].mlp.weight.mul_(-1)
    with traced(b, 5) as tb:
        b(ids)
    assert first_difference(ta, tb).startswith("layer 1 mlp")
    assert first_difference(ta, {}) is None  # an engine that could not be traced names nothing


def test_schedule_checks_the_first_sync_then_every_nth() -> None:
    s = ProbeSchedule(100, 128, 3)
    assert [s.next() is not None for _ in range(7)] == [True, False, False, True, False, False, True]
    once = ProbeSchedule(100, 128, 0)
    assert [once.next() is not None for _ in range(3)] == [True, False, False]
    assert len(ProbeSchedule(100, 8, 1).next()[0]) == 7  # shorter than the engine's context
