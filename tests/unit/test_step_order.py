"""The order of an RL step's phases and of the cluster calls in each, for every rollout schedule on the placement it
runs on, recorded against a stand-in for the cluster (torchtitan's habit): RecordingCluster implements the
TrainerGroup / EngineGroup methods colo.loop.rl_step calls and records each call; the step itself, its schedule
(colo.rollout.schedule), its placement side (colo.cluster.sides), the batch, the rewards and the data are colo's
own. The engines' samples are made up (a fixed response per request); what the real actors do in this order is
tests/integration/test_families.py's (colocated, timed on every actor) and the e2e jobs'.

    .venv/bin/python -m pytest -q tests/unit/test_step_order.py
"""
from __future__ import annotations

import ast
import inspect
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from colo.algo.rewards import RewardRunner
from colo.cluster.sides import Colocated, Disaggregated, side_for
from colo.config import load_config, model_config_json
from colo.data.inputs import RunInputs
from colo.data.prompts import PromptDataset
from colo.loop import Job, rl_step
from colo.plan.resolve import resolve
from colo.rollout.generation import Generation
from colo.rollout.sample import SampleArrays, Status, pack
from colo.rollout.schedule import Ahead, Carried, Sync, rollout_seed, schedule_for
from colo.sync.probe import trainer_scores

K, N = 3, 2  # prompts per step, samples per prompt
# the layer check's records of a model without layers (colo.sync.forcing.Forcing.records): both sides agree
NO_LAYERS = {"order": [], "sites": {}, "rows": {}, "routing": {}, "problems": [], "forwards": 2, "expected_forwards": 2}
VOCAB = 512  # the tokenizer's


