"""The disk a run's checkpoints take, from the memory plan's numbers, against the run dir's free space.

    plan = disk_plan(cfg)                     # DiskPlan: bytes per checkpoint, how many at once, the export
    print(plan.line())                        # disk: 3 checkpoints kept (4 while one is written) x 8.3 MiB ...
    plan.fits                                 # False: the run dir's filesystem cannot hold them

A checkpoint holds the trainer's fp32 parameters and AdamW's two states (trainer.optimizer_dtype), and the frozen
KL reference's fp32 weights when algo.kl_coef > 0 (colo.trainer.checkpoint); the export holds the weights once,
in model.dtype. Measured on the default job (tiny preset, 723,840 parameters): 8.7 MB per checkpoint against
8.3 MiB (8.7 MB) here. At Qwen3-30B-A3B's 30.5B parameters one checkpoint is ~366 GB, which is why a run keeps
the newest run.keep_checkpoints (3) and not all of them: the save writes the new one before the oldest goes, so
keep + 1 are on disk at the peak.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colo.plan.memory import model_shape

if TYPE_CHECKING:
    from colo.config import ColoConfig

MiB, GiB = 2**20, 2**30


@dataclass(frozen=True)
class DiskPlan:
    per_checkpoint: int  # bytes of one checkpoint
    saves: int  # checkpoints the run (what is left of it, on resume) writes: loop.checkpoint_every and the last step
    kept: int  # on disk at the end (those already there included)
    at_once: int  # on disk at the peak: one more than kept while a save is written
    existing: int  # already in the run dir (a resume)
    export: int  # bytes of the final Hugging Face export
    free: int | None  # free bytes on run.dir's filesystem (None: unknown)
    where: str  # the existing directory the free space was read from

    @property
    def need(self) -> int:
        """Bytes the run adds to its filesystem at the peak."""
        return max(0, self.at_once - self.existing) * self.per_checkpoint + self.export

    @property
    def fits(self) -> bool:
        return self.free is None or self.need <= self.free

    def line(self) -> str:
        """One line for --dry-run: the estimate and whether it fits."""
        keep = f"{self.kept} of {self.existing + self.saves} checkpoints kept (run.keep_checkpoints)" + (
            f", {self.at_once} while one is written" if self.at_once > self.kept else "")
        free = "free space unknown" if self.free is None else f"{size(self.free)} free in {self.where}"
        verdict = "" if self.fits else "; does NOT fit"
        return (f"disk: {keep}, each {size(self.per_checkpoint)} (fp32 trained params + AdamW state), export "
                f"{size(self.export)}: {size(self.need)} at the peak; {free}{verdict}")


def size(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def checkpoint_bytes(config_json: dict[str, Any], optimizer_dtype: str, ref_model: bool,
                     lora: tuple[int, tuple[str, ...]] = (0, ())) -> int:
    """Bytes of one checkpoint: fp32 params, AdamW's two states (trainer.optimizer_dtype), the fp32 KL reference
    when there is one (algo.kl_coef > 0). With LoRA (`lora`: rank, targets; rank 0 is off) the checkpoint holds the
    adapters and their AdamW state only (colo.trainer.checkpoint): the frozen base is the model's own files."""
    from colo.plan.memory import lora_params

    state = 2 if optimizer_dtype == "bfloat16" else 4
    m = model_shape(config_json)
    numel = sum(p.numel for p in lora_params(m, lora[0], lora[1])) if lora[0] else m.numel
    return numel * (4 + 2 * state + (4 if ref_model else 0))


def saves(steps: int, every: int, first: int = 0) -> int:
    """Checkpoints written by RL steps first..steps-1: after each step s with (s + 1) % every == 0 (every 0: none)
    and after the last."""
    if steps <= first:
        return 0
    periodic = steps // every - first // every if every else 0
    return periodic + (0 if every and steps % every == 0 else 1)


def disk_plan(cfg: ColoConfig, config_json: dict[str, Any], existing: int = 0, first: int = 0) -> DiskPlan:
    """The plan of `cfg`'s run; `existing` checkpoints already in the run dir and RL steps from `first` (a resume:
    colo.run.rundir.complete_checkpoints and the newest one's step + 1)."""
    lora = (int(cfg.trainer.lora_rank), tuple(cfg.trainer.lora_targets))
    per = checkpoint_bytes(config_json, cfg.trainer.optimizer_dtype, cfg.algo.kl_coef > 0, lora)
    n, keep = saves(cfg.loop.steps, cfg.loop.checkpoint_every, first), cfg.run.keep_checkpoints
    total = existing + n
    kept = min(total, keep) if keep else total
    at_once = max(existing, min(total, keep + 1)) if keep else total
    export = model_shape(config_json).numel * (4 if cfg.model.dtype == "float32" else 2)
    if lora[0]:  # the PEFT adapter folder (fp32 adapters), and the merged model only on request
        export = per // (4 + 2 * (2 if cfg.trainer.optimizer_dtype == "bfloat16" else 4)) * 4 + (
            export if cfg.trainer.lora_export_merged else 0)
    where = Path(cfg.run.dir.replace("{time}", "")).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free: int | None = shutil.disk_usage(where).free
    except OSError:
        free = None
    return DiskPlan(per, n, kept, at_once, existing, export, free, str(where))


def refusal(plan: DiskPlan) -> str:
    """One line: the checkpoints do not fit, and what would."""
    fits_keep = ((plan.free or 0) - plan.export) // max(1, plan.per_checkpoint) - 1 + plan.existing
    fix = (f"run.keep_checkpoints={fits_keep}" if fits_keep >= 1 else "free space there") + \
        ", or a run.dir on a larger filesystem"
    return (f"run.dir: its filesystem cannot hold the run's checkpoints: {size(plan.need)} at the peak "
            f"({plan.at_once} x {size(plan.per_checkpoint)} + export {size(plan.export)}), "
            f"{size(plan.free or 0)} free in {plan.where}; fix: {fix} (`--dry-run` prints the estimate)")
