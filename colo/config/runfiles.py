"""What a resume reads back from the run dir, checked before anything is written or started: the checkpoint's
resume state (extra.json), what the checkpoint holds against this config and the base weights on disk now, and
metrics.jsonl. Each is data that a crash, a disk or a person can damage; a resume on damaged data skipped steps
("at step 31 of 6", exit 0) or failed after Ray had started with a traceback. Here each problem is one ConfigError
line naming the file and the fix, and a refused resume leaves the run dir as it was.

    holds(cfg)                     # what a checkpoint of this run holds: {"params": "full"} or the LoRA adapters'
                                   # rank, scale, targets and the digest of the base weights they apply to
    check_resume_files(resolved)   # --resume: ConfigError, or the run's files are fit to continue from

A checkpoint records `holds` in its extra.json (colo.runlife.save). LoRA keeps only the adapters: the frozen base
comes from model.path again at every start, so a base swapped on disk (same shapes) loaded silently and the run
went on from adapters trained over other weights (its eval fell from 0.422 to 0.000). origin.json is checked by
colo.config.resume (colo.run.origin.read_origin).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from colo.config.schema import AUTO, ColoConfig, ConfigError
from colo.run.origin import weights_digest

POSITION = ("epoch", "pos", "seed", "num_rows")  # the data position a checkpoint records (PromptDataset.state_dict)


def holds(cfg: ColoConfig) -> dict[str, Any]:
    """What a checkpoint of this (resolved) run holds besides the weights' values."""
    t = cfg.trainer
    if t.lora_rank <= 0:
        return {"params": "full"}
    base = (f"random (model.dummy_weights, run.seed={cfg.run.seed})" if cfg.model.dummy_weights
            else _digest(cfg.model.path))
    return {"params": "lora", "lora_rank": t.lora_rank, "lora_alpha": float(t.lora_alpha),
            "lora_targets": sorted(t.lora_targets), "base_weights": base}


def _digest(model_dir: str) -> str:
    d = Path(model_dir)
    files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(d.glob("*.safetensors")))
    return _cached_digest(str(d), files)


@functools.lru_cache(maxsize=4)
def _cached_digest(model_dir: str, files: tuple) -> str:  # `files`: the key, so a changed file is hashed again
    return weights_digest(model_dir)


def check_resume_files(cfg: ColoConfig) -> None:
    """--resume of the (resolved) run: its newest usable checkpoint's resume state, what it holds, and metrics.jsonl.
    Raises ConfigError (one line: the file, what is wrong, the fix). Reads only."""
    from colo.run.rundir import usable_checkpoint

    run_dir = Path(cfg.run.dir)
    newest, damaged = usable_checkpoint(run_dir)  # damaged newer ones are set aside later (colo.launch), a line each
    if newest is None and damaged:  # refused here, before the run dir is locked: a refusal writes nothing
        raise ConfigError(none_usable(run_dir, damaged))
    logged = _check_metrics(run_dir / "metrics.jsonl")
    if newest is None:
        return
    extra = _resume_state(newest)
    step = extra["step"]
    if step + 1 > cfg.loop.steps:
        raise ConfigError(f"--resume: {newest} is step {step}, past the run's end (loop.steps={cfg.loop.steps}: steps "
                          f"0-{cfg.loop.steps - 1}); fix: loop.steps={step + 2} or more to train on from it")
    if logged is not None and step > logged + 1:
        raise ConfigError(f"--resume: {newest / 'extra.json'} is step {step} but {run_dir / 'metrics.jsonl'} ends at "
                          f"step {logged}: resuming would skip steps {logged + 1}-{step - 1}; fix: restore the "
                          "checkpoint's files from a copy of the run, or move it out of checkpoints/ to resume from "
                          "the one before")
    _check_holds(newest, extra.get("holds"), cfg)


def none_usable(run_dir: Path, damaged: list[tuple[Path, str]]) -> str:
    """The refusal of a resume whose every checkpoint is damaged (colo.run.rundir.usable_checkpoint's list)."""
    path, problem = damaged[0]  # the newest
    return (f"--resume: every checkpoint in {run_dir / 'checkpoints'} is damaged; the newest, {path.name}: {problem}; "
            "fix: restore the file, or move the step_* dirs away to start the run over from its warm-up")


