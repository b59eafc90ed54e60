"""tools/peers/verl: the side-by-side's figures come out of the files the runs write, the same way for both systems.

The runs themselves need a GPU and verl's bundle (tools/peers/verl/README.md); here: nvidia-smi's samples are read
and peaked per wall-clock span, verl's per-step metrics and colo's per-step records give the medians over the measured
steps only, and verl's overrides carry the conditions the comparison rests on (fixed lengths, batch, micro-batch).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from tools.peers.verl import run_colo, run_verl
from tools.peers.verl.gpumem import peak_gib, read_samples

T0 = 1_800_000_000.0


def smi_line(t: float, mib: float) -> str:
    return f"{datetime.fromtimestamp(t).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {mib:.0f}"


def write_gpu(path: Path, points: list[tuple[float, float]]) -> None:
    path.write_text("\n".join(smi_line(t, m) for t, m in points) + "\n")


def test_samples_and_peaks(tmp_path: Path) -> None:
    write_gpu(tmp_path / "gpu.csv", [(T0 + i * 0.1, 1024 * (1 + i)) for i in range(10)])
    samples = read_samples(tmp_path / "gpu.csv")
    assert len(samples) == 10 and abs(samples[3][0] - (T0 + 0.3)) < 1e-3
    assert peak_gib(samples, T0 + 0.15, T0 + 0.45) == 5.0  # samples at .2, .3, .4: 3, 4, 5 GiB
    assert peak_gib(samples, T0 + 0.51, T0 + 0.52) == 6.0  # shorter than the period: the nearest sample
    assert peak_gib([], T0, T0 + 1) is None


def test_verl_overrides_hold_the_conditions(tmp_path: Path) -> None:
    args = run_verl.parse_args(["--model", "/m", "--prompts", "64", "--max-tokens", "1024", "--prompt-len", "256"])
    ovr = dict(o.split("=", 1) for o in run_verl.overrides(args, tmp_path / "p.parquet", tmp_path))
    assert ovr["actor_rollout_ref.rollout.ignore_eos"] == "True"
    assert ovr["data.max_response_length"] == "1024" and ovr["data.max_prompt_length"] == "256"
    assert ovr["data.train_batch_size"] == ovr["actor_rollout_ref.actor.ppo_mini_batch_size"] == "64"  # one update
    assert ovr["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "6"  # 8192 // 1280
    assert ovr["actor_rollout_ref.actor.optim.weight_decay"] == "0.0"
    assert ovr["actor_rollout_ref.actor.use_kl_loss"] == "False"
    assert ovr["+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook"] == run_verl.HOOK
    assert ovr["trainer.total_training_steps"] == "5"  # 2 warm-up + 3 measured


def test_verl_summary_takes_the_measured_steps(tmp_path: Path) -> None:
    args = run_verl.parse_args(["--model", "/m", "--prompts", "2", "--n", "2", "--prompt-len", "4", "--max-tokens", "4",
                                "--warmup", "1", "--steps", "2"])
    steps = [{"step": s, "data": {"timing_s/step": 10.0 * s, "perf/throughput": 100.0 / s, "perf/total_num_tokens": 32,
                                  "timing_s/gen": 1.0 * s, "timing_s/update_weights": 0.5,
                                  "timing_s/update_actor": 2.0}}
             for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    spans = []
    for s in range(4):  # step s: gen at 0-1 s, update_weights at 2-3 s of its own 10 s window
        base = T0 + 10 * s
        spans += [{"name": "gen", "t0": base, "t1": base + 1, "pid": 7},
                  {"name": "update_weights", "t0": base + 2, "t1": base + 3, "pid": 7},
                  {"name": "step", "t0": base, "t1": base + 9, "pid": 7},
                  {"name": "gen", "t0": base, "t1": base + 1, "pid": 99}]  # another process's timer: ignored
    (tmp_path / "phases.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    write_gpu(tmp_path / "gpu.csv", [(T0 + 10 * s + d, 1024 * (s + 1) * (2 if d == 0.5 else 1))
                                     for s in range(4) for d in (0.5, 2.5, 5.0)])
    out = run_verl.summarize(tmp_path, args)
    assert (out["steps_done"], out["steps_measured"]) == (4, 2)
    assert out["step_s"] == 25.0 and out["tokens_per_step"] == out["tokens_expected"] == 32
    assert out["sync_s"] == 0.5 and out["phases_s"]["gen"] == 2.5
    assert out["memory_peak_gib"]["gen"] == 6.0  # steps 2 and 3 measured: gen peaks 4 and 6 GiB
    assert out["memory_peak_gib"]["update_weights"] == 3.0


def test_colo_summary_takes_the_measured_steps(tmp_path: Path) -> None:
    recs = [{"t1": T0 + 10 * s + 9, "timing/step_s": 8.0 + s, "bench/tokens": 32.0, "response_len/mean": 4.0,
             "timing/rollout_s": 1.0, "timing/sync_s": 0.1, "timing/offload_s": 0.2, "timing/wake_s": 0.3,
             "sync/verified": True} for s in range(4)]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    spans = [{"name": "rollout", "t0": T0 + 10 * s, "t1": T0 + 10 * s + 1, "part": False} for s in range(4)]
    (tmp_path / "phases.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    write_gpu(tmp_path / "gpu.csv", [(T0 + 10 * s + 0.5, 1024 * (s + 1)) for s in range(4)])
    out = run_colo.summarize(tmp_path, ["--prompts", "2", "--warmup", "2", "--steps", "2"])
    assert (out["steps_done"], out["steps_measured"]) == (4, 2)
    assert out["step_s"] == 10.5 and out["tokens_per_s_per_gpu"] == (32.0 / 10 + 32.0 / 11) / 2  # per-step medians
    assert abs(out["weight_window_s"] - 0.6) < 1e-9 and out["sync_verified"] is True
    assert out["memory_peak_gib"]["rollout"] == 4.0
