"""The front door as a pipeline: a config file and overrides in, a Prepared job out; nothing written or started.

    prepared = prepare("configs/tiny-cpu.yaml", ["trainer.lr=1e-6"])   # every step below, in order
    print(prepared.report())       # what --dry-run prints
    prepared.check()               # ConfigError: the memory plan or the disk cannot hold the job (--dry-run: after)
    cfg = make_run_dir(prepared)   # colo.materialize: the run dir; then colo.loop.run(cfg, ...)

The steps, each refusing with one ConfigError line that names the fix:
    load_config       defaults < YAML file < COLO_* environment < key=value (colo.config)
    load_resumed      --resume: the run's own saved config underneath (colo.config.resume), and what the run
                      generated at its start still there
    validate          the values, files, GPUs, the model family (colo.config.checks)
    check_installed   the vLLM version, from package metadata (colo.rollout.vllm_compat)
    resolve           every `auto`, once: the frozen config everything after reads (colo.plan.resolve)
    the plans         the placement (colo.cluster.placement), the memory per GPU (colo.plan, GPU only), the disk the
                      checkpoints take (colo.plan.disk)
Light: torch is imported only to ask for a GPU (placement.device=auto, or a GPU's size), never Ray or vLLM (but
--dry-run with run.ray_address, which asks the cluster where each rank would go).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colo import config
from colo.config import ColoConfig, ConfigError

if TYPE_CHECKING:
    from colo.cluster.placement import PlacementPlan
    from colo.config.resume import Resumed
    from colo.plan.auto import Tuned
    from colo.plan.disk import DiskPlan
    from colo.plan.job import Device
    from colo.plan.memory import MemoryPlan

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml"


@dataclass(frozen=True)
class Prepared:
    """A job ready to run: its config as given and as resolved, and every plan made from the resolved one."""
    spec: ColoConfig  # as given (`auto` words, auto: presets, Hub ids): what the run dir is made from
    cfg: ColoConfig  # resolved and frozen (colo.plan.resolve): what the run, config.yaml and every actor get
    source: str | None  # the config file it came from (a resume: the run's newest saved config); None: defaults
    config_file: str | None  # the --config given (None: the default one, or none)
    model: dict[str, Any]  # the checkpoint's config.json
    choices: Tuned  # the `auto` trainer settings and why
    device: Device  # what the plans are for: cpu, or a GPU's size and its measured speeds
    placement: PlacementPlan
    memory: MemoryPlan | None  # None on CPU
    disk: DiskPlan | None  # None: config.json lacks the sizes (a checkpoint transformers cannot read either)
    resumed: Resumed | None
    dry_run: bool
    cluster_note: str | None = None  # --dry-run with run.ray_address: the cluster did not answer
    gpu_note: str | None = None  # --dry-run: the GPUs asked for are not all on this machine

    def report(self) -> str:
        """--dry-run's text: the resolved config, the placement, the `auto` choices, the plans, the first prompt."""
        blocks = [f"# resolved config ({self.source or 'built-in defaults'} + env + overrides)\n"
                  f"{config.to_yaml(self.cfg).rstrip()}",
                  self.placement.table() + (f"\n{self.cluster_note}" if self.cluster_note else ""),
                  self.choices.table()]
        blocks += [self.memory.table()] if self.memory is not None else []
        blocks += self.warnings()
        blocks += [_prompt_preview(self.spec)]  # auto: paths as given: a preset is built in memory
        blocks += [self.resumed.describe(self.cfg)] if self.resumed else []
        blocks += [self.disk.line() if self.disk else
                   "disk: not estimated (the model config.json lacks sizes the plan needs)"]
        blocks += [self.gpu_note] if self.gpu_note else []
        return "\n\n".join(blocks)

    def warnings(self) -> list[str]:
        """One line per setting asked for that colo measured to lose on this job's model and card (FP8 rollout:
        colo.plan.job.fp8_warning); --dry-run and a run's start print them."""
        from colo.plan.job import fp8_warning

        line = fp8_warning(self.cfg, self.model, self.memory, self.device)
        return [line] if line else []

    def refusal(self) -> str | None:
        """Why the job cannot run here, in one line with the fix: its memory plan does not fit the GPU, or its
        checkpoints the disk (a dry run that plans for other machines, a cluster or missing GPUs, leaves the disk
        to the run); None when it can."""
        from colo.plan.disk import refusal as disk_refusal
        from colo.plan.job import refusal

        m = self.memory
        if m is not None and m.gpu_bytes is not None and not m.fits:
            return refusal(self.cfg, m, self.model, self.device)
        here = not self.dry_run or not (self.gpu_note or self.cfg.run.ray_address)
        if self.disk is not None and not self.disk.fits and here:
            return disk_refusal(self.disk)
        return None

    def check(self) -> None:
        """Raise the refusal, if any, as a ConfigError."""
        why = self.refusal()
        if why:
            raise ConfigError(why)

    def start_lines(self) -> list[str]:
        """What a run says once its run dir exists: the `auto` trainer values other than before auto, loop.mode=auto's
        choice with its reason, a resume's changes, where the run dir is."""
        from colo.plan.auto import show
        from colo.plan.settings import PLAIN

        resolved = self.choices.resolved
        changed = {k: v for k, v in resolved.items() if k in PLAIN and v != PLAIN[k]}
        lines = ["colo: auto: " + " ".join(f"{k}={show(v)}" for k, v in changed.items()) + " (--dry-run says why)"
                 ] if changed else []
        mode = next((c for c in self.choices.choices if c.key == "loop.mode" and c.auto), None)
        if mode:  # it changes the algorithm: the run says which and why
            lines.append("colo: auto: " + " ".join(f"{k}={show(v)}" for k, v in resolved.items() if k not in PLAIN)
                         + f": {mode.why}")
        lines += [self.resumed.describe(self.cfg)] if self.resumed else []
        lines += [f"colo: {w}" for w in self.warnings()]
        return lines + [f"colo: run dir {self.cfg.run.dir}"]

    def start_up(self) -> str:
        """What the start-up phase starts, in words."""
        p, cfg = self.cfg.placement, self.cfg
        trainers = p.num_gpus if p.mode == "colocated" else p.trainer_gpus
        engines = p.num_gpus if p.mode == "colocated" else (p.num_gpus - p.trainer_gpus) // cfg.rollout.tp_size
        where = "the Ray cluster at " + cfg.run.ray_address if cfg.run.ray_address else "Ray"
        return (f"{where}, {trainers} FSDP2 trainer rank{'s' * (trainers != 1)} and {engines} vLLM "
                f"engine{'s' * (engines != 1)} ({p.mode} on {p.device})")


