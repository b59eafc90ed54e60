"""Memory plan of a GPU job: bytes per GPU and per phase, from the model's config.json and the settings.

    plan = plan_memory(config_json, Settings.from_config(cfg), gpu_bytes=parse_gpu_memory("H100"))
    print(plan.table())                 # rows: vLLM weights, KV cache, trainer params, grads, ...
    plan.fits, plan.worst               # False, ("train", 96.1e9)
    colo.plan.search.ways_to_fit(config_json, settings, gpu_bytes, speeds)   # [(changes, plan)], each re-planned

Pure: no torch, no GPU, no files (config.json comes in as a dict), so a laptop plans a 32-GPU job.

Per GPU, colocated (one trainer rank and one vLLM engine of a DP+EP group per GPU), the phases of a step:

    start    vLLM starts while the trainer holds its fp32 params (colo.cluster.actors starts both at once; the
             trainer is set up first): vLLM asks for vllm_gpu_fraction x GPU of what is left
    rollout  vLLM awake (weights + KV cache + its activation reserve = vllm_gpu_fraction x GPU), trainer
             offloaded (only its sync buffers stay) or, with trainer.offload=false, resident
    asleep   vLLM asleep (level 2: weights and KV freed), trainer offloaded: what never leaves the GPU
    train    trainer onloaded: fp32 params, grads, AdamW state, gathered FSDP units, activations and
             logits of one micro-batch (forward/backward), then the optimizer step's temporaries
    sync     vLLM's weights awake again, the trainer still holds params + optimizer state, gathers dense
             units into bf16 and packs them into the sync buffers (train_step released its cache first)

Where the figures come from (docs/benchmarks.md, "Memory plan: calibration", holds the table):
- First principles: parameter counts (checked against transformers' own models in tests), FSDP2's dim-0
  shard on the largest rank, AdamW's two fp32 states, foreach AdamW's one fp32 temporary per parameter
  (torch/optim/adam.py `_foreach_sqrt`), activations per token per layer read off the HF Qwen3-MoE code
  (what autograd saves), the log-prob pass's lm_head chunk as bf16 + fp32 copies of (chunk x vocab)
  (colo.algo.logprobs: never the whole micro-batch's logits).
- Calibrated on the measured `qwen3-30b-a3b-L2` loop (1xH200 and 1xH100, vLLM at 0.3, same figures on
  both): OVERHEAD (CUDA contexts, NCCL, what vLLM holds outside its fraction), the vLLM reserve that
  survives sleep (its profiling activations; fitted on L2 and on the tiny model's sleep figures), and
  ALLOC_SLACK, the caching allocator's reserve over allocated bytes in the train phase.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from colo.models.archs import num_experts
from colo.models.lora import EXPERT_PARAMS, target_of
from colo.plan.settings import Settings
from colo.plan.vllm_weights import engine_weights

GiB = 2**30
GPUS_PER_NODE = 8  # host memory is reported per node of this many GPUs (the plan does not ask the cluster)

# ---- calibrated constants (each fitted on the measured figures named; the rest is first principles) ----
OVERHEAD = 3.25 * GiB
"""Per GPU, outside vLLM's fraction and the trainer's tensors: the CUDA contexts of the trainer and of vLLM's
worker, NCCL's buffers, cached-but-free blocks. Fitted: L2 loop rollout on 1xH200, 47.3 GiB used = 0.3 x
139.8 (vLLM) + 2.1 (trainer's peak while offloaded) + 3.25; on 1xH100 the same sum gives 29.1 (measured
28.9-29.3)."""
VLLM_RESERVE_BASE = 0.22 * GiB
VLLM_RESERVE_PER_WIDTH = 2.25e-4 * GiB
"""What vLLM keeps through sleep inside its fraction (the profile run's activations, sampler buffers):
BASE + PER_WIDTH x (hidden + top_k x 2 x moe_intermediate), the width a token's activations take. Fitted on
two points: L2 (width 14336): rollout - asleep = 47.3 - 8.8 = 38.5 GiB freed of 0.3 x 139.8 = 41.9, so 3.45
GiB stay (H100: 29.1 - 8.8 = 20.3 of 23.76, 3.46); tiny (width 384): 0.31 GiB (sleep freed 55.61 of 55.92 +
0.49 context). For other widths (Qwen3-235B-A22B: 28672) it is an extrapolation."""
ALLOC_SLACK = 0.26
"""The trainer's caching allocator reserves this much more than it allocates in the train phase (onload's
fresh tensors next to activations of many sizes fragment it). Fitted: L2 loop, device used grew 8.8 -> 52.9
GiB while the trainer's allocated peak grew 2.1 -> 37.0 GiB: 44.1 / 34.9 = 1.26."""
OFFLOADED_REST = 0.1 * GiB
"""Trainer allocations that stay on the GPU when it is offloaded, besides the sync buffers (L2: 2.1 GiB
peak with 2 x 1 GiB buffers)."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    expert: bool  # a fused (E, ...) expert tensor: dim 0 is the expert index

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def rows_on(self, world: int) -> int:
        """Rows of the largest FSDP2 dim-0 shard (torch.chunk: ceil(d0 / world), rank 0 has the most)."""
        return -(-self.shape[0] // world)


@dataclass(frozen=True, eq=False)  # hashed by identity: model_shape() keeps one per config, the caches below key on it
class ModelShape:
    """What the plan needs from config.json."""
    architecture: str
    params: tuple[ParamSpec, ...]
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int  # 0: dense
    top_k: int
    moe_intermediate: int
    intermediate: int  # dense MLP width (dense layers, or a shared expert)
    moe_layers: int
    qk_norm: bool

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def expert_numel(self) -> int:
        return sum(p.numel for p in self.params if p.expert)

    @property
    def kv_bytes_per_token(self) -> int:
        """vLLM's bf16 KV cache: K and V for every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def width(self) -> int:
        return self.hidden + (self.top_k * 2 * self.moe_intermediate if self.experts else 2 * self.intermediate)


