"""Does a batch of stale tokens train slower than a fresh one of the same shapes? One trainer, the two batches in turn.

    python -m tools.experiments.stalebatch --json                                           # CPU, the tiny model
    python -m tools.experiments.stalebatch --preset qwen3-30b-a3b-L4 --device cuda --json   # one GPU, random weights

Why (issue 47): on one H200 the async step's train phase took 1.46 s where sync's took 1.17 s for the same token
count. An async batch differs from a sync one in its values only where staleness reaches: the behaviour log-probs
(vLLM's, from older weights: the TIS weights move away from 1 and some are truncated at algo.tis_cap) and the
advantages; its shapes are the trainer's business (tools.experiments.asyncsim --shapes). So this builds one batch
of long-tail samples (colo.bench.lengths), scores it with the policy, and trains it twice per round with lr 0 (the weights never
move): once with behaviour log-probs next to the policy's (fresh: noise 0.01), once far from them (stale: noise 0.8),
in alternating order, and reports the median train_step seconds and process CPU seconds of each and their ratio.
Measured on the 2-core CPU machine (tiny, 64 samples, 14,603 tokens): stale / fresh 0.990 and 1.015 in two
runs (CPU time alike).
In-process (colo.trainer.worker.Trainer, world size 1): no Ray, no vLLM.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.experiments.stalebatch", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", help="a colo.models.tiny preset (random weights beyond tiny)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512, help="longest response; median a quarter of it")
    ap.add_argument("--rounds", type=int, default=12, help="rounds of one fresh and one stale train_step (the first "
                    "warms up and is not counted)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "colo-bench"))
    args = ap.parse_args(argv)
    if min(args.samples, args.prompt_len, args.max_tokens) < 1 or args.rounds < 2:
        ap.error("--samples, --prompt-len, --max-tokens >= 1 and --rounds >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from dataclasses import replace

    from colo.algo.batch import build_batch, shard_batch, to_wire
    from colo.rollout.sample import Sample, Status
    from colo.bench.lengths import response_length
    from colo.config import ColoConfig, to_dict
    from colo.host.net import free_port
    from colo.models.tiny import WITH_WEIGHTS, make_tiny_model
    from colo.plan.resolve import resolve
    from colo.trainer.worker import Trainer

    model = make_tiny_model(Path(args.workdir) / f"{args.preset}-s0", args.preset, 0)
    cfg = ColoConfig()
    cfg.model.path, cfg.model.dummy_weights = str(model), args.preset not in WITH_WEIGHTS
    cfg.model.dtype = "float32" if args.device == "cpu" else "bfloat16"
    cfg.placement.device, cfg.trainer.lr, cfg.algo.tis_cap = args.device, 0.0, 2.0
    cfg.run.dir = str(Path(args.workdir) / "stalebatch")
    trainer = Trainer(to_dict(resolve(cfg).cfg), 0, 1, "127.0.0.1", free_port())  # resolved, as colo.launch does
    trainer.setup()
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(args.samples):
        r = response_length(1000 + i, args.max_tokens)
        samples.append(Sample(i, 0, 0, torch.randint(3, 500, (args.prompt_len,), generator=g).tolist(),
                              torch.randint(3, 500, (r,), generator=g).tolist(), [0.0] * r, status=Status.COMPLETED))
    adv = torch.randn(args.samples, generator=g)
    own = trainer.compute_logprobs(build_batch(samples, adv))  # (B, T) the policy's own log-probs
    batches = {}
    for name, noise in (("fresh", 0.01), ("stale", 0.8)):
        made = []
        for b, s in enumerate(samples):
            p, r = len(s.prompt_ids), len(s.response_ids)
            made.append(replace(s, logprobs=(own[b, p:p + r] + noise * torch.randn(r, generator=g)).tolist()))
        batches[name] = to_wire(shard_batch(build_batch(made, adv), 1)[0])
    wall: dict[str, list[float]] = {"fresh": [], "stale": []}
    cpu: dict[str, list[float]] = {"fresh": [], "stale": []}
    tis, gap = {}, {}
    for rnd in range(args.rounds):
        for name in (("fresh", "stale") if rnd % 2 else ("stale", "fresh")):
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            m = trainer.train_step(batches[name])
            if args.device == "cuda":
                torch.cuda.synchronize()
            if rnd:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            tis[name], gap[name] = m["tis_mean"], m["logprob_diff/mean"]  # gap: |policy - behaviour| per token
    trainer.shutdown()
    med = {k: statistics.median(v) for k, v in wall.items()}
    medc = {k: statistics.median(v) for k, v in cpu.items()}
    out = {"bench": "stalebatch", "preset": args.preset, "device": args.device,
           "tokens": int(batches["fresh"]["attention_mask"].sum()), "rounds": args.rounds - 1, "tis_mean": tis, "gap": gap,
           "train_step_s": med, "train_step_cpu_s": medc, "stale_over_fresh": med["stale"] / med["fresh"],
           "stale_over_fresh_cpu": medc["stale"] / medc["fresh"]}
    print(f"[bench.stalebatch] {out['tokens']} tokens: stale {med['stale']:.4f} s, fresh {med['fresh']:.4f} s per "
          f"train_step (median of {args.rounds - 1}): stale / fresh {out['stale_over_fresh']:.3f} (CPU "
          f"{out['stale_over_fresh_cpu']:.3f}); TIS mean {tis['stale']:.3f} against {tis['fresh']:.3f}",
          file=sys.stderr, flush=True)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
