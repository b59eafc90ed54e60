"""Generation over every engine: the one request an engine takes (Generation), and how the driver spreads
prompts over the engines and gathers the samples back in prompt order.

    samples, stats = generate(engines, prompts, n, cfg, greedy=False, seed=s, routing=True)   # submit + collect
    pending = submit(engines, prompts, n, cfg, greedy=False, seed=s)   # started, not waited for (generate-ahead)
    samples, stats = collect(engines, pending)

One request shape serves the three kinds of rollout, so the engine has one generation path
(colo.rollout.engine.Engine.generate: the sleeping guard, the run, the routing capture):
- "single": n samples per prompt (`items`: token ids per prompt);
- "turns": n conversations per row with algo.environment (`items`: the driver's rows; colo.rollout.multiturn);
- "partial": one segment of each sample request until `need_groups` groups finished (`items`: the sample
  requests of colo.rollout.buffer; colo.rollout.partial, or with algo.environment conversations,
  colo.rollout.partial_turns), loop.mode=async on colocated engines.

Prompts go round robin over the engines (counts differ by at most one), engine r samples with seed + r, and the
samples come back sorted by their global prompt index, each prompt's n samples together.

`engines` is colo.cluster.actors.EngineGroup (or a stand-in with its submit/collect: tests/unit/test_step_order.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

KINDS = ("single", "turns", "partial")


@dataclass(frozen=True)
class Generation:
    """What one engine generates in one call (Engine.generate). Prompt i's samples draw seeds seed + i * n + j, so a
    call is reproducible on its own; temperature 0 is greedy. `routing`: each sample also carries the experts the
    engine routed each token to (colo.rollout.capture; "partial": this segment's rows)."""

    items: list  # single: token ids per prompt; turns: the driver's rows; partial: sample requests
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    routing: bool = False
    kind: str = "single"
    need_groups: int = 0  # partial: stop the rest once this many whole groups finished

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Generation.kind {self.kind!r}: one of {KINDS}")


class Engines(Protocol):
    """What generation needs of the engines (colo.cluster.actors.EngineGroup)."""

    engines: list

    def submit(self, gens: list[Generation]) -> list: ...

    def collect(self, refs: list) -> list[tuple[list[dict], dict]]: ...


@dataclass
class Pending:
    """Generation started on every engine, not yet collected: which prompts each engine got, and its reference."""

    chunks: list[list[int]]  # engine e -> the global prompt indices it generates
    refs: list = field(repr=False)


def chunks(prompts: int, engines: int) -> list[list[int]]:
    """Prompt indices per engine, round robin."""
    return [list(range(r, prompts, engines)) for r in range(engines)]


def submit(engines: Engines, prompts: list[dict], n: int, cfg: Any, *, greedy: bool, seed: int,
           routing: bool = False) -> Pending:
    """Start generating n samples per prompt on every engine (multi-turn with algo.environment); `greedy`:
    temperature 0 (evaluation)."""
    idx = chunks(len(prompts), len(engines.engines))
    temp, top_p = (0.0, 1.0) if greedy else (cfg.rollout.temperature, cfg.rollout.top_p)
    turns = bool(cfg.algo.environment)
    gens = [Generation([prompts[i] if turns else prompts[i]["prompt_ids"] for i in ix], n, cfg.rollout.max_tokens,
                       temp, top_p, seed + r, routing, kind="turns" if turns else "single")
            for r, ix in enumerate(idx)]
    return Pending(idx, engines.submit(gens))


def collect(engines: Engines, pending: Pending) -> tuple[list[dict], dict]:
    """(samples in prompt order with global prompt_index, {"env_s": the longest any engine waited for its
    environments} for conversations, else {})."""
    answers = engines.collect(pending.refs)
    samples = []
    for ix, (outs, _) in zip(pending.chunks, answers):
        samples += [{**s, "prompt_index": ix[s["prompt_index"]]} for s in outs]
    stats = [st for _, st in answers if st]
    env = {"env_s": max(st["env_s"] for st in stats)} if stats else {}
    return sorted(samples, key=lambda s: s["prompt_index"]), env  # stable: each prompt's n samples stay together


def generate(engines: Engines, prompts: list[dict], n: int, cfg: Any, *, greedy: bool, seed: int,
             routing: bool = False) -> tuple[list[dict], dict]:
    """submit, then collect."""
    return collect(engines, submit(engines, prompts, n, cfg, greedy=greedy, seed=seed, routing=routing))

