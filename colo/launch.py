"""Entry point: config -> checks -> memory plan -> run dir (model, data, config.yaml) -> colo.loop.run.

    python -m colo.launch                                       # configs/tiny-cpu.yaml, CPU, ~minutes
    python -m colo.launch --dry-run                             # resolved config + placement, starts nothing
    python -m colo.launch --config configs/qwen3-30b-a3b-4xh200.yaml trainer.lr=1e-6 loop.steps=50
    COLO_TRAIN_GPU_FRACTION=0.3 COLO_VLLM_GPU_FRACTION=0.6 python -m colo.launch --config ...
    python -m colo.launch --resume                              # continue the newest run of the config
                                                                # (its saved config; env + overrides on top)
    python -m colo.launch run.ray_address=10.0.0.1:6379 ...     # join a Ray cluster (also: RAY_ADDRESS)

Arguments are parsed and the config is checked before torch, Ray or vLLM is imported, so `--help`
and config mistakes answer in well under a second. A config mistake prints one line and exits 2,
before anything is written or started (`--debug` shows the traceback).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from colo.runlife import Clusters
    from colo.config import ColoConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from colo.run.commands import python  # stdlib only: --help stays fast

    ap = argparse.ArgumentParser(
        prog=f"{python()} -m colo.launch",  # .venv/bin/python from a checkout's root: runs as shown
        description="Colocated RL on Mixture-of-Experts LMs (FSDP2 trainer + vLLM on each GPU).",
        epilog="Precedence: defaults < --config YAML < COLO_* env vars < key=value. "
               "Keys and env vars: docs/config.md.")
    ap.add_argument("--config", default=None,
                    help=f"YAML config (default: configs/{DEFAULT_CONFIG.name})")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the resolved config and the per-GPU placement plan, start nothing")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in run.dir (its newest match) from its newest checkpoint, with "
                         "its saved config; env vars and key=value apply on top (same as run.resume=true)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks for config errors")
    ap.add_argument("--verbose", action="store_true",
                    help="show every actor's, vLLM's and Ray's output here (default: in <run.dir>/logs/)")
    ap.add_argument("overrides", nargs="*", metavar="key=value",
                    help="dotted overrides, e.g. trainer.lr=1e-6 placement.num_gpus=4")
    return ap.parse_intermixed_args(argv)  # key=value may follow --dry-run / --resume, as users write it


def main(argv: list[str] | None = None, clusters: Clusters | None = None) -> int:
    """`python -m colo.launch ARGV`; returns the exit status. `clusters`: where the job's cluster comes from and goes
    (colo.runlife.Clusters; by default the job starts its own and ends it; the test suite hands its warm clusters,
    tests/warm_clusters.py, so its short CPU jobs run in turn on the same processes)."""
    args = parse_args(argv)
    from colo.config import ConfigError  # omegaconf + yaml only: still fast
    from colo.run.signals import StopSignals

    early = StopSignals()  # Ctrl-C / SIGTERM before the loop takes them over (colo.loop.run): nothing to save yet
    early.install()
    try:
        return _run(args, clusters)
    except ConfigError as e:
        if args.debug:
            raise
        print(f"colo: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"colo: stopped by {early.name or 'SIGINT'}", file=sys.stderr)
        return early.exit_status if early.signum else 130
    finally:
        early.restore()


def _run(args: argparse.Namespace, clusters: Clusters | None = None) -> int:
    from colo import config

    path = args.config or (str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None)
    overrides = (list(args.overrides) + (["run.resume=true"] if args.resume else [])
                 + (["run.verbose=true"] if args.verbose else []))
    cfg = config.load_config(path, overrides)
    resumed = None
    if cfg.run.resume:  # the run's own saved config, this command's env and overrides on top
        from colo.config.resume import load_resumed

        resumed = load_resumed(cfg.run.dir, overrides, config_file=args.config)  # an explicit --config only
        cfg, path = resumed.cfg, str(resumed.base)
    config.validate(cfg, check_gpus=not args.dry_run)
    from colo.rollout.vllm_compat import check_installed  # package metadata only: no vLLM import

    check_installed()  # an older vLLM stops here, with the version colo needs
    from colo.plan.auto import show
    from colo.plan.job import check_fits, memory_plan, refusal, tune  # light: no torch until a GPU size is read
    from colo.plan.settings import PLAIN

    tuned = tune(cfg)  # the `auto` trainer settings, for this job on this GPU (colo.plan.auto); concrete from here on
    cfg = tuned.cfg
    if args.dry_run:
        from colo.cluster.placement import plan_placement

        resolved = config.resolve(cfg, download=False)
        placement, cluster_note = plan_placement(resolved), None
        if resolved.run.ray_address:  # the node of every rank, from the cluster itself
            from colo.cluster.nodes import plan_on_cluster

            placement, cluster_note = plan_on_cluster(placement, resolved.run.ray_address)
        print(f"# resolved config ({path or 'built-in defaults'} + env + overrides)")
        print(config.to_yaml(resolved), end="")
        print(f"\n{placement.table()}")
        if cluster_note:
            print(cluster_note)
        print(f"\n{tuned.table()}")
        plan = memory_plan(cfg, resolved.placement.device)
        if plan is not None:
            print(f"\n{plan.table()}")
        print(f"\n{_prompt_preview(cfg)}")  # auto: paths as given: a preset is built in memory
        if resumed:
            print(f"\n{resumed.describe(resolved)}")
        note = config.gpu_count_note(cfg)
        disk = _disk_plan(cfg, resolved)
        print(f"\n{disk.line() if disk else 'disk: not estimated (the model config.json lacks sizes the plan needs)'}")
        if note:
            print(f"\n{note}")
        if plan is not None and plan.gpu_bytes is not None and not plan.fits:  # the plan table shows why
            raise config.ConfigError(refusal(cfg, plan, config.model_config_json(cfg)))
        if disk and not disk.fits and not note and not resolved.run.ray_address:  # a job that would run here
            from colo.plan.disk import refusal as disk_refusal

            raise config.ConfigError(disk_refusal(disk))
        print("\n(dry run: nothing was written or started)")
        return 0
    check_fits(cfg)  # a job that cannot fit is refused before anything is written or started
    disk = _disk_plan(cfg, config.resolve(cfg, download=False))
    if disk and not disk.fits:  # its checkpoints would fill the disk mid-run
        from colo.plan.disk import refusal as disk_refusal

        raise config.ConfigError(disk_refusal(disk))
    if clusters is not None:
        clusters.check(config.resolve(cfg, download=False))  # the concrete device: "auto" is resolved
    from colo.host.procs import sweep as sweep_processes
    from colo.plan.preflight import check_host
    from colo.run.terminal import Phases

    check_host(cfg)  # $HOME, TMPDIR and /dev/shm as Ray, vLLM and the sync need them

    sweep_processes()  # what a run killed with SIGKILL left running on this host, by pid (colo.host.procs)
    phases = Phases()  # the start-up phase begins here: the run dir, then Ray, the actors and their imports
    cfg = prepare_run(cfg, config_file=path)  # config.yaml holds the concrete values: a resume runs them as they were
    changed = {k: v for k, v in tuned.resolved.items() if v != PLAIN[k]}
    if changed:
        print("colo: auto: " + " ".join(f"{k}={show(v)}" for k, v in changed.items()) + " (--dry-run says why)",
              flush=True)
    if resumed:
        print(resumed.describe(cfg), flush=True)
    print(f"colo: run dir {cfg.run.dir}", flush=True)
    phases.begin("start-up", _start_up(cfg), at=phases.started)
    from colo import loop  # heavy: torch, Ray, vLLM
    from colo.run.logs import keep_logs
    from colo.run.rundir import unlock

    try:
        status = loop.run(cfg, clusters, phases=phases)
    finally:
        keep_logs(cfg.run.dir, ray_logs=clusters is None)  # a warm cluster's Ray session is not this run's alone
        unlock(cfg.run.dir)  # the process may go on to another job (`clusters`)
    return status if isinstance(status, int) else 0


def _start_up(cfg: ColoConfig) -> str:
    """What the start-up phase starts, in words."""
    p = cfg.placement
    trainers = p.num_gpus if p.mode == "colocated" else p.trainer_gpus
    engines = p.num_gpus if p.mode == "colocated" else (p.num_gpus - p.trainer_gpus) // cfg.rollout.tp_size
    where = "the Ray cluster at " + cfg.run.ray_address if cfg.run.ray_address else "Ray"
    return (f"{where}, {trainers} FSDP2 trainer rank{'s' * (trainers != 1)} and {engines} vLLM "
            f"engine{'s' * (engines != 1)} ({p.mode} on {p.device})")


def _disk_plan(cfg: ColoConfig, resolved: ColoConfig):
    """The disk the run's checkpoints take (colo.plan.disk), counting those a resumed run already has; None when
    the model's config.json lacks the sizes (a checkpoint transformers cannot read either: prepare_run says so)."""
    from colo import config
    from colo.plan.disk import disk_plan
    from colo.run.rundir import complete_checkpoints

    existing = complete_checkpoints(resolved.run.dir) if cfg.run.resume else []
    first = int(existing[-1].name.removeprefix("step_")) + 1 if existing else 0
    try:
        return disk_plan(resolved, config.model_config_json(cfg), len(existing), first)
    except (KeyError, TypeError, ValueError):
        return None


