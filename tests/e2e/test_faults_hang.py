"""An engine that stops responding mid-run (SIGSTOP; on a GPU a stuck CUDA kernel or NCCL call looks the same to the
driver): the run waited without a word, for ever (and went on after SIGCONT). Now it ends within run.heartbeat_s
with one `colo: error:` line naming the engine, a checkpoint of the last finished step and the resume command, and
the resume goes on to the end. On this process's warm clusters (conftest run_job): the stopped engine is killed after
the run, the resume gets a new one beside the same trainer. How slow, stopped and stuck are told apart, on plain actors:
tests/integration/test_faults_liveness.py."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import ACTOR_PID

from colo.host.shm import start_ticks
from colo.run.metrics import read_metrics

SMALL_JOB = ["loop.steps=4", "loop.sft_warmup_steps=2", "loop.eval_every=0", "loop.eval_samples=0",
             "loop.checkpoint_every=0", "data.prompts_per_step=4", "rollout.n=4", "data.eval_size=8",
             "placement.num_gpus=1"]

# Calls: 1 = the warm-up's eval, 2 = step 0, 3 = step 1: engine 0 is stopped once step 0 has trained.
STOPPING_REWARDS = '''
import os
import signal
from pathlib import Path

import psutil

from colo.algo.rewards import exact_match
from colo.host.shm import start_ticks

RUN_DIR = {run_dir!r}
calls = 0

''' + ACTOR_PID + '''

def stop_engine_0(responses, answers, prompts):
    global calls
    calls += 1
    if calls == 3:
        pid = _pid_of("engine-0")
        Path(RUN_DIR, "stopped.pid").write_text(f"{{pid}} {{start_ticks(pid)}}")
        os.kill(pid, signal.SIGSTOP)
    return exact_match(responses, answers, prompts)
'''


@pytest.mark.ends_cluster(restarts=True)
def test_a_stopped_engine_ends_the_run_with_a_checkpoint_and_the_resume_goes_on(warm_jobs, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"stopping_rewards_{os.getpid()}_{abs(hash(str(tmp_path)))}"
    run_dir = tmp_path / "run"
    (tmp_path / f"{name}.py").write_text(STOPPING_REWARDS.format(run_dir=str(run_dir)))
    monkeypatch.syspath_prepend(str(tmp_path))
    r = warm_jobs(f"run.dir={run_dir}", *SMALL_JOB, f"algo.rewards=[{name}:stop_engine_0]", "run.heartbeat_s=20",
                  timeout=400)
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-3000:])
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("colo: error:")]
    assert len(errors) == 1 and errors[0].startswith("colo: error: engine DP rank 0 answered no heartbeat for "), \
        r.stderr[-3000:]
    assert "(a stopped process: SIGSTOP, a frozen host, or one that holds Python's GIL; run.heartbeat_s=20)" in \
        errors[0] and errors[0].endswith(f"its log: {run_dir / 'logs' / 'engine-0.log'})"), errors[0]
    assert r.seconds < 300, f"took {r.seconds:.0f} s to end"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    # step 0 trained: it is saved (the trainers were not inside a call), and the line says how to go on
    extra = json.loads((run_dir / "checkpoints" / "step_000000" / "extra.json").read_text())
    assert extra["step"] == 0 and [x["step"] for x in read_metrics(run_dir / "metrics.jsonl")] == [-1, 0]
    assert f"colo: newest checkpoint {run_dir / 'checkpoints' / 'step_000000'}; continue with: " \
           f".venv/bin/python -m colo.launch --resume run.dir={run_dir}" in r.stderr, r.stderr[-2000:]
    pid, ticks = map(int, (run_dir / "stopped.pid").read_text().split())
    deadline = time.monotonic() + 30  # killed (SIGKILL) as the run ended: gone a moment later
    while start_ticks(pid) == ticks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert start_ticks(pid) != ticks, "the stopped engine's process outlived the run"
    r = warm_jobs("--resume", f"run.dir={run_dir}", "algo.rewards=[exact_match]", timeout=400)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [x["step"] for x in rows] == [-1, 0, 1, 2, 3] and all(x["sync/verified"] for x in rows), rows
