"""Every logged loss metric against plain PyTorch on the whole batch, for 1 rank x 1 micro-batch and for
2 ranks x 4 micro-batches (real FSDP2 over gloo in Ray actors); the KL reference; eval/train modes.

    PYTHONPATH=. .venv/bin/python -m pytest tests/integration/test_loss_layouts.py -q

One module-wide story, so the three actors start once. trainer.lr is 0 (sft_lr is not): RL steps then
leave the weights exactly as they were, so the independent computation, run on an HF export of those
weights, sees the very policy every update saw, and the ratio is 1 (the metrics under test are the
aggregations, which the layout could break; the ratio-dependent terms have exact unit tests in
test_algo_loss.py). The story: 2 SFT steps (the warm-up) -> export A -> RL step (freezes the reference: A)
-> SFT step (the policy moves on) -> export B -> RL steps scored against policy B and reference A.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import ray
import torch

from conftest import cpu_trainer_config

from colo.algo.batch import build_batch, shard_batch
from colo.host.net import free_port
from colo.rollout.sample import Sample, Status
from colo.trainer.worker import TrainWorker

T_SAMPLE, KL_COEF, TIS_CAP = 0.7, 0.05, 2.0


def _cfg(tiny_model: Path, micro_batch_size: int) -> dict:
    # packed: one row, or all, per micro-batch
    c = cpu_trainer_config(tiny_model, lr=0.0, sft_lr=5e-4, micro_batch_size=micro_batch_size, mini_batches=1, epochs=2,
                           max_tokens_per_micro_batch=1 if micro_batch_size == 1 else 10**6)
    c.rollout.temperature = T_SAMPLE
    c.algo.kl_coef, c.algo.tis_cap, c.algo.clip_ratio_c = KL_COEF, TIS_CAP, 3.0
    return dataclasses.asdict(c)


def _start(cfg: dict, world: int) -> list:
    port = free_port()  # below the ephemeral range: a bind(0) port can be taken before gloo listens on it
    ws = [TrainWorker.options(num_cpus=0).remote(cfg, r, world, "127.0.0.1", port) for r in range(world)]
    ray.get([w.setup.remote() for w in ws])
    return ws


def _call(ws: list, method: str, *per_rank) -> list:
    args = per_rank or [()] * len(ws)
    return ray.get([getattr(w, method).remote(*a) for w, a in zip(ws, args)])


def _run(layout: dict, method: str, batch: dict) -> dict:
    """`method` on every rank of a layout, each with its shard of `batch`; rank 0's (global) answer."""
    ws = layout["workers"]
    shards = shard_batch(batch, len(ws)) if len(ws) > 1 else [batch]
    return _call(ws, method, *[(s,) for s in shards])[0]


@pytest.fixture(scope="module")
def layouts(tiny_model: Path, ray_cluster):
    # the helpers handed to actors through __ray_call__ travel by value (tests/ is no package there)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # 8 rows: one rank, micro-batch 8 -> 1 micro-batch; two ranks of 4 rows, micro-batch 1 -> 4 each
    yield {"1x1": {"workers": _start(_cfg(tiny_model, 8), 1), "micro": 1},
           "2x4": {"workers": _start(_cfg(tiny_model, 1), 2), "micro": 4}}


def _samples(seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(8):
        p = torch.randint(3, 500, (2 + (i * 3) % 5,), generator=g).tolist()
        r = torch.randint(3, 500, (2 + (i * 5) % 6,), generator=g).tolist()
        out.append(Sample(i, 0, 0, p, r, [0.0] * len(r), status=Status.TRUNCATED if i == 5 else Status.COMPLETED))
    return out


@pytest.fixture(scope="module")
def rl_batch(tiny_model: Path) -> dict:
    """8 samples, one truncated and filtered out (algo.overlong=filter), advantages of both signs,
    rollout log-probs = the disk model's at T_SAMPLE plus noise (TIS weights on both sides of 1)."""
    from transformers import AutoModelForCausalLM

    samples = _samples(1)
    adv = torch.tensor([1.5, -0.7, 0.3, -1.2, 0.0, 0.9, -0.4, 2.0])
    disk = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    lp = _whole_batch(disk, build_batch(samples, adv))["lp"]
    noisy = lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(2))
    for b, s in enumerate(samples):
        P = len(s.prompt_ids)
        s.logprobs = noisy[b, P:P + len(s.response_ids)].tolist()
    batch = build_batch(samples, adv, mask_truncated=True)
    assert batch["loss_mask"][5].sum() == 0 and batch["loss_mask"].sum() > 20
    return batch


