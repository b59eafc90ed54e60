"""The functional check's end-to-end half: the engine and the trainer score the same token sequences and must agree.

    probe = ProbeSchedule(vocab, max_model_len, every).next()      # {"seqs", "layers"} on a checked sync, else None
    trainer:  scores(probe["seqs"]) via the policy's forward       -> ProbeScores
    engine:   vLLM's prompt log-probs of the seqs (top-k per position) -> ProbeScores
    check(trainer, engine, dtype)                                  -> ProbeResult (ok, err)

The other half, colo.sync.layercheck (probe["layers"]), compares every layer on fixed inputs and names the layer,
expert or head that differs; this one runs the model as it runs on text: natural routing, every layer feeding the
next, the way rollouts see it.

The measure: per position, the RMS of the differences of the log-probs of the engine's top-k next tokens and of the
actual next token, divided by the RMS spread of the trainer's log-probs over those tokens about their mean (so it
reads the same for a peaked trained model and a near-uniform random tiny one). Two statistics over the positions,
each against its tolerance: the median (a weight every position uses), and the FEW-th worst position (a fault only
a few positions reach, such as an expert few tokens route to; one or two positions may move where rounding flips an
MoE routing decision, as measured, so a single position cannot fail a correct sync).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PROBE_SEQS = 2  # sequences per check
PROBE_LEN = 24  # tokens each (<= max_model_len - 1, checked by the caller)
ENGINE_TOPK = 8  # the engine's top-k next tokens compared per position
TRAINER_TOPR = 64  # the trainer's top-r next tokens sent to the driver (the engine's top-k lie inside them)

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.06, "float16": 0.06, "fp8": 0.3}
"""Median per-position relative error allowed. Measured on correct syncs: float32 1.1e-6 to 1.6e-6 (the nine CPU
families and the tiny preset, this module's measure, AMD EPYC AVX512-BF16, 2026-12-07) and 3e-7 to 2.4e-6 (the
default job); bfloat16 0.008 to 0.011 there, 0.013 and 0.018 on an H200 (the L12 slice; the whole Qwen3-30B-A3B with
LoRA, 2026-11-28); float16 is not measured (bfloat16's bound: float16 rounds finer). A skipped refresh measured 1.16
(DeepSeek-V3). "fp8" (rollout.quantization=fp8: an FP8 engine against the bf16 trainer): FP8's rounding alone
measures 0.054-0.081 with the weights rounded and 0.074-0.096 with W8A8's activations rounded too (`python -m
tools.experiments.fp8probe`, the tiny and tiny-fp8 presets, 3 seeds each, CPU, 2026-11-28), a stale engine >= 2.5
(docs/benchmarks.md, "Verification: cost and noise")."""
FEW = 4  # the statistic a few positions can fail: the FEW-th worst position
FEW_TOLERANCE = {"float32": 2e-4, "bfloat16": 0.15, "float16": 0.15, "fp8": 0.6}
"""The FEW-th worst position's error allowed. Measured on the same correct syncs: float32 <= 4.4e-6; bfloat16 <= 0.026
(the worst single positions 0.02-0.09: routing flips); FP8's is twice its median bound (not measured per position)."""


def tolerance_key(model_dtype: str, quantization: str = "none") -> str:
    """The TOLERANCE entry a run's check uses: its engine's weights (rollout.quantization), else model.dtype."""
    return "fp8" if quantization == "fp8" else model_dtype



def probe_sequences(vocab: int, seed: int = 0, count: int = PROBE_SEQS, length: int = PROBE_LEN) -> list[list[int]]:
    """`count` fixed token sequences of `length` ids in [0, vocab): the same on every rank, engine and run."""
    g = torch.Generator().manual_seed(1_000_003 + seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


@dataclass
class ProbeScores:
    """Log-probs of each sequence's positions 1..T-1: per position a {token: log-prob} table that holds the actual
    next token and the side's top tokens (k of the engine, r of the trainer; `floor` the r-th value: the trainer
    puts every token it did not list at or below it)."""

    tables: list[list[dict[int, float]]]  # [sequence][position - 1] -> {token: log-prob}
    floor: list[list[float]] | None = None  # the trainer's: [sequence][position - 1] -> its r-th log-prob


@dataclass
class ProbeResult:
    ok: bool
    err: float  # median per-position relative error
    worst: float  # the largest per-position relative error
    positions: int
    rows: list[float] = field(default_factory=list)  # every position's error, in sequence order
    few: float = 0.0  # the FEW-th worst position's error


def trainer_scores(logits: torch.Tensor, ids: torch.Tensor, top: int = TRAINER_TOPR) -> ProbeScores:
    """From the trainer's logits (S, T, V) of sequences ids (S, T): the tables of positions 1..T-1."""
    lp = torch.log_softmax(logits.float()[:, :-1], dim=-1)  # (S, T-1, V): position t-1 predicts token t
    vals, idx = lp.topk(min(top, lp.shape[-1]), dim=-1)  # (S, T-1, r)
    actual = lp.gather(-1, ids[:, 1:, None].to(lp.device)).squeeze(-1)  # (S, T-1)
    tables, floors = [], []
    for s in range(ids.shape[0]):
        rows, fl = [], []
        for t in range(ids.shape[1] - 1):
            row = dict(zip(idx[s, t].tolist(), vals[s, t].tolist()))
            row[int(ids[s, t + 1])] = float(actual[s, t])
            rows.append(row)
            fl.append(float(vals[s, t, -1]))
        tables.append(rows)
        floors.append(fl)
    return ProbeScores(tables, floors)


def engine_scores(prompt_logprobs: list[list[dict[int, float] | None]]) -> ProbeScores:
    """From vLLM's prompt log-probs per sequence (position 0 is None), as {token: log-prob} per position."""
    return ProbeScores([[dict(p) for p in seq[1:]] for seq in prompt_logprobs])


def check(trainer: ProbeScores, engine: ProbeScores, dtype: str) -> ProbeResult:
    """Compare the engine's tables with the trainer's (module doc for the measure)."""
    errs: list[float] = []
    assert trainer.floor is not None
    for s, (trows, erows) in enumerate(zip(trainer.tables, engine.tables)):
        for t, (trow, erow) in enumerate(zip(trows, erows)):
            diffs, mine = [], []
            for tok, e in erow.items():
                if tok in trow:
                    diffs.append(e - trow[tok])
                    mine.append(trow[tok])
                else:  # the trainer ranks it below its top-r: at least this far off where the engine ranks it higher
                    diffs.append(max(0.0, e - trainer.floor[s][t]))
                    mine.append(trainer.floor[s][t])
            mean = sum(mine) / len(mine)
            spread = math.sqrt(sum((m - mean) ** 2 for m in mine) / len(mine))
            rms = math.sqrt(sum(d * d for d in diffs) / len(diffs))
            errs.append(rms / max(spread, 1e-3))
    if not errs:
        raise ValueError("the probe compared no position: empty sequences")
    ranked = sorted(errs)
    med, few = ranked[len(ranked) // 2], ranked[-min(FEW, len(ranked))]
    tol, few_tol = TOLERANCE.get(dtype, TOLERANCE["bfloat16"]), FEW_TOLERANCE.get(dtype, FEW_TOLERANCE["bfloat16"])
    ok = med <= tol and few <= few_tol
    return ProbeResult(ok, med, ranked[-1], len(errs), errs, few)


class ProbeSchedule:
    """Which syncs the functional check runs on: the first, then every `every`-th (sync.probe_every; 0: the
    first only). Holds what both sides run, made once from the vocabulary they share: the end-to-end sequences and
    the layer check's spec (colo.sync.layercheck.layer_spec)."""

    def __init__(self, vocab: int, max_model_len: int, every: int) -> None:
        from colo.sync.layercheck import layer_spec

        self.probe = {"seqs": probe_sequences(vocab, length=max(2, min(PROBE_LEN, max_model_len - 1))),
                      "layers": layer_spec(vocab, max_model_len)}
        self.every, self.syncs = int(every), 0

    def next(self) -> dict | None:
        """{"seqs", "layers"} when the sync about to run is checked, else None."""
        due = self.syncs == 0 or (self.every > 0 and self.syncs % self.every == 0)
        self.syncs += 1
        return self.probe if due else None
