"""`auto` trainer settings: the fastest setting that fits this job on this hardware, costed from measured figures.

    tuned = resolve_auto(cfg, "cuda", config_json, gpu_bytes, "placement.gpu_memory=H200", SPEEDS["H200"])
    tuned.cfg            # concrete: what the run, the memory plan and the run dir's config.yaml get
    print(tuned.table()) # one line per key: its value and why

colo.plan.resolve calls it once per run (through colo.plan.job.tune); the search and its order are colo.plan.search's,
which a refusal's ways to fit share.

The keys (colo.plan.settings.PLAIN): trainer.offload, trainer.optimizer_offload, trainer.compile,
trainer.gradient_checkpointing, trainer.gather_once, trainer.max_tokens_per_micro_batch. A key the user set keeps its
value; auto chooses the others:
- CPU: PLAIN, what the CPU configs and the CPU suite have always run (CPU_WHY says why, per key), so the suite runs
  the GPU's code paths (offload's copies among them).
- GPU of known size: every combination of the auto keys' candidates is planned (colo.plan.memory) against the GPU
  with HEADROOM of it kept free; of those that fit, the first in colo.plan.search's order wins (the fastest that
  colo.plan.cost estimates with this device's speeds; a tie: the one needing less memory). When none fits with the
  headroom, without it; when none fits at all, the one needing the least memory, which the plan then refuses,
  naming ways to fit (colo.plan.search.ways_to_fit, in the same order).
- GPU of unknown size (a dry run on a machine without one and placement.gpu_memory=auto): PLAIN, said so.
Pure, like the plan: no torch, no files.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional

from colo.config.schema import ColoConfig
from colo.plan.cost import MEASURED_MICRO, Speeds
from colo.plan.memory import GiB
from colo.plan.search import Trial, trial
from colo.plan.settings import PLAIN, Settings, auto_keys, get, settled, with_values

HEADROOM = 0.10
"""Share of the GPU an auto choice leaves free beyond the plan: the plan's figures are calibrated within +-15% each
(docs/benchmarks.md, "Memory plan: calibration"), and the L12 slice gathered once reserved 130.1 GiB, and 137.1 GiB
with one allocator retry, where the plan counts 122.4 (that table's "L12 on the fast path" row). A setting the user
gives is checked against the whole GPU."""
COMPILED_ARCHS = ("Qwen3MoeForCausalLM",)
"""Families whose trainer has run compiled (trainer.compile) on a GPU: the qwen3-30b-a3b slices (docs/benchmarks.md,
"Step throughput and MFU")."""
CPU_WHY = {
    "trainer.offload": "CPU: as CPU runs have always run (the copies stay in host memory there)",
    "trainer.optimizer_offload": "CPU: host and device memory are the same",
    "trainer.compile": "CPU: eager (each trainer process would compile for longer than a CPU job trains)",
    "trainer.gradient_checkpointing": "CPU: tiny models; recompute would only cost time",
    "trainer.gather_once": "CPU: per micro-batch, as the CPU suite runs",
    "trainer.max_tokens_per_micro_batch": "CPU: the budget the CPU suite runs (its batches are smaller)",
}


@dataclass(frozen=True)
class Choice:
    key: str
    value: Any
    why: str
    auto: bool  # False: the user set it


@dataclass(frozen=True)
class Tuned:
    """A config with its auto trainer keys resolved (and those settled), and what was chosen and why; after them, the
    keys loop.mode=auto set (colo.plan.loopmode), where it was given."""
    cfg: ColoConfig
    choices: tuple[Choice, ...]
    summary: str

    @property
    def resolved(self) -> dict[str, Any]:
        """{key: value} of the keys auto chose."""
        return {c.key: c.value for c in self.choices if c.auto}

    def also(self, extra: tuple[Choice, ...]) -> Tuned:
        """These choices after the trainer's, in the config and the table (loop.mode=auto's)."""
        return Tuned(with_values(self.cfg, {c.key: c.value for c in extra}), self.choices + extra, self.summary)

    def table(self) -> str:
        width = max(len(f"{c.key}={show(c.value)}") for c in self.choices)
        return "\n".join([f"auto settings: {self.summary}"] + [
            f"  {f'{c.key}={show(c.value)}'.ljust(width)}  {c.why if c.auto else 'as set'}" for c in self.choices])


def show(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def resolve_auto(cfg: ColoConfig, device: str, config_json: Optional[dict[str, Any]], gpu_bytes: Optional[float],
                 gpu_source: str, speeds: Speeds) -> Tuned:
    """cfg's auto keys resolved (module docstring), and those the config alone decides (colo.plan.settings.settled);
    `gpu_bytes` matters on cuda only."""
    keys = auto_keys(cfg)
    fixed = [Choice(k, get(cfg, k), "", False) for k in PLAIN if k not in keys]
    if not keys:
        return Tuned(with_values(cfg, settled(cfg)), tuple(fixed), "none left: every key is set")
    if device != "cuda" or config_json is None:
        return _tuned(cfg, {k: PLAIN[k] for k in keys}, {k: CPU_WHY[k] for k in keys}, fixed,
                      "on CPU, what CPU runs have always run")
    if gpu_bytes is None:
        why = "GPU size unknown: the setting of before auto (placement.gpu_memory=H100, H200, 80GiB, ... plans it)"
        return _tuned(cfg, {k: PLAIN[k] for k in keys}, {k: why for k in keys}, fixed,
                      "GPU size unknown (no GPU here, placement.gpu_memory=auto)")
    cands, only = {}, {}
    for k in keys:
        cands[k], reason = candidates(cfg, k, config_json)
        if reason:
            only[k] = reason
    trials = _trials(cfg, cands, config_json, gpu_bytes, speeds)
    # the headroom where the choice matters: a phase that needs more in every trial (vLLM starting beside the
    # trainer's parameters, say) is the config's, not auto's, and is held to the whole GPU only
    limits = {p: min(gpu_bytes, max(gpu_bytes * (1 - HEADROOM), min(t.plan.total(p) for t in trials)))
              for p in trials[0].plan.phases}
    tier = [t for t in trials if _over(t, limits) is None]
    if not tier:
        limits = dict.fromkeys(limits, gpu_bytes)
        tier = [t for t in trials if t.plan.fits]
    if not tier:
        best = min(trials, key=lambda t: (t.need, sum(t.plan.totals.values())))
        why = {k: only.get(k, "nothing fits: the setting that needs the least memory") for k in keys}
        return _tuned(cfg, best.changes, why, fixed, f"nothing fits {gpu_bytes / GiB:.1f} GiB per GPU ({gpu_source}) "
                      "with any of them: the one that needs the least memory, which the plan refuses")
    best = min(tier, key=lambda t: t.rank)
    why = {k: only.get(k) or _why(k, best, trials, tier, limits) for k in keys}
    terms = ", ".join(f"{n} {v:.2f}" for n, v in best.cost.items() if v)
    kept = "" if min(limits.values()) >= gpu_bytes else f", {100 * HEADROOM:.0f}% kept free where the choice matters"
    borrowed = "" if speeds.measured_here else f"; {speeds.measured}"  # a device without a row of its own says so
    summary = (f"the fastest that fits {gpu_bytes / GiB:.1f} GiB per GPU ({gpu_source}){kept}: "
               f"{best.plan.worst[0]} phase {best.need / GiB:.1f} GiB, est. {best.seconds:.2f} s of train work per "
               f"step from measured figures (colo.plan.cost: {terms}{borrowed})")
    return _tuned(cfg, best.changes, why, fixed, summary)


def candidates(cfg: ColoConfig, key: str, config_json: dict[str, Any]) -> tuple[list[Any], str]:
    """The values auto tries for `key` on GPU, fastest first, and the reason when there is only one."""
    t = cfg.trainer
    if key == "trainer.offload" and cfg.placement.mode != "colocated":
        return [False], "disaggregated: the trainer never shares its GPU with vLLM, nothing to offload"
    if key == "trainer.compile":
        arch = (config_json.get("architectures") or ["?"])[0]
        if not t.packing:
            return [False], "the padded path (trainer.packing=false) has not run compiled on a GPU"
        if arch not in COMPILED_ARCHS:
            return [False], f"{arch}'s trainer has not run compiled on a GPU (measured: {', '.join(COMPILED_ARCHS)})"
    if key == "trainer.max_tokens_per_micro_batch":
        if not t.packing:
            return [PLAIN[key]], "unused: trainer.packing=false (trainer.micro_batch_size sets the micro-batch)"
        seq = cfg.rollout.max_model_len
        return sorted({max(c, seq) for c in MEASURED_MICRO}, reverse=True), ""
    return ([True, False] if key in ("trainer.compile", "trainer.gather_once") else [False, True]), ""


def _trials(cfg: ColoConfig, cands: dict[str, list[Any]], config_json: dict[str, Any], gpu_bytes: Optional[float],
            speeds: Speeds) -> list[Trial]:
    """Every combination of the candidates, planned and costed (colo.plan.search.trial), in candidate order."""
    first = {k: v[0] for k, v in cands.items()}
    base = Settings(with_values(cfg, {**settled(cfg), **first}))  # concrete: the combinations change `first` only
    return [trial(config_json, base, dict(zip(cands, vs)), gpu_bytes, speeds)
            for vs in itertools.product(*cands.values())]


def _over(t: Trial, limits: dict[str, float]) -> Optional[tuple[str, float, float]]:
    """(phase, need, limit) of the trial's phase most over its limit; None when it fits them all."""
    if not t.plan.kv_ok:
        return "rollout", float("inf"), 0.0
    over = [(p, t.plan.total(p), lim) for p, lim in limits.items() if t.plan.total(p) > lim]
    return max(over, key=lambda o: o[1] / o[2]) if over else None


