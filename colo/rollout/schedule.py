"""Rollout schedules: which samples a step trains on, when they were generated, and what a checkpoint keeps of them.

    schedule = schedule_for(cfg, engines, train_data, colocated)   # picked once per run (colo.loop.Job)
    got = schedule.batch(step)         # the rollout phase: Rollout(prompts, samples, metrics, stats)
    schedule.trained(step)             # after the train phase (its 'wait'): the trainers hold step's weights now
    schedule.position                  # what they hold, as a checkpoint records it: Position(step, data, carry)
    schedule.restore(position)         # --resume: the data position and what was carried

- SyncRollout (loop.mode=sync): each step generates its own batch with the weights the step before synced: on
  policy. Both placements.
- CarriedRollout (loop.mode=async, colocated): partial rollouts carried between steps (colo.rollout.buffer): drop
  stale groups, top up to rollout.oversample x prompts_per_step groups, run every unfinished sample until
  prompts_per_step whole groups exist (each engine's share below), train on those; the rest waits for the next step.
  With algo.environment the samples are conversations, carried mid-turn with their exact history
  (colo.rollout.partial_turns).
- AheadRollout (loop.mode=async, disaggregated): the engines generate step s+1's batch while the trainers train
  on step s's (colo.rollout.ahead); `trained` waits for what is left of it, the timeline's `wait` phase.

The position is recorded when the trainers hold a step's weights (`trained`), never while a step's rollout is
under way, so a failure or a stop at any point saves a step whose data position and carried samples belong to it,
and a resume redoes no step and skips none. Rollout seeds depend only on (run.seed, step).

`engines`: colo.cluster.actors.EngineGroup (colo.rollout.generation.Engines). Plain bookkeeping over it: no
placement here (colo.cluster.sides has the sleeps and wakes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from colo.rollout.ahead import Ahead, GenerateAhead
from colo.rollout.buffer import RolloutBuffer
from colo.rollout.generation import Engines, Generation, Pending, collect, generate, submit


@dataclass
class Position:
    """What the trainers hold: the weights after RL step `step` (-1: warm-up only), the data position after
    that step's batch and what the schedule carries into the next step (None: nothing)."""

    step: int
    data: dict
    carry: dict | None = field(default=None, repr=False)


@dataclass
class Rollout:
    """The rollout phase's result: prompts and their samples (prompt order, prompt_index into prompts), the
    schedule's async/* metrics and the engines' stats ({"env_s"} for conversations)."""

    prompts: list[dict]
    samples: list[dict]
    metrics: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


def rollout_seed(cfg: Any, step: int) -> int:
    """The sampling seed of step `step`'s batch (engine r adds r)."""
    return cfg.run.seed * 100_003 + step * 1_009


class SyncRollout:
    """loop.mode=sync; the base of the others: the position and its restore."""

    def __init__(self, cfg: Any, engines: Engines, data: Any) -> None:
        """`data`: the run's training prompts (colo.data.prompts.PromptDataset: next_batch, state_dict)."""
        self.cfg, self.engines, self.data = cfg, engines, data
        self.position = Position(-1, data.state_dict())

    def batch(self, step: int) -> Rollout:
        prompts = self.data.next_batch(self.cfg.data.prompts_per_step)
        # routing every step: routing/mismatch is logged with replay on or off
        samples, stats = generate(self.engines, prompts, self.cfg.rollout.n, self.cfg, greedy=False,
                                  seed=rollout_seed(self.cfg, step), routing=True)
        return Rollout(prompts, samples, {}, stats)

    def trained(self, step: int) -> None:
        """The trainers hold step's weights: from here on a failure saves this step."""
        self.position = Position(step, self.data.state_dict(), self._carry())

    def restore(self, position: Position) -> None:
        """A checkpoint's position (colo.runlife.restore): the data position, and what the step carried."""
        self.data.load_state_dict(position.data)
        self._load_carry(position.carry)
        self.position = position

    def _carry(self) -> dict | None:
        return None

    def _load_carry(self, carry: dict | None) -> None:
        """A sync step carries nothing (what an async run's checkpoint carried is generated afresh)."""


