"""colo.plan.auto: the `auto` trainer settings resolved per job and hardware. The L12 slice on one H200 gets the
hand-tuned fast path of docs/benchmarks.md, a Qwen3-30B-A3B job on 8 H100s what fits there, a CPU job what CPU runs
have always run; a value the user sets is kept; the resolved config holds concrete values; the cost model meets the
measured figures it was built from, with the device's own speeds; a refusal ranks its ways to fit as auto ranks its
choices. Pure: no GPU, no Ray."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from colo import config as C
from colo.models.tiny import PRESETS
from colo.plan.auto import Tuned, resolve_auto
from colo.plan.cost import SPEEDS, speeds_for, step_seconds
from colo.plan.job import device_of, memory_plan, refusal
from colo.plan.job import tune as tune_for
from colo.plan.memory import GiB, MemoryPlan, model_shape, plan_memory
from colo.plan.search import trial, ways_to_fit
from colo.plan.settings import PLAIN, Settings, auto_keys, get

ROOT = Path(__file__).resolve().parents[2]
# the L12 bench of docs/benchmarks.md (colo.bench.step --preset qwen3-30b-a3b-L12 --device cuda --max-tokens 4096
# --prompt-len 256 --prompts 16 --n 8 trainer.optimizer_dtype=bfloat16) as colo.launch overrides
L12_H200 = ["model.path=auto:qwen3-30b-a3b-L12", "model.dummy_weights=true", "model.dtype=bfloat16",
            "placement.device=cuda", "placement.num_gpus=1", "placement.gpu_memory=H200", "rollout.max_tokens=4096",
            "rollout.max_model_len=4352", "rollout.n=8", "data.prompts_per_step=16", "trainer.optimizer_dtype=bfloat16"]
FAST_PATH = {"trainer.offload": False, "trainer.optimizer_offload": True, "trainer.compile": True,
             "trainer.gradient_checkpointing": True, "trainer.gather_once": True,
             "trainer.max_tokens_per_micro_batch": 32768}
"""The six overrides of the README's train-MFU figure (docs/benchmarks.md, 13th and 14th sessions)."""


def _cfg(overrides: list[str], path: str | None = None) -> C.ColoConfig:
    return C.load_config(path, overrides, {})


def tune(cfg: C.ColoConfig) -> Tuned:
    """The `auto` trainer settings of cfg on the device it names (colo.plan.resolve's part of resolving)."""
    return tune_for(cfg, C.model_config_json(cfg), device_of(cfg))


def check_fits(cfg: C.ColoConfig) -> MemoryPlan:
    """The plan of a tuned cfg; ConfigError (the refusal) when it does not fit."""
    model, device = C.model_config_json(cfg), device_of(cfg)
    plan = memory_plan(cfg, model, device)
    if plan is not None and not plan.fits:
        raise C.ConfigError(refusal(cfg, plan, model, device))
    return plan


def test_l12_on_one_h200_resolves_to_the_measured_fast_path() -> None:
    tuned = tune(_cfg(L12_H200))
    assert tuned.resolved == FAST_PATH
    assert not auto_keys(tuned.cfg) and check_fits(tuned.cfg).fits
    lines = tuned.table().splitlines()
    assert len(lines) == 1 + len(PLAIN)  # a summary, then one line per key with its value and why
    for line, (key, value) in zip(lines[1:], FAST_PATH.items()):
        assert line.split()[0] == f"{key}={str(value).lower()}"
    why = dict(line.split(None, 1) for line in lines[1:])
    assert why["trainer.offload=false"].startswith("true: +")  # resident is faster, and fits
    assert "does not fit" in why["trainer.optimizer_offload=true"]  # the state on the GPU does not


def test_8xh100_job_resolves_to_what_fits_there() -> None:
    """configs/qwen3-30b-a3b-8xh100.yaml leaves the six keys at auto: AdamW's state on the host, activations
    recomputed, compiled; the trainer resident through the rollout would leave under 10% of the H100 free, and the
    whole model gathered does not fit at all."""
    tuned = tune(_cfg([], str(ROOT / "configs/qwen3-30b-a3b-8xh100.yaml")))
    assert tuned.resolved == {"trainer.offload": True, "trainer.optimizer_offload": True, "trainer.compile": True,
                              "trainer.gradient_checkpointing": True, "trainer.gather_once": False,
                              "trainer.max_tokens_per_micro_batch": 16384}
    why = {c.key: c.why for c in tuned.choices}
    assert why["trainer.offload"].startswith("false does not fit (its rollout phase")
    assert why["trainer.gather_once"].startswith("true does not fit")
    plan = check_fits(tuned.cfg)
    assert plan.fits and plan.total("train") <= 0.9 * plan.gpu_bytes


