"""colo.plan.disk: the disk a run's checkpoints take at the model's size, the figure --dry-run prints, and the
refusal when run.dir's filesystem cannot hold them (the CLI's: tests/e2e/test_launch_cli.py)."""
from __future__ import annotations

from pathlib import Path

from colo.config import ColoConfig
from colo.models.tiny import PRESETS
from colo.plan.disk import disk_plan, refusal, saves

MiB = 2**20


def test_saves_counts_periodic_checkpoints_and_the_last_step() -> None:
    assert saves(140, 10) == 14 and saves(40, 10) == 4 and saves(45, 10) == 5 and saves(3, 0) == 1
    assert saves(140, 10, first=100) == 4 and saves(140, 10, first=140) == 0
    assert all(saves(n, k, f) == len({s for s in range(f, n) if k and (s + 1) % k == 0} | ({n - 1} if n > f else set()))
               for n in range(0, 30) for k in range(0, 7) for f in range(0, 12))


def test_default_job_keeps_three_checkpoints_of_the_tiny_models_size(tmp_path: Path) -> None:
    cfg = ColoConfig()
    cfg.model.dtype, cfg.loop.steps, cfg.loop.checkpoint_every, cfg.run.dir = "float32", 140, 10, str(tmp_path / "r")
    plan = disk_plan(cfg, dict(PRESETS["tiny"]))
    # 723,840 params x (4 + 2 x 4) bytes: measured 8.7 MB (8.3 MiB) per checkpoint of the default job
    assert plan.per_checkpoint == 723_840 * 12 and (plan.saves, plan.kept, plan.at_once) == (14, 3, 4)
    assert plan.need == 4 * plan.per_checkpoint + 723_840 * 4 and plan.fits and plan.where == str(tmp_path)
    assert plan.line().startswith("disk: 3 of 14 checkpoints kept (run.keep_checkpoints), 4 while one is written, "
                                  "each 8.3 MiB (fp32 trained params + AdamW state), export 2.8 MiB: 35.9 MiB at the peak;")
    cfg.run.keep_checkpoints, cfg.algo.kl_coef, cfg.trainer.optimizer_dtype = 0, 0.1, "bfloat16"
    plan = disk_plan(cfg, dict(PRESETS["tiny"]))  # all 14 kept; the KL reference adds fp32 weights, bf16 states
    assert plan.per_checkpoint == 723_840 * (4 + 2 * 2 + 4) and plan.at_once == plan.kept == 14
    # a resume at step 100 with 3 checkpoints there: 4 more to write, all kept
    assert disk_plan(cfg, dict(PRESETS["tiny"]), existing=3, first=100).need == 4 * plan.per_checkpoint + 723_840 * 4


def test_a_filesystem_too_small_is_refused_with_a_keep_that_fits(tmp_path: Path) -> None:
    cfg = ColoConfig()  # Qwen3-30B-A3B: ~366 GB per checkpoint
    cfg.run.dir = str(tmp_path / "runs" / "{time}")
    cfg.loop.steps, cfg.loop.checkpoint_every = 1000, 100
    plan = disk_plan(cfg, dict(PRESETS["qwen3-30b-a3b"]))
    assert 360e9 < plan.per_checkpoint < 370e9 and plan.at_once == 4
    small = type(plan)(**{**plan.__dict__, "free": int(plan.per_checkpoint * 2.5 + plan.export)})
    assert not small.fits and small.line().endswith("; does NOT fit")
    line = refusal(small)
    assert line.startswith("run.dir: its filesystem cannot hold the run's checkpoints: ") and "\n" not in line
    assert "fix: run.keep_checkpoints=1, or a run.dir on a larger filesystem" in line


def test_lora_checkpoints_hold_the_adapters_and_their_state_only(tmp_path: Path) -> None:
    """The whole Qwen3-30B-A3B with rank-8 LoRA on one H200 (configs/qwen3-30b-a3b-lora-1xh200.yaml): a checkpoint
    is the 321M adapters' fp32 weights and AdamW state (colo.trainer.checkpoint), not the 30.5B frozen base."""
    from colo.config import load_config

    cfg = load_config("configs/qwen3-30b-a3b-lora-1xh200.yaml", [f"run.dir={tmp_path / 'r'}"], {})
    cj = dict(PRESETS["qwen3-30b-a3b"])
    plan = disk_plan(cfg, cj)
    state = 2 if cfg.trainer.optimizer_dtype == "bfloat16" else 4
    adapters = plan.per_checkpoint // (4 + 2 * state)
    assert 300e6 < adapters < 340e6 and plan.per_checkpoint < 5 * 2**30, plan
    assert plan.export == adapters * 4  # the PEFT folder; the merged model only with trainer.lora_export_merged
    cfg.trainer.lora_export_merged = True
    assert disk_plan(cfg, cj).export > 50 * 2**30
