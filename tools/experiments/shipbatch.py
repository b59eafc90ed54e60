"""A step's batch on its way to a trainer actor through Ray (colo.cluster.actors.TrainerGroup.train_step): as torch
tensors, which Ray pickles in-band, against colo.algo.batch.to_wire's numpy arrays, which Ray's object store hands
over without pickling them; the actor turns what it gets back into tensors (from_wire) either way. One run, the
ratio of the two.

    python -m tools.experiments.shipbatch --json                  # 128 samples of the L12 slice's shape, R3 ids
    python -m tools.experiments.shipbatch --samples 32 --json

Why: the train phase of the L12 slice on an H200 spent 0.18-0.23 s outside the driver's batch building and the
trainer's call: the shard's way to the trainer and the metrics' way back. A shard of 128 samples with R3 ids is ~70
MB, most of it the routing ids. Samples as tools.experiments.buildbatch makes them; the shard is build_batch +
shard_batch(1), as the loop builds it for one trainer. Prints seconds per delivery (median of
--reps, after one unmeasured) for each way, and tensors over arrays. Uses the Ray instance running in this process,
else starts one (2 CPUs) and stops it after.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tools.experiments.buildbatch import check_sample_args, sample_args

    ap = sample_args(argparse.ArgumentParser(prog="python -m tools.experiments.shipbatch",
                                             description=__doc__.splitlines()[0]))
    return check_sample_args(ap, ap.parse_args(argv))


def _receiver():
    import ray

    @ray.remote(num_cpus=0)
    class Receiver:
        """Stands in for a trainer's train_step entry: what arrives, as tensors (colo.algo.batch.from_wire)."""

        def take(self, batch: dict) -> int:
            import torch

            from colo.algo.batch import from_wire

            return sum(v.numel() for v in from_wire(batch).values() if torch.is_tensor(v))

    return Receiver.remote()


def seconds_per_delivery(actor, shard: dict, as_arrays: bool, reps: int) -> tuple[float, int]:
    """Median seconds from the driver's call to the actor's answer (to_wire included for arrays), and the
    elements the actor got."""
    import ray

    from colo.algo.batch import to_wire

    times, got = [], 0
    for _ in range(reps + 1):  # the first one starts the actor's imports
        t0 = time.perf_counter()
        got = ray.get(actor.take.remote(to_wire(shard) if as_arrays else shard))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), got


def measure(args: argparse.Namespace) -> dict:
    import ray
    import torch

    from colo.algo.batch import build_batch, shard_batch
    from tools.experiments.buildbatch import make_samples

    samples = make_samples(args)
    shard = shard_batch(build_batch(samples, torch.zeros(len(samples)), pad_id=0), 1)[0]
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = _receiver()
    try:
        tensors, n_t = seconds_per_delivery(actor, shard, False, args.reps)
        arrays, n_a = seconds_per_delivery(actor, shard, True, args.reps)
    finally:
        ray.kill(actor)
        if started:
            ray.shutdown()
    elements = sum(v.numel() for v in shard.values() if torch.is_tensor(v))
    if not n_t == n_a == elements:
        raise RuntimeError(f"the actor got {n_t} elements as tensors and {n_a} as arrays, the shard holds {elements}")
    mb = sum(v.numel() * v.element_size() for v in shard.values() if torch.is_tensor(v)) / 1e6
    return {"samples": args.samples, "shard_mb": round(mb, 1), "moe_layers": args.moe_layers,
            "seconds": {"tensors": round(tensors, 4), "arrays": round(arrays, 4)},
            "tensors_over_arrays": round(tensors / arrays, 2)}


def summary(out: dict) -> str:
    s = out["seconds"]
    return (f"{out['samples']} samples, a {out['shard_mb']} MB shard to an actor: as tensors "
            f"{s['tensors'] * 1e3:.0f} ms, as numpy arrays {s['arrays'] * 1e3:.0f} ms "
            f"({out['tensors_over_arrays']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = measure(args)
    print(json.dumps(out) if args.json else summary(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
