"""The RL loop end to end through the real CLI (`python -m colo.launch`), as a user runs it.

    pytest -q tests/e2e/test_loop.py            # ~6 min on 2 cores: one default job, one resume, 6 failures

- learning: the default job (configs/tiny-cpu.yaml: 70 warm-up SFT steps + GRPO steps, 80 of the 140 here, on two
  trainer/engine pairs; on the session's warm clusters, conftest default_job) learns (the sampled held-out eval and
  the training reward rise, by tests/learning.py's rule), verifies every weight sync, keeps the
  vLLM/trainer log-prob gap small and leaves every output (metrics, TensorBoard, plot, config, an
  export that transformers loads and that scores like the run's last eval).
- resume: a copy of that run cut back to its step-19 checkpoint, resumed with --resume, reproduces the
  uninterrupted run's steps 20-21 (measured: bit-identical on CPU).
- failures: a raising reward function, an engine or a trainer killed mid-run, an engine that raises
  mid-rollout, a dataset row without its answer: each exits non-zero within a bounded time, names the
  culprit in one `colo: error:` line (traceback in <run.dir>/error.log), and keeps what it can; a whole run
  killed with `kill -9` leaves shared memory that its `--resume` sweeps.
The failure runs use a small job (2 warm-up steps, 4 prompts x 4 samples): start-up dominates (~30 s as a process
of its own). They run on the session's warm clusters (conftest run_job; a dead trainer's cluster is stopped and the
next job starts a new one; a dead or raising engine is ended and the next job of its shape gets a new engine beside
the same trainers: tests/warm_clusters.py), their actors found and killed by pid; only the kill -9 of a whole run
stays a process of its own. Measured alone (2-core EPYC with AVX512-BF16, 2026-11-26): the reward error and the three
deaths took 65 s and 107 CPU-s on warm clusters, 82 s and 116 CPU-s as processes of their own.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import ACTOR_PID, DEFAULT_JOB_STEPS, STEP_KEYS, clean_env, run_cli
from learning import assert_learns

from colo.host.shm import SHM
from colo.rollout.vllm_compat import serve_command
from colo.run.metrics import read_metrics

pytestmark = pytest.mark.slow

# per-step values a resumed run must reproduce (all depend on the sampled tokens and the weights)
RESUME_KEYS = ["reward/mean", "reward/std", "response_len/mean", "loss", "entropy", "clip_frac", "grad_norm",
               "logprob_diff/mean", "approx_kl", "sync/bytes"]
SMALL_JOB = ["loop.steps=4", "loop.sft_warmup_steps=2", "loop.eval_every=0", "loop.eval_samples=0",
             "loop.checkpoint_every=0", "data.prompts_per_step=4", "rollout.n=4", "data.eval_size=8"]
ONE_PAIR = ["placement.num_gpus=1"]  # where the failure needs no second rank: half the processes to start
FAILURE_EXIT_S = 150  # start-up ~30 s + 2 steps + checkpoint; a hang runs into the subprocess timeout

PHASES = ("rollout", "reward", "sleep", "train", "wait", "sync", "offload", "wake", "probe")  # colo.loop.rl_step's timeline


def _tail(r, n: int = 3000) -> str:
    return f"exit {r.returncode} after {r.seconds:.0f} s\n--- stdout\n{r.stdout[-n:]}\n--- stderr\n{r.stderr[-n:]}"


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]


# ------------------------------------------------------------------------------------ the default job


@pytest.fixture(scope="module")
def learned(default_job) -> tuple[Path, list[dict]]:
    """README command 1, the default job, run once per session (tests/conftest.py; test_readme.py uses it too)."""
    run_dir, r = default_job
    assert r.returncode == 0, _tail(r)
    return run_dir, read_metrics(run_dir / "metrics.jsonl")


def test_default_job_learns(learned: tuple[Path, list[dict]]) -> None:
    run_dir, rows = learned
    warm, steps = rows[0], rows[1:]
    assert warm["step"] == -1 and warm["sync/verified"] is True, warm
    assert warm["sync/probe"] == 1.0 and warm["sync/probe_err"] < 0.02, warm  # the first sync is checked (float32)
    assert [r["step"] for r in steps] == list(range(DEFAULT_JOB_STEPS)), "each step logged exactly once, in order"
    evals = [r for r in steps if "eval/reward" in r]
    assert len(evals) == DEFAULT_JOB_STEPS // 10, [r["step"] for r in evals]  # eval_every 10
    for r in steps:
        missing = [k for k in STEP_KEYS if k not in r or r[k] is None]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert r["sync/verified"] is True and r["sync/tensors"] > 0 and r["sync/bytes"] > 0, r
        assert 0 <= r["logprob_diff/mean"] < 0.05, f"step {r['step']}: vLLM/trainer gap {r['logprob_diff/mean']}"
        assert all(math.isfinite(r[k]) for k in ("loss", "entropy", "grad_norm")), r
        # every phase of the step's timeline is timed, and nothing else: a phase renamed, lost or added shows here
        # (timing/batch_s: the driver's batch building, a part of the train phase, which memory_stats does not probe;
        # timing/batch_cpu_s: the driver thread's CPU time in it)
        assert {k for k in r if k.startswith("timing/")} == ({f"timing/{p}_s" for p in PHASES}
                                                          | {"timing/step_s", "timing/batch_s", "timing/batch_cpu_s"}), r
        assert r["sync/probe"] == (r["step"] % 10 == 9) and r.get("sync/probe_err", 0.0) < 0.02, r  # every 10th sync
        assert 0 < r["timing/batch_s"] < r["timing/train_s"] and not any(k.startswith("memory/batch/") for k in r), r
        assert 0 < r["timing/batch_cpu_s"] <= r["timing/batch_s"] + 0.01, r
        # loop.memory_stats: every phase reports the trainer's memory (on CPU its resident set, > 100 MiB)
        assert all(0.1 < r[f"memory/{p}/trainer_rss_gb"] < 64 for p in ("rollout", "train", "sync", "wake")), r
    assert_learns("default", run_dir, rows)  # tests/learning.py: the rule, and the trajectories its bounds come from


def _quiet_terminal(r, run_dir: Path, steps: int, resumed: bool = False) -> str:
    """vLLM, Ray and the actors write to <run.dir>/logs/; the terminal shows colo's lines: the run's phases as they
    start and end (start-up, the warm-up with its bar, then the RL bar; one line each, redrawn with \\r) and, at the
    end, where everything is and what to run next (a resume says first which config it resumes, and has no warm-up).
    Returns the summary."""
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]  # the bar's redraws become lines
    bar = [ln for ln in lines if ln.startswith(("RL:", "warm-up:"))]
    other = [ln for ln in lines if ln not in bar]
    assert bar and len(other) <= 20, other
    assert other[int(resumed)] == f"colo: run dir {run_dir}", other
    assert not resumed or other[0].startswith(f"colo: resume: {run_dir / 'config.resume-'}"), other
    phases = other[int(resumed) + 1:other.index(next(ln for ln in other if ln.startswith("colo: done: ")))]
    assert phases[0].startswith("colo: start-up: Ray, ") and phases[1].startswith("colo: start-up: ready in "), other
    assert resumed == (len(phases) == 2), phases  # a fresh run's warm-up, with its eval; a resume has none
    assert resumed or (phases[2].startswith("colo: warm-up: ") and "held-out eval: greedy " in phases[2]), phases
    assert any(ln.startswith("RL:") for ln in bar) and resumed != any(ln.startswith("warm-up:") for ln in bar)
    summary = r.stdout[r.stdout.index(f"colo: done: {steps} RL steps"):]
    assert re.fullmatch(r"colo: done: \d+ RL steps \(\d+-\d+\) in \d+:\d\d: start-up \d+:\d\d, "
                        + ("" if resumed else r"warm-up \d+:\d\d, ") + r"RL \d+:\d\d", summary.splitlines()[0]), summary
    for want in (str(run_dir / "metrics.jsonl"), serve_command(run_dir / "export"),
                 f".venv/bin/python -m colo.launch --resume run.dir={run_dir} loop.steps={2 * steps}"):
        assert want in summary, summary
    return summary


def test_default_job_terminal_is_quiet_and_ends_with_a_summary(default_job) -> None:
    """On the job's warm cluster (a fresh process's terminal: the engine-error test's last launch)."""
    run_dir, r = default_job
    summary = _quiet_terminal(r, run_dir, DEFAULT_JOB_STEPS)
    assert "\n  training reward  " in summary and f"(mean of steps {DEFAULT_JOB_STEPS - 10}-{DEFAULT_JOB_STEPS - 1})" in summary, summary
    assert "\n  held-out eval    greedy " in summary and "; sampled " in summary, summary
    logs = run_dir / "logs"
    # trainer rank 1 writes nothing on CPU: its empty log is removed at the end, as every empty log is
    assert {p.name for p in logs.iterdir()} >= {"engine-0.log", "engine-1.log", "trainer-0.log"}
    assert not [p for p in logs.iterdir() if p.is_file() and p.stat().st_size == 0]
    assert "Resolved architecture" in (logs / "engine-1.log").read_text()  # vLLM said it there, not here


