"""The RL loop: one step, phase by phase, on every GPU at once.

    python -m colo.launch                                        # tiny CPU job, learns in minutes
    python -m colo.launch --config configs/qwen3-30b-a3b-4xh200.yaml

Each GPU holds a trainer (FSDP2 rank r) and a vLLM engine (vLLM DP rank r). Per step (rl_step):

    rollout  vLLM awake, trainer offloaded   the schedule's batch: prompts spread over engines, n samples each
    reward   driver (thread pool)            rewards → GRPO group-normalized advantages
    sleep    vLLM sleeps                     level 2: its weights are overwritten by the sync anyway
    train    trainer onloads                 log-prob recompute → PPO-clip update with TIS correction
    wait     the schedule's hook             generate-ahead: the rest of the next batch; else nothing
    sync     vLLM wake_up(["weights"])       trainer pushes weights over IPC (colo.sync), every byte checksummed
    offload  trainer offloads                its params, grads and optimizer state to the host
    wake     vLLM wake_up(["kv_cache", "scheduling"])
    probe    engines run the probe           on the syncs sync.probe_every picks, the functional check: every layer on
                                             fixed inputs and the log-probs of fixed sequences equal the trainers'
                                             (colo.cluster.probing)

The order matters: the trainer needs the GPU memory vLLM frees in `sleep`, and the weights must be back
in vLLM's memory before the push, while the KV cache is only re-allocated after the trainer has left.

The step is handed two objects, picked once per run (Job.of), so it reads the same in every mode:
- the rollout schedule (colo.rollout.schedule): sync (on policy), colocated async (partial samples carried
  between steps) or generate-ahead (disaggregated async: the engines generate step s+1's batch while the
  trainers train on step s's, collected in `wait`); it owns the data position and what a checkpoint carries;
- the placement side (colo.cluster.sides): colocated sleeps, wakes and offloads; disaggregated (placement.mode:
  each side has GPUs of its own, the sync is a broadcast from trainer rank 0) does none of them.

With algo.environment a sample is a conversation (colo.rollout.turns, docs/environments.md): the
rollout phase runs every turn of it inside the engines, the reward adds the environment's rewards to
algo.rewards on the model's last turn, and the batch trains the model's tokens only.

Resume is exact: a checkpoint holds model, AdamW and RNG state plus the data position, and rollout seeds
depend only on (run.seed, step), so `--resume` reproduces an uninterrupted run (bit-identical on CPU,
tests/e2e/test_loop.py). A raising reward function, or an engine that dies or raises (in generate, sleep,
wake_up or a sync), ends the run with status 1 after saving the last trained step: one `colo: error:`
line on the terminal, the traceback in <run.dir>/error.log. After a trainer died or raised only the
periodic checkpoints remain. So does a full disk (the line says so) and trainer.max_consecutive_skipped
optimizer steps in a row with a non-finite grad norm.

Ctrl-C or SIGTERM stops the run: the last finished step is saved (a signal during a step's train..save waits
for it), one line says what was saved and how to --resume, and the exit status is 130 / 143; a second signal
skips the save (colo.run.signals). How each failure ends the run is one table, colo.runlife.ENDINGS; every way out
hands the cluster back (colo.runlife.RunLife: its actors, Ray and their /dev/shm segments stopped).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from colo.algo.advantages import step_advantages
from colo.algo.batch import build_batch, shard_batch, torch_threads
from colo.algo.rewards import RewardRunner
from colo.cluster.actors import ActorError, Cluster
from colo.cluster.placement import plan_placement
from colo.cluster.probing import check_probe
from colo.cluster.sides import PlacementSide, side_for
from colo.config import ColoConfig, check_resolved, to_dict
from colo.data.inputs import RunInputs, open_inputs
from colo.data.prompts import pad_id
from colo.host.shm import sweep
from colo.rollout.generation import generate
from colo.rollout.sample import Sample
from colo.rollout.schedule import RolloutSchedule, schedule_for
from colo.rollout.vllm_compat import serve_command
from colo.run.metrics import MetricsWriter, ProgressLine, WandbSettings
from colo.run.signals import StopSignals
from colo.run.summary import run_summary
from colo.run.terminal import Phases, warmed_up
from colo.runlife import RunLife, restore
from colo.sync.plan import MappingError
from colo.sync.probe import ProbeSchedule


class Timer:
    """Collects `timing/<phase>_s` for one step and, given a probe, `memory/<phase>/<key>` at the end of
    each phase (outside the timed span)."""

    def __init__(self, probe: Callable[[], dict] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        self.probe = probe

    @contextmanager
    def __call__(self, phase: str, part: bool = False):
        """`part`: a span inside another phase, timed but not probed (a probe there would be timed by the outer);
        its driver thread's CPU time goes beside it (`timing/<phase>_cpu_s`): far below the wall time, the span
        waited (descheduled, page faults, the GIL) rather than worked."""
        t0, c0 = time.perf_counter(), time.thread_time()
        yield
        self.seconds[f"timing/{phase}_s"] = time.perf_counter() - t0
        if part:
            self.seconds[f"timing/{phase}_cpu_s"] = time.thread_time() - c0
        if self.probe is not None and not part:
            self.memory.update({f"memory/{phase}/{k}": v for k, v in self.probe().items()})


def memory_probe(c: Cluster) -> Callable[[], dict]:
    """Trainer.memory() of every rank, max over ranks (one Ray round trip per phase)."""
    def probe() -> dict:
        reports = c.trainer_group.memory()
        return {k: max(r[k] for r in reports) for k in reports[0]}
    return probe


def score(rewards: RewardRunner, prompts: list[dict], samples: list[Sample], tokenizer) -> torch.Tensor:
    """algo.rewards on each response (a conversation's: on the model's last turn), plus the environment's
    rewards of a conversation."""
    ids = [s.final_ids for s in samples]  # also for a reward that declares response_ids
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    answers = [prompts[s.group]["answer"] for s in samples]
    questions = [prompts[s.group]["prompt_text"] for s in samples]
    finish = [s.finish_reason for s in samples]  # lets `format` see truncated responses
    env = torch.tensor([s.turns.env_reward if s.turns is not None else 0.0 for s in samples])  # (N*G,)
    return torch.tensor(rewards(texts, answers, questions, finish, ids), dtype=torch.float32) + env  # (N*G,)


def conversation_metrics(samples: list[Sample], stats: dict, run_dir: Path, step: int) -> dict:
    """What a multi-turn step logs; each environment error goes to <run_dir>/env-errors.log."""
    turns = [len(s.turns.spans) for s in samples]
    model = sum(sum(s.model_mask) for s in samples)
    errors = [s.turns.env_error for s in samples if s.turns.env_error]
    if errors:
        with (run_dir / "env-errors.log").open("a") as f:
            f.writelines(f"step {step}: {e}\n" for e in errors)
    return {"rollout/turns/mean": sum(turns) / len(turns), "rollout/turns/max": max(turns),
            "rollout/tool_calls_per_sample": sum(s.turns.tool_calls for s in samples) / len(samples),
            "rollout/tool_errors": sum(s.turns.tool_errors for s in samples), "env/errors": len(errors),
            "rollout/model_token_frac": model / max(1, sum(len(s.response_ids) for s in samples)),
            "env/seconds": stats.get("env_s", 0.0)}


@dataclass
class Job:
    """What every step of one run works with. The rollout schedule and the placement side are picked here, once,
    from loop.mode and the cluster's placement: the step itself never asks."""

    cluster: Cluster
    cfg: ColoConfig  # resolved (colo.plan.resolve): no `auto` left
    inputs: RunInputs  # the run dir, tokenizer, prompts
    rewards: RewardRunner  # algo.rewards, each call bounded by algo.reward_timeout_s
    schedule: RolloutSchedule  # which samples a step trains on: Sync, Carried or Ahead (colo.rollout.schedule)
    side: PlacementSide  # what the GPUs do around the train phase: Colocated or Disaggregated (colo.cluster.sides)
    probes: ProbeSchedule  # which syncs the functional check runs on (sync.probe_every)
    writer: MetricsWriter | None = None  # metrics.jsonl and the loggers (None: a step that only returns them)

    @classmethod
    def of(cls, c: Cluster, cfg: ColoConfig, inputs: RunInputs, rewards: RewardRunner,
           writer: MetricsWriter | None = None) -> Job:
        return cls(c, cfg, inputs, rewards, schedule_for(cfg, c.engine_group, inputs.train_data, c.colocated),
                   side_for(c, cfg), ProbeSchedule(inputs.probe_vocab, cfg.rollout.max_model_len, cfg.sync.probe_every),
                   writer)