@pytest.mark.parametrize("path", [None, "configs/tiny-cpu.yaml", "configs/tiny-cpu-tools.yaml"])
def test_cpu_resolves_to_what_cpu_runs_have_run(path: str | None) -> None:
    cfg = _cfg(["placement.device=cpu"], str(ROOT / path) if path else None)
    assert auto_keys(cfg) == list(PLAIN)  # the CPU configs leave all six to auto
    tuned = tune(cfg)
    assert tuned.resolved == PLAIN and all(get(tuned.cfg, k) == v for k, v in PLAIN.items())
    assert all(c.why.startswith("CPU: ") for c in tuned.choices)


def test_explicit_values_are_kept() -> None:
    tuned = tune(_cfg(L12_H200 + ["trainer.offload=true", "trainer.compile=false",
                                  "trainer.max_tokens_per_micro_batch=8192"]))
    cfg = tuned.cfg
    assert (cfg.trainer.offload, cfg.trainer.compile, cfg.trainer.max_tokens_per_micro_batch) == (True, False, 8192)
    assert set(tuned.resolved) == set(PLAIN) - {"trainer.offload", "trainer.compile",
                                               "trainer.max_tokens_per_micro_batch"}
    assert sum(line.endswith("as set") for line in tuned.table().splitlines()) == 3
    # the CPU keeps them too
    cpu = tune(_cfg(["placement.device=cpu", "trainer.gradient_checkpointing=true", "trainer.gather_once=true"]))
    assert (cpu.cfg.trainer.gradient_checkpointing, cpu.cfg.trainer.gather_once) == (True, True)


def test_resolved_config_holds_concrete_values(tmp_path: Path) -> None:
    """The run dir's config.yaml (colo.materialize saves the resolved config) has no auto left among the six,
    so --resume, which starts from it, runs the same settings; tuning it again changes nothing."""
    tuned = tune(_cfg(L12_H200))
    path = C.save_resolved(tuned.cfg, tmp_path)
    text = path.read_text()
    for key, value in FAST_PATH.items():
        assert f"  {key.split('.')[1]}: {str(value).lower()}\n" in text
    again = C.load_config(str(path), [], {})
    assert not auto_keys(again) and again == tuned.cfg
    assert tune(again).cfg == again and tune(again).resolved == {}


def test_gpu_of_unknown_size_and_jobs_that_cannot_fit() -> None:
    unknown = tune(_cfg([o for o in L12_H200 if not o.startswith("placement.gpu_memory")]))
    assert unknown.resolved == PLAIN and "GPU size unknown" in unknown.summary
    # the whole slice on a 40 GiB card: nothing among the six fits; auto takes the least memory and the plan refuses
    small = tune(_cfg(L12_H200 + ["placement.gpu_memory=40GiB"]))
    assert small.resolved["trainer.offload"] and small.resolved["trainer.optimizer_offload"]
    assert small.resolved["trainer.gradient_checkpointing"] and "nothing fits" in small.summary
    with pytest.raises(C.ConfigError, match="the memory plan does not fit"):
        check_fits(small.cfg)


def test_disaggregated_and_padded_jobs_on_gpu() -> None:
    dis = tune(_cfg(L12_H200 + ["placement.mode=disaggregated", "placement.num_gpus=2", "placement.trainer_gpus=1"]))
    assert dis.resolved["trainer.offload"] is False and "nothing to offload" in dis.choices[0].why
    padded = tune(_cfg(L12_H200 + ["trainer.packing=false", "trainer.micro_batch_size=1"]))
    assert padded.resolved["trainer.compile"] is False  # the padded path has not run compiled on a GPU
    assert padded.resolved["trainer.max_tokens_per_micro_batch"] == PLAIN["trainer.max_tokens_per_micro_batch"]


def test_compile_is_repaid_by_the_run_only() -> None:
    """trainer.compile's minute is spread over loop.steps: a few-step job on a small slice runs eager."""
    short = _cfg(["model.path=auto:qwen3-30b-a3b-L2", "model.dummy_weights=true", "placement.device=cuda",
                  "placement.num_gpus=1", "placement.gpu_memory=H200", "rollout.max_tokens=32",
                  "rollout.max_model_len=256", "loop.steps=8"])
    assert tune(short).resolved["trainer.compile"] is False
    assert tune(_cfg(L12_H200 + ["loop.steps=8"])).resolved["trainer.compile"] is False
    assert tune(_cfg(L12_H200 + ["loop.steps=100"])).resolved["trainer.compile"] is True