@pytest.fixture(scope="module")
def sft_batch() -> dict:
    return build_batch(_samples(3), torch.zeros(8))


@torch.no_grad()
def _whole_batch(model, batch: dict) -> dict[str, torch.Tensor]:
    """Plain PyTorch on the whole batch: log-probs and entropies of the distributions that sampled each
    token, as vLLM's sampler forms them (float32 logits / T)."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=am).logits.float()[:, :-1] / T_SAMPLE  # (B, T-1, V)
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1) scores ids[:, 1:]
    ent = -(logp.exp() * logp).sum(-1)  # (B, T-1)
    pad = torch.nn.functional.pad
    return {"lp": pad(lp, (1, 0)), "entropy": pad(ent, (1, 0))}  # (B, T) aligned with input_ids


def _expected(policy, ref, batch: dict, agg: str) -> dict[str, float]:
    """The loss and metrics of one process on the whole batch, ratio 1 (lr 0), by the formulas."""
    pol, lp_ref = _whole_batch(policy, batch), _whole_batch(ref, batch)["lp"]
    m = batch["loss_mask"]  # (B, T)
    lp, roll, A = pol["lp"], batch["rollout_logprobs"], batch["advantages"][:, None]
    w = torch.exp(lp - roll).clamp(max=TIS_CAP) * m  # (B, T)
    pg = -A * w  # ratio 1: PPO-clip and dual-clip leave -A * ratio untouched
    d = lp_ref - lp
    kl = (torch.exp(d) - d - 1) * m

    def agg_of(x: torch.Tensor) -> float:
        if agg == "token-mean":
            return float(x.sum() / m.sum())
        rows = m.sum(1) > 0
        return float(((x.sum(1)[rows] / m.sum(1)[rows])).mean())  # seq-mean-token-mean

    tok = float(m.sum())
    pg_loss, kl_loss = agg_of(pg), agg_of(kl)
    return {"loss": pg_loss + KL_COEF * kl_loss, "pg_loss": pg_loss, "kl_loss": kl_loss,
            "kl_ref": float(kl.sum()) / tok, "entropy": float((pol["entropy"] * m).sum()) / tok,
            "tis_mean": float(w.sum()) / tok, "logprob_diff/mean": float(((lp - roll).abs() * m).sum()) / tok,
            "clip_frac": 0.0, "clip_frac/dual": 0.0, "approx_kl": 0.0}


def _export(layout: dict, path: Path):
    from transformers import AutoModelForCausalLM

    _call(layout["workers"], "export_hf", *[(str(path),)] * len(layout["workers"]))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _check(got: dict, want: dict, keys) -> None:
    for k in keys:
        assert got[k] == pytest.approx(want[k], rel=2e-4, abs=2e-6), (k, got[k], want[k])


@pytest.fixture(scope="module")
def story(layouts, tiny_model, rl_batch, sft_batch, tmp_path_factory) -> dict:
    from transformers import AutoModelForCausalLM

    out: dict = {"disk": AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()}
    tmp = tmp_path_factory.mktemp("exports")
    for name, lay in layouts.items():
        for _ in range(2):  # the warm-up: the policy leaves model.path (twice as far as the later step)
            _run(lay, "sft_step", sft_batch)
        out[name, "A"] = _export(lay, tmp / f"{name}-A")
        out[name, "first"] = _run(lay, "train_step", rl_batch)  # freezes the reference: A
        _run(lay, "sft_step", sft_batch)
        out[name, "B"] = _export(lay, tmp / f"{name}-B")
        out[name, "token-mean"] = _run(lay, "train_step", rl_batch)
    return out


def test_metrics_equal_whole_batch_computation_in_every_layout(layouts, story, rl_batch) -> None:
    keys = ("loss", "pg_loss", "kl_loss", "kl_ref", "entropy", "tis_mean", "logprob_diff/mean",
            "clip_frac", "clip_frac/dual", "approx_kl")
    for name in layouts:
        want = _expected(story[name, "B"], story[name, "A"], rl_batch, "token-mean")
        _check(story[name, "token-mean"], want, keys)
        # the first RL step: reference == policy, so the KL is 0 and loss is the PG part alone
        first = _expected(story[name, "A"], story[name, "A"], rl_batch, "token-mean")
        _check(story[name, "first"], first, keys)
        assert abs(story[name, "first"]["kl_ref"]) < 1e-6
    assert story["2x4", "token-mean"]["updates"] == 2  # two epochs: the mean over updates is exercised


def test_seq_mean_token_mean_metrics_in_every_layout(layouts, story, rl_batch) -> None:
    for name, lay in layouts.items():
        ray.get([w.__ray_call__.remote(_set_loss_agg, "seq-mean-token-mean") for w in lay["workers"]])
        got = _run(lay, "train_step", rl_batch)
        want = _expected(story[name, "B"], story[name, "A"], rl_batch, "seq-mean-token-mean")
        _check(got, want, ("loss", "pg_loss", "kl_loss", "kl_ref", "entropy", "tis_mean"))
        assert abs(want["pg_loss"] - _expected(story[name, "B"], story[name, "A"], rl_batch,
                                               "token-mean")["pg_loss"]) > 1e-3  # the two really differ


def _set_loss_agg(trainer, agg: str) -> None:
    trainer.cfg.algo.loss_agg = agg


def test_kl_reference_is_the_policy_rl_started_from_not_model_path(story, rl_batch) -> None:
    got = story["2x4", "token-mean"]["kl_ref"]
    vs_start = _expected(story["2x4", "B"], story["2x4", "A"], rl_batch, "token-mean")["kl_ref"]
    vs_disk = _expected(story["2x4", "B"], story["disk"], rl_batch, "token-mean")["kl_ref"]
    assert got == pytest.approx(vs_start, rel=2e-4) and got > 1e-4
    # what a reference rebuilt from model.path would have given: 50x the comparison's tolerance away
    assert vs_disk != pytest.approx(got, rel=1e-2)


def test_reference_survives_a_checkpoint(layouts, story, rl_batch, tmp_path) -> None:
    lay = layouts["2x4"]
    ckpt = str(tmp_path / "ckpt")
    _call(lay["workers"], "save_checkpoint", *[(ckpt, {"step": 0})] * 2)
    assert (tmp_path / "ckpt" / "ref" / ".metadata").exists()
    ray.get([w.__ray_call__.remote(_forget_reference) for w in lay["workers"]])
    _call(lay["workers"], "load_checkpoint", *[(ckpt,)] * 2)
    ray.get([w.__ray_call__.remote(_set_loss_agg, "token-mean") for w in lay["workers"]])
    got = _run(lay, "train_step", rl_batch)
    _check(got, _expected(story["2x4", "B"], story["2x4", "A"], rl_batch, "token-mean"), ("kl_ref",))


@torch.no_grad()
def _forget_reference(trainer) -> None:
    """Scramble the reference in place: only the checkpoint can bring it back."""
    for p in trainer.ref_model.parameters():
        (p.to_local() if hasattr(p, "to_local") else p).normal_()
    trainer.ref_frozen = False


def test_logprob_passes_run_in_eval_mode_and_the_update_in_train_mode(layouts, rl_batch) -> None:
    lay = layouts["2x4"]
    ray.get([w.__ray_call__.remote(_record_modes) for w in lay["workers"]])
    _run(lay, "train_step", rl_batch)
    modes = ray.get(lay["workers"][0].__ray_call__.remote(_recorded_modes))
    # old log-probs: 4 eval micro-batches; then 2 epochs x 4 micro-batches of updates in train mode
    assert modes == {"policy": [False] * 4 + [True] * 8, "ref": [False] * 4}


def _record_modes(trainer) -> None:
    trainer.modes = {"policy": [], "ref": []}
    for key, model in (("policy", trainer.model), ("ref", trainer.ref_model)):
        # every pass runs the decoder (model.colo_logprobs), not the LM's own forward
        model.get_decoder().register_forward_pre_hook(lambda m, args, key=key: trainer.modes[key].append(m.training))


def _recorded_modes(trainer) -> dict:
    return trainer.modes
