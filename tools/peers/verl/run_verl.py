"""verl 0.9.1's GRPO trainer on one GPU under colo.bench.step's conditions, and its figures (tools/peers/verl/README).

    source /tmp/site-verl/env.sh    # verl's bundle (vLLM 0.24.0 on the host's torch 2.11.0), never colo's
    python tools/peers/verl/run_verl.py --model /tmp/peers/qwen3-30b-a3b-L4 --prompts 16 --n 8 --prompt-len 256 \
        --max-tokens 1024 --warmup 2 --steps 3 --deadline 540 --out $OUT/verl-16x8          # GPU host
    python tools/peers/verl/run_verl.py --model /tmp/peers-tiny --check                     # CPU: config + prompts

Runs `python -m verl.trainer.main_ppo` (the v1 sync trainer: FSDP2 actor and vLLM server colocated on the GPU, the
hybrid engine, weights synced through CUDA IPC) with the overrides of `overrides()`: the same checkpoint, batch
(prompts x n), prompt length, response length (ignore_eos: every response --max-tokens long, as colo's --lengths
fixed), optimizer (AdamW, lr 1e-6, no weight decay, grad clip 1, fp32 master weights and state, bf16 compute), loss
(GRPO, token-mean, no KL, no entropy term), one optimizer step per RL step, micro-batches of --micro-tokens tokens,
and vLLM's memory share, max_num_seqs and max_num_batched_tokens as colo's engine gets them on an H100/H200.

What it writes to --out (the prompts go to /tmp/peers-data): overrides.txt (the exact command), metrics.jsonl
(verl's own per-step metrics through its file logger: timing_s/*, perf/*), phases.jsonl (the wall-clock span of each
timed phase: phase_hook), gpu.csv (the device's memory in use, nvidia-smi every 100 ms), verl.log, and summary.json:
the medians over the measured steps (those after --warmup) of verl's timing_s/step, gen, old_log_prob, update_actor,
update_weights and tokens/s/GPU (perf/throughput: prompt + response tokens / step / GPUs, colo's count), and the
device's peak memory inside each phase over the measured steps. --deadline stops verl that many seconds in and
summarizes the steps it finished, so a device call's time limit keeps what was measured.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
VERL_PHASES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights", "step")
HOOK = "tools.peers.verl.phase_hook.install"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python tools/peers/verl/run_verl.py", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the checkpoint (tools/peers/verl/make_checkpoint.py)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=1024, help="every response's length (ignore_eos)")
    ap.add_argument("--warmup", type=int, default=2, help="steps run first and not measured")
    ap.add_argument("--steps", type=int, default=3, help="measured steps")
    ap.add_argument("--micro-tokens", type=int, default=8192, help="tokens per micro-batch (colo.bench.step's "
                    "trainer.max_tokens_per_micro_batch); verl's padded micro-batches get this // sequence length rows")
    ap.add_argument("--vllm-fraction", type=float, default=0.4, help="vLLM's gpu_memory_utilization "
                    "(colo's placement.vllm_gpu_fraction)")
    ap.add_argument("--gradient-checkpointing", choices=("true", "false"), default="true")
    ap.add_argument("--deadline", type=float, default=0, help="stop verl after this many seconds (0: never)")
    ap.add_argument("--out", default="/tmp/peers-verl")
    ap.add_argument("--check", action="store_true", help="no run: compose and validate verl's config with these "
                    "overrides, build the prompts and check their length with verl's own token builder (CPU)")
    ap.add_argument("extra", nargs="*", metavar="key=value", help="more verl (hydra) overrides")
    return ap.parse_args(argv)


def workdir(out: Path) -> Path:
    """verl's working directory (hydra's outputs/, checkpoints): outside --out, whose files a device call returns."""
    return Path("/tmp/peers-run") / out.name


def micro_batch(args: argparse.Namespace) -> int:
    return max(1, args.micro_tokens // (args.prompt_len + args.max_tokens))


def overrides(args: argparse.Namespace, data: Path, out: Path) -> list[str]:
    """verl's hydra overrides for the side-by-side (module docstring)."""
    mb = micro_batch(args)
    total = args.warmup + args.steps
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.max_tokens}",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.shuffle=False",
        f"actor_rollout_ref.model.path={args.model}",
        # no flash-attn wheel exists for this host (the registry has its sdist only): SDPA, unpadded batches off
        # (every sequence is prompt_len + max_tokens long, so a padded micro-batch holds no padding)
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={args.gradient_checkpointing.capitalize()}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.optim.clip_grad=1.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mb}",
        "actor_rollout_ref.actor.use_dynamic_bsz=False",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.ignore_eos=True",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.vllm_fraction}",
        # vLLM's own defaults for the LLM class on a GPU of 70 GiB or more (colo's engine leaves them so)
        "actor_rollout_ref.rollout.max_num_seqs=1024",
        "actor_rollout_ref.rollout.max_num_batched_tokens=16384",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={mb}",
        "actor_rollout_ref.rollout.free_cache_engine=True",
        f"reward.custom_reward_function.path={HERE / 'reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.logger=[console,file]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.total_training_steps={total}",
        "trainer.total_epochs=1",
        "trainer.project_name=peers",
        f"trainer.experiment_name=verl-{args.prompts}x{args.n}",
        f"trainer.default_local_dir={workdir(out) / 'ckpt'}",
        f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={HOOK}",
        *args.extra,
    ]