def model_shape(c: dict[str, Any]) -> ModelShape:
    return _model_shape(json.dumps(c, sort_keys=True, default=str))


@functools.lru_cache(maxsize=16)
def _model_shape(text: str) -> ModelShape:  # cached: ways_to_fit plans one model a thousand times
    return _build_shape(json.loads(text))


def _build_shape(c: dict[str, Any]) -> ModelShape:
    """Every trainer parameter of an HF decoder LM (Qwen3-MoE, Qwen2-MoE, Mixtral, Qwen3/Llama dense), in
    transformers v5's in-memory layout (experts fused: gate_up_proj (E, 2I, H), down_proj (E, H, I))."""
    arch = (c.get("architectures") or ["?"])[0]
    mtype = str(c.get("model_type", ""))
    H, L, V = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    nh = int(c["num_attention_heads"])
    nkv = int(c.get("num_key_value_heads") or nh)
    hd = int(c.get("head_dim") or H // nh)
    E = num_experts(c)
    k = int(c.get("num_experts_per_tok") or 0)
    I_moe = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0)
    I_dense = int(c.get("intermediate_size") or 0)
    shared = int(c.get("shared_expert_intermediate_size") or 0)
    sparse_step = int(c.get("decoder_sparse_step") or 1)
    mlp_only = set(c.get("mlp_only_layers") or [])
    qk_norm = mtype.startswith("qwen3")
    bias = mtype.startswith("qwen2") or bool(c.get("attention_bias", False))  # Qwen2's q/k/v always have one
    out: list[ParamSpec] = [ParamSpec("model.embed_tokens.weight", (V, H), False)]
    moe_layers = 0
    for i in range(L):
        p = f"model.layers.{i}."
        att = [("q_proj", nh * hd, H), ("k_proj", nkv * hd, H), ("v_proj", nkv * hd, H)]
        for n, rows, cols in att:
            out.append(ParamSpec(f"{p}self_attn.{n}.weight", (rows, cols), False))
            if bias:
                out.append(ParamSpec(f"{p}self_attn.{n}.bias", (rows,), False))
        out.append(ParamSpec(f"{p}self_attn.o_proj.weight", (H, nh * hd), False))
        if qk_norm:
            out += [ParamSpec(f"{p}self_attn.q_norm.weight", (hd,), False),
                    ParamSpec(f"{p}self_attn.k_norm.weight", (hd,), False)]
        if E and i not in mlp_only and (i + 1) % sparse_step == 0:
            moe_layers += 1
            out += [ParamSpec(f"{p}mlp.experts.gate_up_proj", (E, 2 * I_moe, H), True),
                    ParamSpec(f"{p}mlp.experts.down_proj", (E, H, I_moe), True),
                    ParamSpec(f"{p}mlp.gate.weight", (E, H), False)]
            if shared:
                out += [ParamSpec(f"{p}mlp.shared_expert.{n}.weight", s, False) for n, s in
                        (("gate_proj", (shared, H)), ("up_proj", (shared, H)), ("down_proj", (H, shared)))]
                out.append(ParamSpec(f"{p}mlp.shared_expert_gate.weight", (1, H), False))
        else:
            out += [ParamSpec(f"{p}mlp.{n}.weight", s, False) for n, s in
                    (("gate_proj", (I_dense, H)), ("up_proj", (I_dense, H)), ("down_proj", (H, I_dense)))]
        out += [ParamSpec(f"{p}input_layernorm.weight", (H,), False),
                ParamSpec(f"{p}post_attention_layernorm.weight", (H,), False)]
    out.append(ParamSpec("model.norm.weight", (H,), False))
    if not c.get("tie_word_embeddings", False):
        out.append(ParamSpec("lm_head.weight", (V, H), False))
    return ModelShape(arch, tuple(out), L, H, nh, nkv, hd, V, E, k, I_moe, shared or I_dense, moe_layers, qk_norm)


