import math

import pytest
import torch

from colo.algo.loss import LossOptions, gather_logprobs, policy_loss, scale_logits, token_entropy


def _ref_loss(logp, old, adv, mask, clip_low, clip_high, agg, tis=None, kl=None, dual_c=0.0):
    """Plain-Python loops: the reference the vectorized loss must match."""
    B, T = logp.shape
    per_seq, n_tok, total = [], 0, 0.0
    for b in range(B):
        s, n = 0.0, 0
        for t in range(T):
            if not mask[b][t]:
                continue
            a = float(adv[b]) if adv.dim() == 1 else float(adv[b][t])
            ratio = torch.exp(logp[b, t] - old[b][t])
            clipped = min(max(ratio.item(), 1 - clip_low), 1 + clip_high)
            # the clipped branch is a constant: once it wins, the token has no gradient
            term = -a * clipped + 0 * ratio if -a * clipped > -a * ratio.item() else -a * ratio
            if dual_c and a < 0 and term.item() > -a * dual_c:
                term = -a * dual_c + 0 * ratio  # dual-clip bound: a constant
            if tis is not None:
                term = term * tis[b][t]
            if kl is not None:
                coef, ref = kl
                d = ref[b][t] - logp[b, t]
                term = term + coef * (torch.exp(d) - d - 1)
            s, n = s + term, n + 1
        total = total + s
        n_tok += n
        if n:
            per_seq.append(s if agg == "seq-mean-token-sum" else s / n)
    if agg == "token-mean":
        return total / n_tok
    return sum(per_seq) / len(per_seq)


def test_hand_computed_clipped_and_unclipped_with_gradient():
    # four tokens, clip_low = clip_high = 0.2, one sequence, token-mean:
    #  t0 ratio 1.5, A=+1 -> clipped at 1.2, loss -1.2, grad 0
    #  t1 ratio 0.9, A=+1 -> unclipped, loss -0.9, dloss/dlogp = -0.9
    #  t2 ratio 0.5, A=-1 -> clipped at 0.8, loss +0.8, grad 0
    #  t3 ratio 0.5, A=+1 -> unclipped (pessimistic side), loss -0.5, grad -0.5
    old = torch.zeros(1, 5)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.9, 0.5, 0.5]])).requires_grad_()
    adv = torch.tensor([[0.0, 1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    loss, m = policy_loss(logp, old, adv, mask, LossOptions(clip_low=0.2, clip_high=0.2, loss_agg="token-mean"))
    assert loss.item() == pytest.approx((-1.2 - 0.9 + 0.8 - 0.5) / 4)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, -0.9, 0.0, -0.5]]) / 4)
    assert m["clip_frac"].item() == pytest.approx(0.5)
    assert m["pg_loss"].item() == pytest.approx(loss.item())
    assert m["tis_mean"].item() == 1.0
    # approx_kl: k3 of old vs new, (r - 1) - log r averaged over masked tokens
    want_kl = sum((r - 1 - math.log(r)) for r in (1.5, 0.9, 0.5, 0.5)) / 4
    assert m["approx_kl"].item() == pytest.approx(want_kl, rel=1e-5)


def test_asymmetric_clip():
    # ratio 1.25 with A>0: clip_high 0.28 keeps it unclipped, clip_high 0.2 clips it
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.0, 1.25]]))
    mask = torch.tensor([[0, 1]])
    adv = torch.tensor([1.0])
    hi, m_hi = policy_loss(logp, old, adv, mask, LossOptions(clip_low=0.2, clip_high=0.28))
    lo, m_lo = policy_loss(logp, old, adv, mask, LossOptions(clip_low=0.2, clip_high=0.2))
    assert hi.item() == pytest.approx(-1.25) and m_hi["clip_frac"].item() == 0.0
    assert lo.item() == pytest.approx(-1.2) and m_lo["clip_frac"].item() == 1.0
    # ratio 0.75 with A<0: clip_low 0.2 clips at 0.8, clip_low 0.3 does not
    logp = torch.log(torch.tensor([[1.0, 0.75]]))
    a, _ = policy_loss(logp, old, -adv, mask, LossOptions(clip_low=0.2, clip_high=0.28))
    b, _ = policy_loss(logp, old, -adv, mask, LossOptions(clip_low=0.3, clip_high=0.28))
    assert a.item() == pytest.approx(0.8) and b.item() == pytest.approx(0.75)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("adv_dim", [1, 2])
