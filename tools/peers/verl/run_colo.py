"""colo's side of the side-by-side: `python -m colo.bench.step` itself, with the same per-step records and the same
device memory sampling as run_verl.py, so both systems' figures come out of one summary.

    source /tmp/site/env.sh         # colo's bundle (vLLM 0.32.0, torch 2.13.0), never verl's
    python tools/peers/verl/run_colo.py --out $OUT/colo-16x8 -- --model /tmp/peers/qwen3-30b-a3b-L4 --device cuda \
        --prompts 16 --n 8 --prompt-len 256 --max-tokens 1024 --lengths fixed --warmup 2 --steps 3 --json

Everything after `--` goes to colo.bench.step unchanged (its arguments and colo overrides). Two things are added from
outside the package, neither changing what runs: colo.bench.step.run_step is wrapped so each step's record (colo's
timing/*, bench/tokens, sync/*) is appended to steps.jsonl as it ends, and colo.loop.Timer so each phase's
wall-clock span goes to phases.jsonl; gpu.csv is the device's memory (gpumem.GpuSampler). summary.json holds the
medians over the measured steps (after --warmup) of timing/step_s and tokens/s/GPU (bench/tokens / step / GPUs: prompt
+ response tokens, verl's perf/throughput count), each phase's seconds, the sync alone and the whole weight window
(sync + offload + wake: what verl's timing_s/update_weights spans), and the device's peak memory inside each phase.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
COLO_PHASES = ("rollout", "reward", "sleep", "train", "wait", "sync", "offload", "wake")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python tools/peers/verl/run_colo.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/peers-colo")
    return ap.parse_args(own), bench


def instrument(out: Path) -> None:
    """Wrap colo.bench.step.run_step and colo.loop.Timer.__call__ to record steps and phase spans (docstring)."""
    import colo.bench.step as step
    import colo.loop as loop

    run_step, timer_call = step.run_step, loop.Timer.__call__

    def recorded_step(*a, **k) -> dict:
        m = run_step(*a, **k)
        plain = {key: v for key, v in m.items() if isinstance(v, (int, float, str, bool)) or v is None}
        with (out / "steps.jsonl").open("a") as f:
            f.write(json.dumps({"t1": time.time(), **plain}) + "\n")
        return m

    @contextmanager
    def timed(self, phase: str, part: bool = False):
        t0 = time.time()
        with timer_call(self, phase, part):
            yield
        with (out / "phases.jsonl").open("a") as f:
            f.write(json.dumps({"name": phase, "t0": t0, "t1": time.time(), "part": part}) + "\n")

    step.run_step = recorded_step
    loop.Timer.__call__ = timed


def summarize(out: Path, bench: list[str]) -> dict:
    from tools.peers.verl.gpumem import peak_gib, read_samples

    b = {"warmup": 1, "steps": 3, "gpus": 1}
    for key in b:
        if f"--{key}" in bench:
            b[key] = int(bench[bench.index(f"--{key}") + 1])
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()] \
        if (out / "steps.jsonl").exists() else []
    measured = steps[b["warmup"]: b["warmup"] + b["steps"]]
    med = lambda f: statistics.median(f(m) for m in measured) if measured else None  # noqa: E731
    spans = [json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()] \
        if (out / "phases.jsonl").exists() else []
    # a step's phases run from its rollout's start to its record's end; the measured steps are those after warm-up
    starts = sorted(s["t0"] for s in spans if s["name"] == "rollout")
    windows = [(starts[i], m["t1"]) for i, m in enumerate(steps) if i < len(starts)]
    windows = windows[b["warmup"]: b["warmup"] + b["steps"]]
    samples = read_samples(out / "gpu.csv")
    memory = {}
    for name in (*COLO_PHASES, "step"):
        if name == "step":
            peaks = [peak_gib(samples, a, z) for a, z in windows]
        else:
            peaks = [peak_gib(samples, s["t0"], s["t1"]) for s in spans if s["name"] == name and not s.get("part")
                     and any(a <= s["t0"] <= z for a, z in windows)]
        peaks = [p for p in peaks if p is not None]
        memory[name] = max(peaks) if peaks else None
    window = lambda m: sum(float(m.get(f"timing/{p}_s", 0.0)) for p in ("sync", "offload", "wake"))  # noqa: E731
    return {
        "system": "colo (vLLM 0.32.0, torch 2.13.0)",
        "steps_done": len(steps), "steps_measured": len(measured),
        "step_s": med(lambda m: float(m["timing/step_s"])),
        "tokens_per_s_per_gpu": med(lambda m: float(m["bench/tokens"]) / float(m["timing/step_s"]) / b["gpus"]),
        "tokens_per_step": med(lambda m: float(m["bench/tokens"])),
        "response_len_mean": med(lambda m: float(m["response_len/mean"])),
        "phases_s": {p: med(lambda m, p=p: float(m.get(f"timing/{p}_s", 0.0))) for p in COLO_PHASES},
        "sync_s": med(lambda m: float(m.get("timing/sync_s", 0.0))),
        "weight_window_s": med(window),
        "sync_verified": all(m.get("sync/verified") is True for m in measured) if measured else None,
        "memory_peak_gib": memory,
        "per_step": [{k: m.get(k) for k in ("timing/step_s", "bench/tokens", "timing/rollout_s", "timing/train_s",
                                            "timing/sync_s")} for m in steps],
    }


def main(argv: list[str] | None = None) -> int:
    args, bench = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for f in ("steps.jsonl", "phases.jsonl"):
        (out / f).unlink(missing_ok=True)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from colo.bench import step

    from tools.peers.verl.gpumem import GpuSampler, card

    instrument(out)
    t0 = time.time()
    with GpuSampler(out / "gpu.csv"):
        rc = step.main(bench)
    summary = {**summarize(out, bench), "rc": rc, "wall_s": round(time.time() - t0, 1), "card": card(),
               "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(["python -m colo.bench.step", *bench])}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "per_step"}), flush=True)
    return rc or (0 if summary["steps_measured"] else 1)


if __name__ == "__main__":
    sys.exit(main())
