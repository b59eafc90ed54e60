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

With algo.environment a sample is a conversation (colo.rollout.multiturn, docs/environments.md): the
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
skips the save (colo.run.signals). Every way out hands the cluster back (colo.runlife: its actors, Ray and their
/dev/shm segments stopped).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from colo.algo.advantages import step_advantages
from colo.algo.batch import build_batch, shard_batch, torch_threads
from colo.algo.rewards import RewardError, RewardRunner
from colo.cluster.actors import ActorDied, ActorError, Cluster, node_loss
from colo.cluster.head import HeadLost
from colo.cluster.placement import init_ray, plan_placement
from colo.cluster.sides import Colocated, Disaggregated, side_for
from colo.config import ColoConfig, to_dict
from colo.data.inputs import RunInputs, open_inputs
from colo.envs.base import EnvError
from colo.host.shm import sweep
from colo.rollout.generation import generate
from colo.rollout.schedule import SyncRollout, schedule_for
from colo.rollout.vllm_compat import serve_command
from colo.run.logs import note_ray_logs
from colo.run.metrics import MetricsWriter, ProgressLine, WandbSettings
from colo.run.signals import StopSignals
from colo.run.rundir import prune_checkpoints
from colo.run.summary import run_summary
from colo.run.terminal import Phases, warmed_up
from colo.cluster.probing import SyncMismatch, check_probe
from colo.runlife import Clusters, OwnCluster, fail, restore, save, shut_down, stopped
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


def score(rewards: RewardRunner, prompts: list[dict], samples: list[dict], tokenizer) -> torch.Tensor:
    """algo.rewards on each response (a conversation's: on the model's last turn), plus the environment's
    rewards of a conversation."""
    texts = tokenizer.batch_decode([s.get("final_ids", s["response_ids"]) for s in samples], skip_special_tokens=True)
    answers = [prompts[s["prompt_index"]]["answer"] for s in samples]
    questions = [prompts[s["prompt_index"]]["prompt_text"] for s in samples]
    finish = [s["finish_reason"] for s in samples]  # lets `format` see truncated responses
    ids = [s.get("final_ids", s["response_ids"]) for s in samples]  # for a reward that declares response_ids
    env = torch.tensor([float(s.get("env_reward", 0.0)) for s in samples])  # (N*G,)
    return torch.tensor(rewards(texts, answers, questions, finish, ids), dtype=torch.float32) + env  # (N*G,)


def conversation_metrics(samples: list[dict], stats: dict, run_dir: Path, step: int) -> dict:
    """What a multi-turn step logs; each environment error goes to <run_dir>/env-errors.log."""
    turns = [s["turns"] for s in samples]
    model = sum(sum(s["model_mask"]) for s in samples)
    errors = [s["env_error"] for s in samples if s.get("env_error")]
    if errors:
        with (run_dir / "env-errors.log").open("a") as f:
            f.writelines(f"step {step}: {e}\n" for e in errors)
    return {"rollout/turns/mean": sum(turns) / len(turns), "rollout/turns/max": max(turns),
            "rollout/tool_calls_per_sample": sum(s["tool_calls"] for s in samples) / len(samples),
            "rollout/tool_errors": sum(s["tool_errors"] for s in samples), "env/errors": len(errors),
            "rollout/model_token_frac": model / max(1, sum(len(s["response_ids"]) for s in samples)),
            "env/seconds": stats.get("env_s", 0.0)}


