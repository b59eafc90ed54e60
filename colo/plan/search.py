"""One search over a job's settings, ranked by one cost model: what colo.plan.auto chooses and what a refusal offers.

    t = trial(config_json, settings, {"trainer.offload": True}, gpu_bytes, speeds)   # planned and costed
    best = min(trials_that_fit, key=Trial.rank)                                      # colo.plan.auto
    for changes, plan in ways_to_fit(config_json, settings, gpu_bytes, speeds):       # a refusal's suggestions
        print(format_changes(changes), plan.worst)

Every trial is planned (colo.plan.memory) and costed (colo.plan.cost, with the device's measured speeds), never
guessed, and both callers order trials by the same key (Trial.rank):
1. fewer GPUs (placement.num_gpus: more of them is a resource the job may not have, whatever they would save);
2. the optimizer's state in full precision (trainer.optimizer_dtype=bfloat16 changes the numerics, not the speed);
3. colo.plan.cost's estimate of the rank's train seconds per step on this device, to the millisecond;
4. the smaller peak phase, then less memory over all phases (more headroom at the same speed);
5. fewer changed keys.
So an `auto` choice and a refusal agree about what is cheaper: auto varies only the keys it resolves, on the GPUs given
(1 and 2 are the same for all its trials), and a refusal's first suggestion is the fastest setting the plan accepts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from colo.plan.cost import Speeds, step_seconds
from colo.plan.memory import MemoryPlan, model_shape, plan_memory
from colo.plan.settings import Settings, get


@dataclass(frozen=True)
class Trial:
    """One setting of the job: the dotted keys changed on top of the base, its memory plan and its estimated cost."""
    changes: dict[str, Any]
    plan: MemoryPlan
    cost: dict[str, float]  # colo.plan.cost.step_seconds's terms

    @property
    def settings(self) -> Settings:
        return self.plan.settings

    @property
    def seconds(self) -> float:
        return sum(self.cost.values())

    @property
    def need(self) -> float:
        """Bytes of the phase that needs the most."""
        return self.plan.worst[1]

    @property
    def rank(self) -> tuple[int, bool, float, float, float, int]:
        """The one order of the module docstring: smaller is better."""
        s = self.settings
        return (int(s.placement.num_gpus), s.trainer.optimizer_dtype == "bfloat16", round(self.seconds, 3),
                self.need, sum(self.plan.totals.values()), len(self.changes))


def trial(config_json: dict[str, Any], base: Settings, changes: dict[str, Any], gpu_bytes: Optional[float],
          speeds: Speeds, gpu_source: str = "placement.gpu_memory") -> Trial:
    """`base` with `changes`, planned against `gpu_bytes` and costed with `speeds`."""
    s = base.with_(changes)
    return Trial(dict(changes), plan_memory(config_json, s, gpu_bytes, gpu_source),
                 step_seconds(model_shape(config_json), s, speeds))


LEVERS = (("trainer.offload", True), ("trainer.gradient_checkpointing", True), ("trainer.optimizer_offload", True),
          ("trainer.gather_once", False), ("trainer.optimizer_dtype", "bfloat16"))
"""The settings a refusal may change towards less memory, besides the GPU count, the micro-batch and vLLM's share."""
FRACTION_PHASES = ("start", "rollout", "engine GPU")  # the phases vLLM's fraction changes


def ways_to_fit(config_json: dict[str, Any], s: Settings, gpu_bytes: float, speeds: Speeds, limit: int = 3
                ) -> list[tuple[dict[str, Any], MemoryPlan]]:
    """Change sets (dotted config keys) that the plan accepts, in Trial.rank's order; a set that adds changes to one
    already offered is left out. The levers: LEVERS, a smaller micro-batch (rows when padded, the token budget when
    packed, down to one max_model_len), the vLLM fraction (the one that fits with the largest KV cache), and 2, 4 or 8
    times the GPUs (the experts must divide by the count)."""
    m = model_shape(config_json)
    key = "trainer.max_tokens_per_micro_batch" if s.trainer.packing else "trainer.micro_batch_size"
    size = int(get(s.cfg, key))
    floor = s.rollout.max_model_len if s.trainer.packing else 1
    mbs = sorted({size} | {size // 2**k for k in (1, 2, 3) if size // 2**k >= floor}, reverse=True)
    n0 = s.placement.num_gpus
    gpus = [n0] + [n for n in (2 * n0, 4 * n0, 8 * n0) if not s.colocated or not m.experts or m.experts % n == 0]
    levers = [lv for lv in LEVERS if get(s.cfg, lv[0]) != lv[1]]
    fractions = sorted({round(x * 0.05, 2) for x in range(2, 19)} | {s.placement.vllm_gpu_fraction})
    found: list[Trial] = []
    for n in gpus:
        for mb in mbs:
            for mask in range(1 << len(levers)):
                chosen = {k: v for i, (k, v) in enumerate(levers) if mask >> i & 1}
                changes = {"placement.num_gpus": n, key: mb, **chosen}
                t = _with_fraction(config_json, s, {k: v for k, v in changes.items() if v != get(s.cfg, k)},
                                   gpu_bytes, speeds, fractions)
                if t is not None:
                    found.append(t)
    out: list[tuple[dict[str, Any], MemoryPlan]] = []
    for t in sorted(found, key=lambda t: t.rank):
        if any(c.items() <= t.changes.items() for c, _ in out):
            continue
        out.append((t.changes, t.plan))
        if len(out) == limit:
            break
    return out


def _with_fraction(config_json: dict[str, Any], s: Settings, changes: dict[str, Any], gpu_bytes: float,
                   speeds: Speeds, fractions: list[float]) -> Optional[Trial]:
    """The trial of `changes` that fits: as it is, else with the vLLM fraction that fits with the largest KV cache;
    None when none does."""
    here = trial(config_json, s, changes, gpu_bytes, speeds)
    if here.plan.fits:
        return here
    if any(here.plan.total(p) > gpu_bytes for p in here.plan.phases if p not in FRACTION_PHASES):
        return None  # vLLM's fraction cannot help while it sleeps
    now = s.placement.vllm_gpu_fraction
    fits = [t for f in fractions if f != now and (t := trial(
        config_json, s, {**changes, "placement.vllm_gpu_fraction": f}, gpu_bytes, speeds)).plan.fits]
    return max(fits, key=lambda t: t.settings.placement.vllm_gpu_fraction, default=None)


def format_changes(changes: dict[str, Any], train_fraction: Optional[float] = None) -> str:
    """`key=value ...` as a user types it; a vLLM fraction that would push the two fractions over 1 also
    names the trainer's (a Ray scheduling share on GPU, not a memory limit)."""
    parts = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items()]
    f = changes.get("placement.vllm_gpu_fraction")
    if f is not None and train_fraction is not None and train_fraction + f > 1.0:
        parts.append(f"placement.train_gpu_fraction={round(1.0 - f, 2)}")
    return " ".join(parts)
