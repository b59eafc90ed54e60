"""The memory plan through the CLI: `--dry-run` of a shipped GPU config plans it here (no GPU, no Hub), says what
each `auto` trainer setting resolved to and why, and refuses a setting that cannot fit with suggestions that each fit
when planned again (the plan itself: tests/unit/test_memplan.py; auto: tests/unit/test_plan_auto.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from colo import config as C
from colo.config.checks import parse_gpu_memory
from colo.plan.job import device_of, tune
from colo.plan.memory import plan_memory
from colo.plan.search import format_changes, ways_to_fit
from colo.plan.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLO_")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "colo.launch", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_dry_run_plans_a_gpu_job_here_and_refuses_what_cannot_fit() -> None:
    name = "configs/qwen3-30b-a3b-8xh100.yaml"
    r = _cli("--config", name, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "memory plan: Qwen3MoeForCausalLM 30.53B params" in r.stdout and "\nfits\n" in r.stdout
    assert "colo's copy of its config.json" in r.stderr  # no Hub here: said in one line
    too_big = ["trainer.optimizer_offload=false", "trainer.gradient_checkpointing=false", "trainer.micro_batch_size=2"]
    r = _cli("--config", name, "--dry-run", *too_big)
    assert r.returncode == 2 and "does NOT fit" in r.stdout
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("colo: error: the memory plan does not fit: the ") and "; fix: " in err
    # every suggestion, planned again, fits
    cfg = C.load_config(str(ROOT / name), too_big, {})
    model, device = C.model_config_json(cfg), device_of(cfg)
    cfg = tune(cfg, model, device).cfg  # the auto keys as the run resolved them
    ways = ways_to_fit(model, Settings.from_config(cfg), parse_gpu_memory("H100"), device.speeds)
    assert ways and all(p.fits for _, p in ways)
    for changes, _ in ways:
        assert format_changes(changes, cfg.placement.train_gpu_fraction) in err
        fix = format_changes(changes, cfg.placement.train_gpu_fraction).split()
        fixed = tune(C.load_config(str(ROOT / name), too_big + fix, {}), model, device).cfg
        assert plan_memory(model, Settings.from_config(fixed), parse_gpu_memory("H100")).fits


L12_H200 = ["model.path=auto:qwen3-30b-a3b-L12", "model.dummy_weights=true", "model.dtype=bfloat16",
            "placement.device=cuda", "placement.num_gpus=1", "placement.gpu_memory=H200", "rollout.max_tokens=4096",
            "rollout.max_model_len=4352", "rollout.n=8", "data.prompts_per_step=16", "trainer.optimizer_dtype=bfloat16"]


def test_dry_run_resolves_the_auto_settings_to_the_fast_path_and_says_why() -> None:
    """Issue 44's done-when: the L12 bench's job on one H200, with no trainer override but the optimizer's dtype,
    resolves the six settings to the measured fast path, one line each with why; the printed config holds them."""
    r = _cli("--dry-run", *L12_H200)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("auto settings: the fastest that fits 139.8 GiB"))
    lines = out[start + 1:start + 7]
    want = ["trainer.offload=false", "trainer.optimizer_offload=true", "trainer.compile=true",
            "trainer.gradient_checkpointing=true", "trainer.gather_once=true",
            "trainer.max_tokens_per_micro_batch=32768"]
    assert [line.split()[0] for line in lines] == want, "\n".join(lines)
    assert all(len(line.split(None, 1)) == 2 for line in lines)  # and a reason on the same line
    assert "\n  offload: false\n" in r.stdout and "\n  max_tokens_per_micro_batch: 32768\n" in r.stdout
    assert "whole model gathered bf16" in r.stdout and "\nfits\n" in r.stdout
    # a value set on the command line is kept, and said to be
    r = _cli("--dry-run", *L12_H200, "trainer.offload=true", "trainer.compile=false")
    assert r.returncode == 0, r.stderr
    assert any(line.split() == ["trainer.offload=true", "as", "set"] for line in r.stdout.splitlines())
    assert any(line.split() == ["trainer.compile=false", "as", "set"] for line in r.stdout.splitlines())
    assert "\n  compile: false\n" in r.stdout
