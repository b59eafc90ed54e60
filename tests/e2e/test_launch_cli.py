"""`python -m colo.launch` as a user runs it: --help and config errors answer before torch, Ray or vLLM is
imported, exit code 2 with one line and no traceback, --dry-run output, and that an error writes nothing."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from conftest import HEAVY, ROOT, clean_env, run_cli


def assert_config_error(r, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colo: error: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_help_imports_nothing_heavy() -> None:
    r = run_cli("--help", imports=True)
    assert r.returncode == 0 and "--dry-run" in r.stdout and "key=value" in r.stdout
    assert "argparse" in r.imported and not r.imported & HEAVY, f"--help imported {sorted(r.imported & HEAVY)}"


def test_invalid_key_is_one_line_exit_2_before_anything_heavy(tmp_path: Path) -> None:
    r = run_cli("trainer.lrr=1e-6", cwd=tmp_path, imports=True)
    assert_config_error(r, "trainer.lrr", "did you mean 'trainer.lr'")
    assert "omegaconf" in r.imported and not r.imported & HEAVY, f"a config error imported {sorted(r.imported & HEAVY)}"
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_debug_shows_traceback() -> None:
    r = run_cli("--debug", "trainer.lrr=1")
    assert r.returncode != 0 and "Traceback" in r.stderr and "ConfigError" in r.stderr


def test_errors_through_cli(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("trainer:\n  lr: 1e-6\n   epochs: 2\n")
    assert_config_error(run_cli("--config", str(bad_yaml), cwd=tmp_path), "malformed YAML", "line 3")
    env = clean_env(COLO_VLLM_GPU_FRACTION="0.7")
    assert_config_error(run_cli("--dry-run", env=env, cwd=tmp_path), "> 1.0")
    assert_config_error(run_cli("placement.train_gpu_fraction=0", cwd=tmp_path), "(0, 1]")
    assert_config_error(run_cli("placement.num_gpus=many", cwd=tmp_path), "whole number")
    assert_config_error(run_cli(f"data.path={tmp_path}/none.jsonl", cwd=tmp_path), "does not exist")
    assert_config_error(run_cli("placement.num_gpus=999", cwd=tmp_path), "Ray logical GPUs")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert_config_error(run_cli(f"model.path={ckpt}", cwd=tmp_path), "no config.json")
    (ckpt / "config.json").write_text(json.dumps({"num_experts": 6}))
    r = run_cli(f"model.path={ckpt}", "placement.device=cuda", "placement.num_gpus=4", cwd=tmp_path)
    assert_config_error(r, "6 experts", "expert-parallel size 4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "ckpt"]  # no run dir


def test_hub_model_offline_names_alternatives(tmp_path: Path) -> None:
    env = clean_env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = run_cli("--config", "configs/qwen3-30b-a3b-4xh200.yaml", "model.path=Qwen/Qwen3-Coder-30B-A3B-Instruct",
                "--dry-run", env=env)
    assert_config_error(r, "Qwen/Qwen3-Coder-30B-A3B-Instruct", "HF_HUB_OFFLINE", "not in the local HF cache",
                        "model.dummy_weights=true")
    # a Hub id whose config.json colo ships is planned offline, and the plan says so in one line
    r = run_cli("--config", "configs/qwen3-30b-a3b-4xh200.yaml", "--dry-run", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("colo's copy of its config.json (preset qwen3-30b-a3b)") == 1


def test_dry_run_prints_resolved_config_and_plan(tmp_path: Path) -> None:
    env = clean_env(COLO_TRAIN_GPU_FRACTION="0.3", COLO_VLLM_GPU_FRACTION="0.5")
    r = run_cli("--dry-run", "trainer.lr=0.01", f"run.dir={tmp_path}/runs/{{time}}",
                "data.system_prompt=Reply with the number.", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text, _, plan = r.stdout.partition("\nplacement plan:")
    cfg = yaml.safe_load(text)
    assert cfg["trainer"]["lr"] == 0.01 and cfg["placement"]["train_gpu_fraction"] == 0.3
    assert cfg["placement"]["device"] == "cpu" and cfg["model"]["path"].endswith("/model")
    assert str(tmp_path / "runs") in cfg["run"]["dir"] and "{time}" not in cfg["run"]["dir"]
    assert plan.startswith(" colocated, 2 Ray logical GPUs on CPU")
    rows = [line.split() for line in plan.splitlines() if line[:1].isdigit()]
    assert [r_[:7] for r_ in rows] == [["0", "pg0/0", "trainer+engine", "0", "0", "0", "0"],
                                       ["1", "pg1/0", "trainer+engine", "1", "1", "0", "0"]]
    assert all(r_[7:] == ["0.3", "0.5", "kv_cache=256MiB"] for r_ in rows)
    assert "gpu  bundle  role            trainer_rank  dp_rank  tp_rank  ep_rank" in plan
    # the first prompt as the model will see it: the tiny preset's chat template with the system prompt
    assert ("# first prompt, in the tokenizer's chat template, " in r.stdout and "'<|im_start|>system\\nReply "
            "with the number.<|im_end|>\\n<|im_start|>user\\nQuestion: " in r.stdout)
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_checkpoints_the_disk_cannot_hold_are_refused(tmp_path: Path) -> None:
    """--dry-run says how much disk the run's checkpoints take (run.keep_checkpoints of them, one more while one is
    written) and refuses, as the run does, when run.dir's filesystem cannot hold them: here every one of ten million
    steps' checkpoints kept, 8.3 MiB each (the default job keeps 3: tests/unit/test_disk_plan.py)."""
    big = ["run.keep_checkpoints=0", "loop.checkpoint_every=1", "loop.steps=10000000",
           f"run.dir={tmp_path}/runs/{{time}}"]
    r = run_cli("--dry-run", *big, cwd=tmp_path)
    assert "\ndisk: 10000000 of 10000000 checkpoints kept (run.keep_checkpoints), each 8.3 MiB" in r.stdout, r.stdout
    assert_config_error(r, "colo: error: run.dir: its filesystem cannot hold the run's checkpoints: ",
                        f"free in {tmp_path}; fix: run.keep_checkpoints=")
    r = run_cli(*big, cwd=tmp_path, imports=True)
    assert_config_error(r, "its filesystem cannot hold the run's checkpoints")
    assert not r.imported & {"ray", "vllm"} and list(tmp_path.iterdir()) == []  # refused before anything starts
    r = run_cli("--dry-run", f"run.dir={tmp_path}/runs/{{time}}", cwd=tmp_path)  # the default job: 3 kept
    assert r.returncode == 0 and "\ndisk: 3 of 14 checkpoints kept (run.keep_checkpoints), 4 while one is written" \
        in r.stdout, r.stdout[-2000:]


