"""The RL loop: one step, phase by phase, on every GPU at once.

    python -m colo.launch                                        # tiny CPU job, learns in minutes
    python -m colo.launch --config configs/qwen3-30b-a3b-4xh200.yaml

Each GPU holds a trainer (FSDP2 rank r) and a vLLM engine (vLLM DP rank r). Per step:

    rollout  vLLM awake, trainer offloaded   prompts spread over engines, n samples each
    reward   driver (thread pool)            rewards → GRPO group-normalized advantages
    sleep    vLLM sleeps                     level 2: its weights are overwritten by the sync anyway
    train    trainer onloads                 log-prob recompute → PPO-clip update with TIS correction
    sync     vLLM wake_up(["weights"])       trainer pushes weights over IPC → trainer offloads
    wake     vLLM wake_up(["kv_cache", "scheduling"])

The order matters: the trainer needs the GPU memory vLLM frees in `sleep`, and the weights must be back
in vLLM's memory before the push, while the KV cache is only re-allocated after the trainer has left.

Disaggregated mode (placement.mode) runs the same timeline with sleep, wake and offload left out (each
side has GPUs of its own) and a broadcast from trainer rank 0 to every engine as the sync. While the
trainers train, the engines idle with weights and KV cache in place: the loop stays on-policy (rollouts
of step s come from the weights of step s-1), which is what makes the two modes give the same results.

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
skips the save (colo.run.signals). Every way out stops the actors, Ray and their /dev/shm segments (shut_down).
"""

from __future__ import annotations

import errno
import logging
import math
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch

from colo.algo.advantages import step_advantages
from colo.algo.batch import build_batch, shard_batch, torch_threads
from colo.algo.rewards import RewardError, RewardRunner
from colo.cluster.actors import ActorDied, ActorError, Cluster, node_loss, start_cluster
from colo.config import ColoConfig, to_dict
from colo.run.metrics import MetricsWriter, ProgressLine, WandbSettings
from colo.data.inputs import RunInputs, open_inputs
from colo.run.logs import link_ray_logs, log_of
from colo.run.rundir import complete_checkpoints
from colo.run.signals import StopSignals
from colo.host.shm import sweep
from colo.run.summary import run_summary
from colo.rollout.ahead import Ahead, GenerateAhead
from colo.rollout.buffer import RolloutBuffer
from colo.rollout.vllm_compat import serve_command
from colo.cluster.placement import init_ray, plan_placement
from colo.sync.plan import MappingError
from colo.sync.probe import TOLERANCE, ProbeSchedule, ProbeScores, engine_scores, first_difference, tolerance_key
from colo.sync.probe import check as probe_check

if TYPE_CHECKING:
    from colo.cluster.warm import WarmClusters


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


def generate(c: Cluster, prompts: list[dict], n: int, cfg: ColoConfig, *, greedy: bool, seed: int,
             routing: bool = False, stats: dict | None = None) -> list[dict]:
    """Spread prompts over the engines by count; returns samples in prompt order, prompt_index global.
    `routing`: samples carry the engine's expert ids (colo.rollout.capture) for replay and routing/mismatch.
    With algo.environment each sample is a conversation (colo.rollout.multiturn); `stats` then receives
    "env_s", the longest any engine waited for its environments."""
    if cfg.algo.environment:
        chunks = _chunks(c, prompts)
        temp, top_p = (0.0, 1.0) if greedy else (cfg.rollout.temperature, cfg.rollout.top_p)
        answers = c.engine_group.rollout([[prompts[i] for i in idx] for idx in chunks], n, cfg.rollout.max_tokens,
                                         temp, top_p, _seeds(c, seed), routing)
        if stats is not None:
            stats["env_s"] = max(st["env_s"] for _, st in answers)
        return _in_prompt_order(chunks, [samples for samples, _ in answers])
    return collect(c, submit(c, prompts, n, cfg, greedy=greedy, seed=seed, routing=routing))


def _chunks(c: Cluster, prompts: list[dict]) -> list[list[int]]:
    w = len(c.engines)
    return [list(range(r, len(prompts), w)) for r in range(w)]  # round robin: counts differ by ≤ 1


def _seeds(c: Cluster, seed: int) -> list[int]:
    return [seed + r for r in range(len(c.engines))]


