"""GenerateAhead: loop.mode=async on disaggregated engines, one step off policy.

    ahead = GenerateAhead()
    batch = ahead.take()                      # the batch the engines generated during the last step, or None
    ahead.put(AheadBatch(prompts, samples, step))  # the next step's batch, generated while this step trained
    ahead.metrics(batch, step)                # async/* for the batch trained at `step`

Disaggregated engines sit on GPUs of their own, so they need not idle while the trainers train: step s trains
on the batch the engines generated during step s - 1 (with the weights of version s - 1, one update behind the
policy step s updates: staleness 1) while they generate step s + 1's batch with the weights of version s
(synced at the end of step s - 1). The first step, and a resume whose checkpoint holds no batch, generate
their batch at once (on policy). The trainer recomputes pi_old before its update and truncates the
behaviour-to-pi_old weight as TIS does (docs/loss.md, "Tokens from older weights"): the loss is the colocated
async step's, with every token of a batch one version behind. Versions are the RolloutBuffer's (colo.rollout.
buffer): a token sampled at step s has version s.

Plain bookkeeping: no Ray, no vLLM; colo.rollout.schedule.Ahead submits and collects. A checkpoint holds
the batch generated ahead (`state_dict`), so `--resume` trains on it instead of generating it again.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from colo.rollout.sample import Sample, SampleArrays, pack


@dataclass
class AheadBatch:
    prompts: list[dict]  # data rows, as train_data.next_batch gave them
    samples: list[Sample]  # colo.rollout.generation's: prompt order, Sample.group an index into `prompts`
    version: int  # the step during which the engines sampled it (their weights came from that many updates)


class GenerateAhead:
    def __init__(self) -> None:
        self.next: AheadBatch | None = None

    def take(self) -> AheadBatch | None:
        batch, self.next = self.next, None
        return batch

    def put(self, batch: AheadBatch) -> None:
        if self.next is not None:
            raise RuntimeError("GenerateAhead.put: the batch generated ahead was not trained on yet")
        self.next = batch

    @staticmethod
    def metrics(batch: AheadBatch, step: int, max_staleness: int) -> dict:
        """The step's async/* metrics, the colocated async step's keys: every response token of `batch` lags
        step - batch.version versions; nothing is carried, resumed or dropped (whole batches only)."""
        lag = step - batch.version
        if lag > max_staleness:
            raise RuntimeError(f"step {step} would train on tokens {lag} versions old (loop.max_staleness "
                               f"{max_staleness})")
        tokens = sum(len(s.response_ids) for s in batch.samples)
        return {"async/staleness_mean": float(lag) if tokens else 0.0, "async/staleness_max": lag if tokens else 0,
                "async/offpolicy_frac": 1.0 if tokens and lag > 0 else 0.0, "async/completed": len(batch.samples),
                "async/carried": 0, "async/dropped": 0, "async/dropped_tokens": 0, "async/resumed": 0,
                "async/buffered_groups": 0}

    def state_dict(self) -> dict:
        """A JSON-able copy of the batch generated ahead (checkpoint extra.json; the samples as arrays)."""
        if self.next is None:
            return {"kind": "ahead", "batch": None}
        return {"kind": "ahead", "batch": {"prompts": copy.deepcopy(self.next.prompts),
                                           "samples": pack(self.next.samples).state_dict(),
                                           "version": self.next.version}}

    def load_state_dict(self, state: dict) -> None:
        b = state.get("batch")
        if b is not None and isinstance(b["samples"], list):
            raise ValueError("the checkpoint holds a batch generated ahead in the layout before colo.rollout.sample; "
                             "fix: resume it with the colo that wrote it, or start the run again")
        self.next = None if b is None else AheadBatch(b["prompts"], SampleArrays.from_state(b["samples"]).unpack(),
                                                 int(b["version"]))
