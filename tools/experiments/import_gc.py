"""What the cyclic garbage collector costs vLLM's import, and what colo.host.heap.imports_frozen saves of it.

    python -m tools.experiments.import_gc --reps 3 --json

Why: an engine process imports vLLM (~600,000 objects) and then vLLM's loader runs gc.collect() twice; colo's engine
imports it with the collector paused, then runs one pass and freezes what is left (colo/host/heap.py). This runs the
import in fresh processes, alternating plain / paused, and reports each one's CPU-seconds (the paused one's with its
closing pass and freeze) and the ratio per adjacent pair. Its answer is in docs/benchmarks.md, "Answered
experiments".
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import time
t = time.process_time()
if {paused}:
    from colo.host.heap import imports_frozen
    with imports_frozen():
        from vllm import LLM  # noqa: F401
else:
    from vllm import LLM  # noqa: F401
print("cpu_s", time.process_time() - t)
"""


def one(paused: bool) -> float:
    p = subprocess.run([sys.executable, "-c", CHILD.format(paused=paused)], capture_output=True, text=True,
                       timeout=300)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("cpu_s ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"the import failed: {p.stderr[-2000:]}")
    return float(line.split()[1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.experiments.import_gc", description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="pairs (plain, paused), alternating")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    plain, paused = [], []
    for i in range(args.reps):
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            (paused if on else plain).append(one(on))
    ratios = [b / a for a, b in zip(plain, paused)]
    out = {"experiment": "import_gc", "plain_cpu_s": plain, "paused_cpu_s": paused,
           "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    print(f"[import_gc] vLLM's import: plain {', '.join(f'{x:.2f}' for x in plain)} CPU-s; paused and frozen "
          f"{', '.join(f'{x:.2f}' for x in paused)}; paused / plain median {out['ratio_median']:.2f} "
          f"({out['ratio_min']:.2f}-{out['ratio_max']:.2f})")
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