def _in_prompt_order(chunks: list[list[int]], per_engine: list[list[dict]]) -> list[dict]:
    samples = []
    for idx, outs in zip(chunks, per_engine):
        for s in outs:
            samples.append({**s, "prompt_index": idx[s["prompt_index"]]})
    return sorted(samples, key=lambda s: s["prompt_index"])  # stable: keeps each prompt's n samples together


def submit(c: Cluster, prompts: list[dict], n: int, cfg: ColoConfig, *, greedy: bool, seed: int,
           routing: bool = False) -> tuple[list[list[int]], list]:
    """Single-turn generation started on every engine, not waited for: (chunks, refs) for collect()."""
    chunks = _chunks(c, prompts)
    temp, top_p = (0.0, 1.0) if greedy else (cfg.rollout.temperature, cfg.rollout.top_p)
    refs = c.engine_group.submit_generate([[prompts[i]["prompt_ids"] for i in idx] for idx in chunks], n,
                                          cfg.rollout.max_tokens, temp, top_p, _seeds(c, seed), routing)
    return chunks, refs


def collect(c: Cluster, submitted: tuple[list[list[int]], list]) -> list[dict]:
    chunks, refs = submitted
    return _in_prompt_order(chunks, c.engine_group.collect(refs))


def rollout_seed(cfg: ColoConfig, step: int) -> int:
    """The sampling seed of step `step`'s batch (engine r adds r)."""
    return cfg.run.seed * 100_003 + step * 1_009


def rollout_async(step: int, c: Cluster, cfg: ColoConfig, inputs: RunInputs, pos: Position
                  ) -> tuple[list[dict], list[dict], dict]:
    """loop.mode=async's rollout phase (docs/config.md, "Async"): drop stale groups, top up to oversample x
    prompts_per_step groups, run every unfinished sample until prompts_per_step whole groups exist, take them.
    Returns (prompts, samples, async/* metrics); the rest stays in pos.buffer for the next step."""
    if pos.buffer is None:
        pos.buffer = RolloutBuffer(cfg.rollout.n, cfg.rollout.max_tokens, cfg.loop.max_staleness)
        if pos.carry:  # resumed: what the checkpointed step left carried
            if pos.carry.get("kind") == "ahead":
                raise ValueError("the checkpoint holds a batch the disaggregated async step generated ahead; fix: "
                                 "resume it with placement.mode=disaggregated")
            pos.buffer.load_state_dict(pos.carry)
    buf, k, w = pos.buffer, cfg.data.prompts_per_step, len(c.engines)
    buf.drop_stale(step)
    new = buf.wanted(math.ceil(cfg.rollout.oversample * k))
    if new:
        buf.add(inputs.train_data.next_batch(new), seed=rollout_seed(cfg, step))
    reqs = buf.requests()
    # groups round robin over the engines (a carried sample resumes anywhere: its KV is recomputed anyway);
    # the groups still needed are shared the same way, each engine's share capped by the groups it holds
    order = list(dict.fromkeys(r["group"] for r in reqs))
    engine_of = {g: i % w for i, g in enumerate(order)}
    held, quota = [len(order[e::w]) for e in range(w)], [0] * w
    for i in range(min(buf.need(k), len(order))):
        quota[i % w] += 1
    per_engine = [[r for r in reqs if engine_of[r["group"]] == e] for e in range(w)]
    assert all(q <= h for q, h in zip(quota, held))
    results = c.engine_group.generate_partial(per_engine, quota, cfg.rollout.temperature, cfg.rollout.top_p,
                                              routing=True)
    buf.absorb([r for rs in per_engine for r in rs], [o for os in results for o in os], version=step)
    prompts, samples = buf.take(k, step)
    return prompts, samples, buf.metrics(samples, step)