# ------------------------------------------------------------------------------------------ activations


def layer_activation_bytes(m: ModelShape, tokens: int, moe: bool) -> int:
    """Bytes autograd saves in one decoder layer's forward for `tokens` tokens (bf16 compute), read off
    transformers' Qwen3-MoE code: RMSNorms keep an fp32 copy and the bf16 result (6 B per element); q and k
    keep the projection, q/k-norm's fp32 + bf16 copies and RoPE's rotate_half (12 B); SDPA keeps q, k, v and
    its output; every (token, expert) pair keeps the gathered input (2H), gate_up's output (4I: silu holds
    a view of it), silu(gate) and act*up (2I each) and the weighted down output (2H)."""
    H, q, kv = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    norms = 2 * 6 * H
    attn = (12 if m.qk_norm else 6) * (q + kv) + 2 * kv + 2 * q
    if moe:
        mlp = m.top_k * (4 * H + 8 * m.moe_intermediate) + 2 * H + 8 * m.experts
        if m.intermediate and m.intermediate != m.moe_intermediate and m.experts and _has_shared(m):
            mlp += 8 * m.intermediate
    else:
        mlp = 8 * m.intermediate
    return tokens * (norms + attn + mlp)


@functools.lru_cache(maxsize=256)  # colo.plan.search plans one model many times
def _has_shared(m: ModelShape) -> bool:
    return any(".shared_expert." in p.name for p in m.params)


LOGITS_BYTES = 20
"""Bytes per (token of one lm_head chunk x vocab) in a backward of colo.algo.logprobs: the chunk's bf16 logits
(2), their fp32 copy turned into log p in place (4), p (4), the logits' gradient in fp32 (4) and a product
temporary (4), its bf16 cast (2). Read off the code, not yet measured: colo.bench.step reports the pass's
measured peak (logprob_pass_gb). The old full-logits path held 14 B x every token of the micro-batch
(measured 1xH200, 1 x 4096 tokens: 8.11 GiB for Qwen3's vocabulary), now 20 B x one chunk (1024 tokens:
2.9 GiB at any length)."""
LOGITS_NO_GRAD_BYTES = 14
"""The same per chunk in a forward (log-prob pass, and the update's forward): bf16 logits 2, fp32 4,
logsumexp's temporary 4, exp's 4."""


def activation_bytes(m: ModelShape, s: Settings) -> dict[str, int]:
    """Peak activation memory of one micro-batch (Settings.micro_tokens), and of the lm_head chunk in backward."""
    tokens = s.micro_tokens
    per_layer = [layer_activation_bytes(m, tokens, moe=i < m.moe_layers) for i in range(m.layers)]
    if s.trainer.gradient_checkpointing:
        # non-reentrant checkpoint per decoder layer: each layer keeps its input, and backward recomputes
        # one layer at a time
        layers = m.layers * tokens * m.hidden * s.param_bytes + max(per_layer)
    else:
        layers = sum(per_layer)
    chunk = min(s.trainer.logprob_chunk, tokens)
    # the chunk's temporaries and, summed over chunks, the unsharded lm_head gradient and the last hidden states'
    # gradient in the compute dtype (colo.algo.logprobs: both are made in forward and wait there for backward)
    return {"layers": layers, "logits": LOGITS_BYTES * chunk * m.vocab + s.param_bytes * (m.vocab + tokens) * m.hidden}


