"""What the trainer's settings cost per RL step, in seconds, from figures measured on each kind of device.

    speeds = speeds_for("NVIDIA H200")                          # SPEEDS["H200"]; a device without a row: Hopper's
    step_seconds(model_shape(config_json), settings, speeds)    # {"passes": 4.1, "host copies": 0.0, ...}
    fp8_measured(shape, "H100", 512)                            # FP8_MEASURED: FP8's step against bf16's, or None
    async_measured(shape, "H100", 1, 128, 2048)                 # ASYNC_MEASURED: async's step against sync's, or None

colo.plan.search ranks settings by the sum, for `auto` and for a refusal's ways to fit alike. It is an estimate for
ranking, not a prediction: each figure is measured in one run on one card (docs/benchmarks.md, "The cost model's
inputs"), and the absolute scale (tokens per step, achieved FLOP/s) only matters where a setting trades compute
against copies over PCIe. Pure: no torch.

The train phase of one rank, per RL step:
    passes       forwards and backwards over the rank's tokens: model FLOPs / (peak x compute_mfu), times the
                 factors of the settings that make the kernels slower than the measured best (eager, a small
                 micro-batch, gathering per micro-batch, recompute)
    host copies  trainer.offload: the trainer's state off the GPU after the sync and back before training
    optimizer    each optimizer step: streamed through the GPU (trainer.optimizer_offload) or on it
    compile      trainer.compile's one-off compile, spread over loop.steps
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

from colo.plan.memory import ModelShape, trainer_terms
from colo.plan.settings import Settings


@dataclass(frozen=True)
class Speeds:
    """What one kind of device does per second, as the cost model reads it (one row of SPEEDS)."""
    name: str
    peak_flops: float
    """Dense peak of the compute dtype's matmuls, FLOP/s."""
    compute_mfu: float
    """Model FLOPs over the passes' seconds at the best measured settings."""
    eager: float
    """Passes eager / compiled."""
    per_micro_gather: float
    """Update gathering each FSDP unit per micro-batch / once per pass."""
    recompute: float
    """Update with trainer.gradient_checkpointing / without."""
    micro_half: float
    """Tokens: a pass's time per token goes as 1 + micro_half / (micro-batch tokens)."""
    host_bytes_per_s: float
    """trainer.offload's copies, each way."""
    optim_host_bytes_per_s: float
    """trainer.optimizer_offload's step: the AdamW state streamed in and out."""
    optim_s_per_param: float
    """The optimizer step with its state on the device, seconds per parameter."""
    compile_s: float
    """trainer.compile's first step: the compile it pays once per trainer process."""
    measured: str
    """Where the row's figures come from, in a few words."""

    @property
    def measured_here(self) -> bool:
        """The device has a row of its own in SPEEDS (else the plan's summary says whose figures it borrows)."""
        return SPEEDS.get(self.name) is self


H200 = Speeds(
    name="H200", peak_flops=989e12,  # dense bf16 tensor-core peak of an H200 (and an H100 SXM)
    # 38.1%: compiled, gathered once, 32,768-token micro-batches, no recompute (qwen3-30b-a3b-L4 on 1xH200)
    compute_mfu=0.381,
    eager=1.82,  # log-prob pass + update 4.18 s eager against 2.30 s compiled (the same L4 run)
    per_micro_gather=1.075,  # the L12 update 4.41 s against 4.10 s, and 4.36 against 4.06, compiled, 1xH200
    recompute=4 / 3,  # backward runs each layer's forward again: a fourth forward to forward + backward's three
    # fitted on the compiled L12 update on 1xH200: 8,192 tokens 6.45 s, 12,288 5.19 s, 32,768 ~3.3 s
    micro_half=17_150,
    host_bytes_per_s=46e9,  # 30.2 GiB off in 0.61 s and back in 0.65 s (1xH100); the L12 slice's 32.4 GB in 0.70 s
    optim_host_bytes_per_s=47e9,  # the L12 AdamW state streamed in and out at once, 32.4 GB each way in 0.69 s
    optim_s_per_param=0.15 / 3.11e9,  # 0.15 s for qwen3-30b-a3b-L4's 3.11B parameters
    compile_s=55.0,  # 52.2, 52.6 and 57 s of compile in the first warm-up step
    measured="1xH200 (offload's copies: 1xH100 too)")