def rollout_ahead(step: int, c: Cluster, cfg: ColoConfig, inputs: RunInputs, pos: Position
                  ) -> tuple[list[dict], list[dict], dict, tuple[list[dict], tuple, dict]]:
    """loop.mode=async with disaggregated engines (colo.rollout.ahead): the batch generated during the last step
    (now, on policy, at the first step), and the next step's batch submitted to the engines, which generate it
    while the trainers train. Returns (prompts, samples, async/* metrics, (next prompts, submitted, the data
    position before those prompts were drawn: what a checkpoint records until the batch is collected))."""
    if pos.buffer is None:
        pos.buffer = GenerateAhead()
        if pos.carry:  # resumed: the batch the checkpointed step generated ahead
            if pos.carry.get("kind") != "ahead":
                raise ValueError("the checkpoint holds samples carried by the colocated async step; fix: resume it "
                                 "with placement.mode=colocated")
            pos.buffer.load_state_dict(pos.carry)
    k, n = cfg.data.prompts_per_step, cfg.rollout.n
    batch = pos.buffer.take()
    if batch is None:
        prompts = inputs.train_data.next_batch(k)
        batch = Ahead(prompts, generate(c, prompts, n, cfg, greedy=False, seed=rollout_seed(cfg, step), routing=True),
                      step)
    before = inputs.train_data.state_dict()
    nxt = inputs.train_data.next_batch(k)
    submitted = submit(c, nxt, n, cfg, greedy=False, seed=rollout_seed(cfg, step + 1), routing=True)
    return (batch.prompts, batch.samples, GenerateAhead.metrics(batch, step, cfg.loop.max_staleness),
            (nxt, submitted, before))


def score(rewards: RewardRunner, prompts: list[dict], samples: list[dict], tokenizer) -> torch.Tensor:
    """algo.rewards on each response (a conversation's: on the model's last turn), plus the environment's
    rewards of a conversation."""
    texts = tokenizer.batch_decode([s.get("final_ids", s["response_ids"]) for s in samples], skip_special_tokens=True)
    answers = [prompts[s["prompt_index"]]["answer"] for s in samples]
    questions = [prompts[s["prompt_index"]]["prompt_text"] for s in samples]
    finish = [s["finish_reason"] for s in samples]  # lets `format` see truncated responses
    env = torch.tensor([float(s.get("env_reward", 0.0)) for s in samples])  # (N*G,)
    return torch.tensor(rewards(texts, answers, questions, finish), dtype=torch.float32) + env  # (N*G,)


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
class Position:
    """What the trainers hold: the weights after RL step `step` (-1: warm-up only) and the data position
    after that step's batch. A checkpoint records exactly this, so a resume redoes no step and skips none."""

    step: int
    data: dict
    buffer: RolloutBuffer | GenerateAhead | None = field(default=None, repr=False)  # loop.mode=async: carried samples
    carry: dict | None = field(default=None, repr=False)  # buffer.state_dict() after `step`: what a checkpoint holds