def test_dry_run_disaggregated(tmp_path: Path) -> None:
    r = run_cli("--dry-run", "placement.mode=disaggregated", "placement.num_gpus=2",
                "placement.trainer_gpus=1", "placement.device=cpu", f"run.dir={tmp_path}/runs/{{time}}",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text, _, plan = r.stdout.partition("\nplacement plan:")
    cfg = yaml.safe_load(text)
    assert cfg["placement"]["mode"] == "disaggregated" and cfg["placement"]["trainer_gpus"] == 1
    assert plan.splitlines()[0] == (" disaggregated, 2 Ray logical GPUs on CPU, bundle {'GPU': 1, 'CPU': 2} "
                                    "each, 1 trainer GPU (FSDP), 1 engine x TP 1, weights broadcast from "
                                    "trainer rank 0")
    rows = [line.split() for line in plan.splitlines() if line[:1].isdigit()]
    assert rows == [["0", "trainer-pg0/0", "trainer", "0", "-", "-", "-", "1", "0", "-"],
                    ["1", "engine-pg0/0", "engine", "-", "0", "0", "0", "0", "1", "kv_cache=256MiB"]]
    assert list(tmp_path.iterdir()) == []


def test_placement_errors_through_cli(tmp_path: Path) -> None:
    r = run_cli("--dry-run", "placement.mode=disaggregated", "placement.num_gpus=2", cwd=tmp_path)
    assert_config_error(r, "placement.trainer_gpus=0 must be in [1, 1]", "fix: placement.trainer_gpus=1")
    r = run_cli("rollout.tp_size=2", cwd=tmp_path, env=clean_env(COLO_PLACEMENT_MODE="disaggregated"))
    assert_config_error(r, "fix: placement.trainer_gpus=")  # the env shortcut selected the mode
    tp = len(os.sched_getaffinity(0)) + 1  # more TP workers than cores to bind them to
    r = run_cli("placement.mode=disaggregated", f"placement.num_gpus={tp + 1}", "placement.trainer_gpus=1",
                f"rollout.tp_size={tp}", cwd=tmp_path)  # tiny-cpu.yaml: device cpu
    assert_config_error(r, f"rollout.tp_size={tp} on CPU", f"fix: rollout.tp_size={tp - 1} or less on CPU")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("n, name", [(4, "qwen3-30b-a3b-4xh200"), (8, "qwen3-30b-a3b-8xh200"),
                                     (8, "qwen3-30b-a3b-8xh100"), (32, "qwen3-235b-a22b-32xh200")])
def test_dry_run_shape_of_gpu_configs(n: int, name: str, tmp_path: Path) -> None:
    """The 30B configs on a GPU host, rehearsed here through validate(check_resources=False) and the
    plan (tests/e2e/test_readme.py dry-runs the README's GPU commands, which notes the missing GPUs)."""
    from colo.config import load_config, validate
    from colo.cluster.placement import plan_placement

    cfg = load_config(str(ROOT / "configs" / f"{name}.yaml"), [], {})
    validate(cfg, check_resources=False)
    plan = plan_placement(cfg)
    assert (plan.ep_size, plan.dp_size) == (n, n)
    assert [row.ep_rank for row in plan.rows] == list(range(n))
    assert plan.rows[0].vllm_memory == f"gpu_memory_utilization={cfg.placement.vllm_gpu_fraction:g}"


def test_make_run_dir_generates_model_data_and_config(tmp_path: Path) -> None:
    """What the real job does before colo.loop.run: prepare (one resolve), generate auto: model and data into the
    run dir, save config.yaml; the saved config validates and resumes, and resolves to itself."""
    from colo.config import load_config, validate
    from colo.materialize import make_run_dir
    from colo.prepare import prepare

    r = make_run_dir(prepare(str(ROOT / "configs" / "tiny-cpu.yaml"), [f"run.dir={tmp_path}/r/{{time}}"], {}))
    run = Path(r.run.dir)
    assert (Path(r.model.path) / "config.json").is_file() and Path(r.model.path).parent == run
    assert Path(r.data.path).is_file() and Path(r.data.eval_path).is_file()
    saved = load_config(str(run / "config.yaml"), ["run.resume=true"], {})
    validate(saved)
    assert saved.model.path == r.model.path and saved.placement.device == "cpu"
    # the `auto` trainer settings as the run ran them (colo.plan.auto: CPU's), so a resume runs the same
    from colo.config import unresolved
    from colo.plan.settings import PLAIN, get

    assert {k: get(saved, k) for k in PLAIN} == PLAIN  # true, false, 16384 in config.yaml: no `auto` left
    assert unresolved(saved) == [] and (saved.rollout.sleep_level, saved.trainer.old_logprobs) == (2, "update")
    from colo.config import model_config_json, to_dict
    from colo.plan.resolve import resolve

    again = resolve(saved, model_config_json(saved)).cfg  # what a --resume starts from resolves to itself
    assert {**to_dict(again), "run": None} == {**to_dict(r), "run": None} and again.run.dir == r.run.dir
    from colo.run.rundir import unlock

    unlock(run)  # as the launch does when its run ends


def test_resume_starts_from_the_runs_saved_config(tmp_path: Path) -> None:
    """--resume: the run's newest saved config < COLO_* env < key=value; what differs from the saved run
    is named with its source; config.yaml is never rewritten, each resume adds config.resume-<n>.yaml;
    a copied run dir resumes from its own model and data. (tests/e2e/test_readme.py runs it end to end.)"""
    import shutil

    from colo.config import resolve_paths
    from colo.config.resume import load_resumed, saved_configs
    from colo.materialize import make_run_dir
    from colo.prepare import prepare

    pattern = f"{tmp_path}/r/{{time}}"
    run = Path(make_run_dir(prepare(None, [f"run.dir={pattern}", "loop.steps=3"], {"COLO_TRAINER__LR": "1e-3"})).run.dir)
    first = (run / "config.yaml").read_text()
    # no env, no override: the saved run as it was (not tiny-cpu.yaml's lr 4e-4)
    p = prepare(None, [f"run.dir={pattern}", "run.resume=true"], {})
    assert p.cfg.trainer.lr == 1e-3 and p.cfg.loop.steps == 3 and p.cfg.run.resume
    assert p.resumed.describe(p.cfg) == f"colo: resume: {run / 'config.yaml'}, unchanged"
    # env and command line on top, each change named once with where it came from
    p = prepare(None, [f"run.dir={run}", "loop.steps=5", "run.resume=true", "loop.eval_every=10"],
                {"COLO_TRAINER__LR": "4e-4", "COLO_ROLLOUT__N": "8"})
    resumed = make_run_dir(p)
    assert p.resumed.describe(resumed) == (f"colo: resume: {run / 'config.yaml'}; trainer.lr 0.001 -> 0.0004 "
                                           "(environment COLO_TRAINER__LR); loop.steps 3 -> 5 (command line)")
    assert (run / "config.yaml").read_text() == first
    assert saved_configs(run) == [run / "config.yaml", run / "config.resume-1.yaml"]
    # the next resume starts from the newest config
    r = load_resumed(str(run), ["run.resume=true"], {})
    assert r.base == run / "config.resume-1.yaml" and (r.cfg.trainer.lr, r.cfg.loop.steps) == (4e-4, 5)
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    r = load_resumed(str(copy), ["run.resume=true"], {})
    moved = r.changes(resolve_paths(r.cfg))
    assert moved == [f"model.path {run}/model -> {copy}/model (moved with run.dir)",
                     f"data.path {run}/data/arith_train.jsonl -> {copy}/data/arith_train.jsonl (moved with run.dir)",
                     f"data.eval_path {run}/data/arith_eval.jsonl -> {copy}/data/arith_eval.jsonl (moved with run.dir)",
                     f"run.dir {run} -> {copy} (the run's directory now, saved as {run})"], moved


def test_bad_checkpoints_refused_before_ray(tmp_path: Path) -> None:
    """A real launch (not --dry-run) on checkpoints colo cannot run: one line, exit 2, no run dir, no Ray.
    Unknown architecture and missing weights are caught by validate() from config.json alone; a config
    transformers cannot read by the launch itself, once validate() has passed."""
    ckpt, runs = tmp_path / "ckpt", f"run.dir={tmp_path}/runs/{{time}}"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (ckpt / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # no tensors
    r = run_cli(f"model.path={ckpt}", runs, cwd=tmp_path)
    assert_config_error(r, "GPT2LMHeadModel", "supported:", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
    qwen = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}
    (ckpt / "config.json").write_text(json.dumps(qwen))
    (ckpt / "model.safetensors").unlink()
    assert_config_error(run_cli(f"model.path={ckpt}", runs, cwd=tmp_path), "no weight files",
                        "model.dummy_weights=true")
    (ckpt / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # no tensors
    assert_config_error(run_cli(f"model.path={ckpt}", runs, cwd=tmp_path), "has no tokenizer")
    (ckpt / "tokenizer.json").write_text("{}")
    (ckpt / "config.json").write_text(json.dumps({**qwen, "model_type": "qwen3_moe_nonesuch"}))
    assert_config_error(run_cli(f"model.path={ckpt}", runs, cwd=tmp_path), "transformers cannot read")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no run dir, no Ray session dir
    assert "Started a local Ray instance" not in r.stderr + r.stdout


def test_resume_keeps_what_the_checkpoints_mean(tmp_path: Path) -> None:
    """A resume that would change what the run's checkpoints mean is refused, one line naming each key: the model
    (`model.path=auto:tiny-tools` regenerated the run's model/ in place, tokenizer and all, unlisted), another
    --config file (it was ignored silently), a tokenizer or data file changed on disk since the start. The run's own
    --config changes nothing; safe changes (loop.steps, the eval cadence, logging, an edited file's loop.steps) are
    listed and applied; and a resume generates nothing."""
    import shutil

    from colo.config import ConfigError, load_config
    from colo.config.resume import load_resumed
    from colo.materialize import make_run_dir
    from colo.prepare import prepare

    tiny = str(ROOT / "configs" / "tiny-cpu.yaml")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "Question: {i}+1=? Answer:", "answer": "{i + 1}"}}\n' for i in range(9)))
    cfg = load_config(tiny, [f"run.dir={tmp_path}/run", "trainer.lr=1e-3"], {})
    run = Path(make_run_dir(prepare(tiny, [f"run.dir={tmp_path}/run", "trainer.lr=1e-3"], {})).run.dir)
    model = run / "model"
    before = {p.name: p.stat().st_mtime_ns for p in model.iterdir()}

    def refused(overrides: list[str], config_file: str | None = None, env: dict | None = None) -> str:
        with pytest.raises(ConfigError) as e:
            load_resumed(str(run), ["run.resume=true", *overrides], env or {}, config_file=config_file)
        assert "\n" not in str(e.value) and "fix:" in str(e.value)
        return str(e.value)

    msg = refused(["model.path=auto:tiny-tools"])
    assert msg.startswith(f"--resume would change what the run's checkpoints mean: model.path {model} -> "
                          "auto:tiny-tools (command line); fix: "), msg
    msg = refused([], config_file=str(ROOT / "configs" / "tiny-cpu-tools.yaml"))
    for key in ("model.path", "data.path", "algo.environment"):
        assert f"{key} " in msg and "(config file " in msg, msg
    assert "run.seed" not in msg and "loop.steps" not in msg  # the same there, and safe
    assert "data.prompt_key" in refused([], env={"COLO_DATA__PROMPT_KEY": "question"})
    # the run's own file: nothing changes (its lr came from the command line at the start and stays)
    p = prepare(tiny, [f"run.dir={run}", "run.resume=true"], {})
    assert p.cfg.trainer.lr == 1e-3 and p.resumed.describe(p.cfg) == f"colo: resume: {run / 'config.yaml'}, unchanged"
    # safe changes: listed with their source, applied; the run's model named as it was given is the same model
    edited = tmp_path / "edited.yaml"
    edited.write_text(Path(tiny).read_text().replace(f"  steps: {cfg.loop.steps} ", "  steps: 7 ", 1))
    p = prepare(str(edited), [f"run.dir={run}", "run.resume=true", "loop.eval_every=3", "run.loggers=[jsonl]",
                              "model.path=auto:tiny"], {})
    changes = p.resumed.changes(p.cfg)
    assert f"loop.steps {cfg.loop.steps} -> 7 (config file {edited})" in changes, changes
    assert "loop.eval_every 10 -> 3 (command line)" in changes and "run.loggers" in " ".join(changes), changes
    resumed = make_run_dir(p)
    assert resumed.loop.steps == 7 and {p.name: p.stat().st_mtime_ns for p in model.iterdir()} == before
    # what changed on disk since the start: the tokenizer, a data file
    shutil.copy(model / "tokenizer.json", tmp_path / "tokenizer.json")
    (model / "tokenizer.json").write_text((model / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|end|>"'))
    assert f"the tokenizer of model.path ({model}) changed since the run started (tokenizer.json)" in refused([])
    shutil.copy(tmp_path / "tokenizer.json", model / "tokenizer.json")
    load_resumed(str(run), ["run.resume=true"], {})
    (run / "data" / "arith_train.jsonl").write_text(data.read_text())
    assert f"data.path ({run}/data/arith_train.jsonl) changed since the run started" in refused([])
    (run / "data" / "arith_train.jsonl").unlink()
    with pytest.raises(ConfigError, match="the run's data.path .* is gone"):
        prepare(None, [f"run.dir={run}", "run.resume=true"], {})


def test_resume_into_another_model_through_the_cli(tmp_path: Path) -> None:
    """The symptom as a user met it: `--resume model.path=auto:tiny-tools run.dir=X` on an auto:tiny run."""
    from colo.materialize import make_run_dir
    from colo.prepare import prepare
    from colo.run.rundir import unlock

    run = Path(make_run_dir(prepare(str(ROOT / "configs" / "tiny-cpu.yaml"), [f"run.dir={tmp_path}/run"], {})).run.dir)
    unlock(run)  # as the launch does when its run ends
    marker = (run / "model" / "colo_preset.json").read_text()
    r = run_cli("--resume", "model.path=auto:tiny-tools", f"run.dir={run}", cwd=tmp_path)
    assert_config_error(r, "--resume would change what the run's checkpoints mean: model.path", "auto:tiny-tools")
    assert (run / "model" / "colo_preset.json").read_text() == marker and not list(run.glob("config.resume-*"))