"""The Hopper row: measured on one H200 (docs/benchmarks.md, the step and the plan's calibration tables)."""
H100 = dataclasses.replace(H200, name="H100", measured="H200's figures (the same tensor cores and peak); offload's "
                                                      "copies measured on 1xH100")
"""An H100 SXM: the passes were measured on H200s, whose tensor cores and peak it shares (the H100's lower memory
bandwidth is not in the estimate); offload's copies ran at the same 46 GB/s on both."""
CPU = Speeds(
    name="cpu", peak_flops=27.5e9,  # a float32 matmul on one thread of the suite's 2-core AMD EPYC (AVX2)
    compute_mfu=0.075,  # the tiny model's log-prob pass + update: ~2.0 GFLOP/s (colo.bench.step --preset tiny)
    eager=H200.eager, per_micro_gather=H200.per_micro_gather, recompute=H200.recompute,
    micro_half=0.0,  # not measured on CPU: no per-micro-batch cost counted
    host_bytes_per_s=17e9,  # a 256 MiB host copy on one thread of a 2-core AMD EPYC
    optim_host_bytes_per_s=17e9,  # the same copies: host and device memory are one
    optim_s_per_param=28 / 17e9,  # AdamW reads param, grad and two states and writes three, fp32, at that bandwidth
    compile_s=42.7,  # the tiny model's trainer.compile=true, in the first warm-up step (CPU)
    measured="a 2-core AMD EPYC, one thread per trainer; eager, gather and recompute ratios are the H200's")
"""CPU kinds differ several-fold (a float32 matmul ran at 27.5 GFLOP/s on one thread of an AVX2 EPYC, ~100 on an
AVX512 one), and a tiny model's steps are mostly fixed costs the FLOP count does not see: the row gives the order
of magnitude. colo.plan.auto keeps the CPU suite's settings on CPU (CPU_WHY) whatever it estimates."""
SPEEDS: dict[str, Speeds] = {"H100": H100, "H200": H200, "cpu": CPU}
"""The measured rows, by the name placement.gpu_memory takes (H100-80GB, H100-SXM: H100) or "cpu"."""
MEASURED_MICRO = (4096, 8192, 16384, 32768)
"""The token budgets auto chooses among: up to the largest measured on a GPU (32,768); beyond it micro_half's factor
is an extrapolation."""
SAMPLE_FILL = 0.34
"""Mean trained tokens per sample / rollout.max_model_len: 188,741 tokens in 128 samples of 4,352 (colo.bench.step's
long tail: median response max_tokens / 4, 5% cut at max_tokens). A real task's lengths are its own."""


@dataclass(frozen=True)
class Fp8Measured:
    """One measured FP8-against-bf16 comparison of colo's RL step (rollout.quantization=fp8,none): docs/benchmarks.md,
    "FP8 against bf16", the row of the same workload, card and date."""
    name: str
    """The model as the row names it (a colo.models.tiny preset)."""
    shape: tuple[str, int, int, int, int]
    """(architecture, layers, hidden size, experts, moe_intermediate_size): how a job's model is matched."""
    card: str
    """The SPEEDS row of the card it ran on."""
    prompts: int
    n: int
    max_tokens: int
    step: float
    """FP8's tokens/s/GPU over bf16's (below 1: FP8 lost)."""
    rollout: float
    """FP8's rollout speed over bf16's (bf16's rollout seconds over FP8's)."""
    sync: float
    """FP8's sync seconds over bf16's."""
    date: str