def rl_step(step: int, c: Cluster, cfg: ColoConfig, inputs: RunInputs, rewards: RewardRunner, pos: Position,
            stop: StopSignals | None = None, probes: ProbeSchedule | None = None) -> dict:
    """One RL step. From its train phase on, a stop signal is held (`stop`), so that the trainers' weights and
    the data position stay together; the caller releases it once the step is logged and saved. `probes`: which
    syncs the functional check runs on (sync.probe_every)."""
    t, n = Timer(memory_probe(c) if cfg.loop.memory_stats else None), cfg.rollout.n
    trainers, engines, t_step = c.trainer_group, c.engine_group, time.perf_counter()
    with t("rollout"):
        carry, stats, ahead = {}, {}, None
        if cfg.loop.mode == "async" and c.colocated:  # what is generated, carried and dropped: colo.rollout.buffer
            prompts, samples, carry = rollout_async(step, c, cfg, inputs, pos)
        elif cfg.loop.mode == "async":  # the next batch generates while this one trains: colo.rollout.ahead
            prompts, samples, carry, ahead = rollout_ahead(step, c, cfg, inputs, pos)
        else:
            prompts = inputs.train_data.next_batch(cfg.data.prompts_per_step)
            samples = generate(c, prompts, n, cfg, greedy=False, seed=rollout_seed(cfg, step),
                               routing=True, stats=stats)  # every step: routing/mismatch is logged with replay on or off
    with t("reward"):
        reward = score(rewards, prompts, samples, inputs.tokenizer)  # (N*G,)
        adv, penalty = step_advantages(samples, reward, n, cfg.algo, cfg.rollout.max_tokens)  # (N*G,) each
    with t("sleep"):
        if c.colocated:
            engines.sleep(sleep_level(cfg))
    if stop is not None:
        stop.hold()
    with t("train"):
        if offloads(c, cfg):
            trainers.onload()
        # timing/batch_s, a part of timing/train_s: the driver's share of the train phase, on one thread (torch_threads)
        with t("batch", part=True), torch_threads(1):
            batch = build_batch(samples, adv, pad_id=inputs.tokenizer.pad_token_id,
                                mask_truncated=cfg.algo.overlong == "filter")
            shards = shard_batch(batch, len(c.trainers))
        train = trainers.train_step(shards)[0]  # metrics are already all-reduced over ranks
        pos.step, pos.data = step, inputs.train_data.state_dict()  # a failure from here on saves this step
        pos.carry = pos.buffer.state_dict() if pos.buffer is not None else None
        if ahead is not None:  # until its batch is in hand, a checkpoint leaves the next prompts to be drawn again
            pos.data = ahead[2]
    if ahead is not None:
        with t("wait"):  # what the engines have left of the next batch once the trainers are done
            pos.buffer.put(Ahead(ahead[0], collect(c, ahead[1]), step))
            pos.data, pos.carry = inputs.train_data.state_dict(), pos.buffer.state_dict()
    with t("sync"):
        if c.colocated:
            engines.wake_up(["weights"])
        probe = probes.next() if probes is not None else None
        synced, policy = sync_all(c, probe)
        if offloads(c, cfg):
            trainers.offload()
    with t("wake"):
        if c.colocated:
            engines.wake_up(["kv_cache", "scheduling"])
    if probe is not None:
        with t("probe"):  # the engines score the sequences the trainers scored in sync (colo.sync.probe)
            check_probe(c, cfg, probe, policy, synced)
    lens = torch.tensor([len(s["response_ids"]) for s in samples], dtype=torch.float32)
    metrics = {"step": step, "reward/mean": reward.mean().item(), "reward/std": reward.std().item(),
               "response_len/mean": lens.mean().item(),
               "response/truncated_frac": sum(s["finish_reason"] == "length" for s in samples) / len(samples),
               **carry, **train, **synced, **t.seconds, **t.memory}
    if cfg.algo.environment:
        metrics.update(conversation_metrics(samples, stats, inputs.run_dir, step))
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


def sleep_level(cfg: ColoConfig) -> int:
    """'auto' → 2: the sync overwrites every weight, so level 1's CPU copy of them would be wasted work."""
    return 2 if cfg.rollout.sleep_level == "auto" else int(cfg.rollout.sleep_level)


def sync_metrics(reports: list[dict]) -> dict:
    """sync/verified: every byte landed where the engine expects it (Sender.push raises otherwise) and, where the
    functional check ran on this sync (sync/probe 1), the engines computed what the trainer computes
    (check_probe raises otherwise)."""
    return {"sync/tensors": sum(r["tensors"] for r in reports), "sync/bytes": sum(r["bytes"] for r in reports),
            "sync/verified": all(r["verified"] for r in reports), "sync/seconds": max(r["seconds"] for r in reports),
            "sync/probe": 0.0}


def sync_all(c: Cluster, probe: list[list[int]] | None = None) -> tuple[dict, dict | None]:
    """Push the trainers' weights into the (awake) engines: colocated, each rank into the engine on its GPU;
    disaggregated, rank 0 broadcasts to every engine while the other ranks take part in the gathers. With `probe`
    (colo.sync.probe) the trainers also score those sequences: returns (metrics, the policy's probe) for
    check_probe once the engines can generate."""
    reports = c.trainer_group.sync_weights(probe)
    return sync_metrics(reports), reports[0].get("probe")


class SyncMismatch(RuntimeError):
    """After a sync whose bytes all arrived, an engine computes other log-probs than the trainer."""


