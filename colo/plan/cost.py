"""What the trainer's settings cost per RL step, in seconds, from the figures measured on GPUs (docs/benchmarks.md,
"The cost model's inputs": each constant below, its figure, command, card, date and commit).

    step_seconds(model_shape(config_json), settings)   # {"passes": 4.1, "host copies": 0.0, "optimizer": 0.69, ...}

colo.plan.auto ranks the settings that fit by the sum. It is an estimate for ranking, not a prediction: each
factor is a ratio measured in one run on one card (its row in that table), and the absolute scale (tokens per
step, achieved FLOP/s) only matters where a setting trades compute against copies over PCIe. Pure: no torch.

The train phase of one rank, per RL step:
    passes       forwards and backwards over the rank's tokens: model FLOPs / (peak x COMPUTE_MFU), times the
                 factors of the settings that make the kernels slower than the measured best (eager, a small
                 micro-batch, gathering per micro-batch, recompute)
    host copies  trainer.offload: the trainer's state off the GPU after the sync and back before training
    optimizer    each optimizer step: streamed through the GPU (trainer.optimizer_offload) or on it
    compile      trainer.compile's one-off compile, spread over loop.steps
"""
from __future__ import annotations

import math

from colo.plan.memory import ModelShape, trainer_terms
from colo.plan.settings import Settings

PEAK_FLOPS = 989e12
"""Dense bf16 tensor-core peak of an H100 SXM / H200 (colo.bench.step.PEAK_BF16): the only scale measured."""
COMPUTE_MFU = 0.381
"""Model FLOPs over the passes' seconds at the best measured settings: compiled, gathered once, 32,768-token
micro-batches, no recompute: 38.1% (qwen3-30b-a3b-L4 on one H200, trainer state resident)."""
EAGER = 1.82
"""Passes eager / compiled: log-prob pass + update 4.18 s eager against 2.30 s compiled, one run (COMPUTE_MFU's; the
train phase 1.74x)."""
PER_MICRO_GATHER = 1.075
"""Update gathering each FSDP unit per micro-batch / once per pass: 4.41 s against 4.10 s on one card, 4.36 against
4.06 on another, the L12 slice compiled on one H200. Nothing to save with one micro-batch."""
RECOMPUTE = 4 / 3
"""Update with trainer.gradient_checkpointing / without: backward runs each layer's forward again, a fourth forward's
worth to forward + backward's three (~1.1 s of a 4.39-s L12 update on one H200)."""
MICRO_HALF = 17_150
"""Tokens: a pass's time per token goes as 1 + MICRO_HALF / (micro-batch tokens) (per-micro-batch work: the
expert GEMMs' small groups, launches, FSDP's hooks). Fitted on the compiled L12 update on one H200: 8,192 tokens
6.45 s, 12,288 tokens 5.19 s, 32,768 tokens ~3.3 s (4.41 s less its ~1.1 s of recompute); the fit gives 6.70 s at
8,192."""
MEASURED_MICRO = (4096, 8192, 16384, 32768)
"""The token budgets auto chooses among: up to the largest measured (32,768); beyond it the factor above is an
extrapolation."""
HOST_BYTES_PER_S = 46e9
"""trainer.offload's copies, each way: 30.2 GiB off in 0.61 s and back in 0.65 s (colo.trainer.offload, one H100),
the L12 slice's 32.4 GB back in 0.70 s in an RL step (one H200)."""
OPTIM_HOST_BYTES_PER_S = 47e9
"""trainer.optimizer_offload's step: the AdamW state streamed in and out at once, 32.4 GB each way in 0.69 s by pieces
of 32M elements in an RL step (0.682 s alone)."""
OPTIM_GPU_S_PER_PARAM = 0.15 / 3.11e9
"""The optimizer step with its state on the GPU: 0.15 s for qwen3-30b-a3b-L4's 3.11B parameters (one H200)."""
COMPILE_S = 55.0
"""trainer.compile's first step: 52.2 s (L4), 52.6 s and 57 s (L12) of compile in the first warm-up step."""
SAMPLE_FILL = 0.34
"""Mean trained tokens per sample / rollout.max_model_len: 188,741 tokens in 128 samples of 4,352 (colo.bench.step's
long tail: median response max_tokens / 4, 5% cut at max_tokens). A real task's lengths are its own."""


def step_seconds(m: ModelShape, s: Settings) -> dict[str, float]:
    """The estimate of the module docstring, per term (seconds per RL step on the busiest rank)."""
    t, world = s.trainer, s.trainer_world
    mean_len = SAMPLE_FILL * s.rollout.max_model_len
    tokens = s.cfg.data.prompts_per_step * s.rollout.n * mean_len / world  # the rank's share of a step
    updates = max(1, int(t.mini_batches)) * max(1, int(t.epochs))
    per_update = tokens / max(1, int(t.mini_batches))
    micro = min(s.micro_tokens, per_update) if t.packing else t.micro_batch_size * mean_len
    one_pass = 1.0 if str(t.old_logprobs) == "pass" or updates > 1 else 0.0  # trainer.old_logprobs=auto
    forwards = one_pass + (1.0 if s.ref_model else 0.0) + 3.0 * max(1, int(t.epochs)) * \
        (RECOMPUTE if t.gradient_checkpointing else 1.0)
    slow = (1 + MICRO_HALF / micro) / (1 + MICRO_HALF / 32768)
    slow *= 1.0 if t.compile else EAGER
    slow *= 1.0 if t.gather_once or math.ceil(per_update / micro) <= 1 else PER_MICRO_GATHER
    flops = forwards * tokens * forward_flops_per_token(m, mean_len)
    terms = trainer_terms(m, s)
    state = terms["params"] + terms["ref"] + (0 if t.optimizer_offload else terms["optim_full"])
    step = terms["optim_full"] / OPTIM_HOST_BYTES_PER_S if t.optimizer_offload else \
        terms["params"] / 4 * OPTIM_GPU_S_PER_PARAM
    return {"passes": flops / (PEAK_FLOPS * COMPUTE_MFU) * slow,
            "host copies": 2 * state / HOST_BYTES_PER_S if t.offload and s.colocated else 0.0,
            "optimizer": updates * step,
            "compile": COMPILE_S / max(1, s.cfg.loop.steps) if t.compile else 0.0}


def forward_flops_per_token(m: ModelShape, mean_len: float) -> float:
    """Model FLOPs of one token's forward, as colo.bench.step.forward_flops counts them: 2 x the active parameters'
    matmuls (the routed experts' top-k share; the lm_head, the embedding's rows when tied; not the lookup) and
    attention over a sample of `mean_len` tokens."""
    dense = sum(p.numel for p in m.params
                if not p.expert and len(p.shape) == 2 and p.name != "model.embed_tokens.weight")
    if not any(p.name == "lm_head.weight" for p in m.params):
        dense += m.vocab * m.hidden  # tied: the embedding is the lm_head too
    active = dense + (m.expert_numel * m.top_k / m.experts if m.experts else 0)
    return 2.0 * active + 2.0 * m.layers * m.heads * m.head_dim * mean_len
