"""The whole GPU's memory in use over a run, sampled by nvidia-smi, and its peak inside wall-clock spans.

Both systems keep memory in more than one process (the trainer, vLLM's engine core, Ray's workers), and each reports
only its own allocator's; the device's own count, taken the same way for both, is what the side-by-side compares.

    with GpuSampler(out / "gpu.csv"):            # nvidia-smi -lms 100 in the background
        ...
    samples = read_samples(out / "gpu.csv")      # [(time.time(), MiB used)]
    peak_gib(samples, t0, t1)                    # the highest sample in [t0, t1], GiB
"""
from __future__ import annotations

import os
import subprocess
from datetime import datetime
from pathlib import Path

PERIOD_MS = 100


def gpu_index() -> str:
    """The physical GPU this run uses: the first of CUDA_VISIBLE_DEVICES, else 0."""
    return (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"


class GpuSampler:
    """nvidia-smi writing `timestamp, memory.used` every PERIOD_MS to `path` while the block runs."""

    def __init__(self, path: Path, period_ms: int = PERIOD_MS) -> None:
        self.path, self.period_ms, self.proc = Path(path), period_ms, None

    def __enter__(self) -> "GpuSampler":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "-i", gpu_index(), "--query-gpu=timestamp,memory.used",
                 "--format=csv,noheader,nounits", "-lms", str(self.period_ms)],
                stdout=self.path.open("w"), stderr=subprocess.DEVNULL)
        except FileNotFoundError:  # a CPU machine: no samples, the memory columns stay empty
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def read_samples(path: Path) -> list[tuple[float, float]]:
    """[(seconds since the epoch, MiB in use)] from a GpuSampler file (nvidia-smi prints local time)."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(parts[1])))
        except ValueError:
            continue
    return out


def peak_gib(samples: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """The highest memory in use sampled in [t0, t1] (a span shorter than the period: the sample nearest it), GiB."""
    inside = [m for t, m in samples if t0 <= t <= t1]
    if not inside and samples:
        mid = (t0 + t1) / 2
        inside = [min(samples, key=lambda s: abs(s[0] - mid))[1]]
    return round(max(inside) / 1024, 2) if inside else None


def card() -> str | None:
    """The GPU's name as nvidia-smi gives it (None without one)."""
    try:
        return subprocess.run(["nvidia-smi", "-i", gpu_index(), "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