def rl_step(step: int, job: Job, stop: StopSignals | None = None) -> dict:
    """One RL step, the module docstring's timeline. From its train phase on, a stop signal is held (`stop`), so
    that the trainers' weights and the schedule's position stay together; the caller releases it once the step is
    logged and saved."""
    c, cfg, schedule, side = job.cluster, job.cfg, job.schedule, job.side
    t, t_step = Timer(memory_probe(c) if cfg.loop.memory_stats else None), time.perf_counter()
    with t("rollout"):
        got = schedule.batch(step)
    with t("reward"):
        reward = score(job.rewards, got.prompts, got.samples, job.inputs.tokenizer)  # (N*G,)
        adv, penalty = step_advantages(got.samples, reward, cfg.rollout.n, cfg.algo, cfg.rollout.max_tokens)
    with t("sleep"):
        side.release()
    if stop is not None:
        stop.hold()
    with t("train"):
        side.onload()
        # timing/batch_s, a part of timing/train_s: the driver's share of the train phase, on one thread (torch_threads)
        with t("batch", part=True), torch_threads(1):
            batch = build_batch(got.samples, adv, pad_id=pad_id(job.inputs.tokenizer),
                                mask_truncated=cfg.algo.overlong == "filter")
            shards = shard_batch(batch, len(c.trainers))
        train = c.trainer_group.train_step(shards)[0]  # metrics are already all-reduced over ranks
    with t("wait"):
        schedule.trained(step)  # a failure from here on saves this step
    with t("sync"):
        side.wake_weights()
        probe = job.probes.next()  # None: no functional check on this sync
        synced, policy = sync_all(c, probe)
    with t("offload"):
        side.offload()
    with t("wake"):
        side.wake_kv()
    with t("probe"):
        check_probe(c, cfg, probe, policy, synced)  # once the engines can generate
    samples = got.samples
    lens = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    metrics = {"step": step, "reward/mean": reward.mean().item(), "reward/std": reward.std().item(),
               "response_len/mean": lens.mean().item(),
               "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
               **got.metrics, **train, **synced, **t.seconds, **t.memory}
    if cfg.algo.environment:
        metrics.update(conversation_metrics(samples, got.stats, job.inputs.run_dir, step))
    if cfg.algo.overlong == "penalty":  # reward/mean stays the reward functions' own
        metrics["reward/overlong_penalty"] = penalty.mean().item()
    metrics["timing/step_s"] = time.perf_counter() - t_step  # wall clock: the phases plus what lies between
    return metrics


