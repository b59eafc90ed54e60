"""Loading the config: defaults < YAML file < COLO_* environment < `key=value` CLI overrides.

    cfg = load_config("configs/tiny-cpu.yaml", ["trainer.lr=1e-6"], os.environ)
    places = resolve_paths(cfg)       # run dir, model/data paths (colo.plan.resolve's part of resolving)
    save_resolved(cfg, run_dir)       # <run.dir>/config.yaml reproduces the run

OmegaConf (structured configs over colo.config.schema) types and merges the layers and parses dotted
overrides; this module adds sources to its errors and did-you-mean hints. It is the only module that
reads environment variables (`COLO_*`, `WANDB_API_KEY`, `HF_HUB_OFFLINE` through the Hub client).
"""
from __future__ import annotations

import dataclasses
import glob
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from colo.run.rundir import held_by
from colo.config.schema import AUTO, ColoConfig, ConfigError, all_keys, default_value, did_you_mean, leaf_type

ENV_SHORTCUTS = {"COLO_TRAIN_GPU_FRACTION": "placement.train_gpu_fraction",
                 "COLO_VLLM_GPU_FRACTION": "placement.vllm_gpu_fraction",
                 "COLO_NUM_GPUS": "placement.num_gpus",
                 "COLO_PLACEMENT_MODE": "placement.mode"}


def load_config(config_path: str | None, overrides: list[str],
                env: Mapping[str, str] | None = None) -> ColoConfig:
    """Merge defaults < YAML file < COLO_* env vars < CLI `key=value` overrides; raises ConfigError."""
    env = os.environ if env is None else env
    layers: list[tuple[str, Any, str]] = []  # (source, values, key when it is one key)
    if config_path:
        layers.append((f"config file {config_path}", _read_yaml(config_path), ""))
    if env.get("RAY_ADDRESS"):  # Ray's own variable (ray job submit sets it): below COLO_* and key=value
        layers.append(("environment variable RAY_ADDRESS",
                       OmegaConf.from_dotlist([f"run.ray_address={env['RAY_ADDRESS']}"]), "run.ray_address"))
    for name, key, value in env_overrides(env):
        layers.append((f"environment variable {name}", OmegaConf.from_dotlist([f"{key}={value}"]), key))
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not key=value; fix: write e.g. trainer.lr=1e-6")
        layers.append((f"command line {item!r}", OmegaConf.from_dotlist([item]), item.split("=")[0]))
    merged = OmegaConf.structured(ColoConfig)
    for source, layer, key in layers:
        merged = _merge(merged, layer, source, key)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # e.g. a bad ${interpolation}
        key = str(getattr(e, "full_key", None) or "")
        where = next((src for src, layer, k in reversed(layers) if k == key or (not k and _sets(layer, key))), "")
        named = f"{key} in {where}: " if key and where else f"{key}: " if key else ""
        raise ConfigError(f"{named}{_first_line(e)}; fix: check the ${{...}} reference (it names a dotted key of "
                          "the config, e.g. ${data.path})") from e
    _check_auto_words(cfg, {key: source for source, _, key in layers if key})  # type: ignore[arg-type]
    return cfg  # type: ignore[return-value]


def _check_auto_words(cfg: ColoConfig, sources: dict[str, str]) -> None:
    """A key typed "a value or auto" (Union[bool, str], Union[int, str]) takes no other word: OmegaConf lets any
    string through the str half."""
    for key in all_keys():
        section, _, leaf = key.partition(".")
        value = getattr(getattr(cfg, section), leaf)
        if leaf_type(key).endswith(" or auto") and isinstance(value, str) and value != "auto":
            where = f" in {sources[key]}" if key in sources else ""
            raise ConfigError(f"wrong type for {key}{where}: {value!r} is not {leaf_type(key)}; fix: {key}=auto")


def env_overrides(env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(variable, dotted key, value) for COLO_* variables: the shortcuts, and COLO_<SECTION>__<FIELD>."""
    out = []
    for name in sorted(env):
        if not name.startswith("COLO_"):
            continue
        if name in ENV_SHORTCUTS:
            out.append((name, ENV_SHORTCUTS[name], env[name]))
        elif "__" in name:
            section, _, leaf = name[len("COLO_"):].lower().partition("__")
            out.append((name, f"{section}.{leaf}", env[name]))
        else:  # a typo here would otherwise be silently ignored
            known = list(ENV_SHORTCUTS) + [f"COLO_{k.replace('.', '__').upper()}" for k in all_keys()]
            raise ConfigError(f"unknown environment variable {name}{did_you_mean(name, known)}; "
                              "fix: use COLO_<SECTION>__<FIELD> (e.g. COLO_TRAINER__LR) or unset it")
    return out


def ray_temp_root(env: Mapping[str, str] | None = None) -> Path:
    """The folder a local Ray puts its sessions under (as Ray picks it: RAY_TMPDIR, else TMPDIR, else /tmp), for
    the host check before Ray starts (colo.plan.preflight)."""
    env = os.environ if env is None else env
    return Path(env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp")


def from_dict(d: Mapping[str, Any]) -> ColoConfig:
    """Rebuild a ColoConfig from to_dict()/dataclasses.asdict() output (e.g. inside a Ray actor)."""
    merged = _merge(OmegaConf.structured(ColoConfig), OmegaConf.create(dict(d)), "dict")
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def to_dict(cfg: ColoConfig) -> dict[str, Any]:
    """Plain nested dict (what actors receive)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: ColoConfig) -> str:  # noqa: D103
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_resolved(cfg: ColoConfig, run_dir: str | os.PathLike, name: str = "config.yaml") -> Path:
    """Write <run_dir>/<name>; `--config` on that file reproduces the run (colo.config.resume names the
    files of resumes)."""
    path = Path(run_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))
    return path


