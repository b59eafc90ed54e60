"""One resolve (colo.plan.resolve): every `auto` of a config decided once per process, on the driver, into a frozen
config that no part of the run changes and that every actor checks; what the config alone decides (rollout.sleep_level,
trainer.old_logprobs) resolved with the rest. A real job's count: tests/e2e/test_warm_jobs.py.

    .venv/bin/python -m pytest -q tests/unit/test_resolve.py
"""
from __future__ import annotations

import dataclasses
import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from conftest import count_resolves

from colo import config as C
from colo.plan import resolve as resolving

ROOT = Path(__file__).resolve().parents[2]


def launch(*argv: str) -> tuple[int, str, str]:
    from colo.launch import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_a_launch_resolves_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A --dry-run resolves once (it used to resolve the trainer keys three times and the rest twice), a refused one
    too; the report shows the config it resolved, with no `auto` of colo's left."""
    calls = count_resolves(monkeypatch)
    rc, out, err = launch("--dry-run", f"run.dir={tmp_path}/r/{{time}}")
    assert rc == 0 and calls == [1], (calls, err)
    assert "\n  sleep_level: 2\n" in out and "\n  old_logprobs: update\n" in out and ": auto\n" not in out.split(
        "placement plan:")[0].replace("kv_cache_dtype: auto", "").replace("fp8_kernels: auto", "").replace(
        "experts_implementation: auto", "").replace("gpu_memory: auto", "")
    calls.clear()
    too_big = ["--config", str(ROOT / "configs/qwen3-30b-a3b-8xh100.yaml"), "trainer.optimizer_offload=false",
               "trainer.gradient_checkpointing=false", "trainer.micro_batch_size=2"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, out, err = launch("--dry-run", *too_big, f"run.dir={tmp_path}/g/{{time}}")
    assert rc == 2 and "the memory plan does not fit" in err and calls == [1], (calls, err)


def test_the_resolved_config_is_frozen_and_concrete(tmp_path: Path) -> None:
    """(That config.yaml resolves to itself on --resume: tests/e2e/test_launch_cli.py, once its model exists.)"""
    cfg = C.load_config(str(ROOT / "configs/tiny-cpu.yaml"), [f"run.dir={tmp_path}/r/{{time}}"], {})
    assert "trainer.offload=auto" in C.unresolved(cfg) and "run.dir=" in " ".join(C.unresolved(cfg))
    r = resolving.resolve(cfg)
    assert C.unresolved(r.cfg) == [] and cfg.trainer.offload == "auto"  # cfg itself is left as it was
    with pytest.raises(dataclasses.FrozenInstanceError, match="resolved and frozen"):
        r.cfg.trainer.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.cfg.placement.device = "cuda"
    copy = C.from_dict(C.to_dict(r.cfg))  # what an actor rebuilds from the dict it gets: concrete, its own
    copy.trainer.lr = 1.0


def test_what_the_config_alone_decides() -> None:
    one = resolving.resolve(C.load_config(None, ["placement.device=cpu"], {})).cfg
    assert (one.rollout.sleep_level, one.trainer.old_logprobs) == (2, "update")
    two = resolving.resolve(C.load_config(None, ["placement.device=cpu", "trainer.epochs=2",
                                                "rollout.sleep_level=1"], {})).cfg
    assert (two.rollout.sleep_level, two.trainer.old_logprobs) == (1, "pass")
    with pytest.raises(C.ConfigError, match="trainer.old_logprobs=update .* 4 updates; fix: trainer.old_logprobs=auto"):
        C.validate(C.load_config(None, ["trainer.old_logprobs=update", "trainer.epochs=2", "trainer.mini_batches=2"],
                                 {}), check_resources=False)


def test_actors_refuse_a_config_nobody_resolved(tmp_path: Path) -> None:
    """The trainer used to run an unresolved `auto` as its CPU value (fill_plain), whatever the GPU: now it, and the
    engine, refuse before anything starts, naming what is left and the fix."""
    from colo.rollout.engine import Engine
    from colo.trainer.worker import Trainer

    raw = C.to_dict(C.load_config(None, ["placement.device=cpu", f"run.dir={tmp_path}/r"], {}))
    with pytest.raises(ValueError, match=r"TrainWorker got a config that was not resolved \(.*trainer.offload=auto.*"
                                         r"fix: resolve it on the driver"):
        Trainer(raw, 0, 1, "127.0.0.1", 0)
    with pytest.raises(ValueError, match=r"RolloutEngine got a config that was not resolved .*model.path=auto:tiny"):
        Engine(raw, 0, 1, 0)
    C.check_resolved(resolving.resolve(C.from_dict(raw)).cfg, "TrainWorker")  # a resolved one passes
