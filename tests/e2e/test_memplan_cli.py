"""The memory plan through the CLI: `--dry-run` of a shipped GPU config plans it here (no GPU, no Hub) and
refuses a setting that cannot fit with suggestions that each fit when planned again (the plan itself:
tests/unit/test_memplan.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from colo import config as C
from colo.config.checks import parse_gpu_memory
from colo.plan.fitting import format_changes, ways_to_fit
from colo.plan.memory import Settings, plan_memory

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
    model = C.model_config_json(cfg)
    ways = ways_to_fit(model, Settings.from_config(cfg), parse_gpu_memory("H100"))
    assert ways and all(p.fits for _, p in ways)
    for changes, _ in ways:
        assert format_changes(changes, cfg.placement.train_gpu_fraction) in err
        fixed = C.load_config(str(ROOT / name), too_big + format_changes(changes, cfg.placement.train_gpu_fraction).split(), {})
        assert plan_memory(model, Settings.from_config(fixed), parse_gpu_memory("H100")).fits