def check_probe(c: Cluster, cfg: ColoConfig, seqs: list[list[int]], policy: dict, synced: dict) -> None:
    """The functional check of the sync just made (colo.sync.probe): every engine scores the sequences the
    trainers scored; a disagreement beyond model.dtype's tolerance raises SyncMismatch naming the engine and the
    first sublayer whose output differs. Updates `synced` with sync/probe and sync/probe_err."""
    mine = ProbeScores(**policy["scores"])
    worst, kind = 0.0, tolerance_key(cfg.model.dtype, cfg.rollout.quantization)  # an FP8 engine: FP8's rounding
    for e, got in enumerate(c.engine_group.probe(seqs)):
        res = probe_check(mine, engine_scores(got["tables"]), kind)
        worst = max(worst, res.err)
        if not res.ok:
            trace = c.engine_group.probe(seqs, trace=True, only=e)[0]["trace"]
            where = first_difference(policy["trace"], trace)
            synced["sync/verified"] = False
            raise SyncMismatch(
                f"engine {e} computes other log-probs than the trainer right after a weight sync whose every byte "
                f"arrived (median relative error {res.err:.3f} over {res.positions} positions, tolerance "
                f"{TOLERANCE.get(kind, TOLERANCE['bfloat16'])} for {kind}): a weight vLLM "
                "derives at load was not refreshed; "
                + (f"the first sublayer that differs: {where}" if where else
                   "no sublayer trace names the layer (only an eager engine can be traced: rollout.enforce_eager=true)")
                + f"; please report it with {cfg.run.dir}/error.log, your CPU or GPU model and the output of "
                f"`.venv/bin/python -m colo.bench.sync --model {cfg.model.path} --ranks 2 --check`")
    synced.update({"sync/probe": 1.0, "sync/probe_err": worst})


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


def offloads(c: Cluster, cfg: ColoConfig) -> bool:
    """Trainer state leaves the GPU while vLLM generates only where the two share it."""
    return c.colocated and cfg.trainer.offload


def evaluate(c: Cluster, cfg: ColoConfig, inputs: RunInputs, rewards: RewardRunner) -> dict:
    prompts = inputs.eval_prompts
    if not prompts:  # data.eval_path: null
        return {}
    samples = generate(c, prompts, 1, cfg, greedy=True, seed=0)
    out = {"eval/reward": score(rewards, prompts, samples, inputs.tokenizer).mean().item()}
    if cfg.loop.eval_samples > 0:  # fixed seed: every eval draws the same random streams
        samples = generate(c, prompts, cfg.loop.eval_samples, cfg, greedy=False, seed=7)
        out["eval/sampled_reward"] = score(rewards, prompts, samples, inputs.tokenizer).mean().item()
    return out


def warm_up(c: Cluster, cfg: ColoConfig, inputs: RunInputs) -> dict:
    """A short supervised phase so the tiny policy sometimes succeeds and GRPO has a signal to climb."""
    losses = []
    for i in range(cfg.loop.sft_warmup_steps):
        batch = inputs.sft_batch(cfg.data.prompts_per_step * cfg.rollout.n, i)
        shards = shard_batch(batch, len(c.trainers))
        losses.append(c.trainer_group.sft_step(shards)[0]["sft_loss"])
    return {"sft/loss_first": losses[0], "sft/loss_last": losses[-1]} if losses else {}


def save(c: Cluster, inputs: RunInputs, pos: Position, timeout: float | None = None) -> Path:
    """Checkpoint the trainers as step_NNNNNN: written as step_NNNNNN.tmp and renamed once every rank is done,
    so a save cut off (a full disk, a kill) never leaves a checkpoint that --resume would pick up."""
    path = inputs.run_dir / "checkpoints" / f"step_{pos.step:06d}"
    if (path / "extra.json").exists():  # a failure right after a periodic save: nothing new to write
        return path
    extra = {"step": pos.step, "data": pos.data}
    if pos.carry is not None:  # loop.mode=async: the samples carried into the next step
        extra["async_buffer"] = pos.carry
    tmp = path.with_name(path.name + ".tmp")
    for stale in (tmp, path):  # a save of this step cut off earlier
        shutil.rmtree(stale, ignore_errors=True)
    try:
        c.trainer_group.save_checkpoint(str(tmp), extra, timeout=timeout)
        tmp.rename(path)
    except BaseException as err:
        full = nearly_full(path.parent)  # asked before the half-written files go: they filled it
        shutil.rmtree(tmp, ignore_errors=True)  # half-written: gone, and its space with it
        if full and isinstance(err, Exception):  # torch's writer reports a short write as "unexpected pos"
            raise OSError(errno.ENOSPC, f"No space left on device: saving {path.name} failed "
                                        f"({(str(err).strip().splitlines() or [''])[0]})") from err
        raise
    return path


FULL_BELOW = 64 << 20  # free bytes under which a failed write is put down to a full disk


def nearly_full(path: Path) -> bool:
    try:
        return shutil.disk_usage(path).free < FULL_BELOW
    except OSError:
        return False


