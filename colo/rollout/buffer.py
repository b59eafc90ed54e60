"""RolloutBuffer: what loop.mode=async carries between steps, and the train batch it hands the step.

    buf = RolloutBuffer(n=8, max_tokens=1024, max_staleness=1)
    dropped = buf.drop_stale(step)                   # groups with a token older than max_staleness versions
    buf.add(new_prompts, seed)                       # top up to rollout.oversample x prompts_per_step
    reqs = buf.requests()                            # every unfinished sample: one engine request each
    buf.absorb(reqs, engine_results, version=step)   # one segment per sample (colo.rollout.partial)
    prompts, samples = buf.take(prompts_per_step, step)   # whole groups only, oldest first

Versions: the engine's weights at step s come from s RL updates (step -1 is the SFT warm-up), so a token
sampled at step s has version s, and at step s its staleness is s - version (0: on-policy). A group is a
prompt with its n samples; each sample keeps, per response token, the token, vLLM's log-prob of it (the
behaviour policy's, docs/loss.md) and its version, plus the routing rows of every segment (R3). Only whole
groups are trained (the group is the GRPO baseline). Before anything resumes at step s, a group holding a
token of version < s - max_staleness is dropped: it could only get older. So no trained token is staler than
max_staleness (`take` checks it).

With algo.environment (`turns`) a sample is a conversation (colo.rollout.partial_turns): its prompt ids come from
the environment's reset (None until its first segment), a model_mask marks the model's tokens, and the carried
bookkeeping (turn spans, the turn in progress, the environment's counts) travels with every request and comes back
updated. Versions are kept for every token, but only the model's count for staleness, dropping and metrics: the
environment's tokens are never trained.

Plain bookkeeping: no Ray, no vLLM; colo.rollout.schedule.CarriedRollout drives the engines.
"""
from __future__ import annotations

import base64
import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Group:
    prompt: dict  # the data row: prompt_ids, prompt_text, answer, ...
    samples: list[dict]  # n of {"response_ids", "logprobs", "versions", "routing": [segments], "finish_reason", "seed", "segments"}

    def complete(self) -> bool:
        return all(s["finish_reason"] is not None for s in self.samples)

    def oldest(self) -> int | None:
        """The oldest version among its trained tokens, the model's (None: no such token yet)."""
        return min((min(v) for v in map(model_versions, self.samples) if v), default=None)


def model_versions(sample: dict) -> list[int]:
    """The versions of the tokens the model sampled (a conversation's environment tokens left out)."""
    mask = sample.get("model_mask")
    return sample["versions"] if mask is None else [v for v, m in zip(sample["versions"], mask) if m]


CONVERSATION = {"turn_spans": [], "turn_reasons": [], "turn_tokens": 0, "turns": 0, "env_reward": 0.0,
                "tool_calls": 0, "tool_errors": 0, "env_error": None, "final_ids": []}
"""A new conversation's carried bookkeeping (colo.rollout.partial_turns reads and updates it)."""
TRAINED = ("env_reward", "turns", "tool_calls", "tool_errors", "env_error", "final_ids")
"""A finished conversation's keys a train sample takes (colo.algo.batch, colo.loop.score)."""