# ---------------------------------------------------------------------------------------------- the plan


@dataclass
class MemoryPlan:
    """Bytes per GPU (the largest rank) per phase; `rows` are (component, {phase: bytes})."""
    model: ModelShape
    settings: Settings
    gpu_bytes: Optional[float]
    gpu_source: str
    phases: tuple[str, ...]
    rows: list[tuple[str, dict[str, float]]]
    kv_tokens: float  # tokens vLLM's KV cache holds per engine (colocated / engine GPU)
    host_per_gpu: dict[str, float]
    notes: list[str] = field(default_factory=list)

    def total(self, phase: str) -> float:
        return sum(v.get(phase, 0.0) for _, v in self.rows)

    @property
    def totals(self) -> dict[str, float]:
        return {p: self.total(p) for p in self.phases}

    @property
    def worst(self) -> tuple[str, float]:
        phase = max(self.phases, key=self.total)
        return phase, self.total(phase)

    @property
    def kv_ok(self) -> bool:
        """vLLM refuses to start when its KV cache cannot hold one max_model_len sequence."""
        return self.kv_tokens >= self.settings.rollout.max_model_len

    @property
    def fits(self) -> bool:
        return self.gpu_bytes is not None and self.worst[1] <= self.gpu_bytes and self.kv_ok

    def problem(self) -> str:
        """Why it does not fit, in a few words ('' when it fits or no GPU size is known)."""
        if self.gpu_bytes is None:
            return ""
        phase, need = self.worst
        if need > self.gpu_bytes:
            top = max(self.rows, key=lambda r: r[1].get(phase, 0.0))
            return (f"the {phase} phase needs {need / GiB:.1f} GiB per GPU of {self.gpu_bytes / GiB:.1f} "
                    f"(largest: {top[0]} {top[1][phase] / GiB:.1f} GiB)")
        if not self.kv_ok:
            return (f"vLLM's KV cache holds {max(self.kv_tokens, 0):.0f} tokens, less than one "
                    f"rollout.max_model_len={self.settings.rollout.max_model_len} sequence")
        return ""

    def table(self) -> str:
        s, m = self.settings, self.model
        gpu = "GPU size unknown" if self.gpu_bytes is None else \
            f"{self.gpu_bytes / GiB:.1f} GiB per GPU ({self.gpu_source})"
        moe = f", {m.experts} experts ({m.top_k} active)" if m.experts else ""
        head = (f"memory plan: {m.architecture} {m.numel / 1e9:.2f}B params{moe}, {s.placement.num_gpus} GPUs "
                f"{s.placement.mode}, {gpu}; GiB per GPU on the largest rank")
        cols = ("component",) + self.phases
        body = [(name,) + tuple("-" if p not in v else f"{v[p] / GiB:.2f}" for p in self.phases)
                for name, v in self.rows]
        body.append(("total",) + tuple(f"{self.total(p) / GiB:.2f}" for p in self.phases))
        if self.gpu_bytes is not None:
            body.append(("free",) + tuple(f"{(self.gpu_bytes - self.total(p)) / GiB:.2f}" for p in self.phases))
        widths = [max(len(r[i]) for r in (cols, *body)) for i in range(len(cols))]
        fmt = lambda r: "  ".join(x.ljust(w) if i == 0 else x.rjust(w)  # noqa: E731
                                  for i, (x, w) in enumerate(zip(r, widths)))
        lines = [head, fmt(cols)] + [fmt(r) for r in body]
        kv_need = s.batch_seqs * s.rollout.max_model_len
        lines.append(f"KV cache: {max(self.kv_tokens, 0):,.0f} tokens per engine = "
                     f"{max(self.kv_tokens, 0) / s.rollout.max_model_len:.1f} sequences of max_model_len "
                     f"{s.rollout.max_model_len}"
                     f" (the step's {s.batch_seqs} sequences per engine at full length: {kv_need:,}"
                     f"{'' if self.kv_tokens >= kv_need else '; vLLM runs them in waves'})")
        host = sum(self.host_per_gpu.values())
        per_node = min(s.placement.num_gpus, GPUS_PER_NODE)
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in self.host_per_gpu.items() if v)
        lines.append(f"host memory: {host / GiB:.1f} GiB per GPU ({parts or 'none'}), {host * per_node / GiB:.1f} GiB "
                     f"per node of {per_node} GPUs")
        lines += self.notes
        if self.gpu_bytes is None:
            lines.append("fit not checked: no GPU here and placement.gpu_memory=auto; fix: "
                         "placement.gpu_memory=H100 (or H200, 80GiB, ...)")
        else:
            lines.append("fits" if self.fits else f"does NOT fit: {self.problem()}")
        return "\n".join(lines)