class TrainingDiverged(RuntimeError):
    """Optimizer steps skipped in a row for a non-finite gradient norm reached trainer.max_consecutive_skipped."""


def check_skipped(metrics: dict, limit: int) -> None:
    """Raise TrainingDiverged once `limit` optimizer steps in a row had a non-finite grad norm (each was skipped,
    so the trainers still hold the last good weights)."""
    if metrics.get("train/consecutive_skipped", 0) >= limit:
        raise TrainingDiverged(
            f"the gradient norm was not finite (inf/nan) in {metrics['train/consecutive_skipped']} optimizer steps in "
            f"a row, up to step {metrics['step']}; each was skipped, the weights are those of the last good step; "
            "fix: lower trainer.lr or set trainer.grad_clip, check the rewards and data of these steps, or resume "
            "from an earlier checkpoint (trainer.max_consecutive_skipped sets how many skips end a run)")


def sync_metrics(reports: list[dict]) -> dict:
    """sync/verified: every element landed exactly once where the engine expects it and its bytes are the sender's
    (coverage and checksums: Sender.push raises otherwise; false with sync.digest=false, which compares no bytes),
    and, where the functional check ran on this sync (sync/probe 1), the engines computed what the trainer computes
    (check_probe sets it false, then raises)."""
    senders = [r for r in reports if "role" not in r]  # a disaggregated rank > 0 only gathers
    return {"sync/tensors": sum(r["tensors"] for r in reports), "sync/bytes": sum(r["bytes"] for r in reports),
            "sync/verified": all(r["verified"] for r in reports) and all(r["digest_checked"] for r in senders),
            "sync/seconds": max(r["seconds"] for r in reports), "sync/probe": 0.0}