@dataclass
class RolloutBuffer:
    n: int
    max_tokens: int
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
            self.counts["dropped_tokens"] += sum(len(s["response_ids"]) for s in grp.samples)
        return self.counts["dropped"]

    def wanted(self, in_flight: int) -> int:
        """New prompts that bring the groups held to `in_flight`."""
        return max(0, in_flight - len(self.groups))

    def add(self, prompts: Sequence[dict], seed: int) -> None:
        """New groups; sample j of prompts[i] gets seed `seed + i * n + j` (the sync rollout's seeding)."""
        for i, p in enumerate(prompts):
            self.groups[self.next_id] = Group(dict(p), [
                {"response_ids": [], "logprobs": [], "versions": [], "routing": [], "finish_reason": None,
                 "seed": seed + i * self.n + j, "segments": 0, **(self._conversation() if self.turns else {})}
                for j in range(self.n)])
            self.next_id += 1

    @staticmethod
    def _conversation() -> dict:
        return {"prompt_ids": None, "model_mask": [], "conversation": copy.deepcopy(CONVERSATION)}

    def need(self, batch_groups: int) -> int:
        """Whole groups still to finish for a batch of `batch_groups`."""
        return max(0, batch_groups - sum(g.complete() for g in self.groups.values()))

    def requests(self) -> list[dict]:
        """One engine request per unfinished sample (a "partial" colo.rollout.generation.Generation), oldest group
        first; a conversation's also carries its row, its own prompt ids and its bookkeeping."""
        out = []
        for gid, g in self.groups.items():
            for j, s in enumerate(g.samples):
                if s["finish_reason"] is not None:
                    continue
                r = {"group": gid, "sample": j, "prompt_ids": list(g.prompt["prompt_ids"]),
                     "response_ids": list(s["response_ids"]), "max_tokens": self.max_tokens, "seed": s["seed"],
                     "segment": s["segments"]}
                if self.turns:
                    r |= {"row": g.prompt, "prompt_ids": s["prompt_ids"], "model_mask": list(s["model_mask"]),
                          "conversation": copy.deepcopy(s["conversation"])}
                out.append(r)
        return out

    def absorb(self, requests: Sequence[dict], results: Sequence[dict], version: int) -> None:
        """Append each request's new segment (tokens, log-probs, routing rows), sampled by weights `version`."""
        if len(requests) != len(results):
            raise ValueError(f"{len(requests)} requests but {len(results)} results")
        for r, out in zip(requests, results):
            s = self.groups[r["group"]].samples[r["sample"]]
            if len(s["response_ids"]) != len(r["response_ids"]):
                raise RuntimeError(f"group {r['group']} sample {r['sample']}: a result for a stale request")
            if len(out["tokens"]) != len(out["logprobs"]):
                raise RuntimeError(f"group {r['group']} sample {r['sample']}: {len(out['tokens'])} tokens, "
                                   f"{len(out['logprobs'])} log-probs")
            if self.turns:
                if len(out["model_mask"]) != len(out["tokens"]):
                    raise RuntimeError(f"group {r['group']} sample {r['sample']}: {len(out['tokens'])} tokens, "
                                       f"{len(out['model_mask'])} model_mask entries")
                s["model_mask"] += [int(m) for m in out["model_mask"]]
                s["prompt_ids"] = out["prompt_ids"]
                s["conversation"] = out["conversation"]
            self.counts["resumed"] += bool(s["response_ids"])
            s["response_ids"] += list(out["tokens"])
            s["logprobs"] += [float(x) for x in out["logprobs"]]
            s["versions"] += [version] * len(out["tokens"])
            if "routing" in out:
                s["routing"].append(np.asarray(out["routing"]))
            elif out["tokens"]:
                s["unrouted"] = True  # a segment without routing rows (GPU engines): the sample carries none
            s["segments"] += 1
            s["finish_reason"] = out["finish_reason"]
            if out["finish_reason"] is not None:
                self.counts["completed"] += 1
        self.counts["carried"] = sum(s["finish_reason"] is None for g in self.groups.values() for s in g.samples)

    def take(self, k: int, version: int) -> tuple[list[dict], list[dict]]:
        """k whole groups, oldest first, out of the buffer: (prompts, samples) in colo.rollout.generation's form
        (prompt order then sample order, prompt_index into prompts) plus per-token "versions"."""
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
                out = {"prompt_index": i, "prompt_ids": list(g.prompt["prompt_ids"]),
                       "response_ids": s["response_ids"], "logprobs": s["logprobs"], "versions": s["versions"],
                       "finish_reason": s["finish_reason"]}
                if self.turns:
                    conv = s["conversation"]
                    out |= {"prompt_ids": list(s["prompt_ids"]), "model_mask": s["model_mask"],
                            **{k: conv[k] for k in TRAINED}}
                if s["routing"] and not s.get("unrouted"):  # every segment that sampled was routed (CPU capture)
                    out["routing"] = np.concatenate(s["routing"], axis=0)
                samples.append(out)
        return prompts, samples

    def state_dict(self) -> dict:
        """A JSON-able copy of what is carried (checkpoint extra.json; routing rows as base64 of their bytes)."""
        groups = []
        for gid, g in self.groups.items():
            samples = [{**copy.deepcopy({k: v for k, v in s.items() if k != "routing"}),
                        "routing": [encode_array(a) for a in s["routing"]]} for s in g.samples]
            groups.append([gid, copy.deepcopy(g.prompt), samples])
        return {"next_id": self.next_id, "groups": groups}

    def load_state_dict(self, state: dict) -> None:
        self.next_id = int(state["next_id"])
        self.groups = {int(gid): Group(prompt, [{**s, "routing": [decode_array(a) for a in s["routing"]]} for s in samples])
                       for gid, prompt, samples in state["groups"]}

    def metrics(self, samples: Sequence[dict], version: int) -> dict:
        """The step's async/* metrics: token staleness of the batch, and the buffer's counters."""
        lag = np.array([version - v for s in samples for v in model_versions(s)], dtype=np.float64)
        out = {f"async/{k}": v for k, v in self.counts.items()}
        out.update({"async/staleness_mean": float(lag.mean()) if lag.size else 0.0,
                    "async/staleness_max": int(lag.max()) if lag.size else 0,
                    "async/offpolicy_frac": float((lag > 0).mean()) if lag.size else 0.0,
                    "async/buffered_groups": sum(g.complete() for g in self.groups.values())})
        return out


def encode_array(a: np.ndarray) -> dict:
    """A numpy array as JSON (a checkpoint's extra.json: the routing rows carried; colo.rollout.ahead too)."""
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def decode_array(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()
