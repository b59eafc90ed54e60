"""Ways to fit: settings that colo.plan.memory accepts, searched and planned, not guessed.

    for changes, plan in ways_to_fit(config_json, settings, gpu_bytes):
        print(format_changes(changes), plan.worst)   # trainer.gradient_checkpointing=true ... ("train", 7e10)
"""
from __future__ import annotations

import math
from typing import Any, Optional

from colo.plan.memory import MemoryPlan, model_shape, plan_memory
from colo.plan.settings import Settings, get


def ways_to_fit(config_json: dict[str, Any], s: Settings, gpu_bytes: float, limit: int = 3
                ) -> list[tuple[dict[str, Any], MemoryPlan]]:
    """Change sets (dotted config keys) that the plan accepts, cheapest first; each one is planned, not guessed. A
    set that adds changes to an accepted one is left out.

    Cost order, from the per-step costs measured in docs/benchmarks.md ("What each trainer setting buys", and
    "Answered experiments": the ways to fit): the vLLM fraction
    (free while the KV cache holds one sequence), trainer.offload, gradient checkpointing (recompute), a
    smaller micro batch, optimizer state on the host, bf16 optimizer state, and last more GPUs (the
    experts must divide by the count)."""
    m = model_shape(config_json)
    fraction = s.placement.vllm_gpu_fraction
    fractions = sorted({round(x * 0.05, 2) for x in range(2, 19)} | {fraction})
    # the micro-batch lever: rows when padded, the token budget when packed (down to one max_model_len)
    key = "trainer.max_tokens_per_micro_batch" if s.trainer.packing else "trainer.micro_batch_size"
    size = int(get(s.cfg, key))
    floor = s.rollout.max_model_len if s.trainer.packing else 1
    mbs = sorted({size} | {size // 2**k for k in (1, 2, 3) if size // 2**k >= floor}, reverse=True)
    n0 = s.placement.num_gpus
    gpus = [n0] + [n for n in (2 * n0, 4 * n0, 8 * n0) if not s.colocated or not m.experts or m.experts % n == 0]
    levers = [("trainer.offload", True, 0.3), ("trainer.gradient_checkpointing", True, 1.0),
              ("trainer.optimizer_offload", True, 1.2), ("trainer.optimizer_dtype", "bfloat16", 1.5)]
    levers = [lv for lv in levers if get(s.cfg, lv[0]) != lv[1]]
    found: list[tuple[float, dict[str, Any], MemoryPlan]] = []
    for n_i, n in enumerate(gpus):
        for mb in mbs:
            for mask in range(1 << len(levers)):
                chosen = [lv for i, lv in enumerate(levers) if mask >> i & 1]
                trial = s.with_({"placement.num_gpus": n, key: mb, **{k: v for k, v, _ in chosen}})
                best = _best_fraction(config_json, trial, gpu_bytes, fractions)
                if best is None:
                    continue
                f, plan = best
                cost = (4.0 * n_i + math.log2(size / mb) * 0.8 + sum(c for *_, c in chosen)
                        + (f != fraction) * 0.1)
                changes = {"placement.num_gpus": n, "placement.vllm_gpu_fraction": f, key: mb,
                           **{k: v for k, v, _ in chosen}}
                found.append((cost, {k: v for k, v in changes.items() if v != get(s.cfg, k)}, plan))
    found.sort(key=lambda x: x[0])
    out: list[tuple[dict[str, Any], MemoryPlan]] = []
    for _, changes, plan in found:
        if any(c.items() <= changes.items() for c, _ in out):
            continue
        out.append((changes, plan))
        if len(out) == limit:
            break
    return out


def _best_fraction(config_json: dict[str, Any], s: Settings, gpu_bytes: float, fractions: list[float]
                   ) -> Optional[tuple[float, MemoryPlan]]:
    """The vLLM fraction that fits with the largest KV cache (the current one when it fits)."""
    here = plan_memory(config_json, s, gpu_bytes)
    if here.fits:
        return s.placement.vllm_gpu_fraction, here
    if any(here.total(p) > gpu_bytes for p in here.phases if p not in FRACTION_PHASES):
        return None  # vLLM's fraction cannot help while it sleeps
    fits = [(f, p) for f in fractions
            if (p := plan_memory(config_json, s.with_({"placement.vllm_gpu_fraction": f}), gpu_bytes)).fits]
    return fits[-1] if fits else None


FRACTION_PHASES = ("start", "rollout", "engine GPU")  # the phases vLLM's fraction changes


def format_changes(changes: dict[str, Any], train_fraction: Optional[float] = None) -> str:
    """`key=value ...` as a user types it; a vLLM fraction that would push the two fractions over 1 also
    names the trainer's (a Ray scheduling share on GPU, not a memory limit)."""
    parts = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items()]
    f = changes.get("placement.vllm_gpu_fraction")
    if f is not None and train_fraction is not None and train_fraction + f > 1.0:
        parts.append(f"placement.train_gpu_fraction={round(1.0 - f, 2)}")
    return " ".join(parts)