def test_settings_are_the_config_tree() -> None:
    """Settings reads the config's own fields (no defaults of its own) and refuses a config with auto left."""
    with pytest.raises(ValueError, match="resolve them first"):
        Settings.from_config(_cfg(L12_H200))
    s = Settings.of({"placement.num_gpus": 1})
    assert s.trainer.packing is C.TrainerConfig().packing  # the config's default: packed
    assert all(get(s.cfg, k) == v for k, v in PLAIN.items())
    t = s.with_({"trainer.offload": False})
    assert (t.trainer.offload, s.trainer.offload) == (False, True) and t.cfg.model is not s.cfg.model


# measured train work per step on one H200 (docs/benchmarks.md): (what, preset, trainer settings, log-prob pass +
# update seconds, optimizer seconds); the bench's 188,741 trained tokens, bf16 AdamW state, state resident
MEASURED = [
    ("call A, compiled", "qwen3-30b-a3b-L4", dict(compile=True, gather_once=True, max_tokens_per_micro_batch=32768,
                                                  old_logprobs="pass"), 2.30, 0.15),
    ("call A, eager", "qwen3-30b-a3b-L4", dict(compile=False, gather_once=True, max_tokens_per_micro_batch=32768,
                                               old_logprobs="pass"), 4.18, 0.15),
    ("N1", "qwen3-30b-a3b-L12", dict(compile=True, optimizer_offload=True, gradient_checkpointing=True,
                                     max_tokens_per_micro_batch=32768, old_logprobs="pass"), 5.76, 0.74),
    ("N2", "qwen3-30b-a3b-L12", dict(compile=True, optimizer_offload=True, gradient_checkpointing=True,
                                     gather_once=True, max_tokens_per_micro_batch=32768, old_logprobs="pass"),
     5.40, 0.98),
    ("N3", "qwen3-30b-a3b-L12", dict(compile=True, optimizer_offload=True, max_tokens_per_micro_batch=12288,
                                     old_logprobs="pass"), 6.95, 0.78),
    ("M3", "qwen3-30b-a3b-L12", dict(compile=True, optimizer_offload=True, max_tokens_per_micro_batch=8192,
                                     old_logprobs="pass", offload=True), 8.36, 0.71),
    ("PD", "qwen3-30b-a3b-L12", dict(compile=True, optimizer_offload=True, gradient_checkpointing=True,
                                     gather_once=True, max_tokens_per_micro_batch=32768), 4.03, 0.69),
]


@pytest.mark.parametrize("what, preset, trainer, passes, optim", MEASURED, ids=[m[0] for m in MEASURED])
def test_cost_model_meets_the_measured_figures(what: str, preset: str, trainer: dict, passes: float,
                                               optim: float) -> None:
    """colo.plan.cost within 15% of each measured passes figure (most of them fitted its constants: this holds them
    together) and 30% of each optimizer step (N2's 0.98 s was before the step went by pieces)."""
    s = Settings.of({"placement.num_gpus": 1, "placement.device": "cuda", "rollout.max_model_len": 4352,
                     "rollout.max_tokens": 4096, "rollout.n": 8, "data.prompts_per_step": 16,
                     "trainer.optimizer_dtype": "bfloat16", "trainer.offload": False,
                     **{f"trainer.{k}": v for k, v in trainer.items()}})
    cost = step_seconds(model_shape(dict(PRESETS[preset])), s, SPEEDS["H200"])
    assert abs(cost["passes"] / passes - 1) < 0.15, (what, cost)
    assert abs(cost["optimizer"] / optim - 1) < 0.30, (what, cost)


def test_every_auto_choice_fits_with_headroom_and_is_the_fastest_planned() -> None:
    """resolve_auto against a brute force over the same candidates: nothing that fits is faster."""
    cfg = _cfg(L12_H200)
    model = C.model_config_json(cfg)
    tuned = resolve_auto(cfg, "cuda", model, 139.8 * GiB, "test", SPEEDS["H200"])
    best = sum(step_seconds(model_shape(model), Settings.from_config(tuned.cfg), SPEEDS["H200"]).values())
    plan = plan_memory(model, Settings.from_config(tuned.cfg), 139.8 * GiB)
    assert plan.fits and plan.total("train") <= 0.9 * 139.8 * GiB
    import itertools

    for offload, opt, gc, once, mb in itertools.product((False, True), (False, True), (False, True), (False, True),
                                                        (4352, 8192, 16384, 32768)):
        s = Settings.from_config(tuned.cfg).with_({"trainer.offload": offload, "trainer.optimizer_offload": opt,
                                                   "trainer.gradient_checkpointing": gc, "trainer.gather_once": once,
                                                   "trainer.max_tokens_per_micro_batch": mb})
        p = plan_memory(model, s, 139.8 * GiB)
        if p.kv_ok and all(p.total(ph) <= 0.9 * 139.8 * GiB or ph == "start" for ph in p.phases):
            assert sum(step_seconds(model_shape(model), s, SPEEDS["H200"]).values()) >= best - 1e-9


