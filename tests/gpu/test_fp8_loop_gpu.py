"""The loop with FP8 rollout on GPUs: a few RL steps of `python -m colo.launch` with rollout.quantization=fp8.

    bash tests/gpu/run.sh 590                     # STEPS="fp8" runs it after tests/gpu/test_fp8_gpu.py
    PYTHONPATH=. python -m pytest tests/gpu/test_fp8_loop_gpu.py -x -q -s     (~4-6 min on one H100/H200)

Each job (the tiny-fp8 preset: the tiny model in whole 128x128 blocks) runs the SFT warm-up and 3 RL steps with
every sync probed (sync.probe_every=1): colocated with R3 and TIS, loop.mode=async, a multi-turn environment, LoRA
(merged in bf16 on the trainer, then quantized by the sender), and on 2 GPUs disaggregated (the broadcast carries the e4m3 bytes and scales). Each must exit 0 with every sync verified;
the `[gpu]` lines carry the functional check's errors and the trainer-engine log-prob gap per step.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _job(tmp: Path, *overrides: str, gpus: int = 1) -> subprocess.CompletedProcess:
    from colo.models.tiny import make_tiny_model

    model = make_tiny_model(tmp / "tiny-fp8", "tiny-fp8", 0)
    args = [sys.executable, "-m", "colo.launch", f"model.path={model}", "placement.device=cuda",
            f"placement.num_gpus={gpus}", "model.dtype=bfloat16", "rollout.quantization=fp8", "loop.steps=3",
            "loop.sft_warmup_steps=2",
            "loop.eval_every=0", "data.prompts_per_step=4", "rollout.n=4", "rollout.max_tokens=32",
            "rollout.max_model_len=256", "rollout.enforce_eager=true", "sync.probe_every=1", f"run.dir={tmp}/run",
            *overrides]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    print(f"\n[gpu] fp8 job {' '.join(overrides) or 'default'}: exit {out.returncode}\n{out.stderr[-1500:]}")
    return out


@pytest.mark.parametrize("overrides", [["algo.routing_replay=r3"], ["loop.mode=async"],
                                       ["algo.environment=calculator", "rollout.max_turns=2"],
                                       ["trainer.lora_rank=8"]],
                         ids=["r3-tis", "async", "multiturn", "lora-merged"])
def test_loop_runs_verified_with_fp8(tmp_path: Path, overrides: list[str]) -> None:
    """A few RL steps with FP8 rollout: every sync verified and probed (sync.probe_every=1), the run ends cleanly."""
    _cuda()
    out = _job(tmp_path, *overrides)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = next((tmp_path / "run").rglob("metrics.jsonl"))
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert all(r.get("sync/verified", True) for r in rows) and any(r.get("sync/probe") for r in rows)
    gaps = [r["logprob_diff/mean"] for r in rows if "logprob_diff/mean" in r]
    print(f"[gpu] fp8 {overrides}: probe errors {[r.get('sync/probe_err') for r in rows]}, log-prob gap {gaps}")


def test_disaggregated_broadcast_carries_fp8(tmp_path: Path) -> None:
    _cuda()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = _job(tmp_path, "placement.mode=disaggregated", "placement.trainer_gpus=1", gpus=2)
    assert out.returncode == 0, out.stderr[-3000:]