def test_run_dir_outputs_and_export(learned: tuple[Path, list[dict]]) -> None:
    import torch
    import yaml
    from transformers import AutoModelForCausalLM

    from colo.algo.rewards import exact_match
    from colo.config import load_config
    from colo.data.inputs import open_inputs

    run_dir, rows = learned
    assert list((run_dir / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["run"]["dir"] == str(run_dir) and saved["loop"]["steps"] == DEFAULT_JOB_STEPS
    # run.keep_checkpoints=3: of those saved every 10 steps the newest three stay
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        f"step_{s:06d}" for s in range(9, DEFAULT_JOB_STEPS, 10)][-3:]

    # The export is the final policy: transformers' greedy answers score what vLLM's did in the last eval.
    cfg = load_config(str(run_dir / "config.yaml"), [])
    inputs = open_inputs(cfg)
    tok, prompts = inputs.tokenizer, inputs.eval_prompts
    model = AutoModelForCausalLM.from_pretrained(run_dir / "export", dtype=getattr(torch, cfg.model.dtype))
    T = max(len(p["prompt_ids"]) for p in prompts)
    ids = torch.full((len(prompts), T), tok.pad_token_id)  # (B, T) left-padded
    mask = torch.zeros_like(ids)  # (B, T)
    for i, p in enumerate(prompts):
        ids[i, T - len(p["prompt_ids"]):] = torch.tensor(p["prompt_ids"])
        mask[i, T - len(p["prompt_ids"]):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.rollout.max_tokens,
                         do_sample=False, pad_token_id=tok.pad_token_id)  # (B, T + new)
    texts = tok.batch_decode(out[:, T:], skip_special_tokens=True)
    hf = sum(exact_match(texts, [p["answer"] for p in prompts], [""] * len(prompts))) / len(prompts)
    last_eval = rows[-1]["eval/reward"]
    # measured: equal (0.484 both, in bf16); near-ties may flip a few of the 64 answers
    assert abs(hf - last_eval) <= 0.05, f"export scores {hf:.3f}, the run's last eval {last_eval:.3f}"


def test_resume_reproduces_uninterrupted_run(learned: tuple[Path, list[dict]], tmp_path: Path, warm_jobs) -> None:
    """Cut a copy of the finished run back to what a run killed two steps after its oldest kept checkpoint leaves
    (run.keep_checkpoints=3 leaves steps 59, 69 and 79 of the 80-step job: cut back to 59, metrics logged past it,
    no export), resume it for two steps, compare with the original. Both run on this process's warm clusters
    (conftest run_job), the resume after other jobs reconfigured them (that a reconfigured cluster computes what a
    fresh process does is test_multinode.py's: its reference runs warm, its two-node run is a process of its own,
    and their records are equal to the digit)."""
    run_dir, rows = learned
    cut = tmp_path / "run"
    shutil.copytree(run_dir, cut, ignore=shutil.ignore_patterns("export"))
    back = min(int(p.name.removeprefix("step_")) for p in (cut / "checkpoints").iterdir())
    for ckpt in (cut / "checkpoints").iterdir():
        if int(ckpt.name.removeprefix("step_")) > back:
            shutil.rmtree(ckpt)
    r = warm_jobs("--resume", f"run.dir={cut}", f"loop.steps={back + 3}", timeout=300)
    assert r.returncode == 0, _tail(r)
    resumed = read_metrics(cut / "metrics.jsonl")  # row i holds step i - 1 (the warm-up's is step -1)
    assert [x["step"] for x in resumed] == list(range(-1, back + 3)), "records after the cut are replaced, not doubled"
    assert resumed[:back + 2] == rows[:back + 2], "records up to the checkpoint are kept as they were"
    for new, old in zip(resumed[back + 2:], rows[back + 2:back + 4]):
        for k in RESUME_KEYS + (["eval/reward"] if "eval/reward" in old else []):
            assert new[k] == pytest.approx(old[k], rel=1e-5, abs=1e-6), f"step {old['step']} {k}: {new[k]} != {old[k]}"
        assert new["sync/verified"] is True
    assert (cut / "checkpoints" / f"step_{back + 2:06d}" / "extra.json").exists(), "the last step is checkpointed"
    assert (cut / "export" / "config.json").exists()


# ------------------------------------------------------------------------------------------- failures


# The failure runs on warm clusters (conftest run_job) score in this test process, where a module is imported
# once: each gets a module of its own (its own call counter), and finds the running job's actors by the log file
# their processes write (<run dir>/logs/<role>-<rank>.log, colo.run.logs.actor_output), since warm clusters name
# their actors colo-engine-1-warm<N>. It kills by pid (SIGKILL), as the OOM killer would. Calls: 1 = warm-up eval
# (greedy only: eval_samples=0), 2 = step 0, 3 = step 1, so every failure happens in step 1, after step 0 has
# trained (there is a policy worth checkpointing).
WARM_FAILING_REWARDS = '''
import os
import signal
from pathlib import Path

import psutil
import ray

from colo.algo.rewards import exact_match

RUN_DIR = {run_dir!r}
calls = 0

''' + ACTOR_PID + '''

def _nth_call():
    global calls
    calls += 1
    return calls


def explode(responses, answers, prompts):
    if _nth_call() >= 3:
        raise ValueError(f"cannot score {{responses[0]!r}}")
    return exact_match(responses, answers, prompts)


def _killer(role_rank):
    def reward(responses, answers, prompts):
        if _nth_call() == 3:
            os.kill(_pid_of(role_rank), signal.SIGKILL)
        return exact_match(responses, answers, prompts)
    return reward


def _engine_0():
    """The running job's engine 0 as an actor: the named one whose process writes its log."""
    pid = _pid_of("engine-0")
    for name in ray.util.list_named_actors():
        if name.startswith("colo-engine-0"):
            actor = ray.get_actor(name)
            if ray.get(actor.__ray_call__.remote(lambda self: os.getpid())) == pid:
                return actor
    raise LookupError(f"no named actor runs in process {{pid}}")


def sleep_engine_0(responses, answers, prompts):
    # with loop.eval_every=1, call 3 is step 0's eval: engine 0 is put to sleep behind the loop's back, so
    # its next call, step 1's rollout generate, raises inside the engine (it refuses to generate asleep)
    if _nth_call() == 3:
        ray.get(_engine_0().sleep.remote(1))
    return exact_match(responses, answers, prompts)


kill_engine_0 = _killer("engine-0")
kill_engine_1 = _killer("engine-1")
kill_trainer_1 = _killer("trainer-1")
'''


@pytest.fixture
def warm_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warm_jobs) -> tuple[str, Path]:
    """(module name, run dir) of WARM_FAILING_REWARDS written for this test, importable in this process."""
    name = f"failing_rewards_{os.getpid()}_{abs(hash(str(tmp_path)))}"
    run_dir = tmp_path / "run"
    (tmp_path / f"{name}.py").write_text(WARM_FAILING_REWARDS.format(run_dir=str(run_dir)))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, run_dir


