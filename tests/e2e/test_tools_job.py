"""configs/tiny-cpu-tools.yaml end to end (`python -m colo.launch`): the warm-up on the calculator's
demonstrations, then RL steps whose samples are conversations with the calculator. Shortened (fewer steps);
the shipped config's full run is described in docs/environments.md."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


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


ATTACKER = '''
import json, os, sys, threading, time

import ray

from colo.envs.base import Step
from colo.envs.sandbox import PythonEnv, run_python

OUT = {out!r}
_done = threading.Lock()


def attacks(engine: int, gcs_host: str, gcs_port: int, token: str) -> dict:
    """What issue 49's model-written code did from an engine, as run_python gets it there."""
    forks = ("import os, time\\nkids = []\\nfor i in range(4):\\n    pid = os.fork()\\n    if pid == 0:\\n"
             "        x = b'x' * (400 * 2**20)\\n        print('held', flush=True)\\n        time.sleep(3)\\n"
             "        os._exit(0)\\n    kids.append(pid)\\nfor k in kids: os.waitpid(k, 0)")
    codes = {{
        "kill": f"import os\\nos.kill(os.getppid(), 9)\\nos.kill({{engine}}, 9)",
        "environ": f"print(open('/proc/{{engine}}/environ', 'rb').read())",
        "passwd": "print(open('/etc/passwd').read())",
        "home": (f"import os\\nprint(os.listdir({{os.path.expanduser('~')!r}}))\\n"
                 f"print(open({{os.getcwd()!r}} + '/x', 'w'))"),
        "gcs": f"import socket\\nsocket.create_connection(({{gcs_host!r}}, {{gcs_port}}), 3)",
        "setsid": ("import os, sys\\nif os.fork() == 0:\\n    os.setsid()\\n    os.execv(sys.executable, "
                   f"[sys.executable, '-c', 'import time; time.sleep(60)', {{token!r}}])\\nprint('returned')"),
        "forks": forks,
        "bomb": "import os, time\\nwhile True:\\n    if os.fork() == 0:\\n        time.sleep(30); os._exit(0)",
        "flood": "import sys\\nwhile True: sys.stdout.write('x' * 65536)",
    }}
    out = {{}}
    for name, code in codes.items():
        # forks: the memory kill's reclaim is slow on a busy host
        r = run_python(code, timeout_s=30 if name == "forks" else 8, memory_mb=1024)
        out[name] = {{"stdout": r.stdout[:300], "error": r.error}}
    time.sleep(0.5)
    out["left"] = [p for p in os.listdir("/proc") if p.isdigit() and _has(p, token)]
    return out


def _has(pid: str, token: str) -> bool:
    try:
        return token.encode() in open(f"/proc/{{pid}}/cmdline", "rb").read()
    except OSError:
        return False


class Attacker(PythonEnv):
    """Runs the attacks once per engine (its first step), then answers every turn with a real tool call's output."""

    def step(self, turn):
        if _done.acquire(blocking=False):
            import socket

            host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
            socket.create_connection((host, int(port)), 3).close()  # the engine itself reaches Ray's GCS there
            report = attacks(os.getpid(), host, int(port), f"colo-e2e-escape-{{os.getpid()}}")
            report["engine_pid"], report["cwd"] = os.getpid(), os.getcwd()
            with open(os.path.join(OUT, f"{{os.getpid()}}.json"), "w") as f:
                json.dump(report, f)
        ran = run_python("6 * 7")
        return Step(ran.stdout if ran.error is None else f"error: {{ran.error}}", 0.0, True, tool_calls=1,
                    tool_errors=int(ran.error is not None))
'''


@pytest.mark.sandbox
def test_model_code_cannot_get_out_of_the_sandbox_in_an_engine(tmp_path: Path, warm_jobs) -> None:
    """The attacks of issue 49 as the Python tool runs them inside a real run's engine (configs/tiny-cpu-tools.yaml
    with algo.environment set to a PythonEnv whose step runs them, once per engine): the engine lives on and the run
    ends well, each attempt failed, and the tool's ordinary answers reach the conversations."""
    from conftest import warm_modules

    module = f"attacker_{os.getpid()}_{abs(hash(str(tmp_path)))}"
    out = tmp_path / "reports"
    out.mkdir()
    (warm_modules() / f"{module}.py").write_text(ATTACKER.format(out=str(out)))
    run_dir = tmp_path / "run"
    r = warm_jobs("--config", "configs/tiny-cpu-tools.yaml", f"algo.environment={module}:Attacker",
                  "rollout.max_model_len=256", "loop.sft_warmup_steps=0", "loop.steps=1", "loop.eval_every=0",
                  "data.eval_path=null", "rollout.max_turn_tokens=8", "placement.num_gpus=1", "data.prompts_per_step=2",
                  "rollout.n=2", "algo.env_timeout_s=120", f"run.dir={run_dir}", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    [report] = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert report["kill"]["error"] and "ProcessLookupError" in report["kill"]["error"], report["kill"]
    assert report["environ"]["error"].startswith("FileNotFoundError"), report["environ"]
    assert report["passwd"]["error"].startswith("FileNotFoundError"), report["passwd"]
    assert report["home"]["error"] and not (Path(report["cwd"]) / "x").exists(), report["home"]
    assert report["gcs"]["error"] and ("refused" in report["gcs"]["error"] or "unreachable" in report["gcs"]["error"])
    assert report["setsid"]["error"] is None and report["left"] == [], report
    assert report["forks"]["error"] == "memory limit: its processes together needed more than 1024 MiB", report["forks"]
    assert report["bomb"]["error"] == "BlockingIOError: [Errno 11] Resource temporarily unavailable", report["bomb"]
    assert report["flood"]["error"].startswith("output limit"), report["flood"]
    step = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert step["env/errors"] == 0 and step["rollout/tool_errors"] == 0 and step["rollout/tool_calls_per_sample"] == 1
