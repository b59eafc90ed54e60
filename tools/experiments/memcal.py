"""The memory plan (colo.plan.memory) against every GPU memory figure measured so far: one table, with errors.

    python -m tools.experiments.memcal            # markdown table: point, measured GiB, plan GiB, error
    python -m tools.experiments.memcal --json

The measured figures are those of docs/benchmarks.md (each row names its section); nothing here runs a
GPU. "fit" marks the figures a calibrated constant of colo.plan.memory was fitted on (the error there says
how well one constant serves both cards or both shapes); every other row is a check.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Callable

from colo.config.checks import parse_gpu_memory
from colo.plan.memory import GiB, OFFLOADED_REST, model_shape, plan_memory, trainer_terms
from colo.plan.settings import Settings
from colo.models.tiny import PRESETS

L2 = PRESETS["qwen3-30b-a3b-L2"]
L12 = PRESETS["qwen3-30b-a3b-L12"]
# the L2 loop (docs/benchmarks.md "The RL loop ... 1xH200" / "1xH100"): vLLM 0.3, micro batch 4, responses
# <= 32 tokens after a 17-token chat prompt, so the trainer's sequences are 49 tokens
LOOP = Settings.of({"placement.num_gpus": 1, "placement.vllm_gpu_fraction": 0.3, "trainer.micro_batch_size": 4,
                    "rollout.max_model_len": 49, "trainer.packing": False})


# colo.bench.rollout's L12 sync cycle: vLLM 0.4, micro batch 1, 256-token sequences
L12_CYCLE = Settings.of({"placement.num_gpus": 1, "placement.vllm_gpu_fraction": 0.4, "trainer.micro_batch_size": 1,
                         "rollout.max_model_len": 256, "trainer.packing": False})


@dataclass(frozen=True)
class Point:
    name: str
    source: str
    measured: float  # GiB
    plan: Callable[[], float]  # bytes
    fitted: bool = False


def _plan(cfg: dict, s: Settings, gpu: str):  # noqa: ANN202
    return plan_memory(cfg, s, parse_gpu_memory(gpu), gpu)


def _after_sync(gpu: str) -> float:
    p = _plan(L2, LOOP, gpu)
    return p.total("asleep") + dict(p.rows)["vLLM weights (bf16, experts / EP)"]["sync"]


def _bench(layers: int, gc: bool, what: str) -> float:
    """tools.experiments.trainmem on one rank, one micro-batch of 1 x 4096 tokens, no sync buffers."""
    cfg = dict(L2, num_hidden_layers=layers, max_window_layers=layers)
    s = Settings.of({"placement.num_gpus": 1, "placement.vllm_gpu_fraction": 0.3, "trainer.micro_batch_size": 1,
                     "rollout.max_model_len": 4096, "trainer.packing": False, "trainer.gradient_checkpointing": gc,
                     "sync.buffers": 0})
    t = trainer_terms(model_shape(cfg), s)
    rest = OFFLOADED_REST
    one_micro = max(t["backward"] - t["grads"], t["entropy"])  # one micro-batch: no grads yet at backward's start
    from colo.plan.memory import ALLOC_SLACK

    return {"no_grad": t["no_grad"] - rest, "fwd_bwd": one_micro - rest, "step": t["step"] - rest,
            "reserved": (max(one_micro, t["step"]) - rest) * (1 + ALLOC_SLACK)}[what]


def points() -> list[Point]:
    loop = "L2 loop, 1xH200" 
    pts = [
        Point("rollout: device used (vLLM awake, trainer offloaded)", loop, 47.3,
              lambda: _plan(L2, LOOP, "H200").total("rollout"), fitted=True),
        Point("rollout: device used", "L2 loop, 1xH100", 29.1, lambda: _plan(L2, LOOP, "H100").total("rollout")),
        Point("asleep: device used (vLLM asleep, trainer offloaded)", loop + " and 1xH100", 8.8,
              lambda: _plan(L2, LOOP, "H200").total("asleep"), fitted=True),
        Point("train: trainer's peak allocated", loop + " and 1xH100", 37.0,
              lambda: max(trainer_terms(model_shape(L2), LOOP)[k] for k in ("backward", "entropy", "step"))),
        Point("train: device used after train", loop + " and 1xH100", 52.9,
              lambda: _plan(L2, LOOP, "H200").total("train"), fitted=True),
        Point("sync: trainer's peak allocated", loop + " and 1xH100", 24.7,
              lambda: trainer_terms(model_shape(L2), LOOP)["sync"]),
        Point("sync: device used after the trainer's offload", loop + " and 1xH100", 12.3, lambda: _after_sync("H200")),
        Point("wake: device used (KV cache back)", loop, 46.8, lambda: _plan(L2, LOOP, "H200").total("rollout")),
        Point("wake: device used", "L2 loop, 1xH100", 28.6, lambda: _plan(L2, LOOP, "H100").total("rollout")),
        # measured before train_step released its cache: the cache stayed through rollout then
        Point("rollout with trainer.offload=false (train cache kept, as measured)", "L2 loop, 1xH200, offload off",
              87.8, lambda: _plan(L2, LOOP.with_({"trainer.offload": False}), "H200").total("rollout")
              + (_plan(L2, LOOP, "H200").total("train") - _plan(L2, LOOP, "H200").total("asleep")
                 - trainer_terms(model_shape(L2), LOOP)["sync"] + trainer_terms(model_shape(L2), LOOP)["sync_gather"])),
        Point("L12 sync cycle: trainer's peak allocated (no optimizer state yet)", "bench.rollout L12, 1xH100", 33.9,
              lambda: trainer_terms(model_shape(L12), L12_CYCLE)["sync"]
              - trainer_terms(model_shape(L12), L12_CYCLE)["optim"]),
        Point("L12 rollout: device used after the cycle (vLLM 0.4, CUDA graphs on)", "bench.rollout L12, 1xH100", 33.0,
              lambda: _plan(L12, L12_CYCLE.with_({"rollout.max_model_len": 384}),
                            "H100").total("rollout")),
    ]
    bench = "trainmem, 1xH200, 1x4096 tok"
    for layers, gc, measured in ((2, False, (29.07, 36.03, 34.88, 47.32)), (4, False, (43.00, 54.60, 58.09, 65.07)),
                                 (2, True, (29.07, 36.03, 34.88, 44.76))):
        tag = f"L{layers}{' gc' if gc else ''}"
        for what, m in zip(("no_grad", "fwd_bwd", "step", "reserved"), measured):
            label = {"no_grad": "old-log-prob pass", "fwd_bwd": "forward + backward + entropy",
                     "step": "optimizer step", "reserved": "reserved at the end (allocator cache)"}[what]
            pts.append(Point(f"{tag}: {label}", bench, m, lambda layers=layers, gc=gc, what=what: _bench(layers, gc, what)))
    return pts


def table() -> list[dict]:
    out = []
    for p in points():
        plan = p.plan() / GiB
        out.append({"point": p.name, "source": p.source, "measured_gib": p.measured, "plan_gib": round(plan, 2),
                    "error": round((plan - p.measured) / p.measured, 4), "fitted": p.fitted})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = table()
    if args.json:
        print(json.dumps(rows))
        return
    print("| figure | measured in | measured GiB | plan GiB | error |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['point']}{' (fit)' if r['fitted'] else ''} | {r['source']} | {r['measured_gib']:.2f} | "
              f"{r['plan_gib']:.2f} | {100 * r['error']:+.1f}% |")


if __name__ == "__main__":
    main()