def _why(key: str, best: Trial, trials: list[Trial], tier: list[Trial], limits: dict[str, float]) -> str:
    """Why `key` has best's value: the best setting with another value for it is slower, or nothing with one fits."""
    others = [t for t in tier if t.changes[key] != best.changes[key]]
    if not others:
        # the chosen setting with this key alone changed: what it would need
        near = [t for t in trials if t.changes[key] != best.changes[key]
                and all(t.changes[k] == v for k, v in best.changes.items() if k != key)]
        alt = min(near or [t for t in trials if t.changes[key] != best.changes[key]], key=lambda t: t.rank)
        phase, need, limit = _over(alt, limits) or (alt.plan.worst[0], alt.need, limits[alt.plan.worst[0]])
        what = ("vLLM's KV cache would hold less than one sequence" if not alt.plan.kv_ok else
                f"its {phase} phase {need / GiB:.1f} GiB of {limit / GiB:.1f}")
        return f"{show(alt.changes[key])} does not fit ({what})"
    alt = min(others, key=lambda t: t.rank)
    along = ", ".join(f"{k.split('.')[1]}={show(v)}" for k, v in alt.changes.items()
                      if k != key and v != best.changes[k])
    head = f"{show(alt.changes[key])}{f' (with {along})' if along else ''}"
    delta = alt.seconds - best.seconds
    if abs(delta) < 0.0005:
        phase = max(best.plan.phases, key=lambda p: abs(alt.plan.total(p) - best.plan.total(p)))
        more = (alt.plan.total(phase) - best.plan.total(phase)) / GiB
        return f"{head}: the same estimated time, {more:+.1f} GiB in the {phase} phase"
    term = max(best.cost, key=lambda n: abs(alt.cost[n] - best.cost[n]))
    return f"{head}: {delta:+.2f} s/step ({term} {alt.cost[term] - best.cost[term]:+.2f} s)"


def _tuned(cfg: ColoConfig, values: dict[str, Any], why: dict[str, str], fixed: list[Choice], summary: str) -> Tuned:
    chosen = {k: Choice(k, v, why[k], True) for k, v in values.items()}
    by_key = {c.key: c for c in fixed} | chosen
    return Tuned(with_values(cfg, {**settled(cfg), **values}), tuple(by_key[k] for k in PLAIN), summary)