def prepare_run(cfg: ColoConfig, config_file: str | None = None) -> ColoConfig:
    """Resolve the config, create run.dir, generate auto: model/data into it, save the config: config.yaml
    and origin.json (what the run started from: colo.run.origin; `config_file`, the --config it started with)
    at the start of a run, config.resume-<n>.yaml at its n-th resume (config.yaml is never rewritten).

    Returns the resolved config (concrete device, absolute paths, the `auto` trainer settings colo.plan.auto chose)
    that the loop and actors get; `--resume run.dir=<run.dir>` continues from it. A resume generates nothing: the
    run's model and data are the ones it started with, and must still be there."""
    from colo import config
    from colo.plan.job import tune
    from colo.run import rundir

    cfg = tune(cfg).cfg  # config.yaml holds concrete values: a resume runs the settings this run ran (_run did it)
    resolved = config.resolve(cfg)  # may download a Hub model: still before anything is written
    run_dir = Path(resolved.run.dir)
    if cfg.run.resume:
        for key, value in (("model.path", resolved.model.path), ("data.path", resolved.data.path),
                           ("data.eval_path", resolved.data.eval_path)):
            if value and Path(value).is_relative_to(run_dir) and not Path(value).exists():
                raise config.ConfigError(f"--resume: the run's {key} {value} is gone (it was generated at the run's "
                                         "start and is not generated again); fix: restore it from a copy of the run")
        from colo.config.runfiles import check_resume_files

        check_resume_files(resolved)  # the checkpoint's resume state and what it holds, metrics.jsonl: read only
    check_user_data(cfg, resolved)
    if not cfg.model.path.startswith(config.AUTO):  # presets are written by colo itself
        from colo.config.weights import check_model_readable

        check_model_readable(resolved.model.path, weights=not cfg.model.dummy_weights)
    try:
        rundir.check_writable(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        rundir.lock(run_dir)  # held until this process exits: a second launch into run_dir is refused
    except (rundir.RunDirError, OSError) as e:
        raise config.ConfigError(str(e) if isinstance(e, rundir.RunDirError) else
                                 f"run.dir={run_dir}: {e}; fix: a writable run.dir") from e
    if cfg.run.resume:
        from colo.config.resume import next_resume_config

        set_aside_damaged(run_dir)
        config.save_resolved(resolved, run_dir, next_resume_config(run_dir).name)
        return resolved
    if cfg.model.path.startswith(config.AUTO):
        from transformers.utils import logging as hf_logging

        from colo.models.tiny import WARM, make_tiny_model

        if not cfg.run.verbose:  # save_pretrained's progress bar is not the run's
            hf_logging.disable_progress_bar()
        preset = cfg.model.path[len(config.AUTO):]
        if preset in WARM:  # a trained base (LoRA's tiny job): trained once, from the task, by colo.data.warmstart
            from colo.data.warmstart import make_warm_model

            make_warm_model(resolved.model.path, preset, seed=cfg.run.seed)
        else:
            make_tiny_model(resolved.model.path, preset, seed=cfg.run.seed)
    for value in {cfg.data.path, cfg.data.eval_path} - {None}:
        if value.startswith(config.AUTO):
            from colo.data.tasks import make_task

            make_task(value[len(config.AUTO):], run_dir / "data", seed=cfg.run.seed)
    config.save_resolved(resolved, run_dir)
    _write_origin(cfg, resolved, config_file)
    return resolved


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


def _prompt_preview(cfg: ColoConfig) -> str:
    from colo import config
    from colo.data.inputs import preview_prompt

    try:
        return preview_prompt(cfg)
    except config.ConfigError:
        raise
    except (OSError, ValueError) as e:  # a Hub model or dataset not on this machine: the plan still stands
        return f"# first prompt: not shown ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def check_user_data(cfg: ColoConfig, resolved: ColoConfig) -> None:
    """Read every row of the user's data files (or datasets) before the run dir exists: validate() only looks
    at the first row, and a bad row found after config.yaml is written would force --resume on the rerun.
    Every first turn must leave rollout.max_tokens of rollout.max_model_len: the prompt as the chat template
    renders it, or with algo.environment what its reset() sends (synthetic auto: tasks included: a system
    message may not fit). A system prompt needs a chat template: checked here too, with the checkpoint's tokenizer."""
    from colo import config
    from colo.data.inputs import check_first_turns, uses_chat_template
    from colo.data.prompts import check_prompt_lengths, read_rows
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
            else:
                keys = [cfg.data.prompt_key, cfg.data.answer_key]
                rows = [{"prompt": str(r[keys[0]]), "answer": str(r[keys[1]])}
                        for r in read_rows(path, keys, text=keys[:1])]
            if tok is None:
                tok = driver_tokenizer(cfg, resolved)
                chat = uses_chat_template(cfg, tok)
            if key == "eval_path":  # only the first data.eval_size rows are used
                rows = rows[:cfg.data.eval_size]
            if not cfg.algo.environment:
                check_prompt_lengths([r["prompt"] for r in rows], tok, chat, cfg.data.system_prompt,
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


if __name__ == "__main__":
    sys.exit(main())
