"""Rollout schedules: which samples a step trains on, when they were generated, and what a checkpoint keeps of them.

    schedule = schedule_for(cfg, engines, train_data, colocated)   # picked once per run (colo.loop.Job)
    got = schedule.batch(step)         # the rollout phase: Rollout(prompts, samples, metrics, stats)
    schedule.trained(step)             # after the train phase (its 'wait'): the trainers hold step's weights now
    schedule.state_dict()              # what they hold, as a checkpoint records it: {"step", "data", "carry"}
    schedule.load_state_dict(state)    # --resume: the data position and what was carried

Three siblings, one Protocol (RolloutSchedule):
- Sync (loop.mode=sync): each step generates its own batch with the weights the step before synced: on policy. Both
  placements.
- Carried (loop.mode=async, colocated): partial rollouts carried between steps (colo.rollout.buffer): drop stale
  groups, top up to rollout.oversample x prompts_per_step groups, run every unfinished sample until prompts_per_step
  whole groups exist (each engine's share below), train on those; the rest waits for the next step. With
  algo.environment the samples are conversations, carried mid-turn with their exact history (colo.rollout.turns).
- Ahead (loop.mode=async, disaggregated): the engines generate step s+1's batch while the trainers train on step s's
  (colo.rollout.ahead); `trained` waits for what is left of it, the timeline's `wait` phase.

The position is recorded when the trainers hold a step's weights (`trained`), never while a step's rollout is under
way, so a failure or a stop at any point saves a step whose data position and carried samples belong to it, and a
resume redoes no step and skips none. Rollout seeds depend only on (run.seed, step).

`engines`: colo.cluster.actors.EngineGroup (colo.rollout.generation.Engines). Plain bookkeeping over it: no placement
here (colo.cluster.sides has the sleeps and wakes).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from colo.rollout.ahead import AheadBatch, GenerateAhead
from colo.rollout.buffer import RolloutBuffer
from colo.rollout.generation import Engines, Generation, Pending, collect, generate, submit
from colo.rollout.sample import Sample, pack


@dataclass
class Position:
    """What the trainers hold: the weights after RL step `step` (-1: warm-up only), the data position after that
    step's batch and what the schedule carries into the next step (None: nothing)."""

    step: int
    data: dict
    carry: dict | None = field(default=None, repr=False)

    def state_dict(self) -> dict:
        return asdict(self)


@dataclass
class Rollout:
    """The rollout phase's result: prompts and their samples (prompt order, Sample.group an index into prompts),
    the schedule's async/* metrics and the engines' stats ({"env_s"} for conversations)."""

    prompts: list[dict]
    samples: list[Sample]
    metrics: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


class RolloutSchedule(Protocol):
    """What the step (colo.loop.rl_step) and the run (colo.loop.run, colo.runlife) ask of a schedule."""

    @property
    def position(self) -> Position:
        """What the trainers hold, as a checkpoint records it."""

    def batch(self, step: int) -> Rollout:
        """The rollout phase of step `step`."""

    def trained(self, step: int) -> None:
        """The trainers hold step's weights: from here on a failure saves this step."""

    def state_dict(self) -> dict:
        """The position as plain data: {"step", "data", "carry"}."""

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's position: the data position, and what the step carried."""

    def restore(self, position: Position) -> None:
        """load_state_dict of a Position (colo.loop.run's --resume)."""


def rollout_seed(cfg: Any, step: int) -> int:
    """The sampling seed of step `step`'s batch (engine r adds r)."""
    return cfg.run.seed * 100_003 + step * 1_009


class Sync:
    """loop.mode=sync: see the module docstring."""

    def __init__(self, cfg: Any, engines: Engines, data: Any) -> None:
        """`data`: the run's training prompts (colo.data.prompts.PromptDataset: next_batch, state_dict)."""
        self.cfg, self.engines, self.data = cfg, engines, data
        self.position = Position(-1, data.state_dict())

    def batch(self, step: int) -> Rollout:
        prompts = self.data.next_batch(self.cfg.data.prompts_per_step)
        # routing every step: routing/mismatch is logged with replay on or off
        samples, stats = generate(self.engines, prompts, self.cfg.rollout.n, self.cfg, greedy=False,
                                  seed=rollout_seed(self.cfg, step), routing=True, version=step)
        return Rollout(prompts, samples, {}, stats)

    def trained(self, step: int) -> None:
        self.position = Position(step, self.data.state_dict())

    def state_dict(self) -> dict:
        return self.position.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """A sync step carries nothing (what an async run's checkpoint carried is generated afresh)."""
        self.data.load_state_dict(state["data"])
        self.position = Position(state["step"], state["data"], state.get("carry"))

    def restore(self, position: Position) -> None:
        self.load_state_dict(position.state_dict())