def _failed(r):
    """A failure run's result, once it is shown to have ended as one: exit 1, within FAILURE_EXIT_S."""
    assert r.returncode == 1, _tail(r)
    assert r.seconds < FAILURE_EXIT_S, f"took {r.seconds:.0f} s to fail"
    return r


def _warm_fail_run(warm_jobs, run_dir: Path, *overrides: str):
    return _failed(warm_jobs(f"run.dir={run_dir}", *SMALL_JOB, *overrides, timeout=300))


def _extra(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "extra.json").read_text())


def test_reward_error_names_function_and_sample_checkpoints_exits_1(warm_rewards: tuple[str, Path],
                                                                   warm_jobs) -> None:
    """A reward error leaves the cluster healthy, so the next job of the session reuses it."""
    module, run_dir = warm_rewards
    r = _warm_fail_run(warm_jobs, run_dir, f"algo.rewards=[{module}:explode]", *ONE_PAIR)
    error = next(ln for ln in r.stderr.splitlines() if ln.startswith("colo: error: "))
    assert f"'{module}:explode' raised ValueError: cannot score" in error, error
    assert "on sample 0: response=" in error, error
    assert f"--resume run.dir={run_dir}" in r.stderr
    # step 0 trained, step 1 failed while scoring: the checkpoint holds step 0 and the data position
    # after step 0's batch, so a resume redoes step 1 with the same prompts
    assert _extra(run_dir, 0) == {"step": 0, "data": {"epoch": 0, "pos": 4, "seed": 0, "num_rows": _extra(
        run_dir, 0)["data"]["num_rows"]}, "holds": {"params": "full"}}
    assert _steps(run_dir) == [-1, 0] and (run_dir / "metrics.png").exists()


