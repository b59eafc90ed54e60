"""The driver's batch building (colo.algo.batch: build_batch + shard_batch, the loop's timing/batch_s) on samples
shaped like a step's, with torch's intra-op threads as they are against one thread, on an idle host and with
`--busy` cores kept busy by spinning processes, in one run.

    python -m tools.experiments.buildbatch --json                    # 128 samples of the L12 slice's shape, R3 ids
    python -m tools.experiments.buildbatch --busy 1 --samples 32 --json

Why: on an H200 host the L12 slice's train phase spent 0.13-1.02 s in timing/batch_s, changing from step to step,
where the same build with synthetic samples took 0.07-0.12 s on that host alone. The build is many small copies (a
few per sample), and every parallel one waits for its slowest thread: on a host whose other cores run the trainer,
the engines and Ray, one descheduled thread stalls each of them. This measures that mechanism.

Samples: --samples of prompt --prompt-len tokens and a long-tail response (colo.bench.lengths, median a quarter of
--max-tokens), each with vLLM's sampled log-probs and routing ids (P+R-1, --moe-layers, --topk) uint8, read-only as
Ray hands them over. Prints seconds per build (median of --reps) for each variant and their ratios to one thread.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import time
from contextlib import contextmanager


def sample_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The samples' shape (make_samples), and --reps and --json: the arguments this experiment and
    tools.experiments.shipbatch share."""
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--moe-layers", type=int, default=12, help="routing ids per token: layers (0: no R3 ids)")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    return ap


def check_sample_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if min(args.samples, args.prompt_len, args.max_tokens, args.reps, args.topk) < 1 or args.moe_layers < 0:
        ap.error("--samples, --prompt-len, --max-tokens, --reps and --topk must be >= 1, --moe-layers >= 0")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = sample_args(argparse.ArgumentParser(prog="python -m tools.experiments.buildbatch",
                                             description=__doc__.splitlines()[0]))
    ap.add_argument("--busy", type=int, default=1, help="cores kept busy by spinning processes in the busy variants")
    args = check_sample_args(ap, ap.parse_args(argv))
    if args.busy < 0:
        ap.error("--busy must be >= 0")
    return args


def make_samples(args: argparse.Namespace, seed: int = 0) -> list:
    import numpy as np

    from colo.bench.lengths import response_length
    from colo.rollout.sample import Sample, Status

    rng = random.Random(seed)
    out = []
    for i in range(args.samples):
        R, P = response_length(seed * 1_000_003 + i, args.max_tokens), args.prompt_len
        s = Sample(i, 0, 0, [rng.randrange(150_000) for _ in range(P)], [rng.randrange(150_000) for _ in range(R)],
                   [-rng.random() for _ in range(R)], status=Status.COMPLETED)
        if args.moe_layers:
            shape = (P + R - 1, args.moe_layers, args.topk)
            ids = np.random.default_rng(i).integers(0, 128, size=shape, dtype=np.uint8)
            ids.setflags(write=False)
            s.routing = ids
        out.append(s)
    return out


def _spin(stop) -> None:  # noqa: ANN001 (a multiprocessing Event)
    while not stop.is_set():
        pass


@contextmanager
def busy_cores(n: int):
    """`n` processes spinning on a core each for the span."""
    stop = mp.get_context("spawn").Event()
    procs = [mp.get_context("spawn").Process(target=_spin, args=(stop,), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # spinning before the timing starts
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)


def seconds_per_build(samples: list[dict], threads: int, reps: int) -> float:
    import torch

    from colo.algo.batch import build_batch, shard_batch, torch_threads

    adv = torch.zeros(len(samples))
    times = []
    with torch_threads(threads):
        for _ in range(reps + 1):  # the first one warms the allocator up
            t0 = time.perf_counter()
            shard_batch(build_batch(samples, adv, pad_id=0), 1)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure(args: argparse.Namespace) -> dict:
    import torch

    samples = make_samples(args)
    default = torch.get_num_threads()
    secs = {f"idle_{default}_threads": seconds_per_build(samples, default, args.reps),
            "idle_1_thread": seconds_per_build(samples, 1, args.reps)}
    if args.busy:
        with busy_cores(args.busy):
            secs[f"busy_{default}_threads"] = seconds_per_build(samples, default, args.reps)
            secs["busy_1_thread"] = seconds_per_build(samples, 1, args.reps)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    return {"samples": args.samples, "tokens": tokens, "moe_layers": args.moe_layers, "threads": default,
            "busy_cores": args.busy, "seconds": {k: round(v, 4) for k, v in secs.items()},
            "over_one_thread": {k: round(v / secs[("busy" if k.startswith("busy") else "idle") + "_1_thread"], 2)
                                for k, v in secs.items()}}


def summary(out: dict) -> str:
    return (f"{out['samples']} samples, {out['tokens']} tokens, {out['threads']} torch threads by default: "
            + ", ".join(f"{k} {v * 1e3:.0f} ms ({out['over_one_thread'][k]:.2f}x one thread)"
                        for k, v in out["seconds"].items()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = measure(args)
    print(json.dumps(out) if args.json else summary(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
