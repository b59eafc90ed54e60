"""CPU-seconds per test, for cutting the suite's time on a CPU-bound machine (a pytest plugin and its report).

    PYTHONPATH=tests COLO_CPU_PROFILE=/tmp/cpu.jsonl .venv/bin/python -m pytest -p cpu_profile -q -n 2 \
        --dist loadgroup tests
    .venv/bin/python tests/cpu_profile.py /tmp/cpu.jsonl        # per file and the 25 dearest tests

On 2 cores the suite is CPU-bound (both workers' tests start processes that fill the cores), so a test's wall time
says little about what it costs the other worker; its CPU-seconds do. Each xdist worker moves itself into a cgroup
of its own (learning_margins.CpuClock: v1 cpuacct or v2), which every process it starts inherits (Ray's daemons
and actors, CLI jobs and their orphans), and writes one line per test: the cgroup's CPU-seconds over its setup,
call and teardown, and its wall seconds. A process from an earlier test (a warm cluster, the shared Ray) counts
in the test during which it burns CPU. Needs a user that may make a cgroup (root here); without one it records
nothing.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

_clock = None
_out = None


def pytest_configure(config: pytest.Config) -> None:
    global _clock, _out
    path = os.environ.get("COLO_CPU_PROFILE")
    if not path:
        return
    from learning_margins import CpuClock

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _clock = CpuClock(f"colo-suite-{worker}-{os.getpid()}")
    _clock.join()
    _out = open(path, "a")  # noqa: SIM115 (one line per test, for the whole session)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if _clock is None:
        yield
        return
    cpu0, t0 = _clock.seconds(), time.monotonic()
    yield
    cpu1 = _clock.seconds()
    if cpu0 is not None and cpu1 is not None:
        _out.write(json.dumps({"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                               "cpu_s": round(cpu1 - cpu0, 2), "wall_s": round(time.monotonic() - t0, 2)}) + "\n")
        _out.flush()


def report(path: str) -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        f = files[r["test"].split("::")[0]]
        f[0] += r["cpu_s"]
        f[1] += r["wall_s"]
        f[2] += 1
    total = sum(r["cpu_s"] for r in rows)
    print(f"{len(rows)} tests, {total:.0f} CPU-s, {sum(r['wall_s'] for r in rows):.0f} test-s of wall time")
    print(f"{'CPU-s':>8} {'wall-s':>8} {'tests':>5}  file")
    for name, (cpu, wall, n) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        if cpu >= 5:
            print(f"{cpu:8.1f} {wall:8.1f} {n:5d}  {name}")
    print(f"\n{'CPU-s':>8} {'wall-s':>8}  test")
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:25]:
        print(f"{r['cpu_s']:8.1f} {r['wall_s']:8.1f}  {r['test']}")


if __name__ == "__main__":
    report(sys.argv[1])
