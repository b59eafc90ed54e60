"""Run files edited or damaged between a run and its --resume (issue 56): the resume state, origin.json, metrics.jsonl,
and what a LoRA checkpoint holds against the config and the base weights on disk. Each is refused with one line that
names the file and the fix, before anything is written or started; an untouched run resumes.

The run dir is a real one: colo.launch.prepare_run makes it (auto:tiny, config.yaml, origin.json), its checkpoints
are real DCP checkpoints with the resume state colo.runlife.save writes. No Ray: a refusal comes before it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from colo.config import ConfigError
from colo.run.rundir import unlock

JOB = ["loop.steps=6", "loop.sft_warmup_steps=0", "placement.num_gpus=1", "placement.device=cpu"]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def make_run(run_dir: Path, *overrides: str, steps: tuple[int, ...] = (1, 2)) -> Path:
    """A run dir as a run that trained steps 0..max(steps) leaves it: config.yaml, origin.json, model, data,
    metrics.jsonl and a checkpoint of each of `steps`."""
    import torch.distributed.checkpoint as dcp

    from colo.config.runfiles import holds
    from colo.materialize import make_run_dir
    from colo.prepare import prepare

    cfg = make_run_dir(prepare(None, [*JOB, f"run.dir={run_dir}", *overrides], {}))
    unlock(run_dir)
    rows = len((run_dir / "data").glob("*_train.jsonl").__next__().read_text().splitlines())
    records = [{"step": -1, "eval/reward": 0.1}] + [{"step": s, "reward/mean": 0.2} for s in range(max(steps) + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for s in steps:
        path = run_dir / "checkpoints" / f"step_{s:06d}"
        dcp.save({"model": {"w": torch.arange(64.0) + s}}, checkpoint_id=str(path))
        extra = {"step": s, "data": {"epoch": 0, "pos": 4 * (s + 1), "seed": 0, "num_rows": rows}, "holds": holds(cfg)}
        (path / "extra.json").write_text(json.dumps(extra, indent=1, sort_keys=True))
    return run_dir


def resume(run_dir: Path, *overrides: str) -> None:
    """--resume as colo.launch runs it, up to where Ray would start: prepare (the saved config), then the run dir."""
    from colo.materialize import make_run_dir
    from colo.prepare import prepare

    try:
        make_run_dir(prepare(None, [f"run.dir={run_dir}", "run.resume=true", *overrides], {}))
    finally:
        unlock(run_dir)


def refused(run_dir: Path, *overrides: str) -> str:
    before = snapshot(run_dir)
    with pytest.raises(ConfigError) as e:
        resume(run_dir, *overrides)
    assert snapshot(run_dir) == before, "a refused resume wrote to the run dir"
    assert "\n" not in str(e.value) and "fix:" in str(e.value), e.value
    return str(e.value)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("base") / "run")


@pytest.fixture
def run(base_run: Path, tmp_path: Path) -> Path:
    """A copy of the base run, moved: its saved paths are rebased onto the copy on resume."""
    copy = tmp_path / "run"
    shutil.copytree(base_run, copy)
    return copy


def test_the_resume_state_edited_to_a_later_step_is_refused_through_the_cli(run: Path) -> None:
    """Edited to step 30 of a 6-step run: colo said "at step 31 of 6", skipped everything, exported and exited 0."""
    extra = run / "checkpoints" / "step_000002" / "extra.json"
    extra.write_text(extra.read_text().replace('"step": 2', '"step": 30'))
    before = snapshot(run)
    r = run_cli("--resume", f"run.dir={run}", timeout=300, imports=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0] == (f"colo: error: --resume: {extra} says step 30, but it is the checkpoint of step 2 (its folder "
                        "step_000002): resuming would skip or repeat steps; fix: restore extra.json from a copy of the "
                        "run, or move step_000002 out of checkpoints/ to resume from the checkpoint before"), lines[0]
    assert snapshot(run) == before and "ray" not in r.imported and "vllm" not in r.imported


def test_a_resume_state_missing_a_key_or_past_the_end_is_refused(run: Path) -> None:
    extra = run / "checkpoints" / "step_000002" / "extra.json"
    state = json.loads(extra.read_text())
    del state["data"]["pos"]
    extra.write_text(json.dumps(state))
    assert f"{extra} has no whole data position (it needs 'data' with whole numbers epoch, pos, seed, num_rows" in \
        refused(run)
    shutil.rmtree(run / "checkpoints" / "step_000002")  # step 1 is the newest now
    assert "is step 1, past the run's end (loop.steps=1: steps 0-0); fix: loop.steps=3 or more" in \
        refused(run, "loop.steps=1")
    (run / "checkpoints" / "step_000001").rename(run / "checkpoints" / "step_000005")  # renamed with its state
    assert "says step 1, but it is the checkpoint of step 5" in refused(run)


def test_a_checkpoint_ahead_of_the_metrics_would_skip_steps(run: Path) -> None:
    """The folder and its state moved together to step 5, while the run logged up to step 2."""
    ckpt = run / "checkpoints" / "step_000002"
    state = json.loads((ckpt / "extra.json").read_text())
    (ckpt / "extra.json").write_text(json.dumps({**state, "step": 5}))
    ckpt.rename(ckpt.with_name("step_000005"))
    assert "is step 5 but " in (msg := refused(run)) and "ends at step 2: resuming would skip steps 3-4" in msg, msg


def test_damaged_metrics_lines_are_named(run: Path) -> None:
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], lines[1].replace('"step": 0', '"step": "0"'), *lines[2:]]) + "\n")
    assert f"{metrics} line 2 has no whole-number step (found '0'); fix:" in refused(run)
    metrics.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    assert f"{metrics} line 2 is not JSON" in refused(run)
    metrics.write_text("\n".join(lines) + '\n{"step": 3, "rew')  # torn by a crash: the resume goes on
    resume(run)


@pytest.mark.parametrize("damage", ["empty", "braces", "gone"])
def test_an_emptied_or_missing_origin_is_refused_not_skipped(run: Path, damage: str) -> None:
    """An emptied origin.json and changed data: the resume used to go on, on the changed data, without a word."""
    origin = run / "origin.json"
    if damage == "gone":
        origin.unlink()
    else:
        origin.write_text("" if damage == "empty" else "{}")
    data = next((run / "data").glob("*_train.jsonl"))
    data.write_text(data.read_text().replace("1", "7"))
    msg = refused(run)
    assert msg.startswith(f"--resume: {origin} ") and "fix: restore it from a copy of the run dir" in msg, msg


def test_lora_on_off_and_rank_are_refused_before_ray(tmp_path: Path) -> None:
    """Resuming with LoRA turned on or off, or another rank: Ray started, then an opaque `CheckpointException
    ranks:[0, 1]`, and the failed attempt's config became the run's newest. Refused by the config (what the
    checkpoints mean) and, where the config was edited by hand, by what the checkpoint records."""
    full = make_run(tmp_path / "full", steps=(0,))
    assert "trainer.lora_rank 0 -> 8 (command line)" in refused(full, "trainer.lora_rank=8")
    lora = make_run(tmp_path / "lora", "trainer.lora_rank=4", steps=(0,))
    assert "trainer.lora_rank 4 -> 0 (command line)" in refused(lora, "trainer.lora_rank=0")
    assert "trainer.lora_rank 4 -> 8 (command line)" in refused(lora, "trainer.lora_rank=8")
    saved = lora / "config.yaml"
    saved.write_text(saved.read_text().replace("lora_rank: 4", "lora_rank: 8"))  # the config itself edited
    msg = refused(lora)
    assert msg.startswith(f"--resume: {lora / 'checkpoints' / 'step_000000'} holds LoRA adapters with "
                          "trainer.lora_rank=4, this resume asks trainer.lora_rank=8; fix: resume with "
                          "trainer.lora_rank=4"), msg


def test_a_lora_runs_base_weights_swapped_on_disk_are_refused(tmp_path: Path) -> None:
    """Same shapes, other values (another fine-tune of the same model): the adapters would apply to weights they
    were not trained on (the eval fell from 0.422 to 0.000). Put back, the run resumes."""
    from safetensors.torch import load_file, save_file

    run = make_run(tmp_path / "run", "trainer.lora_rank=4", steps=(0,))
    (weights,) = (run / "model").glob("*.safetensors")
    original = weights.read_bytes()
    tensors = load_file(weights)
    save_file({k: (v + 0.01 if v.is_floating_point() else v) for k, v in tensors.items()}, weights,
              metadata={"format": "pt"})
    msg = refused(run)
    assert msg.startswith(f"--resume: {run / 'checkpoints' / 'step_000000'} holds LoRA adapters trained over other "
                          f"base weights than {run / 'model'} holds now (digest "), msg
    assert msg.endswith(f"fix: put the run's base weights back at {run / 'model'}, or start a new run (another "
                        "run.dir)"), msg
    weights.write_bytes(original)
    resume(run)
    assert (run / "config.resume-1.yaml").is_file()  # this one went on


def test_weights_digest_sees_a_large_file_swapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files larger than SAMPLED are hashed by their header and pieces spread over them: another checkpoint of the
    same shapes differs in every piece."""
    from safetensors.torch import save_file

    from colo.run import origin

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    g = torch.Generator().manual_seed(0)
    w = {"x": torch.randn(1 << 20, generator=g), "y": torch.randn(1 << 19, generator=g)}
    save_file(w, a / "model.safetensors")
    save_file({k: v + 1e-3 for k, v in w.items()}, b / "model.safetensors")
    monkeypatch.setattr(origin, "SAMPLED", 1 << 20)  # the 6 MiB file counts as large
    assert origin.weights_digest(a) != origin.weights_digest(b)
    assert origin.weights_digest(a) == origin.weights_digest(a)


def test_a_run_whose_every_checkpoint_is_damaged_is_refused_before_it_is_locked(run: Path) -> None:
    """The refusal came after the run dir was locked, and left a .lock file behind."""
    for ckpt in (run / "checkpoints").iterdir():
        next(ckpt.glob("*.distcp")).unlink()
    assert "every checkpoint in " in (msg := refused(run)) and "the newest, step_000002: " in msg, msg
    assert not (run / ".lock").exists()
