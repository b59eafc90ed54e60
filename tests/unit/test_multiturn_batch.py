"""Loss only on the model's tokens: a multi-turn sample's environment tokens get loss_mask 0, no behaviour
log-prob and no replayed routing, so the loss, TIS, the KL term and the log-prob gap never see them."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from colo.algo.batch import NO_EXPERT, build_batch
from colo.algo.loss import LossOptions, policy_loss
from colo.algo.parity import logprob_gap
from colo.rollout.sample import Sample, Status, Turns

#             model  model  env  env  env  model  model(eos)
MASK = [1, 1, 0, 0, 0, 1, 1]


def sample(**extra) -> Sample:
    lps = [-0.5 if m else 0.0 for m in MASK]
    return Sample(0, 0, 0, [7, 8, 9], [10, 11, 20, 21, 22, 12, 2], lps, model_mask=MASK,
                  **{"status": Status.COMPLETED, "turns": Turns(), **extra})


def test_environment_tokens_get_no_loss_and_no_behaviour_logprob() -> None:
    b = build_batch([sample()], [1.0])
    assert b["input_ids"][0].tolist() == [7, 8, 9, 10, 11, 20, 21, 22, 12, 2]  # the sequence vLLM saw
    assert b["loss_mask"][0].tolist() == [0, 0, 0] + MASK
    assert b["rollout_logprobs"][0, 3:].tolist() == [-0.5, -0.5, 0, 0, 0, -0.5, -0.5]
    single = build_batch([replace(sample(), model_mask=None, turns=None)], [1.0])
    assert single["loss_mask"][0].tolist() == [0, 0, 0] + [1] * 7  # single-turn samples: unchanged


def test_a_failed_environment_trains_nothing_of_its_sample() -> None:
    failed = sample(status=Status.FAILED)
    failed.turns.env_error = "row 0 sample 1, step of turn 1: EnvError: boom"
    b = build_batch([sample(), failed], [1.0, -1.0])
    assert b["loss_mask"][1].sum() == 0 and b["loss_mask"][0].sum() == 4


def test_routing_of_environment_tokens_is_not_replayed() -> None:
    L = 3 + len(MASK)
    routing = np.arange((L - 1) * 2 * 2, dtype=np.uint8).reshape(L - 1, 2, 2)  # (P+R-1, M, K)
    no_routing = sample()
    b = build_batch([sample(routing=routing), no_routing], [1.0, 1.0])
    r = b["routed_experts"]  # (B, T, M, K)
    env_rows = [3 + j for j, m in enumerate(MASK) if m == 0]
    model_rows = [t for t in range(L - 1) if t not in env_rows]
    assert (r[0, env_rows] == NO_EXPERT["uint8"]).all()
    assert torch.equal(r[0, model_rows], torch.from_numpy(routing[model_rows]))  # prompt and model tokens kept
    assert (r[0, L - 1] == NO_EXPERT["uint8"]).all()  # never forwarded
    assert (r[1] == NO_EXPERT["uint8"]).all()  # a sample without routing (its reset failed)


def test_tis_kl_and_gap_see_model_tokens_only() -> None:
    """Whatever sits at the environment's positions (here: wild log-probs) changes nothing."""
    b = build_batch([sample()], [1.0])
    mask = b["loss_mask"]
    torch.manual_seed(0)
    new = torch.randn(mask.shape) * 0.1 - 1.0
    old, rollout, ref = new.detach() + 0.05, b["rollout_logprobs"].clone(), new.detach() - 0.1
    env = (mask == 0)
    wild = lambda x: torch.where(env, x + 30.0, x)  # noqa: E731

    def run(o, r, f):
        loss, m = policy_loss(new, o, torch.tensor([1.0]), mask,
                              LossOptions(clip_low=0.2, clip_high=0.28, tis_cap=2.0, kl_coef=0.1),
                              rollout_logprobs=r, ref_logprobs=f)
        return loss, m, logprob_gap(o, r, mask)

    loss_a, m_a, gap_a = run(old, rollout, ref)
    loss_b, m_b, gap_b = run(wild(old), wild(rollout), wild(ref))
    assert torch.equal(loss_a, loss_b)
    for key in ("tis_mean", "kl_ref", "approx_kl", "clip_frac"):
        assert torch.equal(m_a[key], m_b[key]), key
    assert gap_a == gap_b and gap_a["gap_tokens"] == sum(MASK)
