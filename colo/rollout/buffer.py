"""RolloutBuffer: what loop.mode=async carries between steps, and the train batch it hands the step.

    buf = RolloutBuffer(n=8, max_staleness=1)
    dropped = buf.drop_stale(step)                   # groups with a token older than max_staleness versions
    buf.add(new_prompts, seed)                       # top up to rollout.oversample x prompts_per_step
    reqs = buf.requests()                            # every unfinished sample, as an engine gets it (Sample.for_engine)
    buf.absorb(engine_samples)                       # what the engines made of them: one segment more each
    prompts, samples = buf.take(prompts_per_step, step)   # whole groups only, oldest first

Versions: the engine's weights at step s come from s RL updates (step -1 is the SFT warm-up), so a token
sampled at step s has version s, and at step s its staleness is s - version (0: on-policy). A group is a
prompt with its n samples (colo.rollout.sample.Sample: per response token, the token, vLLM's log-prob of it, the
behaviour policy's, docs/loss.md, and its version, which the engine stamps; the routing rows, R3). Only whole
groups are trained (the group is the GRPO baseline). Before anything resumes at step s, a group holding a
token of version < s - max_staleness is dropped: it could only get older. So no trained token is staler than
max_staleness (`take` checks it).

With algo.environment (`turns`) a sample is a conversation (colo.rollout.turns): its prompt ids come from the
environment's reset ([] until its first segment), a model_mask marks the model's tokens, and its Turns (turn spans,
the turn in progress, the environment's counts) travel with it. Versions are kept for every token, but only the
model's count for staleness, dropping and metrics: the environment's tokens are never trained.

Plain bookkeeping: no Ray, no vLLM; colo.rollout.schedule.Carried drives the engines.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from colo.rollout.sample import Sample, SampleArrays, Turns, pack


@dataclass
class Group:
    prompt: dict  # the data row: prompt_ids, prompt_text, answer, ...
    samples: list[Sample]  # its n samples; Sample.group is the group's id

    def complete(self) -> bool:
        return all(s.done for s in self.samples)

    def oldest(self) -> int | None:
        """The oldest version among its trained tokens, the model's (None: no such token yet)."""
        return min((min(v) for v in (s.model_versions() for s in self.samples) if v), default=None)


@dataclass
class RolloutBuffer:
    n: int
    max_staleness: int
    turns: bool = False  # algo.environment: every sample is a conversation
    groups: dict[int, Group] = field(default_factory=dict)  # insertion order: oldest first
    next_id: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # this step's counters (metrics)

    def drop_stale(self, version: int) -> int:
        """Drop every group holding a token older than max_staleness versions at `version`; returns samples dropped.
        Starts the step's counters."""
        self.counts = dict.fromkeys(("dropped", "dropped_tokens", "completed", "resumed", "carried"), 0)
        for gid in [g for g, grp in self.groups.items()
                    if grp.oldest() is not None and version - grp.oldest() > self.max_staleness]:
            grp = self.groups.pop(gid)
            self.counts["dropped"] += self.n
            self.counts["dropped_tokens"] += sum(len(s.response_ids) for s in grp.samples)
        return self.counts["dropped"]

    def wanted(self, in_flight: int) -> int:
        """New prompts that bring the groups held to `in_flight`."""
        return max(0, in_flight - len(self.groups))

    def add(self, prompts: Sequence[dict], seed: int) -> None:
        """New groups; sample j of prompts[i] gets seed `seed + i * n + j` (the sync rollout's seeding)."""
        for i, p in enumerate(prompts):
            gid = self.next_id
            self.groups[gid] = Group(dict(p), [
                Sample(gid, j, seed + i * self.n + j, [] if self.turns else [int(t) for t in p["prompt_ids"]],
                       model_mask=[] if self.turns else None, turns=Turns() if self.turns else None)
                for j in range(self.n)])
            self.next_id += 1

    def need(self, batch_groups: int) -> int:
        """Whole groups still to finish for a batch of `batch_groups`."""
        return max(0, batch_groups - sum(g.complete() for g in self.groups.values()))

    def requests(self) -> list[Sample]:
        """Every unfinished sample as an engine gets it (Sample.for_engine: no routing rows), oldest group first."""
        return [s.for_engine() for g in self.groups.values() for s in g.samples if not s.done]

    def rows(self, groups: Sequence[int]) -> dict[int, dict]:
        """The data rows of `groups` (a conversation's environment resets with its row)."""
        return {g: self.groups[g].prompt for g in groups}

    def absorb(self, results: Sequence[Sample]) -> None:
        """What the engines made of requests(): each sample one segment further (its new tokens, their log-probs and
        versions, its routing rows, its status)."""
        for seg in results:
            s = self.groups[seg.group].samples[seg.index]
            if s.done:
                raise RuntimeError(f"group {seg.group} sample {seg.index}: a result for a sample that had ended")
            self.counts["resumed"] += bool(s.response_ids)
            s.merge(seg)
            self.counts["completed"] += s.done
        self.counts["carried"] = sum(not s.done for g in self.groups.values() for s in g.samples)

    def take(self, k: int, version: int) -> tuple[list[dict], list[Sample]]:
        """k whole groups, oldest first, out of the buffer: (prompts, samples) in colo.rollout.generation's form
        (prompt order then sample order, Sample.group an index into prompts), a sample's routing only where every
        row of it is there."""
        done = [gid for gid, g in self.groups.items() if g.complete()][:k]
        if len(done) < k:
            raise RuntimeError(f"async rollout: {len(done)} whole groups finished, {k} needed")
        for gid in done:  # checked before anything leaves the buffer
            staleness = version - min(self.groups[gid].oldest(), version)
            if staleness > self.max_staleness:
                raise RuntimeError(f"async rollout: a sample spans {staleness} weight versions, more than "
                                   f"loop.max_staleness={self.max_staleness}")
        prompts, samples = [], []
        for i, gid in enumerate(done):
            g = self.groups.pop(gid)
            prompts.append(g.prompt)
            for s in g.samples:
                s.group, s.routing, s.routed_from = i, s.complete_routing(), 0
                samples.append(s)
        return prompts, samples

    def state_dict(self) -> dict:
        """A JSON-able copy of what is carried (checkpoint extra.json; the samples as colo.rollout.sample's arrays)."""
        samples = [s for g in self.groups.values() for s in g.samples]
        return {"next_id": self.next_id, "prompts": [[gid, copy.deepcopy(g.prompt)] for gid, g in self.groups.items()],
                "samples": pack(samples).state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "samples" not in state:
            raise ValueError("the checkpoint carries async samples in the layout before colo.rollout.sample; fix: "
                             "resume it with the colo that wrote it, or start the run again")
        self.next_id = int(state["next_id"])
        self.groups = {int(gid): Group(prompt, []) for gid, prompt in state["prompts"]}
        for s in SampleArrays.from_state(state["samples"]).unpack():
            self.groups[s.group].samples.append(s)

    def metrics(self, samples: Sequence[Sample], version: int) -> dict:
        """The step's async/* metrics: token staleness of the batch, and the buffer's counters."""
        lag = np.array([version - v for s in samples for v in s.model_versions()], dtype=np.float64)
        out = {f"async/{k}": v for k, v in self.counts.items()}
        out.update({"async/staleness_mean": float(lag.mean()) if lag.size else 0.0,
                    "async/staleness_max": int(lag.max()) if lag.size else 0,
                    "async/offpolicy_frac": float((lag > 0).mean()) if lag.size else 0.0,
                    "async/buffered_groups": sum(g.complete() for g in self.groups.values())})
        return out