class RecordingTrainers:
    """TrainerGroup's interface as rl_step uses it."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def memory(self) -> list[dict]:
        self.log.append("|")  # the Timer's probe ends every phase (loop.memory_stats): the phases' boundary
        return [{"trainer_rss_gb": 1.0}]

    def onload(self) -> list[dict]:
        self.log.append("trainers.onload")
        return [{}]

    def offload(self) -> list[dict]:
        self.log.append("trainers.offload")
        return [{}]

    def train_step(self, shards: list[dict]) -> list[dict]:
        assert len(shards) == 2 and all(s["input_ids"].shape[0] > 0 for s in shards)
        self.log.append("trainers.train_step")
        return [{"loss": 0.0}]

    def sync_weights(self, probe: dict | None = None) -> list[dict]:
        self.log.append("trainers.sync_weights" + (" probe" if probe else ""))
        report = {"tensors": 1, "bytes": 8, "verified": True, "digest_checked": True, "seconds": 0.0}
        if probe:  # the policy's scores of the functional check: a uniform distribution over the vocabulary
            report["probe"] = {"scores": asdict(trainer_scores(*_uniform(probe["seqs"]))), "layers": NO_LAYERS}
        return [report] * 2


class RecordingEngines:
    """EngineGroup's interface: submit records what each engine was asked (every sample to its end, with the seed of
    its first sample, or `until` some groups ended), collect hands back made-up outputs (every sample finishes with 3
    tokens); `fail_collect`: the n-th collect raises."""

    def __init__(self, log: list[str], fail_collect: int | None = None) -> None:
        self.log, self.engines, self.fail_collect, self.collects = log, [None, None], fail_collect, 0

    def submit(self, gens: list[Generation]) -> list:
        assert len(gens) == len(self.engines) and len({g.stop_after is None for g in gens}) == 1
        g = gens[0]
        self.log.append("engines.submit " + (f"all seed={g.samples.meta[0, 2]}" if g.stop_after is None else "until"))
        return [self._outputs(g) for g in gens]

    def collect(self, refs: list) -> list[tuple[SampleArrays, dict]]:
        self.collects += 1
        self.log.append("engines.collect")
        if self.collects == self.fail_collect:
            raise RuntimeError("an engine died while generating ahead")
        return refs

    @staticmethod
    def _outputs(g: Generation) -> tuple[SampleArrays, dict]:
        samples = g.samples.unpack()
        for s in samples:
            s.extend([7, 8, 9], [-1.0] * 3, g.version)
            s.status, s.segments = Status.COMPLETED, s.segments + 1
        return pack(samples), {}

    def probe(self, probe: dict) -> list[dict]:
        self.log.append("engines.probe")
        logits, ids = _uniform(probe["seqs"])
        lp = torch.log_softmax(logits, -1)  # (S, T, V): what vLLM's prompt log-probs hold, top-8 and the actual token
        tables = [[None] + [{**{int(i): float(lp[s, t - 1, i]) for i in range(8)},
                             int(ids[s, t]): float(lp[s, t - 1, ids[s, t]])} for t in range(1, ids.shape[1])]
                  for s in range(ids.shape[0])]
        return [{"tables": tables, "layers": NO_LAYERS} for _ in self.engines]

    def sleep(self, level: int) -> list[float]:
        self.log.append(f"engines.sleep {level}")
        return [0.0]

    def wake_up(self, tags: list[str] | None) -> list[float]:
        self.log.append(f"engines.wake_up {','.join(tags or ['all'])}")
        return [0.0]


class RecordingCluster:
    """colo.cluster.actors.Cluster as rl_step, the schedules and the sides see it: two trainer ranks, two engines."""

    def __init__(self, colocated: bool, fail_collect: int | None = None) -> None:
        self.log: list[str] = []
        self.trainer_group = RecordingTrainers(self.log)
        self.engine_group = RecordingEngines(self.log, fail_collect)
        self.trainers, self.engines, self.colocated = [None, None], [None, None], colocated


@pytest.fixture(scope="module")
def tok():
    from colo.models.tokenizer import build_tokenizer

    return build_tokenizer(VOCAB)


def _job(tmp_path: Path, tok, mode: str, placement: str, fail_collect: int | None = None) -> Job:
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Question: {i}+1=? Answer:", "answer": str(i + 1)}) + "\n"
                            for i in range(20)))
    cfg = load_config(None, ["placement.device=cpu", f"placement.mode={placement}", f"loop.mode={mode}",
                             f"data.prompts_per_step={K}", f"rollout.n={N}", "rollout.max_tokens=8",
                             "trainer.offload=true", "loop.memory_stats=true", "rollout.oversample=1",
                             f"run.dir={tmp_path}/run"], {})
    cfg = resolve(cfg, model_config_json(cfg)).cfg  # as colo.launch hands it to the loop: no `auto` left
    data = PromptDataset(rows, tokenizer=tok, seed=0)
    c = RecordingCluster(placement == "colocated", fail_collect)
    inputs = RunInputs(tmp_path, tok, data, [], probe_vocab=len(tok))
    return Job.of(c, cfg, inputs, RewardRunner(["exact_match"]))


def _timeline(job: Job, metrics: dict) -> list[tuple[str, list[str]]]:
    """(phase, its cluster calls) in order: the phases from the step's memory/* keys (one probe per phase, in the
    order the phases ended), the calls split at the probes."""
    phases = list(dict.fromkeys(k.split("/")[1] for k in metrics if k.startswith("memory/")))
    calls, chunk = [], []
    for entry in job.cluster.log:
        if entry == "|":
            calls.append(chunk)
            chunk = []
        else:
            chunk.append(entry)
    assert not chunk, f"calls after the last phase: {chunk}"
    assert len(calls) == len(phases), (phases, calls)
    return list(zip(phases, calls))


PHASES = ["rollout", "reward", "sleep", "train", "wait", "sync", "offload", "wake", "probe"]


def _uniform(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(seqs)
    return torch.zeros(*ids.shape, VOCAB), ids  # (S, T, V) logits, (S, T) ids


def seed(job: Job, step: int) -> int:
    return rollout_seed(job.cfg, step)  # engine r adds r: engine 0's is recorded


# What each seam puts into the phases, per step; a combination's timeline is the two merged, phase by phase.
def schedule_calls(kind: str, job: Job, step: int) -> dict[str, list[str]]:
    if kind == "sync":
        return {"rollout": [f"engines.submit all seed={seed(job, step)}", "engines.collect"]}
    if kind == "carried":  # every unfinished sample one segment further, until K whole groups exist
        return {"rollout": ["engines.submit until", "engines.collect"]}
    # ahead: the first step generates its own batch; every step submits the next one and collects it in `wait`
    first = [f"engines.submit all seed={seed(job, step)}", "engines.collect"] if step == 0 else []
    return {"rollout": first + [f"engines.submit all seed={seed(job, step + 1)}"], "wait": ["engines.collect"]}


SIDE_CALLS = {
    "colocated": {"sleep": ["engines.sleep 2"], "train": ["trainers.onload", "trainers.train_step"],
                  "sync": ["engines.wake_up weights", "trainers.sync_weights"], "offload": ["trainers.offload"],
                  "wake": ["engines.wake_up kv_cache,scheduling"]},
    "disaggregated": {"train": ["trainers.train_step"], "sync": ["trainers.sync_weights"]},
}


# (loop.mode, placement.mode) -> the schedule and side the run is handed: the four combinations colo runs
COMBINATIONS = {("sync", "colocated"): ("sync", Sync, Colocated),
                ("sync", "disaggregated"): ("sync", Sync, Disaggregated),
                ("async", "colocated"): ("carried", Carried, Colocated),
                ("async", "disaggregated"): ("ahead", Ahead, Disaggregated)}


@pytest.mark.parametrize("mode, placement", list(COMBINATIONS))
def test_phase_order_of_every_schedule_on_its_placement(tmp_path: Path, tok, mode: str, placement: str) -> None:
    kind, schedule_cls, side_cls = COMBINATIONS[mode, placement]
    job = _job(tmp_path, tok, mode, placement)
    assert type(job.schedule) is schedule_cls and type(job.side) is side_cls
    for step in range(3):
        job.cluster.log.clear()
        metrics = rl_step(step, job)
        checked = step == 0  # the functional check: the run's first sync (step 0's: no warm-up here), then every 10th
        calls = {p: schedule_calls(kind, job, step).get(p, []) + SIDE_CALLS[placement].get(p, []) for p in PHASES}
        if checked:
            calls["sync"] = [c + " probe" if c == "trainers.sync_weights" else c for c in calls["sync"]]
            calls["probe"] = ["engines.probe"]
        assert _timeline(job, metrics) == list(calls.items()), step
        assert metrics["sync/probe"] == float(checked)
        # every phase is timed, offload apart from sync; the batch's build is a part of train
        assert [k for k in metrics if k.startswith("timing/") and not k.startswith("timing/batch")] == \
            [f"timing/{p}_s" for p in PHASES] + ["timing/step_s"]
        assert job.schedule.position.step == step  # a checkpoint after the step holds it
        assert metrics["reward/mean"] >= 0 and metrics["sync/verified"] is True


def test_the_other_combinations_are_never_built(tmp_path: Path, tok) -> None:
    """Carried samples need engines that stop when the trainers train (colocated); generate-ahead needs engines that
    keep generating while they do (disaggregated): schedule_for and side_for never pair them the other way."""
    for (mode, placement), (_, schedule_cls, side_cls) in COMBINATIONS.items():
        job = _job(tmp_path, tok, mode, placement)
        c = job.cluster
        assert type(schedule_for(job.cfg, c.engine_group, job.inputs.train_data, c.colocated)) is schedule_cls
        assert type(side_for(c, job.cfg)) is side_cls


def test_generate_ahead_checkpoints_the_step_without_the_batch_until_it_is_in_hand(tmp_path: Path, tok) -> None:
    """The position is recorded in `wait` before the engines are waited for: an engine that dies there leaves a
    position of the trained step whose data position redraws the next prompts (they were never generated); once
    collected, the position holds the batch and the data past it."""
    job = _job(tmp_path, tok, "async", "disaggregated", fail_collect=3)  # step 0's own, step 0's ahead, step 1's
    data = job.inputs.train_data
    rl_step(0, job)
    pos = job.schedule.position
    assert pos.step == 0 and pos.carry["batch"]["version"] == 0 and pos.data == data.state_dict()
    before = dict(data.state_dict())
    with pytest.raises(RuntimeError, match="generating ahead"):
        rl_step(1, job)
    pos = job.schedule.position
    assert pos.step == 1 and pos.carry == {"kind": "ahead", "batch": None} and pos.data == before
    # a resume from it trains step 2 on a batch of its own (on policy) drawn from those same prompts
    again = _job(tmp_path, tok, "async", "disaggregated")
    again.schedule.restore(pos)
    again.cluster.log.clear()
    metrics = rl_step(2, again)
    assert _timeline(again, metrics)[0] == ("rollout", [f"engines.submit all seed={seed(again, 2)}",
                                                        "engines.collect",
                                                        f"engines.submit all seed={seed(again, 3)}"])
    assert metrics["async/staleness_max"] == 0


def test_a_checkpoint_of_one_async_schedule_is_refused_by_the_other(tmp_path: Path, tok) -> None:
    carried = _job(tmp_path, tok, "async", "colocated")
    rl_step(0, carried)
    ahead = _job(tmp_path, tok, "async", "disaggregated")
    with pytest.raises(ValueError, match="resume it with placement.mode=colocated"):
        ahead.schedule.restore(carried.schedule.position)
    rl_step(0, ahead)
    with pytest.raises(ValueError, match="resume it with placement.mode=disaggregated"):
        _job(tmp_path, tok, "async", "colocated").schedule.restore(ahead.schedule.position)


def test_rl_step_asks_nothing_of_the_placement_or_the_rollout_mode() -> None:
    """The step is a straight list of phases: its `if`s may look at the algorithm's options, never at where the
    actors run or how the rollout is scheduled (those are the side's and the schedule's)."""
    tree = ast.parse(inspect.getsource(rl_step))
    tests = [ast.unparse(n.test) for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp))]
    assert tests, "the walk sees the step's conditions"
    banned = ("colocated", "placement", "mode", "async", "offload", "sleep", "Ahead", "Carried", "isinstance")
    assert not [t for t in tests if any(b in t for b in banned)], tests


def test_schedules_are_siblings_whose_position_goes_through_state_dict(tmp_path: Path, tok) -> None:
    """The three schedules share a Protocol, not a parent; what a checkpoint keeps of each is its state_dict (plain
    JSON), and a schedule loaded from it continues where the first one was: the same data position, and the same
    samples carried (colocated async) or generated ahead (disaggregated async)."""
    for (mode, placement), (_, cls, _) in COMBINATIONS.items():
        assert cls.__bases__ == (object,), cls
        job = _job(tmp_path, tok, mode, placement)
        for step in range(2):
            rl_step(step, job)
        state = json.loads(json.dumps(job.schedule.state_dict()))
        assert state["step"] == 1 and state == job.schedule.position.state_dict()
        again = _job(tmp_path, tok, mode, placement)
        again.schedule.load_state_dict(state)
        assert again.schedule.state_dict() == state
        assert again.inputs.train_data.state_dict() == job.inputs.train_data.state_dict()
        a, b = job.schedule.batch(2), again.schedule.batch(2)
        assert a.prompts == b.prompts and [(s.group, s.response_ids) for s in a.samples] == \
            [(s.group, s.response_ids) for s in b.samples], mode