def sync_all(c: Cluster, probe: dict | None = None) -> tuple[dict, dict | None]:
    """Push the trainers' weights into the (awake) engines: colocated, each rank into the engine on its GPU;
    disaggregated, rank 0 broadcasts to every engine while the other ranks take part in the gathers. With `probe`
    (colo.sync.probe.ProbeSchedule's) the trainers also run it: returns (metrics, the policy's records) for
    check_probe once the engines can generate."""
    reports = c.trainer_group.sync_weights(probe)
    return sync_metrics(reports), reports[0].get("probe")


def check_sync(c: Cluster) -> list[dict]:
    """Every trainer plans its sync against the engines' description (docs: the weight path), before the
    warm-up or any rollout; a model that does not map raises MappingError listing every problem at once."""
    try:
        return c.trainer_group.prepare_sync()
    except ActorError as e:  # a trainer raised: the model's own MappingError is the news, not the actor
        cause = getattr(e.__cause__, "cause", None)
        if isinstance(cause, MappingError):
            raise cause from e
        raise


def evaluate(job: Job) -> dict:
    """Held-out reward: greedy, and (loop.eval_samples) sampled at the rollout temperature with a fixed seed."""
    prompts, cfg = job.inputs.eval_prompts, job.cfg
    if not prompts:  # data.eval_path: null
        return {}
    samples, _ = generate(job.cluster.engine_group, prompts, 1, cfg, greedy=True, seed=0)
    out = {"eval/reward": score(job.rewards, prompts, samples, job.inputs.tokenizer).mean().item()}
    if cfg.loop.eval_samples > 0:  # fixed seed: every eval draws the same random streams
        samples, _ = generate(job.cluster.engine_group, prompts, cfg.loop.eval_samples, cfg, greedy=False, seed=7)
        out["eval/sampled_reward"] = score(job.rewards, prompts, samples, job.inputs.tokenizer).mean().item()
    return out


def warm_up(c: Cluster, cfg: ColoConfig, inputs: RunInputs, progress: ProgressLine | None = None) -> dict:
    """A short supervised phase so the tiny policy sometimes succeeds and GRPO has a signal to climb."""
    losses = []
    for i in range(cfg.loop.sft_warmup_steps):
        batch = inputs.sft_batch(cfg.data.prompts_per_step * cfg.rollout.n, i)
        shards = shard_batch(batch, len(c.trainers))
        losses.append(c.trainer_group.sft_step(shards)[0]["sft_loss"])
        if progress is not None:
            progress.update({"sft_loss": losses[-1]})
    return {"sft/loss_first": losses[0], "sft/loss_last": losses[-1]} if losses else {}


def due(every: int, step: int) -> bool:
    """Step `step` is the every-th's last (every 0: never)."""
    return bool(every) and (step + 1) % every == 0