def restore(c: Cluster, inputs: RunInputs, writer: MetricsWriter) -> Position | None:
    """Load the newest checkpoint into the trainers and the data position; None when there is none."""
    if not checkpoints(inputs.run_dir):
        writer.resume_from(-2)  # an earlier attempt that never checkpointed: its records are redone
        return None
    last = str(checkpoints(inputs.run_dir)[-1])
    extra = c.trainer_group.load_checkpoint(last)
    inputs.train_data.load_state_dict(extra["data"])
    writer.resume_from(extra["step"])  # drops records of steps after the checkpoint: they are redone
    return Position(extra["step"], extra["data"], carry=extra.get("async_buffer"))


def fail(c: Cluster, inputs: RunInputs, pos: Position, e: Exception, keep_policy: bool,
         progress: ProgressLine | None = None) -> int:
    """Report a run-ending failure, checkpointing the trainers when they still hold a whole policy; status 1.

    The terminal gets one `colo: error:` line (who failed and why), the checkpoint and the --resume hint;
    the whole traceback (the driver's and, for an actor that raised, the remote one) is appended to
    <run.dir>/error.log, which that line names."""
    if progress:  # ends the bar's line: the error starts a line of its own
        progress.close()
    full = disk_full(e)
    try:
        where = f"traceback: {log_error(inputs.run_dir, e)}"
    except OSError as err:  # the disk that ended the run cannot take the traceback either
        where = f"traceback not written: {err.strerror or err}"
    actor_log = log_of(inputs.run_dir, getattr(e, "name", ""))  # ActorDied / ActorError name the actor
    what = (f"the disk of {inputs.run_dir} is full ({e}); fix: free space there, then continue the run"
            if full else str(e))
    lines = [f"colo: error: {what} ({where}" + (f"; its log: {actor_log})" if actor_log else ")")]
    if keep_policy and pos.step >= 0 and not full:  # a full disk would only fail the save a second time
        try:  # bounded: a rank stuck in a collective with a dead peer must not hang the exit
            save(c, inputs, pos, timeout=SAVE_ON_FAILURE_S)
        except Exception as err:  # noqa: BLE001 (report and exit; the periodic checkpoints remain)
            lines.append(f"colo: could not checkpoint step {pos.step}: {type(err).__name__}: {err}")
    if checkpoints(inputs.run_dir):
        lines.append(f"colo: newest checkpoint {checkpoints(inputs.run_dir)[-1]}; "
                     f"continue with: python -m colo.launch --resume run.dir={inputs.run_dir}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 1


def log_error(run_dir: Path, e: Exception) -> Path:
    """Append the failure's full traceback to <run_dir>/error.log (earlier failures of the run stay)."""
    path = run_dir / "error.log"
    text = "".join(traceback.format_exception(e))  # the chain: an actor's RayTaskError holds its remote traceback
    with path.open("a") as f:
        f.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} colo: error: {e}\n{text}\n")
    return path


SAVE_ON_FAILURE_S = 900.0  # a DCP save of a 30B model takes minutes; a hung collective takes forever