def _resume_state(ckpt: Path) -> dict[str, Any]:
    """extra.json of a complete checkpoint, checked: its step is the one its folder names, its data position whole."""
    path = ckpt / "extra.json"
    fix = (f"fix: restore {path.name} from a copy of the run, or move {ckpt.name} out of checkpoints/ to resume from "
           "the checkpoint before")
    extra = json.loads(path.read_text())  # parses: checkpoint_problem said so
    if not isinstance(extra, dict):
        raise ConfigError(f"--resume: {path} holds a {type(extra).__name__}, not a resume state; {fix}")
    step, data = extra.get("step"), extra.get("data")
    named = int(ckpt.name.removeprefix("step_"))
    if type(step) is not int:
        raise ConfigError(f"--resume: {path} has no whole-number 'step' (found {step!r}); {fix}")
    if step != named:
        raise ConfigError(f"--resume: {path} says step {step}, but it is the checkpoint of step {named} (its folder "
                          f"{ckpt.name}): resuming would skip or repeat steps; {fix}")
    if not isinstance(data, dict) or any(type(data.get(k)) is not int or data[k] < 0 for k in POSITION):
        raise ConfigError(f"--resume: {path} has no whole data position (it needs 'data' with whole numbers "
                          f"{', '.join(POSITION)}; found {data!r}); {fix}")
    if data["pos"] > data["num_rows"]:
        raise ConfigError(f"--resume: {path}'s data position {data['pos']} is past its {data['num_rows']} rows; {fix}")
    if "holds" in extra and not isinstance(extra["holds"], dict):
        raise ConfigError(f"--resume: {path}'s 'holds' is not a record ({extra['holds']!r}); {fix}")
    return extra


def _check_holds(ckpt: Path, recorded: dict | None, cfg: ColoConfig) -> None:
    """The checkpoint's record of what it holds against this config and the base weights now. A checkpoint written
    before checkpoints kept the record is not checked."""
    if recorded is None:
        return
    now = holds(cfg)
    start = "fix: resume with the run's own settings and base weights, or start a new run (another run.dir)"
    if recorded.get("params") != now["params"]:
        was = _describe(recorded)
        raise ConfigError(f"--resume: {ckpt} holds {was}, but this resume would train "
                          f"{_describe(now)}; {start}" + (f" (trainer.lora_rank={recorded.get('lora_rank')})"
                                                          if recorded.get("params") == "lora" else
                                                          " (trainer.lora_rank=0)"))
    if now["params"] != "lora":
        return
    for key in ("lora_rank", "lora_alpha", "lora_targets"):
        if recorded.get(key) != now[key]:
            raise ConfigError(f"--resume: {ckpt} holds LoRA adapters with trainer.{key}={recorded.get(key)}, this "
                              f"resume asks trainer.{key}={now[key]}; fix: resume with trainer.{key}="
                              f"{recorded.get(key)} (the run's), or start a new run (another run.dir)")
    if recorded.get("base_weights") != now["base_weights"]:
        where = cfg.model.path if not cfg.model.path.startswith(AUTO) else "model.path"
        raise ConfigError(f"--resume: {ckpt} holds LoRA adapters trained over other base weights than {where} holds "
                          f"now (digest {str(recorded.get('base_weights'))[:12]} then, {now['base_weights'][:12]} "
                          "now): they would apply to weights they were not trained on; fix: put the run's base "
                          f"weights back at {where}, or start a new run (another run.dir)")


def _describe(h: dict) -> str:
    if h.get("params") == "lora":
        return f"LoRA adapters of rank {h.get('lora_rank')} (the base weights frozen)"
    return "every weight (no LoRA)" if h.get("params") == "full" else f"{h.get('params')!r}"


def _check_metrics(path: Path) -> int | None:
    """The last step metrics.jsonl records (-1: the warm-up's only; None: none, or no file); ConfigError naming the
    line of a record that is not a JSON object with a whole-number step. A torn last line (a crash mid-write) is
    dropped on resume."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--resume: {path} is unreadable ({e}); fix: restore it from a copy of the run") from e
    last = None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if n == len(lines):  # torn by a crash: colo.run.metrics drops it
                continue
            raise ConfigError(f"--resume: {path} line {n} is not JSON ({line[:60]!r}); fix: restore the file from a "
                              "copy of the run, or delete that line") from None
        step = record.get("step") if isinstance(record, dict) else None
        if type(step) is not int:
            raise ConfigError(f"--resume: {path} line {n} has no whole-number step (found {step!r}); fix: restore "
                              "the file from a copy of the run, or delete that line")
        last = step if last is None else max(last, step)
    return last