def test_the_cost_model_takes_the_devices_measured_speeds() -> None:
    """The speeds are the device's row (colo.plan.cost.SPEEDS): an H100 gets the H100's, CPU its own, a GPU given by
    its size the H200's figures, which the summary says; and they are an input of the choice: a device that compiles
    a hundred times slower than the H200 runs the same L12 job eager."""
    assert speeds_for("NVIDIA H100 80GB HBM3") is SPEEDS["H100"] and speeds_for("H200-141GB") is SPEEDS["H200"]
    assert speeds_for("cpu") is SPEEDS["cpu"] and SPEEDS["cpu"].peak_flops < SPEEDS["H200"].peak_flops / 1000
    assert device_of(_cfg(L12_H200[:-6] + ["placement.gpu_memory=H100"])).speeds is SPEEDS["H100"]
    other = device_of(_cfg(L12_H200 + ["placement.gpu_memory=200GiB"])).speeds
    assert "no row" in other.measured and other.peak_flops == SPEEDS["H200"].peak_flops and not other.measured_here
    big = tune(_cfg(L12_H200 + ["placement.gpu_memory=200GiB"]))
    assert "no row for a 200GiB GPU: the H200's figures" in big.summary
    cfg = _cfg(L12_H200)
    model = C.model_config_json(cfg)
    fast = resolve_auto(cfg, "cuda", model, 139.8 * GiB, "test", SPEEDS["H200"])
    assert fast.resolved["trainer.compile"] is True and "no row" not in fast.summary
    slow_compile = dataclasses.replace(SPEEDS["H200"], compile_s=100 * SPEEDS["H200"].compile_s)
    slow = resolve_auto(cfg, "cuda", model, 139.8 * GiB, "test", slow_compile)
    assert slow.resolved["trainer.compile"] is False and "+" in dict((c.key, c.why) for c in slow.choices)[
        "trainer.compile"]


def test_a_refusal_ranks_its_ways_to_fit_as_auto_ranks_its_choices() -> None:
    """One search, one cost model (colo.plan.search): the L12 slice on one H200 with the whole model gathered and no
    recompute does not fit; the refusal's first way is gradient checkpointing, which the cost model puts 0.8 s/step
    ahead of halving the micro-batch (the hand-weighted order before it put the micro-batch first), as auto, given
    those two keys, chooses recompute with a larger micro-batch. Every way is in the one order: fewer GPUs first, then
    the estimated seconds."""
    set_ = ["placement.gpu_memory=H200", "trainer.offload=true", "trainer.optimizer_offload=true",
            "trainer.gather_once=true", "trainer.compile=true"]
    cfg = _cfg(L12_H200 + set_ + ["trainer.gradient_checkpointing=false", "trainer.max_tokens_per_micro_batch=16384"])
    model, device = C.model_config_json(cfg), device_of(cfg)
    plan = memory_plan(tune_for(cfg, model, device).cfg, model, device)
    assert not plan.fits
    ways = ways_to_fit(model, plan.settings, plan.gpu_bytes, device.speeds)
    assert [c for c, _ in ways][:2] == [{"trainer.gradient_checkpointing": True},
                                        {"trainer.max_tokens_per_micro_batch": 8192}]
    trials = [trial(model, plan.settings, c, plan.gpu_bytes, device.speeds) for c, _ in ways]
    assert [t.rank for t in trials] == sorted(t.rank for t in trials) and all(t.plan.fits for t in trials)
    assert trials[0].seconds < trials[1].seconds
    assert refusal(plan.settings.cfg, plan, model, device).split("fix: ")[1].startswith(
        "trainer.gradient_checkpointing=true (")
    chosen = tune_for(_cfg(L12_H200 + set_), model, device).resolved
    assert chosen["trainer.gradient_checkpointing"] is True and chosen["trainer.max_tokens_per_micro_batch"] > 16384