def test_matches_reference_loss_and_grad(agg, adv_dim):
    g = torch.Generator().manual_seed(0)
    B, T = 3, 6
    old = -torch.rand(B, T, generator=g) * 2
    logp0 = old + torch.randn(B, T, generator=g) * 0.3  # a mix of clipped and unclipped tokens
    logp0[1, 2] = old[1, 2] + 1.5  # ratio e^1.5 = 4.5 > clip_ratio_c: dual-clipped when its A < 0
    adv = torch.randn(B, generator=g) if adv_dim == 1 else torch.randn(B, T, generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0]])
    rollout = old + torch.randn(B, T, generator=g) * 0.5
    ref = old + torch.randn(B, T, generator=g) * 0.2
    tis = torch.clamp(torch.exp(old - rollout), max=1.5)

    logp = logp0.clone().requires_grad_()
    if adv_dim == 1:
        adv[1] = -abs(adv[1])
    else:
        adv[1, 2] = -abs(adv[1, 2])
    loss, m = policy_loss(logp, old, adv, mask,
                          LossOptions(clip_low=0.1, clip_high=0.15, loss_agg=agg, tis_cap=1.5,
                                      kl_coef=0.1, clip_ratio_c=3.0), rollout_logprobs=rollout, ref_logprobs=ref)
    loss.backward()
    logp_r = logp0.clone().requires_grad_()
    want = _ref_loss(logp_r, old, adv, mask, 0.1, 0.15, agg, tis=tis, kl=(0.1, ref), dual_c=3.0)
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(logp.grad, logp_r.grad)
    assert 0.0 < m["clip_frac"].item() < 1.0  # the case exercises both branches
    assert m["clip_frac/dual"].item() > 0  # and the dual-clip bound
    assert "kl_ref" in m


def test_tis_weight_is_capped_and_has_no_grad():
    old = torch.tensor([[0.0, -1.0, -1.0]])
    rollout = torch.tensor([[0.0, -1.0 - math.log(3.0), -1.0 + math.log(2.0)]])  # weights 3, 0.5
    logp = old.clone().requires_grad_()
    mask = torch.tensor([[0, 1, 1]])
    adv = torch.tensor([1.0])
    loss, m = policy_loss(logp, old, adv, mask,
                          LossOptions(clip_low=0.2, clip_high=0.2, tis_cap=2.0), rollout_logprobs=rollout)
    assert loss.item() == pytest.approx((-2.0 - 0.5) / 2)  # ratio 1, weights min(3, 2) and 0.5
    assert m["tis_mean"].item() == pytest.approx(1.25)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.0, -0.25]]))
    uncapped, m2 = policy_loss(old, old, adv, mask,
                               LossOptions(clip_low=0.2, clip_high=0.2, tis_cap=None), rollout_logprobs=rollout)
    assert uncapped.item() == pytest.approx((-3.0 - 0.5) / 2)
    off, m3 = policy_loss(old, old, adv, mask,
                          LossOptions(clip_low=0.2, clip_high=0.2, tis_cap=0),
                          rollout_logprobs=rollout)  # config: 0 disables the correction
    assert off.item() == pytest.approx(-1.0) and m3["tis_mean"].item() == 1.0
    with pytest.raises(ValueError, match="tis_cap"):
        policy_loss(old, old, adv, mask,
                    LossOptions(clip_low=0.2, clip_high=0.2, tis_cap=-1.0), rollout_logprobs=rollout)