def _sets(layer: Any, key: str) -> bool:
    """Whether an OmegaConf layer sets the dotted `key` itself."""
    try:
        return OmegaConf.select(layer, key, throw_on_missing=False, throw_on_resolution_failure=False) is not None \
            or key in _dotted(OmegaConf.to_container(layer, resolve=False))
    except OmegaConfBaseException:
        return False


def _dotted(d: Any, prefix: str = "") -> set[str]:
    if not isinstance(d, dict):
        return set()
    out: set[str] = set()
    for k, v in d.items():
        out |= {f"{prefix}{k}"} | _dotted(v, f"{prefix}{k}.")
    return out


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error: PyYAML keeps the last silently, so a second
    `lr:` overrode the first and a second `loop:` section dropped the first one's keys back to their defaults."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                first = seen[key]
                raise _Duplicate(key, first.line + 1, key_node.start_mark.line + 1,
                                 "section" if isinstance(_, yaml.MappingNode) else "key")
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


class _Duplicate(yaml.YAMLError):
    def __init__(self, key: Any, first: int, again: int, what: str) -> None:
        super().__init__(f"{what} {key!r} given twice (line {first} and line {again})")
        self.key, self.first, self.again, self.what = key, first, again, what


def _undot(data: dict, path: str, line_of: dict | None = None) -> dict:
    """Dotted keys in the YAML (`trainer.lr: 1e-6`, as on the command line) written out as sections; a key that is
    then given twice (`trainer.lr` beside `trainer: {lr: ...}`) is refused naming both."""
    out: dict = {}
    for key, value in data.items():
        if isinstance(value, dict):
            value = _undot(value, path)
        parts = key.split(".") if isinstance(key, str) and "." in key else [key]
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config file {path}: {key!r} puts a key under {part!r}, which is a value here; "
                                  f"fix: write it once, as a section ({part}:) or as dotted keys")
        leaf = parts[-1]
        if leaf in node and not (isinstance(node[leaf], dict) and isinstance(value, dict)):
            raise ConfigError(f"config file {path}: {key!r} sets a key that is set elsewhere in the file too; "
                              "fix: set each key once (as a section or as a dotted key, not both)")
        if leaf in node:  # two dicts: merged, each key still given once
            for k in value:
                if k in node[leaf]:
                    raise ConfigError(f"config file {path}: '{key}.{k}' is set twice (as a dotted key and in a "
                                      "section); fix: set each key once")
            node[leaf].update(value)
        else:
            node[leaf] = value
    return out


def _read_yaml(path: str) -> Any:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}; "
                          "fix: pass an existing --config (ready ones are in configs/)") from e
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader: no Python objects)
    except _Duplicate as e:
        raise ConfigError(f"config file {path}: {e}; fix: give each {e.what} once (the second one replaced the "
                          "first" + (", and every key of the first section went back to its default)"
                                     if e.what == "section" else ")")) from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"malformed YAML in {path}{where}: {problem}; "
                          "fix: use 'key: value' lines indented with spaces") from e
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} holds a {type(data).__name__}, not a mapping; "
                          "fix: write sections like 'trainer:' with 'lr: 1e-6' indented below")
    return OmegaConf.create(_undot(data, path))


def _merge(base: Any, layer: Any, source: str, key_hint: str = "") -> Any:
    try:
        return OmegaConf.merge(base, layer)
    except ConfigKeyError as e:
        key = str(getattr(e, "full_key", None) or "")
        raise ConfigError(f"unknown config key {key!r} in {source}{did_you_mean(key, all_keys())}; "
                          "fix: use a key listed in docs/config.md") from e
    except ValidationError as e:
        key = str(getattr(e, "full_key", None) or key_hint)
        want = leaf_type(key)
        fix = f"give {want}, e.g. {key}={default_value(key)}" if want else "see docs/config.md"
        raise ConfigError(f"wrong type for {key} in {source}: {_first_line(e)}; fix: {fix}") from e
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config in {source}: {_first_line(e)}; "
                          "fix: see docs/config.md") from e


def _first_line(e: BaseException) -> str:
    return (getattr(e, "msg", None) or str(e)).strip().splitlines()[0]


# --------------------------------------------------------------------------------------- resolve