@functools.lru_cache(maxsize=256)  # colo.plan.search plans one model many times
def _shard_bytes(m: ModelShape, world: int, nbytes: int, experts: Optional[bool] = None) -> int:
    return sum(p.rows_on(world) * (p.numel // p.shape[0]) * nbytes for p in m.params
               if experts is None or p.expert == experts)


def trainer_terms(m: ModelShape, s: Settings) -> dict[str, float]:
    """The trainer's allocations on its largest rank (bytes), and the four moments one of which is the train
    phase's peak (each includes the state and the sync buffers):

    - no_grad: the old-log-prob pass: 14 B per logit of one lm_head chunk, the root and last layer still gathered
    - backward: the start of a micro-batch's backward once earlier micro-batches left their grads: every
      layer's saved activations, one lm_head chunk's backward (20 B per logit), the weight's and the hidden states'
      gradients (made in forward with trainer.loss_in_lm_head, in backward without),
      gathered units and one unit's reduce-scatter buffers
    - entropy: right after backward: every grad, nothing gathered (the entropy comes with the log-probs,
      chunk by chunk; the full-logits path computed it here)
    - step: grads and the optimizer step's temporaries
    """
    W = s.trainer_world
    # LoRA: the frozen base in the compute dtype beside fp32 adapters; grads and AdamW state for the adapters only
    rank, targets = int(s.trainer.lora_rank), tuple(s.trainer.lora_targets)
    trained = lora_params(m, rank, targets) if rank else m.params
    grads = _spec_bytes(trained, W, 4) if rank else _shard_bytes(m, W, 4)
    params = grads + (_shard_bytes(m, W, s.param_bytes) if rank else 0)
    optim_full = 2 * (_spec_bytes(trained, W, s.state_bytes) if rank else _shard_bytes(m, W, s.state_bytes))
    optim = 0 if s.trainer.optimizer_offload else optim_full
    biggest = max(p.rows_on(W) * (p.numel // p.shape[0]) for p in trained)
    if s.trainer.optimizer_offload:
        # one param's states streamed in, fp32 math on them, the next one's states already coming in and the
        # last one's still going out (colo.trainer.optim overlaps the copies)
        step_tmp = biggest * (4 * s.state_bytes + 3 * 4 + 2 * s.state_bytes)
    elif s.trainer.optimizer_dtype == "bfloat16":
        step_tmp = biggest * 4 * 4  # StreamedAdamW on the GPU: fp32 m, v and two temporaries of one param
    else:
        step_tmp = grads  # foreach AdamW: sqrt(exp_avg_sq) of every param at once (torch/optim/adam.py)
    ref = params if s.ref_model else 0
    resident = s.bucket_bytes * s.buffers + OFFLOADED_REST
    act = activation_bytes(m, s)
    chunk_v = min(s.trainer.logprob_chunk, s.micro_tokens) * m.vocab
    # FSDP2 units in bf16 (world 1 too: it still copies into bf16 buffers): the root (embeddings, lm_head)
    # stays gathered through forward and backward, a layer's unit is gathered and the next prefetched;
    # backward also holds a unit's unsharded bf16 grads and their fp32 copy for the reduce-scatter.
    units = _units(m)
    root, unit = units[0], max(units[1:], default=0)
    last = sum(u for u in units[1:][-2:])  # the last layer and its expert unit stay gathered after forward
    dense_units = sorted(_units(m, experts=False))
    state = params + optim + ref + resident
    out = {"params": params, "grads": grads, "optim": optim, "optim_full": optim_full, "ref": ref,
           "resident": resident, "step_tmp": step_tmp, "activations": act["layers"], "logits": act["logits"],
           "gathered": s.param_bytes * (root + 2 * unit), "reduce": (s.param_bytes + 4) * unit,
           # sync: dense units gathered in bf16 (one packed, the next prefetched); expert shards read locally
           "sync_gather": s.param_bytes * sum(dense_units[-2:])}
    if rank:  # the merge of the largest local tensor: its fp32 delta and the merged copy (colo.sync.merge)
        out["sync_gather"] += (4 + s.param_bytes) * max(p.rows_on(W) * (p.numel // p.shape[0]) for p in m.params)
    out["no_grad"] = state + LOGITS_NO_GRAD_BYTES * chunk_v + s.param_bytes * (root + last)
    out["backward"] = state + grads + act["layers"] + act["logits"] + out["gathered"] + out["reduce"]
    if s.trainer.gather_once:
        # every unit stays gathered through the pass; the gradient accumulates unsharded in fp32 (FSDP2 upcasts
        # it to the reduce dtype) and replaces the sharded one, which is None until the last micro-batch's
        # reduce-scatter fills it unit by unit
        full = m.numel
        out["gathered"] = s.param_bytes * full
        out["reduce"] = 4 * sum(p.numel for p in trained) + (s.param_bytes + 4) * unit
        out["no_grad"] = state + LOGITS_NO_GRAD_BYTES * chunk_v + s.param_bytes * full
        out["backward"] = state + act["layers"] + act["logits"] + out["gathered"] + out["reduce"]
    out["entropy"] = state + grads
    out["step"] = state + grads + step_tmp
    out["sync"] = params + optim + ref + resident + out["sync_gather"]
    return out


def plan_memory(config_json: dict[str, Any], s: Settings, gpu_bytes: Optional[float],
                gpu_source: str = "placement.gpu_memory") -> MemoryPlan:
    """The plan for one setting; see the module docstring for the phases and where each figure comes from."""
    m = model_shape(config_json)
    W = s.trainer_world
    notes: list[str] = []
    # ---- vLLM, per GPU: dense weights replicated, experts split over EP (colocated) or TP (disaggregated)
    vocab_pad = (-m.vocab) % 64 * m.hidden * (1 if config_json.get("tie_word_embeddings") else 2)
    v_weights, staging = engine_weights(m, s, vocab_pad)  # bf16, or FP8 rollout's e4m3 + scales (vllm_weights.py)
    kv_per_token = m.kv_bytes_per_token // (2 if s.rollout.kv_cache_dtype == "fp8" else 1)
    reserve = VLLM_RESERVE_BASE + VLLM_RESERVE_PER_WIDTH * m.width
    budget = s.placement.vllm_gpu_fraction * gpu_bytes if gpu_bytes is not None else v_weights + reserve + \
        s.rollout.max_model_len * kv_per_token
    kv = budget - v_weights - reserve
    kv_tokens = kv / kv_per_token
    t = trainer_terms(m, s)
    if s.placement.mode == "disaggregated":
        return _plan_disaggregated(m, s, gpu_bytes, gpu_source, v_weights, reserve, kv, kv_tokens, t, notes, staging)
    params, grads, optim, ref, resident = t["params"], t["grads"], t["optim"], t["ref"], t["resident"]
    rank = int(s.trainer.lora_rank)
    train_peak = max(t["backward"], t["entropy"], t["step"])
    slack = ALLOC_SLACK * (train_peak - resident)
    phases = ("start", "rollout", "asleep", "train", "step", "sync")
    # trainer.offload=false: the state stays through rollout (train_step released the allocator's cache)
    kept = resident if s.trainer.offload else params + optim + ref + resident
    rows: list[tuple[str, dict[str, float]]] = [
        ("overhead (CUDA contexts, NCCL; calibrated)", {p: OVERHEAD for p in phases}),
        ("vLLM reserve (activations; calibrated)", {p: reserve for p in phases}),
        ("vLLM weights (" + ("FP8 e4m3 + scales, router/embeddings/norms bf16" if s.rollout.quantization == "fp8"
                            else "bf16") + ", experts / EP)",
         {"start": v_weights, "rollout": v_weights, "sync": v_weights}),
        ("vLLM's bf16 staging of its FP8 weights during the sync (sync.fp8_in=receiver)", {"sync": staging}),
        ("vLLM KV cache", {"start": max(kv, 0.0), "rollout": max(kv, 0.0)}),
        ("trainer while vLLM runs" + (" (offloaded: sync buffers)" if s.trainer.offload else " (offload=false)"),
         {"rollout": kept, "asleep": kept}),
        ("trainer params fp32" if not rank else f"trainer base {'fp32' if s.param_bytes == 4 else 'bf16'} "
         f"(frozen) + LoRA adapters fp32 (rank {rank})",
         {"start": params, "train": params, "step": params, "sync": params}),
        ("trainer grads fp32" + (" (adapters)" if rank else ""),
         {"train": 0 if s.trainer.gather_once else grads, "step": grads}),  # gather_once: below
        (f"AdamW state {s.trainer.optimizer_dtype}" + (" (adapters)" if rank else "")
         + (" (on host)" if s.trainer.optimizer_offload else ""),
         {"train": optim, "step": optim, "sync": optim}),
        ("reference model fp32 (kl_coef > 0)", {"start": ref, "train": ref, "step": ref, "sync": ref}),
        ("sync buffers + rest", {"train": resident, "step": resident, "sync": resident}),
        (f"activations {s.micro_label}, checkpointing "
         f"{'on' if s.trainer.gradient_checkpointing else 'off'}", {"train": t["activations"]}),
        (f"lm_head chunk {min(s.trainer.logprob_chunk, s.micro_tokens)}x{m.vocab} + weight, hidden grads",
         {"train": t["logits"]}),
        ("whole model gathered bf16 + its fp32 gradient unsharded (trainer.gather_once)" if s.trainer.gather_once else
         "gathered FSDP units bf16 + reduce-scatter", {"train": t["gathered"] + t["reduce"]}),
        # with few layers the entropy after backward (all grads + 14 B per logit) can top backward's start
        ("peak at the entropy after backward instead", {"train": max(0.0, t["entropy"] - t["backward"])}),
        ("optimizer step temporaries", {"step": t["step_tmp"]}),
        ("sync gather (dense units bf16)" + (" + LoRA merge" if rank else ""), {"sync": t["sync_gather"]}),
        ("allocator cache (calibrated)", {"train": slack, "step": slack}),
    ]
    rows = [(n, {p: b for p, b in v.items() if b}) for n, v in rows]
    rows = [(n, v) for n, v in rows if v]
    on_host = (params + t["optim_full"] + ref if s.trainer.offload
               else t["optim_full"] if s.trainer.optimizer_offload else 0)
    host = {"trainer state offloaded" if s.trainer.offload else "AdamW state": on_host,
            "vLLM weights asleep (level 1)": v_weights if s.sleep_level == 1 else 0}
    plan = MemoryPlan(m, s, gpu_bytes, gpu_source, phases, rows, kv_tokens, host, notes)
    if s.rollout.quantization == "fp8" or s.rollout.kv_cache_dtype == "fp8":
        bf16 = engine_weights(m, s.with_({"rollout.quantization": "none"}), vocab_pad)[0]
        L = s.rollout.max_model_len
        plain = (budget - bf16 - reserve) / m.kv_bytes_per_token  # bf16 weights and KV cache: tokens per engine
        notes.append(f"FP8 rollout: vLLM's weights {v_weights / GiB:.2f} GiB per GPU against {bf16 / GiB:.2f} in bf16"
                     + (f", KV cache {kv_per_token} bytes per token (fp8)" if s.rollout.kv_cache_dtype == "fp8" else "")
                     + "; the room freed goes to the KV cache"
                     + (f": {max(kv_tokens, 0) / L:,.0f} sequences of max_model_len {L} per engine against "
                        f"{max(plain, 0) / L:,.0f} with bf16 weights and KV cache" if gpu_bytes is not None else ""))
    notes.append(f"loading: each rank reads its own {params / GiB:.1f} GiB {'fp32 ' if not rank else ''}shard "
                 f"from the safetensors files; the end-of-run export gathers the model in bf16 on rank 0's host "
                 f"({2 * m.numel / GiB:.0f} GiB)" + ("; with LoRA only the adapters unless trainer.lora_export_merged"
                                                    if rank else ""))
    if rank:
        n = sum(p.numel for p in lora_params(m, rank, tuple(s.trainer.lora_targets)))
        notes.append(f"LoRA: rank {rank} on {', '.join(s.trainer.lora_targets)}: {n / 1e6:.1f}M trained parameters "
                     f"({100 * n / m.numel:.2f}% of {m.numel / 1e9:.2f}B); the base stays frozen")
    return plan


def _spec_bytes(params: tuple[ParamSpec, ...], world: int, nbytes: int) -> int:
    return sum(p.rows_on(world) * (p.numel // p.shape[0]) * nbytes for p in params)


@functools.lru_cache(maxsize=64)
def lora_params(m: ModelShape, rank: int, targets: tuple[str, ...]) -> tuple[ParamSpec, ...]:
    """The adapters colo.trainer.adapters adds (colo.models.lora): A (r, in) and B (out, r) per targeted Linear; per
    fused expert tensor A (E, r, in) and B (E, out, r), sharded on dim 0 (the expert) like the weight."""
    out = []
    for p in m.params:
        module, _, leaf = p.name.rpartition(".")
        if p.expert and "experts" in targets and leaf in EXPERT_PARAMS:
            E, rows, cols = p.shape
            out += [ParamSpec(f"{p.name}_lora_A", (E, rank, cols), True),
                    ParamSpec(f"{p.name}_lora_B", (E, rows, rank), True)]
        elif leaf == "weight" and len(p.shape) == 2 and target_of(module) in targets:
            out += [ParamSpec(f"{module}.lora_A", (rank, p.shape[1]), False),
                    ParamSpec(f"{module}.lora_B", (p.shape[0], rank), False)]
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _units(m: ModelShape, experts: Optional[bool] = None) -> tuple[int, ...]:
    """Elements of each FSDP unit, root first (colo.trainer.fsdp: per expert block, per layer, root)."""
    root = sum(p.numel for p in m.params if not p.name.startswith("model.layers."))
    layers: dict[str, int] = {}
    for p in m.params:
        if p.name.startswith("model.layers."):
            key = ".".join(p.name.split(".")[:3]) + (".experts" if p.expert else "")
            layers[key] = layers.get(key, 0) + p.numel
    units = [v for k, v in layers.items() if experts is None or k.endswith(".experts") == experts]
    return tuple(([root] if experts in (None, False) else []) + units)


def _plan_disaggregated(m: ModelShape, s: Settings, gpu_bytes: Optional[float], gpu_source: str,
                        v_weights: float, reserve: float, kv: float, kv_tokens: float, t: dict[str, float],
                        notes: list[str], staging: float = 0.0) -> MemoryPlan:
    """Trainer GPUs hold the trainer all the time (nothing sleeps); engine GPUs hold vLLM at its fraction (and, with
    sync.fp8_in=receiver, the bf16 staging of its FP8 weights beside it during a sync)."""
    phases = ("trainer GPU", "engine GPU")
    state = t["params"] + t["grads"] + t["optim"] + t["ref"]
    peak = max(t["backward"], t["entropy"], t["step"])
    rows = [("overhead (CUDA contexts, NCCL; calibrated)", {p: OVERHEAD for p in phases}),
            ("vLLM weights (" + ("FP8 + scales" if s.rollout.quantization == "fp8" else "bf16") + ", / TP)",
             {"engine GPU": v_weights}),
            *([("vLLM's bf16 staging of its FP8 weights during the sync (sync.fp8_in=receiver)",
                {"engine GPU": staging})] if staging else []),
            ("vLLM KV cache", {"engine GPU": max(kv, 0.0)}),
            ("vLLM reserve (activations)", {"engine GPU": reserve}),
            ("trainer state (params, grads, AdamW, ref)", {"trainer GPU": state}),
            ("sync buffers + rest", {"trainer GPU": t["resident"]}),
            ("activations, logits, gathered units (or step temporaries)", {"trainer GPU": peak - state - t["resident"]}),
            ("allocator cache (calibrated)", {"trainer GPU": ALLOC_SLACK * (peak - t["resident"])})]
    host = {"AdamW state (trainer.optimizer_offload)": t["optim_full"] if s.trainer.optimizer_offload else 0}
    return MemoryPlan(m, s, gpu_bytes, gpu_source, phases, rows, kv_tokens, host, notes)