def test_kl_off_costs_nothing_and_kl_on_matches_k3():
    old = torch.tensor([[0.0, -1.0, -2.0]])
    mask = torch.tensor([[0, 1, 1]])
    adv = torch.tensor([0.0])  # isolate the KL term
    poison = torch.full_like(old, float("nan"))  # any read of ref with kl off would show as nan
    base, m = policy_loss(old, old, adv, mask, LossOptions(clip_low=0.2, clip_high=0.2))
    off, m_off = policy_loss(old, old, adv, mask,
                             LossOptions(clip_low=0.2, clip_high=0.2, kl_coef=0.0), ref_logprobs=poison)
    assert torch.equal(base, off) and "kl_ref" not in m_off
    ref = torch.tensor([[0.0, -1.5, -1.0]])
    logp = old.clone().requires_grad_()
    on, m_on = policy_loss(logp, old, adv, mask,
                           LossOptions(clip_low=0.2, clip_high=0.2, kl_coef=0.5), ref_logprobs=ref)
    d = torch.tensor([-0.5, 1.0])
    assert on.item() == pytest.approx(0.5 * (torch.exp(d) - d - 1).mean().item())
    on.backward()  # d/dlogp of exp(d) - d - 1 with d = ref - logp is 1 - exp(d)
    torch.testing.assert_close(logp.grad[0, 1:], 0.5 * (1 - torch.exp(d)) / 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(old, old, adv, mask, LossOptions(clip_low=0.2, clip_high=0.2, kl_coef=0.1))


def test_masked_positions_never_produce_nan():
    # off-mask values like the rollout's 0 at prompt positions vs a trainer's -1000 must not overflow
    logp = torch.tensor([[-1000.0, -1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[500.0, -1.0, 0.0]])
    rollout = torch.tensor([[-900.0, -1.0, 0.0]])
    mask = torch.tensor([[0, 1, 0]])
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), mask,
                          LossOptions(clip_low=0.2, clip_high=0.2, tis_cap=2.0, kl_coef=0.1),
                          rollout_logprobs=rollout, ref_logprobs=rollout)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in m.values())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_global_counts_make_split_gradients_equal_one_process(agg):
    """Two 'ranks' each holding half the rows, scaled by global counts, sum to the full gradient."""
    g = torch.Generator().manual_seed(1)
    B, T = 4, 5
    old = -torch.rand(B, T, generator=g)
    logp0 = old + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    opts = LossOptions(clip_low=0.2, clip_high=0.2, loss_agg=agg)
    full = logp0.clone().requires_grad_()
    policy_loss(full, old, adv, mask, opts)[0].backward()
    tokens, seqs = mask.sum(), (mask.sum(1) > 0).sum()
    parts = logp0.clone().requires_grad_()
    for rows in (slice(0, 1), slice(1, 4)):
        policy_loss(parts[rows], old[rows], adv[rows], mask[rows], opts, token_count=tokens,
                    seq_count=seqs)[0].backward()
    torch.testing.assert_close(parts.grad, full.grad)


def test_all_masked_rows_keep_graph():
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 3), torch.tensor([0.0]), torch.zeros(1, 3),
                          LossOptions(clip_low=0.2, clip_high=0.2, loss_agg="seq-mean-token-mean"))
    loss.backward()  # a padding-only rank must still be able to backprop
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(1, 3))


def test_rejects_unknown_agg():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="loss_agg"):
        policy_loss(x, x, torch.zeros(1), x, LossOptions(clip_low=0.2, clip_high=0.2, loss_agg="mean"))


def test_token_entropy_and_gather_logprobs():
    V = 8
    logits = torch.zeros(2, 3, V)
    logits[1, 1] = torch.tensor([100.0] + [0.0] * (V - 1))  # near one-hot; it scores token 2
    ent = token_entropy(logits.to(torch.bfloat16))
    assert ent.shape == (2, 3) and ent.dtype == torch.float32
    torch.testing.assert_close(ent[0], torch.tensor([0.0, math.log(V), math.log(V)]))
    assert ent[1, 2].item() < 1e-6 and ent[1, 1].item() == pytest.approx(math.log(V))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, V, generator=g)
    ids = torch.randint(0, V, (2, 4), generator=g)
    lp = gather_logprobs(logits, ids)
    want = torch.log_softmax(logits, -1)
    assert lp[0, 0] == 0 and lp[1, 0] == 0
    for b in range(2):
        for t in range(1, 4):  # value at t scores ids[t] with the logits of position t - 1
            assert lp[b, t].item() == pytest.approx(want[b, t - 1, ids[b, t]].item(), abs=1e-5)


def test_entropy_of_two_response_tokens_is_that_of_the_distributions_that_sampled_them():
    # prompt [p], response [r1, r2]: r1 was drawn from logits[0], r2 from logits[1]; logits[2] (after
    # the last token) produced nothing. Uniform, uniform, one-hot: the right mean is log 5 = 1.609; the
    # old shifted mean (positions 1 and 2) was 0.805.
    V = 5
    logits = torch.zeros(1, 3, V)
    logits[0, 2, 0] = 100.0
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    got = ((token_entropy(logits) * mask).sum() / mask.sum()).item()
    p = torch.softmax(logits[0, :2], -1)  # the two sampling distributions, computed directly
    want = (-(p * p.log()).sum(-1)).mean().item()
    assert got == pytest.approx(want, abs=1e-6) and want == pytest.approx(math.log(5), abs=1e-6)