@dataclass
class Job:
    """What every step of one run works with. The rollout schedule and the placement side are picked here, once,
    from loop.mode and the cluster's placement: the step itself never asks."""

    cluster: Cluster
    cfg: ColoConfig
    inputs: RunInputs
    rewards: RewardRunner
    schedule: SyncRollout
    side: Colocated | Disaggregated
    probes: ProbeSchedule  # which syncs the functional check runs on (sync.probe_every)

    @classmethod
    def of(cls, c: Cluster, cfg: ColoConfig, inputs: RunInputs, rewards: RewardRunner) -> Job:
        return cls(c, cfg, inputs, rewards, schedule_for(cfg, c.engine_group, inputs.train_data, c.colocated),
                   side_for(c, cfg), ProbeSchedule(inputs.probe_vocab, cfg.rollout.max_model_len, cfg.sync.probe_every))


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
            batch = build_batch(got.samples, adv, pad_id=job.inputs.tokenizer.pad_token_id,
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
    lens = torch.tensor([len(s["response_ids"]) for s in samples], dtype=torch.float32)
    metrics = {"step": step, "reward/mean": reward.mean().item(), "reward/std": reward.std().item(),
               "response_len/mean": lens.mean().item(),
               "response/truncated_frac": sum(s["finish_reason"] == "length" for s in samples) / len(samples),
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


def run(cfg: ColoConfig, clusters: Clusters | None = None, phases: Phases | None = None) -> int:
    """Run a whole job on a resolved config (colo.launch.prepare_run); returns the exit status.

    A reward function that raises or an actor that dies or raises ends the run with status 1 after a
    checkpoint of the last completed step, when the trainers still hold one (not after a trainer failed).
    `clusters`: where the job's cluster comes from and goes (colo.runlife.Clusters); by default the job starts
    its own actors and ends them, and Ray, when it ends (OwnCluster). `phases`: the terminal's phases
    (colo.run.terminal), start-up already begun by colo.launch."""
    clusters = clusters or OwnCluster()
    if phases is None:
        phases = Phases()
        phases.begin("start-up")
    stop = StopSignals()
    stop.install()  # from here on Ctrl-C / SIGTERM stop the run cleanly (colo.run.signals), start-up included
    inputs, cluster, writer, rewards, progress = None, None, None, None, None
    healthy = True  # every actor alive and trusted at the end (a cluster is kept for another job only then)
    try:
        inputs = open_inputs(cfg)
        sweep()  # sync buffers and vLLM queues that killed runs left in this host's /dev/shm (colo.host.shm)
        plan = plan_placement(cfg)
        # the actors' output stays in <run.dir>/logs unless the run is verbose (colo.run.logs)
        init_ray(plan, address=cfg.run.ray_address, log_to_driver=cfg.run.verbose,
                 logging_level=logging.INFO if cfg.run.verbose else logging.ERROR)
        note_ray_logs(inputs.run_dir)  # copied into the run dir at its end (colo.run.logs.keep_logs)
        stop.install()  # again: ray.init replaced the SIGTERM handler with its own
        cluster = clusters.acquire(cfg, plan)
        stop.install()  # and whatever start-up imported may have too
        if len(cluster.ranks_by_node) > 1:  # a run over several nodes says where each rank is
            print("colo: nodes: " + "; ".join(f"{ip}: {', '.join(names)}"
                                               for ip, names in cluster.ranks_by_node.values()), flush=True)
        wandb = WandbSettings(cfg.run.wandb_project, cfg.run.wandb_mode, to_dict(cfg))
        writer = MetricsWriter(inputs.run_dir, loggers=list(cfg.run.loggers), wandb=wandb)
        rewards = RewardRunner(list(cfg.algo.rewards), timeout_s=cfg.algo.reward_timeout_s)
        job = Job.of(cluster, cfg, inputs, rewards)
    except KeyboardInterrupt:  # nothing trained yet: nothing to save
        print(f"colo: stopped by {stop.name} during start-up; nothing was trained, nothing saved",
              file=sys.stderr, flush=True)
        shut_down(cluster, None, None, None, stop, clusters)
        return stop.exit_status
    except BaseException:
        shut_down(cluster, writer, None, rewards, stop, clusters, healthy=False)
        raise
    at = job.schedule  # at.position: what the trainers hold, as a checkpoint records it
    try:
        try:
            check_sync(cluster)
        except MappingError as e:  # the model itself: nothing ran, nothing to save
            print(f"colo: error: {getattr(e, 'cause', None) or e}\nfix: a checkpoint of a family colo maps "
                  "(docs/models.md)", file=sys.stderr, flush=True)
            return 2
        restored = restore(cluster, inputs, writer) if cfg.run.resume else None
        if restored:
            at.restore(restored)
        else:
            phases.end("ready in {s}")
            phases.begin("warm-up")
            progress = ProgressLine(cfg.loop.sft_warmup_steps, desc="warm-up", disable=not cfg.loop.sft_warmup_steps)
        first = {} if restored else warm_up(cluster, cfg, inputs, progress)
        if progress:
            progress.close()
        probe = job.probes.next()  # the first sync of every run (and of every resume) is checked
        synced, policy = sync_all(cluster, probe)
        check_probe(cluster, cfg, probe, policy, synced)  # the engines are awake: they start so
        if restored:
            phases.end(f"ready in {{s}}, at step {at.position.step + 1} of {cfg.loop.steps}")
        else:
            setup = {f"setup/{k}": v for k, v in cluster.setup.items()}
            evals = evaluate(job)
            writer.log(-1, {**first, **synced, **setup, **evals})
            phases.end(warmed_up(cfg.loop.sft_warmup_steps, evals))
        job.side.offload()
        phases.begin("RL")
        progress = ProgressLine(cfg.loop.steps, initial_step=at.position.step + 1)
        for step in range(at.position.step + 1, cfg.loop.steps):
            metrics = rl_step(step, job, stop)  # holds a stop from its train phase
            last = step + 1 == cfg.loop.steps  # evaluated and saved too: --resume can extend a finished run
            if cfg.loop.eval_every and (step + 1) % cfg.loop.eval_every == 0 or last:
                metrics.update(evaluate(job))
            writer.log(step, metrics)
            progress.update(metrics)
            check_skipped(metrics, cfg.trainer.max_consecutive_skipped)
            if cfg.loop.checkpoint_every and (step + 1) % cfg.loop.checkpoint_every == 0 or last:
                save(cluster, inputs, at.position)
                prune_checkpoints(inputs.run_dir, cfg.run.keep_checkpoints)  # the newest N and those marked `keep`
            stop.release()  # the step is trained, logged and saved as configured: a stop that came meanwhile
        cluster.trainer_group.export_hf(str(inputs.run_dir / "export"))
        progress.close()
        phases.end()
        print(run_summary(inputs.run_dir, phases.wall(), list(cfg.run.loggers), serve_command, phases.seconds),
              flush=True)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (colo.run.signals)
        healthy = False  # an actor may still be in the call the signal cut short: its cluster is not reused
        return stopped(cluster, inputs, at.position, stop, progress)
    except (RewardError, TrainingDiverged, SyncMismatch, EnvError, HeadLost) as e:  # the trainers hold a whole policy
        return fail(cluster, inputs, at.position, e, keep_policy=True, progress=progress)
    except OSError as e:  # the driver's own writes (metrics, logs): a full or vanished disk
        return fail(cluster, inputs, at.position, e, keep_policy=True, progress=progress)
    except (ActorDied, ActorError) as e:
        healthy = False
        # A lost node is the news, not the actor that noticed it first (a trainer whose gloo peer vanished).
        lost = node_loss(cluster, e)
        if lost is not None:
            return fail(cluster, inputs, at.position, lost, keep_policy=not lost.trainers, progress=progress)
        # After an engine died or raised, the trainers still hold the policy: keep it. After a trainer did,
        # its shards are gone or may be half-updated (and its peers may sit in a collective): do not save.
        return fail(cluster, inputs, at.position, e, keep_policy=e.name.startswith("engine"), progress=progress)
    finally:
        shut_down(cluster, writer, progress, rewards, stop, clusters, healthy)
    return 0
