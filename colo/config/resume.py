"""`--resume` continues the run that was: its own saved config, with this command's settings on top.

    resumed = load_resumed(cfg.run.dir, overrides, env)   # cfg: what --config + env + overrides gave
    resolved = resolve(resumed.cfg)
    print(resumed.describe(resolved))
    # colo: resume: <run>/config.yaml; trainer.lr 0.001 -> 0.0004 (environment COLO_TRAINER__LR)
    save_resolved(resolved, run_dir, next_resume_config(run_dir).name)

Layers on resume: the run's newest saved config (config.yaml, or config.resume-<n>.yaml of its latest
resume) < COLO_* environment < key=value, the same precedence as a fresh run with the saved config in
place of the YAML file. The --config file only says where the run is (its run.dir pattern): its values
were applied when the run started and the saved config holds them. So a run started with
COLO_TRAINER__LR=1e-3 and resumed without the variable keeps 1e-3; a setting that this command does
change is applied, and every setting that differs from the saved run is named in one line.

Every config a run was trained under is kept: config.yaml is written once, at the start, and resume n
writes config.resume-<n>.yaml. A run dir that was moved or copied resumes from its own model and data:
saved paths inside the old run dir are rebased onto the new one.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colo.config.loading import env_overrides, load_config, resolve_run_dir, to_dict
from colo.config.schema import ColoConfig

FIRST = "config.yaml"
RESUME_RE = re.compile(r"config\.resume-(\d+)\.yaml")
RUN_PATHS = ("model.path", "data.path", "data.eval_path")  # may lie inside the run dir (auto: presets)
NOT_COMPARED = ("run.resume",)  # true on every resume by definition


def saved_configs(run_dir: str | os.PathLike) -> list[Path]:
    """The configs a run was trained under, oldest first: config.yaml, config.resume-1.yaml, ..."""
    d = Path(run_dir)
    resumes = sorted((int(m.group(1)), p) for p in d.glob("config.resume-*.yaml")
                     if (m := RESUME_RE.fullmatch(p.name)))
    return [d / FIRST] * (d / FIRST).is_file() + [p for _, p in resumes]


def next_resume_config(run_dir: str | os.PathLike) -> Path:
    """Where this resume's config goes: config.resume-<n>.yaml, n = 1 + the resumes before it."""
    return Path(run_dir) / f"config.resume-{len(saved_configs(run_dir))}.yaml"


@dataclass
class Resumed:
    cfg: ColoConfig  # saved < env < overrides, run.dir = the run's directory, run.resume = true
    saved: ColoConfig  # the newest saved config as written
    base: Path  # the file it came from
    sources: dict[str, str] = field(default_factory=dict)  # dotted key -> who set it on this command

    def changes(self, resolved: ColoConfig) -> list[str]:
        """'key old -> new (source)' for every setting of `resolved` that differs from the saved run."""
        old, new = _flat(to_dict(self.saved)), _flat(to_dict(resolved))
        out = []
        for key in new:
            if key in NOT_COMPARED or old.get(key) == new[key]:
                continue
            source = self.sources.get(key) or next(
                (s for k, s in self.sources.items() if key.startswith(k + ".")), "")
            out.append(f"{key} {_show(old.get(key))} -> {_show(new[key])}" + (f" ({source})" if source else ""))
        return out

    def describe(self, resolved: ColoConfig) -> str:
        """One line for the terminal."""
        changes = self.changes(resolved)
        return f"colo: resume: {self.base}" + ("; " + "; ".join(changes) if changes else ", unchanged")


def load_resumed(pattern: str, overrides: list[str], env: Mapping[str, str] | None = None) -> Resumed:
    """The config to resume the run at `pattern` (a run dir, or "{time}": the newest match) with; raises
    ConfigError when there is no run to resume."""
    env = os.environ if env is None else env
    run_dir = Path(resolve_run_dir(pattern, True)).resolve()
    base = saved_configs(run_dir)[-1]
    saved = load_config(str(base), [], {})
    cfg = load_config(str(base), overrides, env)
    sources = {key: f"environment {name}" for name, key, _ in env_overrides(env)}
    if env.get("RAY_ADDRESS"):  # a re-formed cluster may have a new head address
        sources["run.ray_address"] = "environment RAY_ADDRESS"
    sources.update({item.split("=", 1)[0]: "command line" for item in overrides if "=" in item})
    old_dir = Path(saved.run.dir)
    if old_dir != run_dir:  # moved or copied: its own model and data, not the old place's
        sources["run.dir"] = f"the run's directory now, saved as {old_dir}"
        for key in RUN_PATHS:
            section, leaf = key.split(".")
            value = getattr(getattr(cfg, section), leaf)
            if value and value == getattr(getattr(saved, section), leaf) and Path(value).is_relative_to(old_dir):
                setattr(getattr(cfg, section), leaf, str(run_dir / Path(value).relative_to(old_dir)))
                sources[key] = "moved with run.dir"
    cfg.run.dir, cfg.run.resume = str(run_dir), True
    return Resumed(cfg, saved, base, sources)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _show(v: Any) -> str:
    return "null" if v is None else str(v)