@pytest.mark.ends_cluster
def test_engine_death_names_rank_and_checkpoints(warm_rewards: tuple[str, Path], warm_jobs) -> None:
    module, run_dir = warm_rewards  # on warm clusters: the next two-pair job gets a new engine 1 beside the trainers
    r = _warm_fail_run(warm_jobs, run_dir, f"algo.rewards=[{module}:kill_engine_1]")
    assert "colo: error: engine DP rank 1 died" in r.stderr, _tail(r)
    # step 0's checkpoint is saved (that such a checkpoint resumes to the end is the next test's)
    assert _extra(run_dir, 0)["step"] == 0 and _steps(run_dir) == [-1, 0]


@pytest.mark.ends_cluster
def test_engine_error_then_a_killed_resume_then_resume_to_the_end(warm_rewards: tuple[str, Path], warm_jobs) -> None:
    """One run dir, three launches (until 2026-11-26 two tests of two launches each; the middle launch now serves
    both: it is the resume after the engine error and the run that is killed):
    1. an engine that raises (and lives on) ends the run like a dead one: one line naming the engine and the
       cause, the traceback in <run.dir>/error.log, the trained step saved;
    2. `--resume` goes on from that checkpoint, saves step 1, and is then killed with `kill -9` (driver, Ray,
       actors, all at once), which leaves each trainer's sync buffer in /dev/shm, where nothing else would
       ever remove it;
    3. `--resume` again removes those segments and finishes the run, in a fresh process whose terminal (Ray
       starting in it) stays quiet and ends with the summary.
    Launch 1 runs on this process's warm clusters (the raising engine is ended after it); launches 2
    and 3 are processes of their own: only a whole process tree can be killed so, and launch 3 shows the terminal
    of `python -m colo.launch` as a newcomer sees it (the session's default job runs warm)."""
    module, run_dir = warm_rewards
    r = _warm_fail_run(warm_jobs, run_dir, f"algo.rewards=[{module}:sleep_engine_0]", "loop.eval_every=1",
                       *ONE_PAIR)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("colo: error:")]
    assert len(errors) == 1, _tail(r)
    assert errors[0].startswith("colo: error: engine DP rank 0 raised RuntimeError: generate() on rank 0 while "
                                "['kv_cache', 'weights'] still sleep"), errors
    assert errors[0].endswith(f"(traceback: {run_dir / 'error.log'}; its log: {run_dir / 'logs/engine-0.log'})")
    assert "Traceback (most recent call last)" not in r.stderr, "the driver's traceback belongs in error.log"
    assert "Resolved architecture" in (run_dir / "logs" / "engine-0.log").read_text()  # vLLM: in its log, not here
    log = (run_dir / "error.log").read_text()
    # the remote traceback: ray::Engine.generate() in a run of its own, ray::WarmEngine.generate() on warm clusters
    assert "Traceback (most recent call last)" in log and re.search(r"ray::\w*Engine\.generate\(\)", log), log
    assert "in generate" in log and "ActorError: engine DP rank 0 raised RuntimeError" in log, log
    # step 0 trained (and was evaluated), step 1's rollout failed: step 0 is saved, the hint points at it
    assert _extra(run_dir, 0)["step"] == 0 and _steps(run_dir) == [-1, 0]
    assert f"newest checkpoint {run_dir / 'checkpoints' / 'step_000000'}" in r.stderr
    assert f"--resume run.dir={run_dir}" in r.stderr

    left = _resume_and_kill_after_step_1(run_dir)
    r = run_cli("--resume", f"run.dir={run_dir}", timeout=300)
    assert r.returncode == 0, _tail(r)
    _quiet_terminal(r, run_dir, 4, resumed=True)
    # what a finished run leaves besides its results: no lock file naming a dead pid, Ray's logs of this session
    # copied (the killed launch 2 left none: it never reached its end), and no empty log file
    assert not (run_dir / ".lock").exists()
    (ray_logs,) = (run_dir / "logs").glob("ray-session_*")
    assert ray_logs.is_dir() and not ray_logs.is_symlink() and (ray_logs / "raylet.out").stat().st_size > 0
    assert not [p for p in (run_dir / "logs").rglob("*") if p.is_file() and p.stat().st_size == 0]
    assert not [n for n in left if (SHM / n).exists()], "the resumed run did not sweep the killed run's segments"
    rows = read_metrics(run_dir / "metrics.jsonl")
    # steps after the checkpoint are redone once, nothing is lost
    assert [x["step"] for x in rows] == [-1, 0, 1, 2, 3] and all(x["sync/verified"] for x in rows), rows
    assert (run_dir / "export" / "config.json").exists()