L4_SHAPE = ("Qwen3MoeForCausalLM", 4, 2048, 128, 768)
FP8_MEASURED = (
    Fp8Measured("qwen3-30b-a3b-L4", L4_SHAPE, "H100", 16, 8, 2048, step=0.95, rollout=8.19 / 8.78, sync=1.85,
                date="2026-12-07"),
    Fp8Measured("qwen3-30b-a3b-L4", L4_SHAPE, "H100", 64, 8, 2048, step=0.96, rollout=0.93, sync=0.083 / 0.044,
                date="2026-12-07"),
)
"""The measured FP8 steps, with the torch quantization in the sync and vLLM's default fused-MoE tiles on the H100 (before
colo.sync.fp8_pack and colo.rollout.moe_tuning): a new measurement replaces its row. colo.plan.job.fp8_warning reads
them; rollout.quantization stays the user's choice (default none), never picked by the plan."""


def fp8_measured(model: tuple[str, int, int, int, int], card: str, seqs: int) -> Fp8Measured | None:
    """The measurement of this model shape on this card nearest the step's sequences (prompts x n); None if none."""
    rows = [r for r in FP8_MEASURED if r.shape == model and r.card == card]
    return min(rows, key=lambda r: abs(r.prompts * r.n - seqs)) if rows else None


@dataclass(frozen=True)
class AsyncMeasured:
    """One measured async-against-sync comparison of colo's RL step (colo.bench.step --compare loop.mode=async,sync,
    colocated, one turn, the bench's long-tail lengths): docs/benchmarks.md, "Async against sync", the row of the same
    workload, card and date."""
    name: str
    """The model as the row names it (a colo.models.tiny preset)."""
    shape: tuple[str, int, int, int, int]
    """(architecture, layers, hidden size, experts, moe_intermediate_size): how a job's model is matched."""
    card: str
    """The SPEEDS row of the card it ran on."""
    gpus: int
    prompts: int
    n: int
    max_tokens: int
    oversample: float
    """The row's rollout.oversample."""
    max_staleness: int
    """The row's loop.max_staleness."""
    ratio: float
    """Async's tokens/s/GPU over sync's (below 1: async lost)."""
    spread: str
    """How the ratio was taken: repeats or calls, and their range."""
    date: str


ASYNC_MEASURED = (
    AsyncMeasured("qwen3-30b-a3b-L4", L4_SHAPE, "H100", 1, 16, 8, 2048, oversample=3.0, max_staleness=3, ratio=1.31,
                  spread="median of 3 repeats, 1.27-1.41, compiled trainer", date="2026-12-07"),
    AsyncMeasured("qwen3-30b-a3b-L4", L4_SHAPE, "H200", 1, 16, 8, 2048, oversample=3.0, max_staleness=3, ratio=1.30,
                  spread="the lower of two calls, 1.48 and 1.30", date="2026-11-26, 2026-11-28"),
    AsyncMeasured("qwen3-30b-a3b-L4", L4_SHAPE, "H100", 1, 16, 8, 4096, oversample=1.5, max_staleness=1, ratio=1.035,
                  spread="one call, eager trainer", date="2026-11-26"),
    AsyncMeasured("qwen3-30b-a3b-L4", L4_SHAPE, "H100", 1, 64, 8, 2048, oversample=1.5, max_staleness=1, ratio=0.95,
                  spread="one call, eager trainer", date="2026-11-26"),
)
"""The measured async steps on GPUs, one per row of docs/benchmarks.md's "Async against sync" table that ran
colocated with independent long-tail lengths (per-prompt correlated lengths measured 0.99x at the defaults, a row
auto cannot match: a job's length distribution is its task's); a new measurement replaces its row. colo.plan.loopmode
reads them for loop.mode=auto. No CPU rows: the CPU keeps sync, what the suite's learning bounds were measured on (there
the tiny bench measured async 1.117x, and the default job ran 42.7 RL-seconds async against 40.5 sync)."""
ASYNC_NEAR = 1.5
"""A row answers for a job whose sequences per step (prompts x n) and rollout.max_tokens are each within this factor
of its own, the nearest where several do: 16x8 at 2k answers for 11-24 prompts x 8 at 1,366-3,072 tokens (from 2,897
tokens on an H100, the 4k row is nearer); 32x8 or 4k is another workload (at 64x8 and at 4k the defaults measured 0.95x
and 1.035x)."""
ASYNC_PAYS = 1.10
"""The ratio from which auto picks async: a ratio of one call moves with the rollout by up to ~20% between calls
(docs/benchmarks.md, Method), so a 1.035x call is no evidence that async pays."""