class CarriedRollout(SyncRollout):
    """loop.mode=async on colocated engines (docs/config.md, "Async"): see the module docstring."""

    def __init__(self, cfg: Any, engines: Engines, data: Any) -> None:
        super().__init__(cfg, engines, data)
        self.buffer = RolloutBuffer(cfg.rollout.n, cfg.rollout.max_tokens, cfg.loop.max_staleness,
                                    turns=bool(cfg.algo.environment))  # conversations: colo.rollout.partial_turns

    def batch(self, step: int) -> Rollout:
        buf, k, cfg = self.buffer, self.cfg.data.prompts_per_step, self.cfg
        buf.drop_stale(step)
        new = buf.wanted(math.ceil(cfg.rollout.oversample * k))
        if new:
            buf.add(self.data.next_batch(new), seed=rollout_seed(cfg, step))
        reqs = buf.requests()
        per_engine, quota = share(reqs, buf.need(k), len(self.engines.engines))
        gens = [Generation(r, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, routing=True,
                           kind="partial", need_groups=q) for r, q in zip(per_engine, quota)]
        results = self.engines.collect(self.engines.submit(gens))
        buf.absorb([r for rs in per_engine for r in rs], [o for outs, _ in results for o in outs], version=step)
        prompts, samples = buf.take(k, step)
        stats = [st for _, st in results if st]  # conversations: {"env_s"} per engine
        env = {"env_s": max(st["env_s"] for st in stats)} if stats else {}
        return Rollout(prompts, samples, buf.metrics(samples, step), env)

    def _carry(self) -> dict:
        return self.buffer.state_dict()

    def _load_carry(self, carry: dict | None) -> None:
        if carry and carry.get("kind") == "ahead":
            raise ValueError("the checkpoint holds a batch the disaggregated async step generated ahead; fix: "
                             "resume it with placement.mode=disaggregated")
        if carry:
            self.buffer.load_state_dict(carry)


def share(requests: list[dict], need: int, engines: int) -> tuple[list[list[dict]], list[int]]:
    """CarriedRollout's split: the sample requests per engine, and how many whole groups each must finish. Groups go
    round robin over the engines (a carried sample resumes anywhere: its KV is recomputed anyway), and the `need`
    groups still to finish are shared the same way, so no engine's quota exceeds the groups it holds."""
    order = list(dict.fromkeys(r["group"] for r in requests))  # oldest group first
    engine_of = {g: i % engines for i, g in enumerate(order)}
    quota = [0] * engines
    for i in range(min(need, len(order))):
        quota[i % engines] += 1
    return [[r for r in requests if engine_of[r["group"]] == e] for e in range(engines)], quota


class AheadRollout(SyncRollout):
    """loop.mode=async on disaggregated engines, one step off policy (colo.rollout.ahead): step s trains on the
    batch generated during step s-1 (the first step, and a resume whose checkpoint holds none, generate theirs at
    once) while the engines generate step s+1's."""

    def __init__(self, cfg: Any, engines: Engines, data: Any) -> None:
        super().__init__(cfg, engines, data)
        self.ahead = GenerateAhead()
        self.pending: tuple[list[dict], Pending, dict] | None = None  # next prompts, their generation, data before

    def batch(self, step: int) -> Rollout:
        k, n, cfg = self.cfg.data.prompts_per_step, self.cfg.rollout.n, self.cfg
        batch = self.ahead.take()
        if batch is None:
            prompts = self.data.next_batch(k)
            samples, _ = generate(self.engines, prompts, n, cfg, greedy=False, seed=rollout_seed(cfg, step),
                                  routing=True)
            batch = Ahead(prompts, samples, step)
        before = self.data.state_dict()
        nxt = self.data.next_batch(k)
        self.pending = (nxt, submit(self.engines, nxt, n, cfg, greedy=False, seed=rollout_seed(cfg, step + 1),
                                    routing=True), before)
        return Rollout(batch.prompts, batch.samples, GenerateAhead.metrics(batch, step, cfg.loop.max_staleness))

    def trained(self, step: int) -> None:
        """Until the next batch is in hand, a checkpoint leaves its prompts to be drawn again; then it holds it."""
        assert self.pending is not None, "trained() before batch()"
        nxt, pending, before = self.pending
        self.position = Position(step, before, self.ahead.state_dict())
        self.ahead.put(Ahead(nxt, collect(self.engines, pending)[0], step))  # what the engines have left of it
        self.pending = None
        super().trained(step)

    def _carry(self) -> dict:
        return self.ahead.state_dict()

    def _load_carry(self, carry: dict | None) -> None:
        if carry and carry.get("kind") != "ahead":
            raise ValueError("the checkpoint holds samples carried by the colocated async step; fix: resume it "
                             "with placement.mode=colocated")
        if carry:
            self.ahead.load_state_dict(carry)


def schedule_for(cfg: Any, engines: Engines, data: Any, colocated: bool) -> SyncRollout:
    """The run's schedule, from loop.mode and the placement."""
    if cfg.loop.mode == "sync":
        return SyncRollout(cfg, engines, data)
    return CarriedRollout(cfg, engines, data) if colocated else AheadRollout(cfg, engines, data)
