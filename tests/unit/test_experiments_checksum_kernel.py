"""tools.experiments.checksum_kernel on CPU: Triton's interpreter runs colo's checksum kernel (a mix per word, and per
element) and the one it replaced on the same pieces; colo's sums equal the torch path's in both forms, and the old
kernel's launches agree with each other (the experiment asserts both per launch)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_both_kernels_run_and_agree_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}  # before Triton is imported: a process
    p = subprocess.run([sys.executable, "-m", "tools.experiments.checksum_kernel", "--device", "cpu", "--elements",
                        "4096", "--pieces", "4", "--reps", "1", "--json"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert {(r["source"], r["kernel"]) for r in out["rows"]} == {
        (s, k) for s in ("float32", "bfloat16") for k in ("colo", "colo per-element", "before")}
    assert all(r["ms"] > 0 and r["copy_ms"] > 0 and r["ratio"] == r["ms"] / r["copy_ms"] for r in out["rows"])
