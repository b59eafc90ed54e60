"""colo's one typed config tree: defaults < YAML file < COLO_* environment < `key=value` CLI overrides.

    cfg = load_config("configs/tiny-cpu.yaml", ["trainer.lr=1e-6"], os.environ)
    validate(cfg)                     # raises ConfigError("<problem>; fix: <what to do>")
    resolve_paths(cfg)                # run dir, model/data paths: a part of colo.plan.resolve, which resolves it all

Split by role, re-exported here (the config API):
    schema.py    the dataclasses (a docstring per field), CHOICES, ConfigError
    loading.py   YAML / COLO_* env / key=value merge, from_dict/to_dict, concrete paths, save (the only reader of
                 environment variables)
    frozen.py    a resolved config: frozen on the driver (freeze), checked by the actors (check_resolved)
    checks.py    validate: the checks OmegaConf cannot know (fractions, files, GPUs, experts); whether the
                 job fits its GPUs is colo.plan's, computed from the validated config
    resume.py    the config of a resumed run
Nothing here imports torch/Ray/vLLM at module level, so `python -m colo.launch --help` and config errors
stay fast.
"""
from __future__ import annotations

from colo.config.checks import expert_parallel_size, gpu_count_note, model_config_json, validate
from colo.config.frozen import check_resolved, freeze, unresolved
from colo.config.loading import (ENV_SHORTCUTS, env_overrides, from_dict, hub_download, load_config, resolve_device,
                                 resolve_paths, resolve_run_dir, save_resolved, to_dict, to_yaml, wandb_online)
from colo.config.schema import (AUTO, CHOICES, LOGGERS, AlgoConfig, ColoConfig, ConfigError, DataConfig, LoopConfig,
                                ModelConfig, PlacementConfig, RolloutConfig, RunConfig, SyncConfig, TrainerConfig,
                                all_keys)

__all__ = ["AUTO", "CHOICES", "ENV_SHORTCUTS", "LOGGERS", "AlgoConfig", "ColoConfig", "ConfigError", "DataConfig",
           "LoopConfig", "ModelConfig", "PlacementConfig", "RolloutConfig", "RunConfig", "SyncConfig", "TrainerConfig", "all_keys",
           "check_resolved", "env_overrides", "expert_parallel_size", "freeze", "from_dict", "gpu_count_note", "hub_download",
           "load_config", "model_config_json", "resolve_device", "resolve_paths", "resolve_run_dir", "save_resolved",
           "to_dict", "to_yaml", "unresolved", "validate", "wandb_online"]
