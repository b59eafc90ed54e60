"""configs/tiny-cpu-tools.yaml end to end (`python -m colo.launch`): the warm-up on the calculator's
demonstrations, then RL steps whose samples are conversations with the calculator. Shortened (fewer steps);
the shipped config's full run is described in docs/environments.md."""
from __future__ import annotations

import json
from pathlib import Path


def test_tool_job_runs_conversations_and_logs_their_metrics(tools_job) -> None:
    """The session's tools job (tests/conftest.py: the README's tools command, 3 RL steps)."""
    run_dir, r = tools_job
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    warm, steps = records[0], records[1:]
    assert warm["step"] == -1 and warm["sft/loss_last"] < warm["sft/loss_first"] / 4
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:
        assert s["rollout/turns/mean"] > 1 and s["rollout/turns/max"] <= 3  # the model calls the tool
        assert s["rollout/tool_calls_per_sample"] > 0.5 and s["env/errors"] == 0
        assert 0.2 < s["rollout/model_token_frac"] < 0.9  # the tool's tokens are in the rows, without loss
        assert s["sync/verified"] is True and s["env/seconds"] >= 0 and s["rollout/tool_errors"] >= 0
        assert s["logprob_diff/mean"] < 0.05  # trainer and vLLM agree on the model's tokens
    assert "eval/reward" in steps[-1]
    assert not (run_dir / "env-errors.log").exists()


def test_tool_job_runs_disaggregated(tmp_path: Path, warm_jobs) -> None:
    """The same conversations with trainer and engine on separate (logical) GPUs: the engine runs them the
    same way, and the broadcast sync is verified."""
    run_dir = tmp_path / "run"
    r = warm_jobs("--config", "configs/tiny-cpu-tools.yaml", f"run.dir={run_dir}", "placement.mode=disaggregated",
                  "placement.trainer_gpus=1", "loop.steps=2", "loop.eval_every=0", "data.eval_path=null",
                  "loop.sft_warmup_steps=40", timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert s["rollout/turns/mean"] > 1 and s["env/errors"] == 0 and s["sync/verified"] is True
        assert s["logprob_diff/mean"] < 0.05
