"""The run dir of a prepared job (colo.prepare): the last checks that read every data row and the checkpoint, then
the directory, locked, with what the run starts from.

    cfg = make_run_dir(prepared)     # the resolved config, now backed by <run.dir>: colo.loop.run's

Fresh run: <run.dir>/config.yaml (the resolved config: --resume starts from it), origin.json (colo.run.origin: what
the run started from), and what `auto:` asked for generated into it (model/, data/). A Hub model's pinned revision
(colo.config.resolve_paths) is downloaded in full here, once the plans accepted the job. A resume generates nothing
(the run's model and data are the ones it started with, and must still be there): it sets damaged checkpoints aside
and saves its config as config.resume-<n>.yaml. Every refusal comes before the run dir exists, or leaves it unlocked.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from colo import config
from colo.config import ColoConfig

if TYPE_CHECKING:
    from colo.prepare import Prepared


def make_run_dir(prepared: Prepared) -> ColoConfig:
    """The module docstring, for `prepared`; returns its resolved config (nothing is resolved again here)."""
    from colo.run import rundir

    spec, cfg = prepared.spec, prepared.cfg
    run_dir = Path(cfg.run.dir)
    _download(spec, cfg)
    check_user_data(spec, cfg)
    if not spec.model.path.startswith(config.AUTO):  # presets are written by colo itself
        from colo.config.weights import check_model_readable

        check_model_readable(cfg.model.path, weights=not spec.model.dummy_weights)
    try:
        rundir.check_writable(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        rundir.lock(run_dir)  # held until the run ends (colo.runlife) or this process exits
    except (rundir.RunDirError, OSError) as e:
        raise config.ConfigError(str(e) if isinstance(e, rundir.RunDirError) else
                                 f"run.dir={run_dir}: {e}; fix: a writable run.dir") from e
    try:
        _fill(prepared, run_dir)
    except BaseException:
        rundir.unlock(run_dir)
        raise
    return cfg


def _download(spec: ColoConfig, cfg: ColoConfig) -> None:
    """A Hub model: the rest of the revision whose config.json the plan read (its snapshot dir is cfg.model.path)."""
    if spec.model.path.startswith(config.AUTO) or Path(spec.model.path).expanduser().is_dir():
        return
    pinned = Path(cfg.model.path)
    got = config.hub_download(spec.model.path, config_only=False, revision=pinned.name if pinned.is_dir() else None)
    if Path(got) != pinned:  # the Hub could not be reached when the config was resolved, and can now
        raise config.ConfigError(f"model.path={spec.model.path}: the Hub answered only after the plan was made from "
                                 "colo's copy of its config.json; fix: run the same command again")


def _fill(prepared: Prepared, run_dir: Path) -> None:
    """What the run dir holds before the run: a resume's config and set-aside checkpoints, or a fresh run's generated
    model and data, config and origin."""
    spec, cfg = prepared.spec, prepared.cfg
    if spec.run.resume:
        from colo.config.resume import next_resume_config

        set_aside_damaged(run_dir)
        config.save_resolved(cfg, run_dir, next_resume_config(run_dir).name)
        return
    if spec.model.path.startswith(config.AUTO):
        from transformers.utils import logging as hf_logging

        from colo.models.tiny import WARM, make_tiny_model

        if not spec.run.verbose:  # save_pretrained's progress bar is not the run's
            hf_logging.disable_progress_bar()
        preset = spec.model.path[len(config.AUTO):]
        if preset in WARM:  # a trained base (LoRA's tiny job): trained once, from the task, by colo.data.warmstart
            from colo.data.warmstart import make_warm_model

            make_warm_model(cfg.model.path, preset, seed=spec.run.seed)
        else:
            make_tiny_model(cfg.model.path, preset, seed=spec.run.seed)
    for value in {spec.data.path, spec.data.eval_path} - {None}:
        if value.startswith(config.AUTO):
            from colo.data.tasks import make_task

            make_task(value[len(config.AUTO):], run_dir / "data", seed=spec.run.seed)
    config.save_resolved(cfg, run_dir)
    _write_origin(spec, cfg, prepared.source)


def _write_origin(cfg: ColoConfig, resolved: ColoConfig, config_file: str | None) -> None:
    from colo.config.resume import file_values
    from colo.run.origin import write_origin

    values = file_values(config_file) if config_file else {}
    specs = {"model.path": cfg.model.path, "data.path": cfg.data.path, "data.eval_path": cfg.data.eval_path}
    write_origin(resolved.run.dir, specs, config_file, values, resolved.model.path,
                 {"data.path": resolved.data.path, "data.eval_path": resolved.data.eval_path})


def set_aside_damaged(run_dir: Path) -> None:
    """Before a resume: checkpoints newer than the newest usable one are renamed step_NNNNNN.damaged (kept for a
    look, out of --resume's way; their steps are redone and saved again), with one line each. Refuses, naming
    the file, when checkpoints exist but none is usable."""
    from colo import config
    from colo.config.runfiles import none_usable
    from colo.run.rundir import usable_checkpoint

    good, damaged = usable_checkpoint(run_dir)
    if damaged and good is None:
        raise config.ConfigError(none_usable(run_dir, damaged))
    for path, problem in damaged:
        aside = next(path.with_name(f"{path.name}.damaged" + (f"-{i}" if i else "")) for i in range(1000)
                     if not path.with_name(f"{path.name}.damaged" + (f"-{i}" if i else "")).exists())
        path.rename(aside)
        print(f"colo: checkpoint {path.name} is damaged ({problem}); resuming from {good.name} instead "
              f"(kept as {aside.name})", flush=True)


def check_user_data(cfg: ColoConfig, resolved: ColoConfig) -> None:
    """Read every row of the user's data files (or datasets) before the run dir exists: validate() only looks
    at the first row, and a bad row found after config.yaml is written would force --resume on the rerun.
    Every first turn must leave rollout.max_tokens of rollout.max_model_len: the prompt as the chat template
    renders it, or with algo.environment what its reset() sends (synthetic auto: tasks included: a system
    message may not fit). A system prompt needs a chat template: checked here too, with the checkpoint's tokenizer."""
    from colo import config
    from colo.data.inputs import check_first_turns, uses_chat_template
    from colo.data.prompts import check_prompt_lengths, prompt_row, read_examples
    from colo.data.tasks import task_rows
    from colo.envs.base import EnvError

    tok = chat = None
    checks: list[tuple[str, list[dict]]] = []  # (name, rows {"prompt", "answer"})
    for key in ("path", "eval_path"):
        value = getattr(cfg.data, key)
        if not value or value.startswith(config.AUTO) and not cfg.algo.environment:
            continue  # a synthetic task's own prompts fit the presets it is made for
        path = value if value.startswith(config.AUTO) else getattr(resolved.data, key)
        try:
            if value.startswith(config.AUTO):
                rows = task_rows(value[len(config.AUTO):], "eval" if key == "eval_path" else "train", cfg.run.seed)
                examples = [(r["prompt"], r["answer"]) for r in rows]
            else:
                examples = read_examples(path, cfg.data.prompt_key, cfg.data.answer_key)
                rows = [prompt_row(p, a) for p, a in examples]
            if tok is None:
                tok = driver_tokenizer(cfg, resolved)
                chat = uses_chat_template(cfg, tok)
            if key == "eval_path":  # only the first data.eval_size rows are used
                rows, examples = rows[:cfg.data.eval_size], examples[:cfg.data.eval_size]
            if not cfg.algo.environment:
                check_prompt_lengths([p for p, _ in examples], tok, chat, cfg.data.system_prompt,
                                     cfg.rollout.max_model_len, cfg.rollout.max_tokens, path)
        except (OSError, ValueError) as e:  # read_rows names the file, the row and the field
            raise config.ConfigError(f"data: {e}") from e
        checks.append((path, rows))
    if cfg.algo.environment and checks:
        try:
            check_first_turns(cfg, tok, chat, checks)
        except ValueError as e:
            raise config.ConfigError(f"data: {e}") from e
        except EnvError as e:
            raise config.ConfigError(f"{e}; fix: the environment's reset() (docs/environments.md)") from e
    if cfg.data.system_prompt and not cfg.model.path.startswith(config.AUTO):  # presets have a template
        uses_chat_template(cfg, tok if tok is not None else driver_tokenizer(cfg, resolved))


def driver_tokenizer(cfg: ColoConfig, resolved: ColoConfig):
    """The tokenizer the run will use, before the run dir exists: an auto: preset's is built in memory."""
    from colo import config

    if cfg.model.path.startswith(config.AUTO):
        from colo.models.tiny import TOKENIZER_VOCAB, TOOL_PRESETS
        from colo.models.tokenizer import build_tokenizer

        return build_tokenizer(TOKENIZER_VOCAB, tools=cfg.model.path[len(config.AUTO):] in TOOL_PRESETS)
    from colo.data.prompts import load_tokenizer

    return load_tokenizer(resolved.model.path)