def _resume_and_kill_after_step_1(run_dir: Path) -> list[str]:
    """`--resume` (the reward that broke the engine swapped for exact_match, a checkpoint every step) until step
    1's checkpoint is written, then every process of the run at once, as a cgroup-wide kill (OOM killer,
    scheduler, container stop) does: stopped first, then killed, so none of them cleans up after another (each
    trainer's multiprocessing resource tracker, a child of its own, unlinks the trainer's segments when it sees
    the trainer die; Ray's actors sit in sessions of their own, which a killpg of the driver misses). Returns the
    /dev/shm segments the dead run left."""
    import contextlib
    import signal
    import subprocess
    import sys
    import time

    from colo.host.shm import alive, owner_pid, process_tree

    p = subprocess.Popen([sys.executable, "-m", "colo.launch", "--resume", f"run.dir={run_dir}",
                          "algo.rewards=[exact_match]", "loop.checkpoint_every=1"], env=clean_env(), start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not (run_dir / "checkpoints" / "step_000001" / "extra.json").exists():
        assert p.poll() is None and time.monotonic() < deadline, "the run ended or hung before step 1's checkpoint"
        time.sleep(0.5)
    run_pids = process_tree(p.pid)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in run_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    p.wait(timeout=60)
    ours = [n for n in os.listdir(SHM) if owner_pid(n) in run_pids]
    deadline = time.monotonic() + 30  # a killed process counts as alive until it is reaped (a zombie)
    while any(alive(owner_pid(n)) for n in ours) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [n for n in ours if not alive(owner_pid(n))]
    assert left, f"expected the trainer's sync buffers, found {ours}"
    return left


@pytest.mark.ends_cluster
def test_trainer_death_names_rank_exits_1(warm_rewards: tuple[str, Path], warm_jobs) -> None:
    module, run_dir = warm_rewards
    r = _warm_fail_run(warm_jobs, run_dir, f"algo.rewards=[{module}:kill_trainer_1]", "loop.checkpoint_every=1")
    assert "colo: error: trainer rank 1 died" in r.stderr, _tail(r)
    # a dead rank's shards are gone: nothing new is saved, the periodic checkpoint of step 0 is pointed at
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000000"]
    assert f"newest checkpoint {run_dir / 'checkpoints' / 'step_000000'}" in r.stderr


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_dataset_row_missing_field_exits_2_early(tmp_path: Path, fmt: str) -> None:
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(5)]
    del rows[3]["answer"]
    data = tmp_path / f"bad.{fmt}"
    if fmt == "jsonl":
        data.write_text("".join(json.dumps(x) + "\n" for x in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), data)
    r = run_cli(f"run.dir={tmp_path / 'run'}", f"data.path={data}", f"data.eval_path={data}", timeout=120, imports=True)
    assert r.returncode == 2, _tail(r)
    assert "Traceback" not in r.stderr, _tail(r)
    error = r.stderr.strip().splitlines()[-1]
    assert error.startswith("colo: error: data: ") and str(data) in error, error
    assert "row 3" in error and "missing field 'answer'" in error, error
    assert not r.imported & {"ray", "vllm"}, f"the data error came after {sorted(r.imported & {'ray', 'vllm'})} was imported: it must precede Ray/vLLM start-up"
    assert not (tmp_path / "run").exists(), "a data error must leave no run dir behind (a rerun would need --resume)"


@pytest.mark.ends_cluster
def test_disaggregated_engine_death_names_it_and_checkpoints(warm_rewards: tuple[str, Path], warm_jobs) -> None:
    """1 trainer + 1 engine on GPUs of their own: the engine dies during step 1; the trainer meets it in the
    broadcast sync, the driver names it, the trainer (which still holds the policy) checkpoints step 1.
    (Until 2026-11-26 with 2 engines and engine 1 killed: the same path, one engine start more.)"""
    module, run_dir = warm_rewards
    r = _warm_fail_run(warm_jobs, run_dir, f"algo.rewards=[{module}:kill_engine_0]",
                       "placement.mode=disaggregated", "placement.num_gpus=2", "placement.trainer_gpus=1")
    assert "colo: error: engine 0 (seen by trainer rank 0 during the weight sync) died" in r.stderr, _tail(r)
    assert _extra(run_dir, 1)["step"] == 1 and _steps(run_dir) == [-1, 0]
