"""colo.config: precedence, the key surface, round trips and every validation error (in process).

The same errors through the real CLI (exit code 2, one line, no traceback) are in test_launch_cli.py.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import socket
from pathlib import Path

import pytest

from colo import config as C
from colo.config import ConfigError, load_config, validate

ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def cpu(*overrides: str) -> list[str]:
    return ["placement.device=cpu", *overrides]


def error_of(overrides: list[str], env: dict[str, str] | None = None, path: str | None = None,
             check_resources: bool = True) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(path, overrides, env or {}), check_resources=check_resources)
    msg = str(e.value)
    assert "\n" not in msg and "fix:" in msg, msg  # one line that names the fix
    return msg


# ------------------------------------------------------------------------------------ precedence


def test_precedence_defaults_yaml_env_cli(tmp_path: Path) -> None:
    yml = write(tmp_path / "c.yaml", "trainer:\n  lr: 0.1\n  epochs: 3\nplacement:\n  num_gpus: 3\n")
    assert load_config(None, [], {}).trainer.lr == 1e-6  # default
    assert load_config(yml, [], {}).trainer.lr == 0.1  # YAML over default
    env = {"COLO_TRAINER__LR": "0.2", "COLO_NUM_GPUS": "4"}
    cfg = load_config(yml, [], env)
    assert (cfg.trainer.lr, cfg.placement.num_gpus, cfg.trainer.epochs) == (0.2, 4, 3)  # env over YAML
    cfg = load_config(yml, ["trainer.lr=0.3", "placement.num_gpus=5"], env)
    assert (cfg.trainer.lr, cfg.placement.num_gpus) == (0.3, 5)  # CLI over env
    assert cfg.trainer.epochs == 3 and cfg.trainer.weight_decay == 0.0  # untouched keys keep lower layers


def test_fraction_env_vars_and_types() -> None:
    env = {"COLO_TRAIN_GPU_FRACTION": "0.3", "COLO_VLLM_GPU_FRACTION": "0.6"}
    cfg = load_config(None, ["algo.rewards=[numeric,format]", "rollout.sleep_level=1"], env)
    assert (cfg.placement.train_gpu_fraction, cfg.placement.vllm_gpu_fraction) == (0.3, 0.6)
    assert isinstance(cfg.placement.train_gpu_fraction, float)
    assert cfg.algo.rewards == ["numeric", "format"] and cfg.rollout.sleep_level == 1
    validate(cfg, check_resources=False)


def test_documented_keys_exist_with_their_defaults() -> None:
    keys = C.all_keys()
    for key in ("model.path", "placement.num_gpus", "placement.train_gpu_fraction",
                "placement.vllm_gpu_fraction", "trainer.lr", "data.path", "loop.steps", "run.dir"):
        assert key in keys
    cfg = C.ColoConfig()
    p = cfg.placement
    assert (p.num_gpus, p.train_gpu_fraction, p.vllm_gpu_fraction, p.device) == (2, 0.4, 0.4, "auto")
    assert (cfg.sync.mode, cfg.sync.bucket_mb, cfg.sync.buffers, cfg.sync.digest) == ("direct", 1024, 2, True)
    assert (cfg.rollout.kv_cache_mb, cfg.rollout.sleep_level, cfg.model.dtype) == (256, "auto", "bfloat16")
    assert (cfg.algo.loss_agg, cfg.algo.rewards) == ("token-mean", ["exact_match"])
    assert (p.mode, p.trainer_gpus, cfg.rollout.tp_size) == ("colocated", 0, 1)


def test_placement_mode_env_shortcut() -> None:
    cfg = load_config(None, ["placement.trainer_gpus=1"], {"COLO_PLACEMENT_MODE": "disaggregated"})
    assert (cfg.placement.mode, cfg.placement.trainer_gpus) == ("disaggregated", 1)
    assert load_config(None, ["placement.mode=colocated"], {"COLO_PLACEMENT_MODE": "disaggregated"}
                       ).placement.mode == "colocated"  # CLI over env


def test_every_field_documented_in_code_and_docs() -> None:
    tree = ast.parse((ROOT / "colo" / "config" / "schema.py").read_text())
    docs = (ROOT / "docs" / "config.md").read_text()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")
                and n.name != "ColoConfig"):
        for i, node in enumerate(cls.body):
            if isinstance(node, ast.AnnAssign):
                nxt = cls.body[i + 1] if i + 1 < len(cls.body) else None
                doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                assert doc, f"{cls.name}.{node.target.id} has no docstring"  # type: ignore[union-attr]
    for key in C.all_keys():
        assert f"`{key}`" in docs, f"docs/config.md does not document {key}"
    for name in C.ENV_SHORTCUTS:
        assert name in docs


def test_round_trips(tmp_path: Path) -> None:
    cfg = load_config(str(ROOT / "configs" / "tiny-cpu.yaml"), ["trainer.lr=0.5"], {})
    d = C.to_dict(cfg)
    assert d == dataclasses.asdict(cfg) and json.loads(json.dumps(d)) == d  # plain data for actors
    assert C.from_dict(d) == cfg
    path = C.save_resolved(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml" and load_config(str(path), [], {}) == cfg
    with pytest.raises(ConfigError, match="trainer.lrr"):
        C.from_dict({**d, "trainer": {**d["trainer"], "lrr": 1}})


def test_shipped_configs() -> None:
    tiny = load_config(str(ROOT / "configs" / "tiny-cpu.yaml"), [], {})
    assert (tiny.placement.device, tiny.placement.num_gpus, tiny.model.path) == ("cpu", 2, "auto:tiny")
    assert tiny.data.path == "auto:arith" and tiny.rollout.enforce_eager
    for n, name in ((4, "qwen3-30b-a3b-4xh200"), (8, "qwen3-30b-a3b-8xh200")):
        cfg = load_config(str(ROOT / "configs" / f"{name}.yaml"), [], {})
        assert (cfg.model.path, cfg.placement.num_gpus, cfg.placement.device) == \
            ("Qwen/Qwen3-30B-A3B", n, "cuda")
        validate(cfg, check_resources=False)
        # the same shape offline: 128 experts split over n GPUs passes the expert check, then the
        # GPU count check fails on this CUDA-less machine (it names the GPUs)
        msg = error_of([f"placement.num_gpus={n}", "placement.device=cuda",
                        "model.path=auto:qwen3-30b-a3b", "model.dummy_weights=true"])
        assert "CUDA GPU" in msg


# ------------------------------------------------------------------------------------ validation


def test_unknown_keys_with_suggestion(tmp_path: Path) -> None:
    assert "'trainer.lr'" in error_of(["trainer.lrr=1"])
    assert "did you mean 'trainer.lr'" in error_of(["trainr.lr=1"])
    yml = write(tmp_path / "c.yaml", "rollout:\n  max_token: 3\n")
    msg = error_of([], path=yml)
    assert "rollout.max_token" in msg and "rollout.max_tokens" in msg and "c.yaml" in msg
    msg = error_of([], env={"COLO_TRAIN_GPU_FRACTON": "0.3"})
    assert "COLO_TRAIN_GPU_FRACTION" in msg
    assert "COLO_SYNC__BUCKETMB" in error_of([], env={"COLO_SYNC__BUCKETMB": "1"})
    assert "key=value" in error_of(["trainer.lr"])


def test_wrong_types() -> None:
    msg = error_of(["trainer.lr=fast"])
    assert "trainer.lr" in msg and "a number" in msg
    assert "whole number" in error_of(["placement.num_gpus=1.5"])
    assert "COLO_NUM_GPUS" in error_of([], env={"COLO_NUM_GPUS": "two"})
    assert "trainer" in error_of(["trainer=3"])
    assert "sync.mode" in error_of(["sync.mode=fast"], check_resources=False)
    assert "rollout.sleep_level" in error_of(["rollout.sleep_level=3"], check_resources=False)


@pytest.mark.parametrize("overrides, needle", [
    (["placement.train_gpu_fraction=0"], "placement.train_gpu_fraction=0.0 must be in (0, 1]"),
    (["placement.vllm_gpu_fraction=-0.2"], "placement.vllm_gpu_fraction"),
    (["placement.vllm_gpu_fraction=0.7"], "> 1.0"),
    (["rollout.max_tokens=4096"], "rollout.max_model_len"),
    (["trainer.micro_batch_size=0"], "must be >= 1"),
    (["algo.rewards=[]"], "algo.rewards"),
    (["rollout.top_p=0.9"], "rollout.top_p=0.9: the engine's log-probs would be renormalized over the nucleus"),
    (["algo.clip_ratio_c=0.5"], "algo.clip_ratio_c=0.5 must be > 1 (or 0: off); fix: algo.clip_ratio_c=3.0"),
    (["algo.overlong=truncate"], "algo.overlong='truncate' is not one of ['none', 'filter', 'penalty']"),
    (["algo.overlong=penalty", "rollout.max_tokens=64"],
     "algo.overlong_buffer=256 must be in [1, rollout.max_tokens=64]"),
])
def test_bad_values(overrides: list[str], needle: str) -> None:
    assert needle in error_of(overrides, check_resources=False)


DISAGG = ["placement.mode=disaggregated"]


@pytest.mark.parametrize("overrides, needles", [
    (["placement.mode=disagregated"], ["placement.mode='disagregated' is not one of",
                                       "did you mean 'disaggregated'", "fix: placement.mode=disaggregated"]),
    (["placement.mode=split"], ["['colocated', 'disaggregated']", "fix: placement.mode=colocated"]),
    # colocated: one engine per GPU, sharing it with a trainer rank
    (["rollout.tp_size=2"], ["rollout.tp_size=2", "fix: rollout.tp_size=1 or placement.mode=disaggregated"]),
    (["placement.trainer_gpus=1"], ["placement.trainer_gpus=1", "fix: placement.trainer_gpus=0 or "
                                    "placement.mode=disaggregated"]),
    (["placement.trainer_gpus=-1"], ["placement.trainer_gpus=-1"]),
    (["rollout.tp_size=0"], ["rollout.tp_size=0 must be >= 1"]),
    # disaggregated: T trainer GPUs, the rest in engines of tp_size GPUs
    (DISAGG + ["placement.num_gpus=1"], ["needs a trainer GPU and an engine GPU",
                                        "fix: placement.num_gpus=2"]),
    (DISAGG, ["placement.trainer_gpus=0 must be in [1, 1]", "fix: placement.trainer_gpus=1"]),
    (DISAGG + ["placement.trainer_gpus=2"], ["placement.trainer_gpus=2 must be in [1, 1]"]),
    (DISAGG + ["placement.num_gpus=8", "placement.trainer_gpus=9", "rollout.tp_size=2"],
     ["must be in [1, 7]", "fix: placement.trainer_gpus=6"]),
    (DISAGG + ["placement.num_gpus=8", "placement.trainer_gpus=5", "rollout.tp_size=2"],
     ["the 3 engine GPUs", "rollout.tp_size=2", "fix: rollout.tp_size to one of [1, 3]"]),
    (DISAGG + ["placement.trainer_gpus=1", "rollout.tp_size=0"], ["rollout.tp_size=0 must be >= 1"]),
])
def test_placement_mode_errors(overrides: list[str], needles: list[str]) -> None:
    msg = error_of(overrides, check_resources=False)
    for needle in needles:
        assert needle in msg, msg


def test_disaggregated_fractions_do_not_add_up() -> None:
    """Trainers and engines sit on different GPUs: 0.5 + 0.85 is fine; each must still be in (0, 1]."""
    ok = DISAGG + ["placement.trainer_gpus=1", "placement.train_gpu_fraction=0.5",
                   "placement.vllm_gpu_fraction=0.85"]
    validate(load_config(None, ok, {}), check_resources=False)
    assert "> 1.0" in error_of([o for o in ok if o != DISAGG[0]], check_resources=False)  # colocated
    assert "(0, 1]" in error_of(ok + ["placement.vllm_gpu_fraction=1.2"], check_resources=False)
    validate(load_config(None, DISAGG + ["placement.num_gpus=8", "placement.trainer_gpus=4",
                                         "rollout.tp_size=2", "placement.device=cuda"], {}),
             check_resources=False)


def test_tensor_parallel_on_cpu_needs_a_core_per_worker(tmp_path: Path) -> None:
    """device=auto resolves to cpu here (no CUDA): the TP check runs after resolving too."""
    tp = len(os.sched_getaffinity(0)) + 1  # one worker more than there are cores to bind
    shape = DISAGG + [f"placement.num_gpus={tp + 1}", "placement.trainer_gpus=1", f"rollout.tp_size={tp}"]
    validate(load_config(None, shape, {}), check_resources=False)  # auto: unknown device yet
    msg = error_of(shape + [f"run.dir={tmp_path}/r"])
    assert f"rollout.tp_size={tp} on CPU" in msg and f"fix: rollout.tp_size={tp - 1} or less" in msg, msg
    assert "on CPU" in error_of(shape + ["placement.device=cpu"], check_resources=False)
    two = DISAGG + ["placement.num_gpus=3", "placement.trainer_gpus=1", "rollout.tp_size=2"]
    validate(load_config(None, cpu(*two, f"run.dir={tmp_path}/r"), {}))  # TP 2 on 2 cores runs


def test_fractions_summing_to_one_are_fine() -> None:
    validate(load_config(None, ["placement.train_gpu_fraction=0.3", "placement.vllm_gpu_fraction=0.7"],
                         {}), check_resources=False)


def test_model_path_errors(tmp_path: Path) -> None:
    assert "does not exist" in error_of(cpu(f"model.path={tmp_path / 'nope'}"))
    (tmp_path / "empty").mkdir()
    assert "no config.json" in error_of(cpu(f"model.path={tmp_path / 'empty'}"))
    assert "did you mean 'tiny'" in error_of(cpu("model.path=auto:tiyn"))
    assert "model.dummy_weights=true" in error_of(cpu("model.path=auto:qwen3-30b-a3b"))


NO_TENSORS = (2).to_bytes(8, "little") + b"{}"  # a whole safetensors file that holds no tensor
QWEN3_MOE_JSON = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 6}


def test_local_checkpoint_accepted_and_experts_checked(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write(ckpt / "config.json", json.dumps(QWEN3_MOE_JSON))
    (ckpt / "model.safetensors").write_bytes(NO_TENSORS)  # its header is checked before anything starts
    write(ckpt / "tokenizer.json", "{}")  # and that it has a tokenizer
    validate(load_config(None, cpu(f"model.path={ckpt}", f"run.dir={tmp_path}/r"), {}))  # CPU: EP 1
    msg = error_of([f"model.path={ckpt}", "placement.device=cuda", "placement.num_gpus=4"])
    assert "6 experts" in msg and "expert-parallel size 4" in msg and "[1, 2, 3, 6]" in msg


def test_attention_heads_and_experts_with_tensor_parallel(tmp_path: Path) -> None:
    """disaggregated on GPU: heads must split over TP; experts need no EP split (engines are replicas)."""
    ckpt = tmp_path / "ckpt"
    write(ckpt / "config.json", json.dumps({**QWEN3_MOE_JSON, "num_attention_heads": 6}))
    shape = [f"model.path={ckpt}", "model.dummy_weights=true", "placement.device=cuda",
             "placement.mode=disaggregated", "placement.num_gpus=5", "placement.trainer_gpus=1"]
    msg = error_of(shape + ["rollout.tp_size=4"])
    assert "6 attention heads" in msg and "rollout.tp_size=4" in msg and "one of [1, 2]" in msg
    assert "4 engine GPUs" in msg
    # tp 2 splits the heads, and 6 experts with 5 GPUs pass: the next check is the CUDA GPU count
    assert "CUDA GPU" in error_of(shape + ["rollout.tp_size=2"])
    # colocated on 5 GPUs is one DP+EP group of 5: the experts check fires there
    assert "expert-parallel size 5" in error_of(shape[:3] + ["placement.num_gpus=5"])
    assert C.expert_parallel_size("cuda", 4) == 4 and C.expert_parallel_size("cuda", 4, "disaggregated") == 1
    assert C.expert_parallel_size("cpu", 4, "colocated") == 1


def test_model_family_and_weights_refused_before_anything(tmp_path: Path) -> None:
    """Refused by validate() (config.json only, no torch): an architecture the sync does not map (the
    message names the supported ones), a family with no test that runs it (with the reason), a
    quantized checkpoint, and a dir without weight files unless model.dummy_weights."""
    from colo.models.archs import ARCHS

    ckpt = tmp_path / "ckpt"
    run = f"run.dir={tmp_path}/r"
    write(ckpt / "config.json", json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    msg = error_of(cpu(f"model.path={ckpt}", run))
    assert "architecture GPT2LMHeadModel has no weight-sync mapping" in msg
    assert all(a in msg for a in ARCHS) and "\n" not in msg
    write(ckpt / "config.json", json.dumps({"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"]}))
    assert "torchvision" in error_of(cpu(f"model.path={ckpt}", run))
    write(ckpt / "config.json", json.dumps({"model_type": "qwen3_moe"}))
    assert "names no architecture" in error_of(cpu(f"model.path={ckpt}", run))
    write(ckpt / "config.json", json.dumps({**QWEN3_MOE_JSON, "quantization_config": {"quant_method": "fp8"}}))
    assert "quantized (fp8)" in error_of(cpu(f"model.path={ckpt}", run))
    write(ckpt / "config.json", json.dumps(QWEN3_MOE_JSON))
    msg = error_of(cpu(f"model.path={ckpt}", run))
    assert "no weight files" in msg and "model.dummy_weights=true" in msg
    validate(load_config(None, cpu(f"model.path={ckpt}", "model.dummy_weights=true", run), {}))
    (ckpt / "model-00001-of-00002.safetensors").write_bytes(NO_TENSORS)
    assert "has no tokenizer" in error_of(cpu(f"model.path={ckpt}", run))
    write(ckpt / "tokenizer.json", "{}")
    validate(load_config(None, cpu(f"model.path={ckpt}", run), {}))


def test_gpu_count() -> None:
    limit = (os.cpu_count() or 1) * 4
    assert f"{limit} Ray logical GPUs" in error_of(cpu(f"placement.num_gpus={limit + 1}"))
    validate(load_config(None, cpu(f"placement.num_gpus={limit}"), {}))
    # no CUDA on the CPU test machines (tests/gpu/ covers the positive case)
    assert "placement.device=cpu" in error_of(["placement.device=cuda", "placement.num_gpus=1"])


def test_routing_capture_colo_only_on_gpu_engines() -> None:
    """rollout.routing_capture=colo lives in vLLM's CUDA model runner: refused on CPU with the fix, taken on GPU (a plan
    for one: check_gpus=False), and off by default."""
    assert C.ColoConfig().rollout.routing_capture == "vllm"
    msg = error_of(cpu("rollout.routing_capture=colo"))
    assert "rollout.routing_capture=colo needs GPU engines" in msg and "fix: rollout.routing_capture=vllm" in msg
    assert "is not one of ['vllm', 'colo']" in error_of(["rollout.routing_capture=slots"], check_resources=False)
    validate(load_config(None, ["placement.device=cuda", "placement.num_gpus=1", "rollout.routing_capture=colo"], {}),
             check_gpus=False)


def test_data_errors(tmp_path: Path) -> None:
    assert "does not exist" in error_of(cpu(f"data.path={tmp_path / 'x.jsonl'}"))
    assert "did you mean 'arith'" in error_of(cpu("data.eval_path=auto:arit"))
    bad = write(tmp_path / "bad.jsonl", "{not json\n")
    assert "unreadable" in error_of(cpu(f"data.path={bad}"))
    other = write(tmp_path / "q.jsonl", json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    msg = error_of(cpu(f"data.path={other}"))
    assert "'prompt'" in msg and "question" in msg
    validate(load_config(None, cpu(f"data.path={other}", "data.prompt_key=question"), {}))
    csv = write(tmp_path / "d.csv", "prompt,answer\n")
    assert "unknown format" in error_of(cpu(f"data.path={csv}"))
    locked = write(tmp_path / "locked.jsonl", "{}\n")
    os.chmod(locked, 0)
    if not os.access(locked, os.R_OK):  # root reads anything
        assert "unreadable" in error_of(cpu(f"data.path={locked}"))


def test_rewards_resolved_at_load() -> None:
    assert "unknown reward function" in error_of(cpu("algo.rewards=[exact_matsh]"))
    assert "cannot import" in error_of(cpu("algo.rewards=[no_such_module_x:f]"))
    validate(load_config(None, cpu("algo.rewards=[exact_match,colo.algo.rewards:numeric]"), {}))


def test_malformed_and_odd_yaml(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.yaml", "trainer:\n  lr: [1\nmodel: x\n")
    msg = error_of([], path=bad)
    assert "malformed YAML" in msg and "line" in msg
    assert "not a mapping" in error_of([], path=write(tmp_path / "list.yaml", "- a\n- b\n"))
    assert "cannot read config file" in error_of([], path=str(tmp_path / "missing.yaml"))
    assert load_config(write(tmp_path / "empty.yaml", ""), [], {}) == C.ColoConfig()


def test_run_dir_rules(tmp_path: Path) -> None:
    run = tmp_path / "run"
    validate(load_config(None, cpu(f"run.dir={run}"), {}))
    assert "--resume" in error_of(cpu(f"run.dir={run}", "run.resume=true"))
    write(run / "config.yaml", "{}\n")
    assert "already holds a run" in error_of(cpu(f"run.dir={run}"))
    validate(load_config(None, cpu(f"run.dir={run}", "run.resume=true"), {}))


# --------------------------------------------------------------------------------------- resolve


def resolved(cfg: C.ColoConfig) -> C.ColoConfig:
    """colo.plan.resolve of cfg on this machine (as colo.launch's prepare resolves it)."""
    from colo.plan.resolve import resolve

    return resolve(cfg, C.model_config_json(cfg)).cfg


def test_resolve_fills_in_run_dir_and_generated_paths(tmp_path: Path) -> None:
    cfg = load_config(None, cpu(f"run.dir={tmp_path}/runs/{{time}}", "data.eval_path=auto:arith"), {})
    r = resolved(cfg)
    run = Path(r.run.dir)
    assert run.parent == tmp_path / "runs" and "{" not in r.run.dir and not run.exists()
    assert r.model.path == str(run / "model") and r.placement.device == "cpu"
    assert (r.data.path, r.data.eval_path) == (str(run / "data" / "arith_train.jsonl"),
                                               str(run / "data" / "arith_eval.jsonl"))
    assert cfg.model.path == "auto:tiny"  # resolve returns a copy
    # resume picks the newest earlier run of the pattern
    for stamp in ("20250101-000000", "20250102-000000"):
        write(tmp_path / "runs" / stamp / "config.yaml", "{}\n")
    resumed = resolved(load_config(None, cpu(f"run.dir={tmp_path}/runs/{{time}}", "run.resume=true"), {}))
    assert resumed.run.dir == str(tmp_path / "runs" / "20250102-000000")


def test_loggers_checked_and_wandb_mode_resolved(tmp_path: Path) -> None:
    for bad, hint in ((["jsonl", "tensorbord"], "did you mean 'tensorboard'"), (["wandb"], "jsonl")):
        cfg = load_config(None, [f"run.loggers=[{','.join(bad)}]"], {})
        with pytest.raises(ConfigError, match=hint):
            C.validate(cfg, check_resources=False)
    cfg = load_config(None, ["run.loggers=[jsonl,wandb]", f"run.dir={tmp_path}/r"], {})
    C.validate(cfg, check_resources=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_API_KEY", raising=False)
        assert resolved(cfg).run.wandb_mode == "offline"  # no key: nothing is uploaded
        mp.setenv("WANDB_API_KEY", "x" * 40)
        assert resolved(cfg).run.wandb_mode == "online"
    cfg.run.wandb_mode = "offline"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_API_KEY", "x" * 40)
        assert resolved(cfg).run.wandb_mode == "offline"  # explicit wins


def test_ray_address_joins_a_cluster_whose_gpus_are_not_here() -> None:
    """RAY_ADDRESS (set by `ray job submit`) fills run.ray_address, below COLO_* and key=value; with a
    cluster to join, a CUDA job validates on a driver without GPUs (colo.cluster.nodes checks the cluster's)."""
    env = {"RAY_ADDRESS": "10.0.0.1:6379"}
    assert load_config(None, [], env).run.ray_address == "10.0.0.1:6379"
    assert load_config(None, [], {**env, "COLO_RUN__RAY_ADDRESS": "10.0.0.2:6379"}).run.ray_address == "10.0.0.2:6379"
    assert load_config(None, ["run.ray_address=10.0.0.3:6379"], env).run.ray_address == "10.0.0.3:6379"
    cuda = ["placement.device=cuda", "placement.num_gpus=8", "model.path=auto:tiny"]
    with socket.socket() as head:  # validate() asks the address: something must listen there
        head.bind(("127.0.0.1", 0))
        head.listen()
        env = {"RAY_ADDRESS": f"127.0.0.1:{head.getsockname()[1]}"}
        C.validate(load_config(None, cuda, env))  # the memory plan is colo.plan.job's, after validate
    if not __import__("torch").cuda.is_available():  # here: the same job without a cluster is refused
        with pytest.raises(ConfigError, match="placement.num_gpus=8 but this machine has"):
            C.validate(load_config(None, cuda, {}))