def _absolute_file(reward: str) -> str:
    """"rewards.py:fn" -> "/abs/rewards.py:fn"; a module or a built-in as it is."""
    where, _, attr = reward.rpartition(":")
    return f"{Path(where).expanduser().resolve()}:{attr}" if where.endswith(".py") else reward


def resolve_paths(cfg: ColoConfig) -> ColoConfig:
    """A copy with concrete places: run.dir ("{time}" filled in), model.path, the data paths and reward files, all
    absolute (actors may chdir).

    auto: model/data paths become where the run dir's creation generates them (<run.dir>/model,
    <run.dir>/data/<task>_{train,eval}.jsonl, colo.materialize). A Hub id becomes its snapshot in the local HF cache,
    pinned to the revision whose config.json the plan reads (colo.materialize downloads the rest of that revision when
    the run starts, after the plan has accepted it); it stays the id when the Hub cannot be reached and the model is
    not cached (a dry run plans from colo's copy of its config.json; a run fails at the download, saying so)."""
    out = from_dict(to_dict(cfg))
    run_dir = Path(resolve_run_dir(cfg.run.dir, cfg.run.resume)).resolve()
    out.run.dir = str(run_dir)
    if cfg.model.path.startswith(AUTO):
        out.model.path = str(run_dir / "model")
    elif Path(cfg.model.path).expanduser().is_dir():
        out.model.path = str(Path(cfg.model.path).expanduser().resolve())
    else:
        try:
            out.model.path = hub_download(cfg.model.path, config_only=True)
        except ConfigError:
            pass  # colo.config.checks.model_config_json planned it from colo's copy, and said so
    out.algo.rewards = [_absolute_file(name) for name in cfg.algo.rewards]  # a resume may start elsewhere
    for key, split in (("path", "train"), ("eval_path", "eval")):
        value = getattr(cfg.data, key)
        if value and value.startswith(AUTO):
            setattr(out.data, key, str(run_dir / "data" / f"{value[len(AUTO):]}_{split}.jsonl"))
        elif value:  # a file or save_to_disk dir made absolute; a Hub dataset id stays as it is
            from colo.data.prompts import DataSource

            setattr(out.data, key, DataSource.parse(value).resolved())
    return out


def wandb_online() -> bool:
    """run.wandb_mode=auto goes online when WANDB_API_KEY is set (W&B reads the key itself)."""
    return bool(os.environ.get("WANDB_API_KEY"))


def resolve_run_dir(pattern: str, resume: bool) -> str:
    """Fill in "{time}" (newest existing match when resuming); refuse to reuse or resume wrongly."""
    if "{time}" in pattern:
        if resume:
            matches = sorted(p for p in glob.glob(pattern.replace("{time}", "*"))
                             if os.path.isfile(os.path.join(p, "config.yaml")))
            if not matches:
                raise ConfigError(f"--resume: no earlier run matches run.dir={pattern}; fix: "
                                  "run.dir=<the run's dir>")
            return matches[-1]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        runs = (pattern.replace("{time}", stamp + (f"-{i}" if i else "")) for i in range(1000))
        return next(d for d in runs if not Path(d).exists())  # same-second runs get -1, -2, ...
    busy = held_by(pattern)
    if busy:
        raise ConfigError(f"run.dir={pattern} is in use by another colo run ({busy}); fix: wait for it to end "
                          "(or stop it), or give this one another run.dir")
    has_run = (Path(pattern) / "config.yaml").is_file()
    if resume and not has_run:
        raise ConfigError(f"--resume: run.dir={pattern} holds no earlier run (no config.yaml); fix: "
                          "drop --resume or point run.dir at the run to continue")
    if has_run and not resume:
        raise ConfigError(f"run.dir={pattern} already holds a run; fix: --resume to continue it, or "
                          "another run.dir (e.g. run.dir=runs/{time})")
    return pattern


def resolve_device(cfg: ColoConfig) -> str:
    """"cpu" or "cuda"; "auto" asks torch (imported only here, and only for auto)."""
    if cfg.placement.device != "auto":
        return cfg.placement.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def hub_download(repo_id: str, *, config_only: bool, revision: str | None = None) -> str:
    """Local snapshot dir of a Hub repo (the HF cache; HF_HUB_OFFLINE=1 uses the cache only); `revision`: a commit
    (the name of a snapshot dir) pins it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    patterns = ["config.json"] if config_only else None
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, revision=revision)
    except RepositoryNotFoundError as e:
        raise ConfigError(f"model.path={repo_id}: no such repo on the Hugging Face Hub (or it is "
                          "gated; log in with `hf auth login`); fix: check the repo id") from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false")
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub cannot be reached"
        raise ConfigError(
            f"model.path={repo_id}: {why} and the model is not in the local HF cache; fix: download "
            f"it where the Hub is reachable (`hf download {repo_id}`, then copy HF_HOME here), set "
            "model.path to a local checkpoint dir, or run with random weights offline: "
            f"model.path=auto:{repo_id.split('/')[-1].lower()} model.dummy_weights=true") from e
