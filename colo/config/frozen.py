"""A resolved config: frozen on the driver, checked by every actor.

    cfg = freeze(cfg)                     # colo.plan.resolve's last step: setting any field now raises
    check_resolved(cfg, "TrainWorker")    # an actor, first thing: ValueError naming every `auto` left

colo decides every key of COLO_AUTO once, on the driver (colo.plan.resolve): after that none holds "auto", model.path
and data paths are no auto: presets, and run.dir has no "{time}". An actor that finds one left refuses to start
rather than fill a default of its own (it would run what nobody planned, and config.yaml would not say it).

Left as they are: the libraries' own `auto` words, which colo passes on unchanged (trainer.experts_implementation:
transformers' choice; rollout.kv_cache_dtype: vLLM's, the model's dtype; rollout.fp8_kernels: vLLM's choice with
DeepGEMM off), and placement.gpu_memory, which says what hardware the plan is for (auto: ask the machine) and which
colo.plan reads, no actor.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from colo.config.schema import AUTO, ColoConfig

COLO_AUTO = ("placement.device", "rollout.sleep_level", "trainer.old_logprobs", "trainer.offload",
             "trainer.optimizer_offload", "trainer.compile", "trainer.gradient_checkpointing", "trainer.gather_once",
             "trainer.max_tokens_per_micro_batch", "loop.mode", "run.wandb_mode")
"""The keys whose `auto` colo.plan.resolve decides (its docstring says how)."""


def _get(cfg: ColoConfig, key: str) -> Any:
    section, _, leaf = key.partition(".")
    return getattr(getattr(cfg, section), leaf)


def unresolved(cfg: ColoConfig) -> list[str]:
    """`key=value` for each setting colo.plan.resolve would still change: empty for a resolved config."""
    left = [f"{k}=auto" for k in COLO_AUTO if _get(cfg, k) == "auto"]
    left += [f"{k}={_get(cfg, k)}" for k in ("model.path", "data.path", "data.eval_path")
             if str(_get(cfg, k) or "").startswith(AUTO)]
    if "{time}" in cfg.run.dir:
        left.append(f"run.dir={cfg.run.dir}")
    return left


def check_resolved(cfg: ColoConfig, who: str) -> None:
    """ValueError when `cfg` was not resolved (colo.plan.resolve): what builds actors hands them a resolved config."""
    left = unresolved(cfg)
    if left:
        raise ValueError(f"{who} got a config that was not resolved ({', '.join(left)}); fix: resolve it on the "
                         "driver first (colo.plan.resolve.resolve, as colo.launch does), and hand the actors that")


def freeze(cfg: ColoConfig) -> ColoConfig:
    """Mark cfg and its sections frozen (colo.config.schema.Section) and return it. A copy (copy.deepcopy, pickle) is
    frozen too; a config built from it (from_dict, dataclasses.replace, colo.plan.settings.with_values) is not."""
    for obj in (cfg, *(getattr(cfg, f.name) for f in dataclasses.fields(cfg))):
        object.__setattr__(obj, "_frozen", True)
    return cfg


def is_frozen(cfg: ColoConfig) -> bool:
    return bool(cfg.__dict__.get("_frozen"))