def disk_full(e: BaseException) -> bool:
    """ENOSPC anywhere in the failure: the driver's own OSError, or an actor's (inside a DCP CheckpointException)."""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    return "No space left on device" in "".join(traceback.format_exception(e))


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (colo.run.rundir.complete_checkpoints: renamed into place)."""
    return complete_checkpoints(run_dir)


def run(cfg: ColoConfig, warm: WarmClusters | None = None) -> int:
    """Run a whole job on a resolved config (colo.launch.prepare_run); returns the exit status.

    A reward function that raises or an actor that dies or raises ends the run with status 1 after a
    checkpoint of the last completed step, when the trainers still hold one (not after a trainer failed).
    `warm`: the job runs on a warm cluster of this process and leaves it (and Ray) running for the next job
    (colo.cluster.warm); without it the job starts its own actors and ends them, and Ray, when it ends."""
    t_start = time.perf_counter()
    stop = StopSignals()
    stop.install()  # from here on Ctrl-C / SIGTERM stop the run cleanly (colo.run.signals), start-up included
    inputs, cluster, writer, rewards, progress = None, None, None, None, None
    healthy = True  # every actor alive and trusted at the end (a warm cluster is kept only then)
    try:
        inputs = open_inputs(cfg)
        sweep()  # sync buffers and vLLM queues that killed runs left in this host's /dev/shm (colo.host.shm)
        plan = plan_placement(cfg)
        # the actors' output stays in <run.dir>/logs unless the run is verbose (colo.run.logs)
        init_ray(plan, address=cfg.run.ray_address, log_to_driver=cfg.run.verbose,
                 logging_level=logging.INFO if cfg.run.verbose else logging.ERROR)
        link_ray_logs(inputs.run_dir)
        stop.install()  # again: ray.init replaced the SIGTERM handler with its own
        cluster = warm.acquire(cfg, plan) if warm is not None else start_cluster(cfg, plan)
        stop.install()  # and whatever start-up imported may have too
        if len(cluster.ranks_by_node) > 1:  # a run over several nodes says where each rank is
            print("colo: nodes: " + "; ".join(f"{ip}: {', '.join(names)}"
                                               for ip, names in cluster.ranks_by_node.values()), flush=True)
        wandb = WandbSettings(cfg.run.wandb_project, cfg.run.wandb_mode, to_dict(cfg))
        writer = MetricsWriter(inputs.run_dir, loggers=list(cfg.run.loggers), wandb=wandb)
        rewards = RewardRunner(list(cfg.algo.rewards), timeout_s=cfg.algo.reward_timeout_s)
    except KeyboardInterrupt:  # nothing trained yet: nothing to save
        print(f"colo: stopped by {stop.name} during start-up; nothing was trained, nothing saved",
              file=sys.stderr, flush=True)
        shut_down(cluster, None, None, None, stop, warm)
        return stop.exit_status
    except BaseException:
        shut_down(cluster, writer, None, rewards, stop, warm, healthy=False)
        raise
    pos = Position(-1, inputs.train_data.state_dict())
    try:
        try:
            check_sync(cluster)
        except MappingError as e:  # the model itself: nothing ran, nothing to save
            print(f"colo: error: {getattr(e, 'cause', None) or e}\nfix: a checkpoint of a family colo maps "
                  "(docs/models.md)", file=sys.stderr, flush=True)
            return 2
        restored = restore(cluster, inputs, writer) if cfg.run.resume else None
        probes = ProbeSchedule(inputs.probe_vocab, cfg.rollout.max_model_len, cfg.sync.probe_every)
        first = {} if restored else warm_up(cluster, cfg, inputs)
        seqs = probes.next()  # the first sync of every run is checked
        synced, policy = sync_all(cluster, seqs)
        check_probe(cluster, cfg, seqs, policy, synced)  # the engines are awake: they start so
        if restored:
            pos = restored
        else:
            setup = {f"setup/{k}": v for k, v in cluster.setup.items()}
            writer.log(-1, {**first, **synced, **setup, **evaluate(cluster, cfg, inputs, rewards)})
        if offloads(cluster, cfg):
            cluster.trainer_group.offload()
        progress = ProgressLine(cfg.loop.steps, initial_step=pos.step + 1)
        for step in range(pos.step + 1, cfg.loop.steps):
            metrics = rl_step(step, cluster, cfg, inputs, rewards, pos, stop, probes)  # holds a stop from its train
            last = step + 1 == cfg.loop.steps  # evaluated and saved too: --resume can extend a finished run
            if cfg.loop.eval_every and (step + 1) % cfg.loop.eval_every == 0 or last:
                metrics.update(evaluate(cluster, cfg, inputs, rewards))
            writer.log(step, metrics)
            progress.update(metrics)
            check_skipped(metrics, cfg.trainer.max_consecutive_skipped)
            if cfg.loop.checkpoint_every and (step + 1) % cfg.loop.checkpoint_every == 0 or last:
                save(cluster, inputs, pos)
            stop.release()  # the step is trained, logged and saved as configured: a stop that came meanwhile
        cluster.trainer_group.export_hf(str(inputs.run_dir / "export"))
        progress.close()
        print(run_summary(inputs.run_dir, time.perf_counter() - t_start, list(cfg.run.loggers), serve_command),
              flush=True)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (colo.run.signals)
        healthy = False  # an actor may still be in the call the signal cut short: a warm cluster is not kept
        return stopped(cluster, inputs, pos, stop, progress)
    except (RewardError, TrainingDiverged, SyncMismatch) as e:  # the trainers hold a whole policy: save it
        return fail(cluster, inputs, pos, e, keep_policy=True, progress=progress)
    except OSError as e:  # the driver's own writes (metrics, logs): a full or vanished disk
        return fail(cluster, inputs, pos, e, keep_policy=True, progress=progress)
    except (ActorDied, ActorError) as e:
        healthy = False
        # A lost node is the news, not the actor that noticed it first (a trainer whose gloo peer vanished).
        lost = node_loss(cluster, e)
        if lost is not None:
            return fail(cluster, inputs, pos, lost, keep_policy=not lost.trainers, progress=progress)
        # After an engine died or raised, the trainers still hold the policy: keep it. After a trainer did,
        # its shards are gone or may be half-updated (and its peers may sit in a collective): do not save.
        return fail(cluster, inputs, pos, e, keep_policy=e.name.startswith("engine"), progress=progress)
    finally:
        shut_down(cluster, writer, progress, rewards, stop, warm, healthy)
    return 0


def stopped(c: Cluster, inputs: RunInputs, pos: Position, stop: StopSignals, progress: ProgressLine | None) -> int:
    """A stop signal: checkpoint the last finished step (unless a second signal asks for haste), then one line
    saying what was saved and how to continue; the exit status is 130 (SIGINT) or 143 (SIGTERM)."""
    if progress:
        progress.close()
    hint = f"continue with: python -m colo.launch --resume run.dir={inputs.run_dir}"
    saved = None
    if pos.step >= 0 and not stop.hurry:
        try:
            saved = save(c, inputs, pos, timeout=SAVE_ON_FAILURE_S)
        except KeyboardInterrupt:  # a second Ctrl-C during the save: exit at once, nothing half-written kept
            pass
        except Exception as err:  # noqa: BLE001 (report and exit; the periodic checkpoints remain)
            print(f"colo: could not checkpoint step {pos.step}: {type(err).__name__}: {err}", file=sys.stderr)
    newest = checkpoints(inputs.run_dir)[-1] if checkpoints(inputs.run_dir) else None
    if saved is not None:
        what = f"saved step {pos.step} in {saved}"
    elif newest is not None:
        what = (f"step {pos.step} not saved (second signal)" if pos.step >= 0 else "no RL step finished") + \
               f"; newest checkpoint {newest}"
    else:
        what = "no RL step finished yet, nothing saved" if pos.step < 0 else f"step {pos.step} not saved"
    print(f"colo: stopped by {stop.name}: {what}; {hint}", file=sys.stderr, flush=True)
    return stop.exit_status


def shut_down(cluster: Cluster | None, writer: MetricsWriter | None, progress: ProgressLine | None,
              rewards: RewardRunner | None, stop: StopSignals, warm: WarmClusters | None = None,
              healthy: bool = True) -> None:
    """Close the run's files and stop its actors, Ray and their shared memory; never raises, and every step runs
    even when one fails (a full disk fails metrics.png). A stop signal that arrives now only hurries it. With
    `warm`, the cluster goes back to it instead (kept when `healthy`) and Ray keeps running."""
    stop.closing = True  # no KeyboardInterrupt in the middle of the cleanup: a second signal only shortens the wait
    try:
        if writer is not None:
            try:
                writer.close()  # metrics.png: on a full disk this fails too
            except OSError:
                pass
        if progress:
            progress.close()
        if rewards is not None:
            rewards.close()
        if warm is not None:
            if cluster is not None:
                try:
                    warm.release(cluster, healthy)
                except Exception as err:  # noqa: BLE001 (the job's outcome stands; its cluster is lost to reuse)
                    print(f"colo: could not return the cluster to the warm clusters: {err}", file=sys.stderr)
            return
        if cluster is not None and ray.is_initialized():
            # best effort, bounded: unlink the trainers' sync buffers and stop vLLM's engine cores (ray.shutdown
            # kills actors without their atexit hooks, which would leave segments in /dev/shm)
            gone = set(cluster.lost)  # actors on a lost node: a call would wait out the timeout
            ends = [a.shutdown.remote() for name, a in cluster.actors() if name not in gone]
            deadline = time.monotonic() + 30
            while ends and time.monotonic() < deadline and not stop.hurry:  # a second signal: stop waiting
                _, ends = ray.wait(ends, num_returns=len(ends), timeout=0.5)
        ray.shutdown()
        sweep()  # what an actor that did not get to its shutdown left in this host's /dev/shm
    finally:
        stop.restore()
