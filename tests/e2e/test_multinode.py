"""colo on a Ray cluster of two nodes with two IP addresses, on this one machine (tests/e2e/twonodes.py: the
worker node in a network namespace of its own when we are root, else a second raylet on 127.0.0.2).

    pytest -q tests/e2e/test_multinode.py -s     # -s shows which kind of second node was used; 366 s on
                                             # 2 cores while another suite ran (cluster 37 s, dry run 19 s,
                                             # one-node run 121 s, two-node run + node loss + resume 184 s)

One module-scoped cluster (head 1 logical GPU, worker 1), started with launch/ray-cluster.sh, on which
the README's cluster `--dry-run` shows rank 0 on the head and rank 1 on the worker; three short runs of
the default loop
(configs/tiny-cpu.yaml, 2 warm-up steps, 4 prompts x 4 samples, a checkpoint every step):
- a single-node run of STEPS steps, the reference, on this process's warm clusters (conftest run_job: the
  session's two-pair cluster, reconfigured), so this module runs in the session jobs' xdist group; the two-node
  runs below are processes of their own, so their equal records also show that a reconfigured cluster computes
  what a fresh process does;
- the same job joined to the cluster through RAY_ADDRESS: trainer rank 0 + engine 0 on the head, rank 1 +
  engine 1 on the worker node. Once its step-1 checkpoint is written, the worker node's raylet is killed
  (by the pid this test started) while its reward holds step 2: the run ends with one error line naming the
  node and the ranks on it, and the newest checkpoint (step 1) with the --resume command;
- a fresh worker node joins (the cluster re-formed) and `--resume` finishes the run.
A hard-coded 127.0.0.1 rendezvous (tried by hand) hangs the two-node run: rank 1 in the namespace dials
its own loopback, and the test fails on its 400 s wait for the step-1 checkpoint.
Every weight sync of both runs is verified, and every step's metrics of the two-node run (before the
node died and after the resume) equal the single-node run's exactly: same seed, same numbers, whichever
node a rank sits on.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, clean_env, run_cli
from twonodes import TwoNodes

from colo.run.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_jobs")]  # the session jobs' group, for `single`

STEPS = 4  # 2 warm-up + 4 RL steps: the node dies after step 1's checkpoint, the resume runs steps 2-3
JOB = ["loop.sft_warmup_steps=2", "loop.eval_every=0", "loop.eval_samples=0", "loop.checkpoint_every=1",
       "data.prompts_per_step=4", "rollout.n=4", "data.eval_size=8"]
# what depends on the sampled tokens and the weights: must not depend on where a rank runs
SAME = ["reward/mean", "reward/std", "response_len/mean", "loss", "entropy", "clip_frac", "grad_norm",
        "logprob_diff/mean", "approx_kl", "sync/tensors", "sync/bytes", "eval/reward"]


@pytest.fixture(scope="module")
def cluster():
    with TwoNodes(head_gpus=1, worker_gpus=1, cpus=3) as c:
        print(f"\ntwo-node cluster: {c.kind}, head {c.head_ip}, worker {c.worker_ip}", file=sys.stderr)
        yield c


@pytest.fixture(scope="module")
def single(tmp_path_factory, warm_jobs) -> Path:
    run_dir = tmp_path_factory.mktemp("single") / "run"
    r = warm_jobs(*JOB, f"loop.steps={STEPS}", f"run.dir={run_dir}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


# The two-node run's reward: exact_match (so its numbers equal the single-node run's), which holds the run in step 2
# until the test has killed the worker node. Without the hold, a fast machine ran steps 2-5 between step 1's
# checkpoint and the node's death (AMD EPYC with AVX512-BF16, 2026-11-26: the resume then had nothing left to do).
HELD_REWARD = '''
import os
import time
from pathlib import Path

from colo.algo.rewards import exact_match


def exact_match_held_after_step_1(responses, answers, prompts):
    run = Path(os.environ["HELD_REWARD_RUN_DIR"])
    if (run / "checkpoints" / "step_000001" / "extra.json").exists():
        deadline = time.monotonic() + 300
        while not (run.parent / "node-killed").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    return exact_match(responses, answers, prompts)
'''


def _joined_env(c: TwoNodes, run_dir: Path | None = None) -> dict[str, str]:
    env = clean_env(RAY_ADDRESS=c.address, **c.client_env)
    if run_dir is not None:  # the held reward (HELD_REWARD), importable by the driver
        (run_dir.parent / "held_reward.py").write_text(HELD_REWARD)
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(run_dir.parent)])
        env["HELD_REWARD_RUN_DIR"] = str(run_dir)
    return env


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {path} was written"
        assert time.monotonic() < deadline, f"{path} not written in {timeout:.0f} s"
        time.sleep(0.2)


def test_readme_cluster_dry_run_shows_the_node_of_every_rank(cluster: TwoNodes) -> None:
    """The README's `RAY_ADDRESS=<head>:6379 ... --dry-run`, against this cluster: rank 0 on the head,
    rank 1 on the worker node, read from the cluster (a plan without a cluster has no node column)."""
    from test_readme import _of

    commands = _of("cluster-run")
    assert commands
    for cmd in commands:
        r = run_cli(*cmd.args, env=clean_env(**{**cmd.env, "RAY_ADDRESS": cluster.address}, **cluster.client_env),
                    timeout=120)
        assert r.returncode == 0, f"{cmd.text}\n{r.stderr[-2000:]}"
        table = r.stdout.partition("placement plan:")[2].splitlines()
        assert "on 2 nodes of the Ray cluster" in table[0], cmd.text
        rows = [ln.split()[:2] for ln in table[2:4]]
        assert rows == [["0", cluster.head_ip], ["1", cluster.worker_ip]], (cmd.text, table)


def test_node_loss_then_resume_matches_one_node(cluster: TwoNodes, single: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "colo.launch", *JOB, "loop.steps=40", f"run.dir={run_dir}",
            "algo.rewards=[held_reward:exact_match_held_after_step_1]"]
    env = _joined_env(cluster, run_dir)
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(run_dir / "checkpoints" / "step_000001" / "extra.json", proc, timeout=400)
        cluster.kill_worker_raylet()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the GCS has answered without the worker node
            alive = cluster.alive_nodes()
            if alive and cluster.worker_ip not in alive:
                break
            time.sleep(0.5)
        (tmp_path / "node-killed").write_text("")  # the GCS counts the node dead: step 2's next call meets it
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    assert (f"colo: nodes: {cluster.head_ip}: trainer rank 0, engine DP rank 0; "
            f"{cluster.worker_ip}: trainer rank 1, engine DP rank 1") in out
    error = next((ln for ln in err.splitlines() if ln.startswith("colo: error:")), err[-2000:])
    want = f"colo: error: node {cluster.worker_ip} died; on it: trainer rank 1, engine DP rank 1"
    assert error.startswith(want), error
    newest = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "extra.json").exists())[-1]
    assert newest.name == "step_000001", newest  # the node died in step 2 (the held reward)
    assert (f"colo: newest checkpoint {newest}; continue with: .venv/bin/python -m colo.launch --resume "
            f"run.dir={run_dir}") in err, err[-2000:]

    cluster.stop_worker()  # what is left of the dead node's processes
    cluster.start_worker()  # the cluster re-formed: a fresh worker node with the same address
    r = run_cli("--resume", f"run.dir={run_dir}", f"loop.steps={STEPS}", env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    want, got = read_metrics(single / "metrics.jsonl"), read_metrics(run_dir / "metrics.jsonl")
    assert [x["step"] for x in got] == [x["step"] for x in want] == list(range(-1, STEPS))
    assert all(x["sync/verified"] for x in want + got)
    for a, b in zip(want, got):
        same = {k: a.get(k) for k in SAME if k in a}
        assert same == {k: b.get(k) for k in same}, (a["step"], json.dumps(same), json.dumps(b))