def prepare(config_file: str | None, overrides: list[str], env: Mapping[str, str] | None = None, *,
            dry_run: bool = False) -> Prepared:
    """The module docstring's pipeline. `config_file`: --config (None: configs/tiny-cpu.yaml when there is one);
    `env`: the COLO_* variables (default: this process's); `dry_run`: the GPU count is noted, not checked, and a
    joined Ray cluster is asked where each rank would go."""
    from colo.cluster.placement import plan_placement
    from colo.plan.job import memory_plan
    from colo.plan.resolve import resolve
    from colo.rollout.vllm_compat import check_installed

    source = config_file or (str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None)
    spec = config.load_config(source, overrides, env)
    resumed = None
    if spec.run.resume:  # the run's own saved config, this command's env and overrides on top
        from colo.config.resume import load_resumed

        resumed = load_resumed(spec.run.dir, overrides, env, config_file=config_file)  # an explicit --config only
        spec, source = resumed.cfg, str(resumed.base)
        _check_generated(spec)
    config.validate(spec, check_gpus=not dry_run)
    check_installed()  # an older vLLM stops here, with the version colo needs
    model = config.model_config_json(spec)
    resolved = resolve(spec, model)  # the one resolve of this process
    cfg = resolved.cfg
    if spec.run.resume:
        from colo.config.runfiles import check_resume_files

        check_resume_files(cfg)  # the checkpoint's resume state and what it holds, metrics.jsonl: read only
    placement, cluster_note = plan_placement(cfg), None
    if dry_run and cfg.run.ray_address:  # the node of every rank, from the cluster itself
        from colo.cluster.nodes import plan_on_cluster

        placement, cluster_note = plan_on_cluster(placement, cfg.run.ray_address)
    return Prepared(spec, cfg, source, config_file, model, resolved.choices, resolved.device, placement,
                    memory_plan(cfg, model, resolved.device), _disk_plan(cfg, model), resumed, dry_run, cluster_note,
                    config.gpu_count_note(spec) if dry_run else None)


def _check_generated(spec: ColoConfig) -> None:
    """--resume: the model and data the run generated at its start (auto: presets) are still in its run dir."""
    run_dir = Path(spec.run.dir)
    for key, value in (("model.path", spec.model.path), ("data.path", spec.data.path),
                       ("data.eval_path", spec.data.eval_path)):
        if value and Path(value).is_relative_to(run_dir) and not Path(value).exists():
            raise ConfigError(f"--resume: the run's {key} {value} is gone (it was generated at the run's start and is "
                              "not generated again); fix: restore it from a copy of the run")


def _disk_plan(cfg: ColoConfig, model: dict[str, Any]) -> DiskPlan | None:
    """The disk the run's checkpoints take (colo.plan.disk), counting those a resumed run already has; None when
    the model's config.json lacks the sizes (a checkpoint transformers cannot read either: colo.materialize says so)."""
    from colo.plan.disk import disk_plan
    from colo.run.rundir import complete_checkpoints

    existing = complete_checkpoints(cfg.run.dir) if cfg.run.resume else []
    first = int(existing[-1].name.removeprefix("step_")) + 1 if existing else 0
    try:
        return disk_plan(cfg, model, len(existing), first)
    except (KeyError, TypeError, ValueError):
        return None


def _prompt_preview(spec: ColoConfig) -> str:
    from colo.data.inputs import preview_prompt

    try:
        return preview_prompt(spec)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # a Hub model or dataset not on this machine: the plan still stands
        return f"# first prompt: not shown ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
