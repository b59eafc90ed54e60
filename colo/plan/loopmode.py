"""loop.mode=auto: async where a measured row says it pays on this setup, sync everywhere else, and why.

    extra = loop_mode(cfg, config_json, device, "auto:qwen3-30b-a3b-L4")   # () unless loop.mode=auto
    tuned.also(extra)    # colo.plan.resolve: in the resolved config, --dry-run's table and the run's `colo: auto:` line

Async changes the algorithm (samples carried across weight versions, decoupled PPO, loop.max_staleness), so sync stays
the default and auto is the user's opt-in. It picks async only where colo.plan.cost.ASYNC_MEASURED has a row for this
setup that measured at least ASYNC_PAYS: colocated, one turn, the same model shape, card and GPU count, and a batch
(prompts x n) and rollout.max_tokens within ASYNC_NEAR of the row's. With async, rollout.oversample and
loop.max_staleness left at their defaults take the row's values (the gain was measured at those); values the user set
are kept, and the reason says what the row ran. Everywhere else sync, with the reason: CPU, disaggregated, an
environment, a GPU of unknown kind, no row (the reason says so, and how to measure one), or a row where async lost.
The rows are measured with the bench's independent long-tail lengths; a task whose long responses cluster on some
prompts gains less (docs/benchmarks.md, "Async against sync"). Pure: no torch, no files.
"""
from __future__ import annotations

from typing import Any

from colo.config.schema import AUTO, ColoConfig, LoopConfig, RolloutConfig
from colo.plan.auto import Choice, show
from colo.plan.cost import ASYNC_MEASURED, ASYNC_NEAR, ASYNC_PAYS, AsyncMeasured, async_measured
from colo.plan.job import Device
from colo.plan.memory import model_shape

WHERE = 'docs/benchmarks.md, "Async against sync"'
CPU_WHY = ("CPU: what CPU runs and the suite's learning bounds have always run (on CPU async measured 1.117x on the "
           f"tiny bench's 8x4 and 42.7 RL-seconds against sync's 40.5 on the default job: {WHERE})")
DEFAULTS = {"rollout.oversample": RolloutConfig.oversample, "loop.max_staleness": LoopConfig.max_staleness}
"""The async settings auto sets to the measured row's when they are left at these (the schema's defaults)."""


def loop_mode(cfg: ColoConfig, config_json: dict[str, Any], device: Device, model: str) -> tuple[Choice, ...]:
    """loop.mode=auto resolved for this job on `device` (the module docstring): its Choice, then those of the async
    settings it sets; () when loop.mode is set. `model`: model.path as the user gave it (an auto: preset or a path),
    for the reason."""
    if cfg.loop.mode != "auto":
        return ()
    row, why = _decide(cfg, config_json, device, model)
    if row is None:
        return (Choice("loop.mode", "sync", why, True),)
    measured = {"rollout.oversample": row.oversample, "loop.max_staleness": row.max_staleness}
    job = {"rollout.oversample": cfg.rollout.oversample, "loop.max_staleness": cfg.loop.max_staleness}
    mine = {k: v for k, v in job.items() if v != DEFAULTS[k] and v != measured[k]}
    if mine:
        why += "; this job runs " + ", ".join(f"{k}={show(v)}" for k, v in mine.items()) + ", as set"
    sets = [Choice(k, v, f"the measured row's (left at its default, {show(DEFAULTS[k])})", True)
            for k, v in measured.items() if job[k] == DEFAULTS[k] and v != DEFAULTS[k]]
    return (Choice("loop.mode", "async", why, True), *sets)


def _decide(cfg: ColoConfig, config_json: dict[str, Any], device: Device,
            model: str) -> tuple[AsyncMeasured | None, str]:
    """The row that makes this job async (None: sync) and the reason."""
    if device.kind != "cuda":
        return None, CPU_WHY
    if cfg.placement.mode != "colocated":
        return None, (f"disaggregated: no GPU row (async against sync was measured colocated on GPUs; on CPU, "
                      f"disaggregated, 0.94x: {WHERE})")
    if cfg.algo.environment:
        return None, f"algo.environment: no row (async against sync was measured on one-turn responses: {WHERE})"
    card = device.speeds.name
    if device.gpu_bytes is None or not device.speeds.measured_here:  # no GPU here, or a card without a SPEEDS row
        return None, (f"GPU kind unknown ({device.source}): the rows are per card, measured on "
                      f"{' and '.join(sorted({r.card for r in ASYNC_MEASURED}))} (placement.gpu_memory=H100 or H200 "
                      "plans for one)")
    m = model_shape(config_json)
    p, n, tokens, gpus = cfg.data.prompts_per_step, cfg.rollout.n, cfg.rollout.max_tokens, cfg.placement.num_gpus
    row = async_measured((m.architecture, m.layers, m.hidden, m.experts, m.moe_intermediate), card, gpus, p * n, tokens)
    if row is None:
        name = model.removeprefix(AUTO)
        which = f"--preset {name}" if model.startswith(AUTO) else f"--model {model} --dummy-weights"
        return None, (f"no measured row for this setup ({name}, {p}x{n}, {_tokens(tokens)}, {gpus}x{card}); the rows: "
                      f"{_rows()}, each answering for a batch and length within {ASYNC_NEAR:g}x of its own ({WHERE}); "
                      f"measure one: python -m colo.bench.step {which} --device cuda --gpus {gpus} --prompts {p} "
                      f"--n {n} --max-tokens {tokens} --repeats 3 --compare loop.mode=async,sync, and add its row "
                      "there and to colo.plan.cost.ASYNC_MEASURED")
    measured = (f"{_ratio(row.ratio)}x sync's tokens/s/GPU measured on {row.name}, {row.prompts}x{row.n}, "
                f"{_tokens(row.max_tokens)}, {row.gpus}x{row.card} at oversample {row.oversample:g}, staleness "
                f"{row.max_staleness} ({row.spread}, {row.date}; {WHERE})")
    if row.ratio < ASYNC_PAYS:
        return None, f"async {measured}, under the {ASYNC_PAYS:.2f}x auto asks"
    return row, measured


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n} tokens"


def _ratio(r: float) -> str:
    return max(f"{r:.2f}", f"{r:g}", key=len)  # 1.30, 1.035


def _rows() -> str:
    """The measured setups in a few words: "qwen3-30b-a3b-L4 16x8 2k, 64x8 2k on 1xH100; ..."."""
    setups: dict[tuple[str, str], list[str]] = {}
    for r in ASYNC_MEASURED:
        setups.setdefault((r.name, f"{r.gpus}x{r.card}"), []).append(f"{r.prompts}x{r.n} {_tokens(r.max_tokens)}")
    return "; ".join(f"{name} {', '.join(runs)} on {card}" for (name, card), runs in setups.items())
