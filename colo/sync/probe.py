"""The functional check of a sync: the engine and the trainer score the same token sequences and must agree.

    seqs = probe_sequences(vocab)                                  # a few fixed token sequences
    trainer:  scores(seqs) via the policy's forward                -> ProbeScores (+ sublayer traces of seqs[-1])
    engine:   vLLM's prompt log-probs of seqs (top-k per position) -> ProbeScores
    check(trainer, engine, dtype)                                  -> ProbeResult (ok, err)
    first_difference(trainer_trace, engine_trace)                  -> "layer 1 attention" when they disagree

The byte check (colo.sync.verify) proves the bytes arrived; it cannot see what vLLM computes from them after
loading (colo.sync.refresh: packed layouts, MLA's absorbed projections). This check looks at what the engine
computes: for every position of every sequence, the log-probs of the engine's top-k next tokens and of the actual
next token, against the trainer's log-probs of the same tokens.

The measure: per position, the RMS of the differences divided by the RMS spread of the trainer's log-probs over
those tokens about their mean (so it reads the same for a peaked trained model and a near-uniform random tiny
one); the median over positions (an MoE routing decision that rounding flips moves one position, a stale weight
moves all of them) against TOLERANCE[dtype]. Where it fails, the per-sublayer traces of one sequence
(embedding, each decoder layer's attention and MLP output, projected on a fixed random basis so a trace is a few KB)
name the first sublayer whose output differs: the layer family to look at. A trace covers the last sequence.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

PROBE_SEQS = 2  # sequences per check
PROBE_LEN = 24  # tokens each (<= max_model_len - 1, checked by the caller)
ENGINE_TOPK = 8  # the engine's top-k next tokens compared per position
TRAINER_TOPR = 64  # the trainer's top-r next tokens sent to the driver (the engine's top-k lie inside them)
TRACE_DIM = 16  # width of the random basis a sublayer's output is projected on
TOLERANCE = {"float32": 0.02, "bfloat16": 0.15, "float16": 0.1, "fp8": 0.3}
"""Median per-position relative error allowed (docs/benchmarks.md, "Verification: cost and noise"). With a correct
sync: float32 3e-7 to 2.4e-6 (the default job), bfloat16 0.008 to 0.012 (the nine CPU families), 0.013 and 0.018 on
an H200 (the L12 slice; the whole Qwen3-30B-A3B with LoRA); with the post-load refresh skipped: 1.16 (DeepSeek-V3).
"fp8" (rollout.quantization=fp8: an FP8 engine against the bf16 trainer): FP8's rounding alone measures 0.054-0.081
with the weights rounded and 0.074-0.096 with W8A8's activations rounded too (`python -m tools.experiments.fp8probe`,
the tiny and tiny-fp8 presets, 3 seeds each, CPU), a stale engine >= 2.5: 0.3 is three times FP8's worst on top of
bf16's kernel differences (<= 0.02), and well below what a skipped refresh or a stale engine measures."""


def tolerance_key(model_dtype: str, quantization: str = "none") -> str:
    """The TOLERANCE entry a run's check uses: its engine's weights (rollout.quantization), else model.dtype."""
    return "fp8" if quantization == "fp8" else model_dtype
LAYER_TOLERANCE = 0.25  # relative error of one sublayer's projected output that counts as "differs"


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
    errs.sort()
    med = errs[len(errs) // 2]
    return ProbeResult(med <= TOLERANCE.get(dtype, TOLERANCE["bfloat16"]), med, errs[-1], len(errs))


# ---------------------------------------------------------------------------------- sublayer traces


def sublayers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(label, module) in forward order: the embedding, then each decoder layer's attention and MLP. The same
    labels for a transformers model and a vLLM model of one family (both keep the checkpoint's layer structure:
    `model.embed_tokens`, `model.layers.N.self_attn` / `linear_attn` / `attn`, `.mlp` / `.block_sparse_moe`)."""
    base = getattr(model, "model", model)
    out: list[tuple[str, nn.Module]] = []
    for name in ("embed_tokens", "embedding", "wte"):
        if isinstance(getattr(base, name, None), nn.Module):
            out.append(("embedding", getattr(base, name)))
            break
    layers = getattr(base, "layers", None)
    for i, layer in enumerate(layers if isinstance(layers, nn.ModuleList) else []):
        for child_name, child in layer.named_children():
            if child_name.endswith("attn"):  # self_attn, attn (vLLM's GPT-OSS), linear_attn (gated delta-net)
                out.append((f"layer {i} {'linear attention' if 'linear' in child_name else 'attention'}", child))
        for child_name, child in layer.named_children():
            if child_name in ("mlp", "block_sparse_moe", "feed_forward"):
                out.append((f"layer {i} mlp", child))
    return out


def _basis(width: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(width, TRACE_DIM, generator=g) / math.sqrt(width)).to(device)  # (H, D)


@contextmanager
def traced(model: nn.Module, tokens: int) -> Iterator[dict[str, list[list[float]]]]:
    """While active, each sublayer's output over the last `tokens` tokens it computes is kept, projected on a fixed
    random basis: {label: (tokens, TRACE_DIM) as lists}. Labels whose module returned no tensor are left out."""
    traces: dict[str, list[list[float]]] = {}
    handles = []

    def hook(label: str):
        def save(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            if not torch.is_tensor(out) or out.dim() < 2:
                return
            flat = out.detach().reshape(-1, out.shape[-1])[-tokens:].float()  # (tokens, H)
            traces[label] = (flat @ _basis(flat.shape[-1], flat.device)).cpu().tolist()
        return save

    for label, module in sublayers(model):
        handles.append(module.register_forward_hook(hook(label)))
    try:
        yield traces
    finally:
        for h in handles:
            h.remove()


def first_difference(trainer: dict[str, list[list[float]]], engine: dict[str, list[list[float]]]) -> str | None:
    """The first sublayer (forward order of the trainer's trace) whose projected outputs differ by more than
    LAYER_TOLERANCE relative error; None when every sublayer both sides traced agrees (or none was traced)."""
    for label, a in trainer.items():
        b = engine.get(label)
        if b is None:
            continue
        ta, tb = torch.tensor(a), torch.tensor(b)
        if ta.shape != tb.shape:
            return f"{label} (output shapes {tuple(ta.shape)} and {tuple(tb.shape)})"
        rel = float((ta - tb).norm() / ta.norm().clamp_min(1e-6))
        if rel > LAYER_TOLERANCE:
            return f"{label} (relative error {rel:.2f})"
    return None


class ProbeSchedule:
    """Which syncs the functional check runs on: the first, then every `every`-th (sync.probe_every; 0: the
    first only). Holds the sequences, made once from the vocabulary both sides share."""

    def __init__(self, vocab: int, max_model_len: int, every: int) -> None:
        self.seqs = probe_sequences(vocab, length=max(2, min(PROBE_LEN, max_model_len - 1)))
        self.every, self.syncs = int(every), 0

    def next(self) -> list[list[int]] | None:
        """The sequences when the sync about to run is checked, else None."""
        due = self.syncs == 0 or (self.every > 0 and self.syncs % self.every == 0)
        self.syncs += 1
        return self.seqs if due else None