class Carried:
    """loop.mode=async on colocated engines (docs/config.md, "Async"): see the module docstring."""

    def __init__(self, cfg: Any, engines: Engines, data: Any) -> None:
        self.cfg, self.engines, self.data = cfg, engines, data
        self.turns = bool(cfg.algo.environment)  # conversations: colo.rollout.turns
        self.buffer = RolloutBuffer(cfg.rollout.n, cfg.loop.max_staleness, turns=self.turns)
        self.position = Position(-1, data.state_dict())

    def batch(self, step: int) -> Rollout:
        buf, k, cfg = self.buffer, self.cfg.data.prompts_per_step, self.cfg
        buf.drop_stale(step)
        new = buf.wanted(math.ceil(cfg.rollout.oversample * k))
        if new:
            buf.add(self.data.next_batch(new), seed=rollout_seed(cfg, step))
        per_engine, quota = share(buf.requests(), buf.need(k), len(self.engines.engines))
        gens = [Generation(pack(reqs), cfg.rollout.max_tokens, cfg.rollout.temperature, cfg.rollout.top_p,
                           routing=True, stop_after=q, version=step,
                           rows=buf.rows({s.group for s in reqs}) if self.turns else {})
                for reqs, q in zip(per_engine, quota)]
        results = self.engines.collect(self.engines.submit(gens))
        buf.absorb([s for arrays, _ in results for s in arrays.unpack()])
        prompts, samples = buf.take(k, step)
        stats = [st for _, st in results if st]  # conversations: {"env_s"} per engine
        env = {"env_s": max(st["env_s"] for st in stats)} if stats else {}
        return Rollout(prompts, samples, buf.metrics(samples, step), env)

    def trained(self, step: int) -> None:
        self.position = Position(step, self.data.state_dict(), self.buffer.state_dict())

    def state_dict(self) -> dict:
        return self.position.state_dict()

    def load_state_dict(self, state: dict) -> None:
        carry = state.get("carry")
        if carry and carry.get("kind") == "ahead":
            raise ValueError("the checkpoint holds a batch the disaggregated async step generated ahead; fix: "
                             "resume it with placement.mode=disaggregated")
        self.data.load_state_dict(state["data"])
        if carry:
            self.buffer.load_state_dict(carry)
        self.position = Position(state["step"], state["data"], carry)

    def restore(self, position: Position) -> None:
        self.load_state_dict(position.state_dict())


def share(requests: list[Sample], need: int, engines: int) -> tuple[list[list[Sample]], list[int]]:
    """Carried's split: the samples per engine, and how many whole groups each must finish. Groups go round robin over
    the engines (a carried sample resumes anywhere: its KV is recomputed anyway), and the `need` groups still to finish
    are shared the same way, so no engine's quota exceeds the groups it holds."""
    order = list(dict.fromkeys(s.group for s in requests))  # oldest group first
    engine_of = {g: i % engines for i, g in enumerate(order)}
    quota = [0] * engines
    for i in range(min(need, len(order))):
        quota[i % engines] += 1
    return [[s for s in requests if engine_of[s.group] == e] for e in range(engines)], quota


class Ahead:
    """loop.mode=async on disaggregated engines, one step off policy (colo.rollout.ahead): step s trains on the batch
    generated during step s-1 (the first step, and a resume whose checkpoint holds none, generate theirs at once) while
    the engines generate step s+1's."""

    def __init__(self, cfg: Any, engines: Engines, data: Any) -> None:
        self.cfg, self.engines, self.data = cfg, engines, data
        self.ahead = GenerateAhead()
        self.pending: tuple[list[dict], Pending, dict] | None = None  # next prompts, their generation, data before
        self.position = Position(-1, data.state_dict())

    def batch(self, step: int) -> Rollout:
        k, n, cfg = self.cfg.data.prompts_per_step, self.cfg.rollout.n, self.cfg
        batch = self.ahead.take()
        if batch is None:
            prompts = self.data.next_batch(k)
            samples, _ = generate(self.engines, prompts, n, cfg, greedy=False, seed=rollout_seed(cfg, step),
                                  routing=True, version=step)
            batch = AheadBatch(prompts, samples, step)
        before = self.data.state_dict()
        nxt = self.data.next_batch(k)
        self.pending = (nxt, submit(self.engines, nxt, n, cfg, greedy=False, seed=rollout_seed(cfg, step + 1),
                                    routing=True, version=step), before)
        return Rollout(batch.prompts, batch.samples, GenerateAhead.metrics(batch, step, cfg.loop.max_staleness))

    def trained(self, step: int) -> None:
        """Until the next batch is in hand, a checkpoint leaves its prompts to be drawn again; then it holds it."""
        assert self.pending is not None, "trained() before batch()"
        nxt, pending, before = self.pending
        self.position = Position(step, before, self.ahead.state_dict())
        self.ahead.put(AheadBatch(nxt, collect(self.engines, pending)[0], step))  # what the engines have left of it
        self.pending = None
        self.position = Position(step, self.data.state_dict(), self.ahead.state_dict())

    def state_dict(self) -> dict:
        return self.position.state_dict()

    def load_state_dict(self, state: dict) -> None:
        carry = state.get("carry")
        if carry and carry.get("kind") != "ahead":
            raise ValueError("the checkpoint holds samples carried by the colocated async step; fix: resume it "
                             "with placement.mode=colocated")
        self.data.load_state_dict(state["data"])
        if carry:
            self.ahead.load_state_dict(carry)
        self.position = Position(state["step"], state["data"], carry)

    def restore(self, position: Position) -> None:
        self.load_state_dict(position.state_dict())


def schedule_for(cfg: Any, engines: Engines, data: Any, colocated: bool) -> RolloutSchedule:
    """The run's schedule, from loop.mode and the placement."""
    if cfg.loop.mode == "sync":
        return Sync(cfg, engines, data)
    return Carried(cfg, engines, data) if colocated else Ahead(cfg, engines, data)