def compose(ovr: list[str]):
    """verl's ppo_trainer config with the overrides, validated as main_ppo validates it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = hydra_compose("ppo_trainer", overrides=ovr)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    typed = {k: omega_conf_to_dataclass(v) for k, v in (("actor", cfg.actor_rollout_ref.actor),
                                                       ("rollout", cfg.actor_rollout_ref.rollout),
                                                       ("model", cfg.actor_rollout_ref.model))}
    return cfg, typed


def check(args: argparse.Namespace, out: Path) -> dict:
    """The CPU check: prompts of exactly --prompt-len ids by verl's own Continuous Token builder, and the config."""
    from transformers import AutoTokenizer

    from tools.peers.verl import prompts
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    data = prompts.write(args.model, str(out / "prompts.parquet"), 4, args.prompt_len)
    import pandas as pd

    tok = AutoTokenizer.from_pretrained(args.model)
    builder = create_continuous_token_builder(tokenizer=tok, processor=None, model_family="auto",
                                              hf_model_type=json.loads((Path(args.model) / "config.json")
                                                                       .read_text())["model_type"])
    lengths = [len(builder.build_initial_tokens(list(p))) for p in pd.read_parquet(data)["prompt"]]
    cfg, typed = compose(overrides(args, data, out))
    ro, actor, model = typed["rollout"], typed["actor"], typed["model"]
    return {"builder": type(builder).__name__, "prompt_lengths": lengths,
            "rollout": {k: getattr(ro, k) for k in ("name", "mode", "ignore_eos", "response_length", "prompt_length",
                                                    "n",
                                                    "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                                                    "tensor_model_parallel_size", "free_cache_engine", "load_format")},
            "actor": {"strategy": actor.strategy, "ppo_mini_batch_size": actor.ppo_mini_batch_size,
                      "ppo_micro_batch_size_per_gpu": actor.ppo_micro_batch_size_per_gpu,
                      "lr": actor.optim.lr, "weight_decay": actor.optim.weight_decay,
                      "param_offload": actor.fsdp_config.param_offload,
                      "optimizer_offload": actor.fsdp_config.optimizer_offload,
                      "model_dtype": actor.fsdp_config.model_dtype, "dtype": actor.fsdp_config.dtype,
                      "use_kl_loss": actor.use_kl_loss, "loss_agg_mode": actor.loss_agg_mode},
            "model": {"use_remove_padding": model.use_remove_padding,
                      "attn_implementation": model.override_config.get("attn_implementation"),
                      "gradient_checkpointing": model.enable_gradient_checkpointing},
            "trainer": {"total_training_steps": cfg.trainer.total_training_steps, "logger": list(cfg.trainer.logger),
                        "adv_estimator": cfg.algorithm.adv_estimator,
                        "hook": cfg.ray_kwargs.ray_init.runtime_env.worker_process_setup_hook}}


def summarize(out: Path, args: argparse.Namespace) -> dict:
    """summary.json: medians of verl's per-step metrics over the measured steps, the device's peak memory per phase."""
    from tools.peers.verl.gpumem import peak_gib, read_samples

    steps = []
    for line in (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []:
        rec = json.loads(line)
        steps.append({"step": rec["step"], **rec["data"]})
    measured = [s for s in steps if s["step"] > args.warmup][: args.steps]
    med = lambda key: statistics.median(float(s[key]) for s in measured) if measured and all(  # noqa: E731
        key in s for s in measured) else None
    spans = [json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()] \
        if (out / "phases.jsonl").exists() else []
    trainer_pids = {s["pid"] for s in spans if s["name"] == "step"}
    steps_spans = sorted((s for s in spans if s["name"] == "step" and s["pid"] in trainer_pids), key=lambda s: s["t0"])
    measured_windows = [(s["t0"], s["t1"]) for s in steps_spans[args.warmup: args.warmup + args.steps]]
    samples = read_samples(out / "gpu.csv")
    memory = {}
    for name in VERL_PHASES:
        peaks = [peak_gib(samples, s["t0"], s["t1"]) for s in spans if s["name"] == name and s["pid"] in trainer_pids
                 and any(a <= s["t0"] <= b for a, b in measured_windows)]
        peaks = [p for p in peaks if p is not None]
        memory[name] = max(peaks) if peaks else None
    expected = args.prompts * args.n * (args.prompt_len + args.max_tokens)
    return {
        "system": "verl 0.9.1 (vLLM 0.24.0, torch 2.11.0)",
        "shape": f"{args.prompts}x{args.n}", "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "steps_done": len(steps), "steps_measured": len(measured),
        "step_s": med("timing_s/step"),
        "tokens_per_s_per_gpu": med("perf/throughput"),
        "tokens_per_step": med("perf/total_num_tokens"), "tokens_expected": expected,
        "response_len_mean": med("response_length/mean"),
        "phases_s": {k: med(f"timing_s/{k}") for k in VERL_PHASES[:-1]},
        "sync_s": med("timing_s/update_weights"),
        "memory_peak_gib": memory,
        "per_step": [{k: s.get(k) for k in ("step", "timing_s/step", "perf/throughput", "timing_s/gen",
                                            "timing_s/update_actor", "timing_s/update_weights")} for s in steps],
    }


def run(args: argparse.Namespace, out: Path) -> dict:
    from tools.peers.verl import prompts
    from tools.peers.verl.gpumem import GpuSampler, card

    rows = args.prompts * (args.warmup + args.steps + 1)
    data = Path("/tmp/peers-data") / f"prompts-{rows}x{args.prompt_len}.parquet"  # outside $OUT: 8 files come back
    if not data.exists():
        prompts.write(args.model, str(data), rows, args.prompt_len)
    ovr = overrides(args, data, out)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *ovr]
    (out / "overrides.txt").write_text(" \\\n  ".join(cmd) + "\n")
    for f in ("metrics.jsonl", "phases.jsonl"):
        (out / f).unlink(missing_ok=True)
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(out / "metrics.jsonl"), PEERS_PHASES=str(out / "phases.jsonl"),
               PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"),
                                                                              str(ROOT)])))
    t0 = time.time()
    stopped = False
    with GpuSampler(out / "gpu.csv"), (out / "verl.log").open("w") as log:
        workdir(out).mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(cmd, cwd=str(workdir(out)), env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: stopped whole at the deadline
        try:
            proc.wait(timeout=args.deadline or None)
        except subprocess.TimeoutExpired:
            stopped = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    try:  # its local Ray cluster (the bundle's `ray` script is not on PATH: --target installs)
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], env=env, capture_output=True,
                       timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        pass
    summary = {**summarize(out, args), "rc": proc.returncode, "stopped_at_deadline": stopped,
               "wall_s": round(time.time() - t0, 1), "card": card(), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(["python", "tools/peers/verl/run_verl.py", *sys.argv[1:]])}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    result = check(args, out) if args.check else run(args, out)
    print(json.dumps(result), flush=True)
    return 0 if args.check or result.get("steps_measured") else 1


if __name__ == "__main__":
    sys.exit(main())
