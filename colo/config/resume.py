"""`--resume` continues the run that was: its own saved config, with this command's settings on top.

    resumed = load_resumed(cfg.run.dir, overrides, env, config_file)  # config_file: an explicit --config, or None
    resolved = colo.plan.resolve.resolve(resumed.cfg).cfg    # colo.prepare does both
    print(resumed.describe(resolved))
    # colo: resume: <run>/config.yaml; trainer.lr 0.001 -> 0.0004 (environment COLO_TRAINER__LR)
    save_resolved(resolved, run_dir, next_resume_config(run_dir).name)

Layers on resume: the run's newest saved config (config.yaml, or config.resume-<n>.yaml of its latest
resume) < an explicit --config file's differences < COLO_* environment < key=value, the same precedence as a
fresh run with the saved config in place of the YAML file. The --config file the run started with changes
nothing (its values were applied when the run started and the saved config holds them; colo.run.origin keeps
them): so a run started with COLO_TRAINER__LR=1e-3 and resumed with the same file and without the variable
keeps 1e-3. Another file, or the same file edited, brings the keys whose values differ from it. Every setting
that differs from the saved run is named in one line, with its source.

What the checkpoints mean is not changed on resume: the model, its tokenizer, the data (file and content, its
fields and how prompts are rendered), the environment, the seed and LoRA's adapters (on or off, rank, scale,
targets: a LoRA checkpoint holds the adapters only) (MEANING). colo.config.runfiles checks the checkpoint's own
record of what it holds, and the base weights on disk, before anything starts. A resume that would change any of
them is refused with one line naming each (from whatever source: a key=value, a variable, another --config
file, or a tokenizer or data file changed on disk since the run started, colo.run.origin); the rest (loop.steps,
logging, the eval cadence, the learning rate, ...) is listed and applied. Nothing in the run dir is generated
again on resume (colo.materialize).

Every config a run was trained under is kept: config.yaml is written once, at the start, and resume n
writes config.resume-<n>.yaml. A run dir that was moved or copied resumes from its own model and data:
saved paths inside the old run dir are rebased onto the new one.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colo.config.loading import _read_yaml, env_overrides, load_config, resolve_run_dir, to_dict
from colo.config.schema import AUTO, ColoConfig, ConfigError
from colo.run.origin import OriginError, origin_changes, read_origin

FIRST = "config.yaml"
RESUME_RE = re.compile(r"config\.resume-(\d+)\.yaml")
RUN_PATHS = ("model.path", "data.path", "data.eval_path")  # may lie inside the run dir (auto: presets)
NOT_COMPARED = ("run.resume",)  # true on every resume by definition
# what gives the checkpoints their meaning besides the weights: never changed on resume
MEANING = ("model.path", "data.path", "data.prompt_key", "data.answer_key", "data.chat_template", "data.system_prompt",
           "algo.environment", "run.seed", "trainer.lora_rank", "trainer.lora_alpha", "trainer.lora_targets")


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

    def meaning_changes(self, origin: dict | None) -> list[str]:
        """'key old -> new (source)' for each MEANING key this resume changes, and what changed on disk since the
        run started (its tokenizer's files, its data files: colo.run.origin)."""
        old, new = _flat(to_dict(self.saved)), _flat(to_dict(self.cfg))
        specs = (origin or {}).get("specs", {})
        out = []
        for key in MEANING:
            if old.get(key) == new.get(key) or self.sources.get(key) == "moved with run.dir":
                continue
            if key in RUN_PATHS and new[key] and (new[key] == specs.get(key) or _same_place(new[key], old[key])):
                continue  # the run's own model or data, named as it was given or by another path
            source = self.sources.get(key, "this command")
            out.append(f"{key} {_show(old.get(key))} -> {_show(new.get(key))} ({source})")
        if origin and not out:  # the run's own model and data: where they are now (saved, or moved with the run)
            def where(key: str) -> str:
                return (new if self.sources.get(key) == "moved with run.dir" else old)[key]

            out += origin_changes(origin, where("model.path"), {k: where(k) for k in ("data.path", "data.eval_path")})
        return out

    def describe(self, resolved: ColoConfig) -> str:
        """One line for the terminal."""
        changes = self.changes(resolved)
        return f"colo: resume: {self.base}" + ("; " + "; ".join(changes) if changes else ", unchanged")


def load_resumed(pattern: str, overrides: list[str], env: Mapping[str, str] | None = None,
                 config_file: str | None = None) -> Resumed:
    """The config to resume the run at `pattern` (a run dir, or "{time}": the newest match) with; raises
    ConfigError when there is no run to resume, or when the resume would change what its checkpoints mean."""
    env = os.environ if env is None else env
    run_dir = Path(resolve_run_dir(pattern, True)).resolve()
    base = saved_configs(run_dir)[-1]
    saved = load_config(str(base), [], {})
    try:
        origin = read_origin(run_dir)
    except OriginError as e:
        raise ConfigError(str(e)) from e
    sources = {key: f"environment {name}" for name, key, _ in env_overrides(env)}
    if env.get("RAY_ADDRESS"):  # a re-formed cluster may have a new head address
        sources["run.ray_address"] = "environment RAY_ADDRESS"
    sources.update({item.split("=", 1)[0]: "command line" for item in overrides if "=" in item})
    from_file = _file_changes(config_file, saved, origin, set(sources)) if config_file else {}
    sources.update(dict.fromkeys(from_file, f"config file {config_file}"))
    cfg = load_config(str(base), [f"{k}={json.dumps(v)}" for k, v in from_file.items()] + overrides, env)
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
    resumed = Resumed(cfg, saved, base, sources)
    refused = resumed.meaning_changes(origin)
    if refused:
        raise ConfigError(f"--resume would change what the run's checkpoints mean: {'; '.join(refused)}; fix: resume "
                          "without these changes (the run keeps its own model, tokenizer and data), or start a new "
                          "run with them (another run.dir, no --resume)")
    return resumed


def _file_changes(config_file: str, saved: ColoConfig, origin: dict | None, given: set[str]) -> dict[str, Any]:
    """The keys an explicit --config file sets to values other than the file the run started with (or, for a run
    with no record of it, other than the saved run's), less those this command sets otherwise: dotted key -> value."""
    start = ((origin or {}).get("config_file") or {}).get("values")
    now = _flat(to_dict(saved))
    out = {}
    for key, value in file_values(config_file).items():
        if key in ("run.dir", "run.resume") or key in given:
            continue
        was = start[key] if start is not None and key in start else now.get(key)
        if value != was:
            out[key] = value
    return out


def file_values(config_file: str) -> dict[str, Any]:
    """The keys a config file sets, with their values as the schema types them (dotted key -> value)."""
    from omegaconf import OmegaConf

    typed = _flat(to_dict(load_config(config_file, [], {})))
    return {k: typed[k] for k in _flat(OmegaConf.to_container(_read_yaml(config_file))) if k in typed}


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same_place(a: str, b: str | None) -> bool:
    """Two values of a path key naming the same file or folder (relative against absolute)."""
    if b is None or a.startswith(AUTO) or b.startswith(AUTO):
        return False
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return False


def _show(v: Any) -> str:
    return "null" if v is None else str(v)