def async_measured(model: tuple[str, int, int, int, int], card: str, gpus: int, seqs: int,
                   max_tokens: int) -> AsyncMeasured | None:
    """The measurement of this model shape on this card and GPU count nearest the step's sequences (prompts x n) and
    response length, among those within ASYNC_NEAR of both; None if none."""
    def off(r: AsyncMeasured) -> tuple[float, float]:
        return abs(math.log(seqs / (r.prompts * r.n))), abs(math.log(max_tokens / r.max_tokens))

    near = math.log(ASYNC_NEAR) + 1e-9
    rows = [r for r in ASYNC_MEASURED if r.shape == model and r.card == card and r.gpus == gpus
            and max(off(r)) <= near]
    return min(rows, key=lambda r: sum(off(r))) if rows else None


def speeds_for(device: str) -> Speeds:
    """The row of a device: "cpu", a placement.gpu_memory name or a CUDA device's name ("NVIDIA H200"). A GPU without a
    row (an A100, or a size such as 80GiB) gets the H200's: an estimate for ranking, which says so (Speeds.measured)."""
    if device == "cpu":
        return CPU
    for key in ("H200", "H100"):  # "NVIDIA H100 80GB HBM3", "H100-80GB", ...
        if key in device.upper():
            return SPEEDS[key]
    return dataclasses.replace(H200, name=device, measured=f"no row for {device}: the H200's figures")


def step_seconds(m: ModelShape, s: Settings, speeds: Speeds) -> dict[str, float]:
    """The estimate of the module docstring, per term (seconds per RL step on the busiest rank)."""
    t, world, v = s.trainer, s.trainer_world, speeds
    mean_len = SAMPLE_FILL * s.rollout.max_model_len
    tokens = s.cfg.data.prompts_per_step * s.rollout.n * mean_len / world  # the rank's share of a step
    updates = max(1, int(t.mini_batches)) * max(1, int(t.epochs))
    per_update = tokens / max(1, int(t.mini_batches))
    micro = min(s.micro_tokens, per_update) if t.packing else t.micro_batch_size * mean_len
    one_pass = 1.0 if t.old_logprobs == "pass" else 0.0  # "update": the one update's own forward gives them
    forwards = one_pass + (1.0 if s.ref_model else 0.0) + 3.0 * max(1, int(t.epochs)) * \
        (v.recompute if t.gradient_checkpointing else 1.0)
    slow = (1 + v.micro_half / micro) / (1 + v.micro_half / 32768)
    slow *= 1.0 if t.compile else v.eager
    slow *= 1.0 if t.gather_once or math.ceil(per_update / micro) <= 1 else v.per_micro_gather
    flops = forwards * tokens * forward_flops_per_token(m, mean_len)
    terms = trainer_terms(m, s)
    state = terms["params"] + terms["ref"] + (0 if t.optimizer_offload else terms["optim_full"])
    step = terms["optim_full"] / v.optim_host_bytes_per_s if t.optimizer_offload else \
        terms["params"] / 4 * v.optim_s_per_param
    return {"passes": flops / (v.peak_flops * v.compute_mfu) * slow,
            "host copies": 2 * state / v.host_bytes_per_s if t.offload and s.colocated else 0.0,
            "optimizer": updates * step,
            "compile": v.compile_s / max(1, s.cfg.loop.steps) if t.compile else 0.0}


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