def test_temperature_divides_float32_logits_like_vllm():
    """vLLM's sampler casts the model's logits to float32, then divides by T. Dividing the bf16 logits
    rounds every quotient to bf16: measurably different log-probs at a Qwen-sized vocabulary."""
    g = torch.Generator().manual_seed(0)
    V, T = 151_936, 0.6
    logits = (torch.randn(2, 4, V, generator=g) * 3).to(torch.bfloat16)  # (B, T, V) what the LM returns
    ids = torch.randint(0, V, (2, 4), generator=g)
    vllm = torch.log_softmax(logits.to(torch.float32) / T, dim=-1)  # vLLM: fp32 first, then / T
    want = torch.stack([vllm[b, t - 1, ids[b, t]] for b in range(2) for t in range(1, 4)])
    got = gather_logprobs(scale_logits(logits, T), ids)[:, 1:].flatten()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-4)  # logsumexp vs log_softmax rounding
    bf16 = gather_logprobs(logits / T, ids)[:, 1:].flatten()  # the old order: divide in bf16
    assert (bf16 - want).abs().max().item() > 1e-2  # the difference fp32 division removes
    assert scale_logits(logits, 1.0).dtype == torch.float32


def _dual_ref(logp, old, adv, clip_low, clip_high, c):
    """verl's dual-clip, written out per token."""
    out = []
    for lp, o, a in zip(logp.tolist(), old.tolist(), adv.tolist()):
        r = math.exp(lp - o)
        pg = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
        out.append(min(pg, -a * c) if a < 0 else pg)
    return out


def test_dual_clip_bounds_negative_advantages_only():
    old = torch.zeros(6)
    ratios = torch.tensor([5.0, 2.0, 1.1, 5.0, 0.5, 4.0])
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0, -2.0, -0.5])
    logp = torch.log(ratios).requires_grad_()
    mask = torch.ones(1, 6)
    loss, m = policy_loss(logp.view(1, 6), old.view(1, 6), adv.view(1, 6), mask,
                          LossOptions(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0))
    want = _dual_ref(logp.detach(), old, adv, 0.2, 0.28, 3.0)
    assert loss.item() == pytest.approx(sum(want) / 6)
    # token 0 (A<0, ratio 5 > c) and token 5 (ratio 4 > 3) are bounded: no gradient; token 3 has A>0
    assert want[0] == pytest.approx(3.0) and want[5] == pytest.approx(1.5)
    assert m["clip_frac/dual"].item() == pytest.approx(2 / 6)
    loss.backward()
    assert logp.grad[0] == 0 and logp.grad[5] == 0 and logp.grad[1] != 0
    off, m_off = policy_loss(logp.detach().view(1, 6), old.view(1, 6), adv.view(1, 6), mask,
                             LossOptions(clip_low=0.2, clip_high=0.28))
    assert off.item() == pytest.approx((5 + 2 + 1.1 - 1.28 + 1.6 + 2.0) / 6)  # by hand, PPO-clip only
    assert m_off["clip_frac/dual"].item() == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp.view(1, 6), old.view(1, 6), adv.view(1, 6), mask,
                    LossOptions(clip_low=0.2, clip_high=0.2, clip_ratio_c=0.5))


def test_k3_is_clamped():
    # log-ratios of 30 and -30: unclamped k3 would be e^30 ~ 1e13 and 29; clamped: 10 (cap) and
    # e^-20 + 20 - 1 = 19 -> 10 too; a small one stays exact
    logp = torch.tensor([[0.0, -30.0, 0.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, 0.0, -30.0, -1.2]])
    mask = torch.tensor([[0, 1, 1, 1]])
    loss, m = policy_loss(logp, logp.detach(), torch.tensor([0.0]), mask,
                          LossOptions(clip_low=0.2, clip_high=0.2, kl_coef=1.0), ref_logprobs=ref)
    small = math.exp(-0.2) + 0.2 - 1
    assert m["kl_ref"].item() == pytest.approx((10 + 10 + small) / 3, rel=1e-5)
    assert m["kl_loss"].item() == pytest.approx(loss.item())
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0 and logp.grad[0, 2] == 0


def test_scale_logits_never_modifies_its_input_and_keeps_the_gradient():
    x = torch.randn(1, 3, 8, requires_grad=True)
    y = x * 1.0  # a non-leaf fp32 tensor, like the model's logits
    before = y.detach().clone()
    out = scale_logits(y, 0.5)
    assert torch.equal(y.detach(), before)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
