"""Generation over every engine: what one engine generates in one call (Generation), and how the driver spreads a
step's prompts over the engines and gathers their samples back in prompt order.

    samples, stats = generate(engines, prompts, n, cfg, greedy=False, seed=s, routing=True)   # submit + collect
    pending = submit(engines, prompts, n, cfg, greedy=False, seed=s)   # started, not waited for (generate-ahead)
    samples, stats = collect(engines, pending)

Every call is the same request: samples to start or resume (colo.rollout.sample.Sample, as arrays over Ray), the
sampling settings, and when to stop (every sample, or `stop_after` whole groups: loop.mode=async on colocated engines,
colo.rollout.schedule.Carried). The engine runs them through its one loop (colo.rollout.engine_loop), conversations
with algo.environment.

Prompts go round robin over the engines (counts differ by at most one); engine r's prompt i (its own numbering) gets
samples seeded seed + r + i*n + j; the samples come back sorted by their prompt (Sample.group: the prompt's index in
`prompts`), each prompt's n samples together.

`engines` is colo.cluster.actors.EngineGroup (or a stand-in with its submit/collect: tests/unit/test_step_order.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from colo.rollout.sample import Sample, SampleArrays, pack


@dataclass(frozen=True)
class Generation:
    """What one engine generates in one call (Engine.generate)."""

    samples: SampleArrays  # to start (fresh) or resume (carried), without the routing rows the driver holds
    max_tokens: int  # response tokens per sample (a conversation's: the model's and the environment's)
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    routing: bool = False  # each sample also gets the rows of the experts its tokens were routed to (R3)
    stop_after: int | None = None  # stop the rest once this many whole groups ended; None: every sample to its end
    version: int = 0  # the engine's weights (the RL updates they came from): stamped on every new token
    rows: dict[int, dict] = field(default_factory=dict)  # algo.environment: group -> the data row reset() gets

    @classmethod
    def fresh(cls, prompts: list[list[int]], n: int = 1, max_tokens: int = 16, temperature: float = 1.0,
              top_p: float = 1.0, seed: int = 0, routing: bool = False) -> Generation:
        """n fresh samples of each prompt (group i = prompts[i]), seeded seed + i*n + j: one engine's share of a
        single-turn step, or a direct call (benchmarks, tests)."""
        return cls(pack(fresh_samples(prompts, n, seed)), max_tokens, temperature, top_p, routing)


def fresh_samples(prompts: list[list[int]], n: int, seed: int, groups: list[int] | None = None) -> list[Sample]:
    """n samples of each prompt, nothing generated; sample j of prompt k draws from seed + k*n + j (a conversation's
    prompts are [] until its environment's reset). `groups`: each prompt's group (default: its position)."""
    groups = list(range(len(prompts))) if groups is None else groups
    return [Sample(g, j, seed + k * n + j, [int(t) for t in p]) for k, (g, p) in enumerate(zip(groups, prompts))
            for j in range(n)]


class Engines(Protocol):
    """What generation needs of the engines (colo.cluster.actors.EngineGroup)."""

    engines: list

    def submit(self, gens: list[Generation]) -> list: ...

    def collect(self, refs: list) -> list[tuple[SampleArrays, dict]]: ...


@dataclass
class Pending:
    """Generation started on every engine, not yet collected."""

    refs: list = field(repr=False)


def chunks(prompts: int, engines: int) -> list[list[int]]:
    """Prompt indices per engine, round robin."""
    return [list(range(r, prompts, engines)) for r in range(engines)]


def submit(engines: Engines, prompts: list[dict], n: int, cfg: Any, *, greedy: bool, seed: int,
           routing: bool = False, version: int = 0) -> Pending:
    """Start generating n samples per prompt on every engine (conversations with algo.environment); `greedy`:
    temperature 0 (evaluation); `version`: the engines' weights."""
    temp, top_p = (0.0, 1.0) if greedy else (cfg.rollout.temperature, cfg.rollout.top_p)
    turns = bool(cfg.algo.environment)
    gens = []
    for r, ix in enumerate(chunks(len(prompts), len(engines.engines))):
        ids = [[] if turns else prompts[i]["prompt_ids"] for i in ix]  # a conversation's come from its reset
        gens.append(Generation(pack(fresh_samples(ids, n, seed + r, groups=ix)), cfg.rollout.max_tokens, temp, top_p,
                               routing, version=version, rows={i: prompts[i] for i in ix} if turns else {}))
    return Pending(engines.submit(gens))


def collect(engines: Engines, pending: Pending) -> tuple[list[Sample], dict]:
    """(samples in prompt order, {"env_s": the longest any engine waited for its environments} for conversations,
    else {})."""
    answers = engines.collect(pending.refs)
    samples = [s for arrays, _ in answers for s in arrays.unpack()]
    stats = [st for _, st in answers if st]
    env = {"env_s": max(st["env_s"] for st in stats)} if stats else {}
    return sorted(samples, key=lambda s: s.group), env  # stable: each prompt's n samples stay together


def generate(engines: Engines, prompts: list[dict], n: int, cfg: Any, *, greedy: bool, seed: int,
             routing: bool = False, version: int = 0) -> tuple[list[Sample], dict]:
    """submit, then collect."""
    return collect(engines, submit(engines, prompts, n, cfg, greedy=greedy, seed=seed, routing=routing,
                                   version=version))
