"""Every `auto` of a config decided in one place, once per process: colo.launch's prepare calls it; a benchmark or a
test that starts actors itself calls it for its own config.

    resolved = resolve(cfg, config_json)     # validate()d cfg; config_json: model_config_json(cfg), read when None
    resolved.cfg                             # frozen, concrete: what config.yaml, the plans and every actor get
    resolved.choices.table()                 # the `auto` trainer settings (and loop.mode), each with its value and
                                             # why (--dry-run)
    resolved.device                          # what it was planned for: cpu or a GPU's size, and its measured speeds

What each `auto` becomes (colo.config.frozen.COLO_AUTO lists the keys; actors refuse a config with one left):
    placement.device         cuda when torch sees a GPU, else cpu
    run.wandb_mode           online when WANDB_API_KEY is set, else offline
    run.dir, model.path,     "{time}" filled in; auto: presets' paths in the run dir; a Hub id its pinned snapshot
      data.path/eval_path      (colo.config.resolve_paths)
    rollout.sleep_level      2, trainer.old_logprobs update or pass: what the config alone decides
                               (colo.plan.settings.settled)
    the six trainer keys     the fastest setting that fits this device (colo.plan.auto: its search and cost model
                               are colo.plan.search's and colo.plan.cost's, which a refusal's ways to fit share)
    loop.mode                async where a measured row says it pays on this setup, with that row's
                               rollout.oversample / loop.max_staleness where left at their defaults; else sync
                               (colo.plan.loopmode, from colo.plan.cost.ASYNC_MEASURED); `auto` is opt-in, the
                               default is sync
A resolved config resolves to itself, so a --resume, which starts from the run's config.yaml, runs what it ran.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colo.config import ColoConfig, freeze, model_config_json, resolve_paths, wandb_online
from colo.plan.auto import Tuned
from colo.plan.job import Device, device_of, tune
from colo.plan.loopmode import loop_mode
from colo.plan.settings import settled, with_values


@dataclass(frozen=True)
class Resolved:
    cfg: ColoConfig  # frozen (colo.config.frozen): nothing after resolve changes what the run runs
    choices: Tuned  # the `auto` trainer settings and why
    device: Device  # what the plans are made for


def resolve(cfg: ColoConfig, config_json: dict[str, Any] | None = None) -> Resolved:
    """The module docstring's resolution of cfg (left unchanged) for this machine; `config_json`: the checkpoint's
    config.json (colo.config.model_config_json(cfg), read here when None)."""
    if config_json is None:
        config_json = model_config_json(cfg)
    device = device_of(cfg)
    out = resolve_paths(cfg)
    derived = {"placement.device": device.kind, **settled(cfg)}
    if cfg.run.wandb_mode == "auto":
        derived["run.wandb_mode"] = "online" if wandb_online() else "offline"
    choices = tune(with_values(out, derived), config_json, device)
    choices = choices.also(loop_mode(choices.cfg, config_json, device, cfg.model.path))
    return Resolved(freeze(choices.cfg), choices, device)