def run(cfg: ColoConfig, life: RunLife, phases: Phases) -> int:
    """Run a whole job on its resolved config (colo.launch: the run dir made); returns the exit status (0: every step
    ran). `life` owns the signals, Ray, the checkpoints and how a failure ends the run (colo.runlife); `phases`: the
    terminal's phases, start-up already begun."""
    job = start(cfg, life)
    begin(job, life, phases)
    at = job.schedule  # at.position: what the trainers hold, as a checkpoint records it
    life.progress = progress = ProgressLine(cfg.loop.steps, initial_step=at.position.step + 1)
    for step in range(at.position.step + 1, cfg.loop.steps):
        metrics = rl_step(step, job, life.stop)  # holds a stop from its train phase
        last = step + 1 == cfg.loop.steps  # evaluated and saved too: --resume can extend a finished run
        if due(cfg.loop.eval_every, step) or last:
            metrics.update(evaluate(job))
        job.writer.log(step, metrics)
        progress.update(metrics)
        check_skipped(metrics, cfg.trainer.max_consecutive_skipped)
        if due(cfg.loop.checkpoint_every, step) or last:
            life.save(at.position)
        life.stop.release()  # the step is trained, logged and saved as configured: a stop that came meanwhile
    finish(job, life, phases)
    return 0


def start(cfg: ColoConfig, life: RunLife) -> Job:
    """The start-up phase: the run's inputs, Ray and the actors, the metrics writer, the reward functions."""
    check_resolved(cfg, "colo.loop")
    inputs = open_inputs(cfg)
    sweep()  # sync buffers and vLLM queues that killed runs left in this host's /dev/shm (colo.host.shm)
    cluster = life.start_cluster(cfg, plan_placement(cfg), inputs.run_dir)
    if len(cluster.ranks_by_node) > 1:  # a run over several nodes says where each rank is
        print("colo: nodes: " + "; ".join(f"{ip}: {', '.join(names)}" for ip, names in cluster.ranks_by_node.values()),
              flush=True)
    writer = MetricsWriter(inputs.run_dir, loggers=list(cfg.run.loggers),
                           wandb=WandbSettings(cfg.run.wandb_project, cfg.run.wandb_mode, to_dict(cfg)))
    life.job = Job.of(cluster, cfg, inputs, RewardRunner(list(cfg.algo.rewards), timeout_s=cfg.algo.reward_timeout_s),
                      writer)
    return life.job


def begin(job: Job, life: RunLife, phases: Phases) -> None:
    """From ready actors to the first RL step: the sync planned; the newest checkpoint restored (--resume) or the
    warm-up run and the held-out eval logged; the first sync of the run checked (and of every resume); the engines
    left awake and the trainers offloaded."""
    c, cfg = job.cluster, job.cfg
    check_sync(c)
    restored = restore(c, job.inputs, job.writer) if cfg.run.resume else None
    if restored:
        job.schedule.restore(restored)
    else:
        phases.end("ready in {s}")
        phases.begin("warm-up")
        life.progress = ProgressLine(cfg.loop.sft_warmup_steps, desc="warm-up", disable=not cfg.loop.sft_warmup_steps)
        first = warm_up(c, cfg, job.inputs, life.progress)
        life.progress.close()
    probe = job.probes.next()  # the first sync of every run (and of every resume) is checked
    synced, policy = sync_all(c, probe)
    check_probe(c, cfg, probe, policy, synced)  # the engines are awake: they start so
    if restored:
        phases.end(f"ready in {{s}}, at step {job.schedule.position.step + 1} of {cfg.loop.steps}")
    else:
        evals = evaluate(job)
        job.writer.log(-1, {**first, **synced, **{f"setup/{k}": v for k, v in c.setup.items()}, **evals})
        phases.end(warmed_up(cfg.loop.sft_warmup_steps, evals))
    job.side.offload()
    phases.begin("RL")


def finish(job: Job, life: RunLife, phases: Phases) -> None:
    """After the last step: the export (a Hugging Face checkpoint, or LoRA's adapter) and the run's summary."""
    job.cluster.trainer_group.export_hf(str(job.inputs.run_dir / "export"))
    if life.progress is not None:
        life.progress.close()
    phases.end()
    print(run_summary(job.inputs.run_dir, phases.wall(), list(job.cfg.run.loggers), serve_command, phases.seconds),
          flush=True)
