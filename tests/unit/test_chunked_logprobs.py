"""Chunked lm_head log-probs and entropy (colo.algo.logprobs) against the straightforward full-logits path:
values and gradients (hidden states and lm_head weight, tied or not), odd vocabularies, temperatures."""
import pytest
import torch

from colo.algo.logprobs import shifted_logprobs, token_logprobs
from colo.algo.loss import gather_logprobs, scale_logits, token_entropy


def _full(hidden, weight, ids, temperature):
    """The trainer's old path: full (b, T, V) logits, then gather_logprobs / token_entropy."""
    logits = scale_logits(hidden @ weight.t(), temperature)  # (b, T, V)
    lp = gather_logprobs(logits, ids)
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    ent = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))  # token_entropy, with its gradient
    assert torch.allclose(ent.detach(), token_entropy(logits.detach()))
    return lp, ent


@pytest.mark.parametrize("vocab,chunk,temperature", [(97, 5, 1.0), (131, 64, 0.7), (64, 1, 1.3), (257, 1000, 1.0)])
def test_chunked_equals_full(vocab, chunk, temperature):
    g = torch.Generator().manual_seed(vocab)
    b, T, H = 3, 9, 16
    hidden = torch.randn(b, T, H, generator=g, dtype=torch.float64).float()
    weight = torch.randn(vocab, H, generator=g) * 0.5
    ids = torch.randint(0, vocab, (b, T), generator=g)
    w_lp, w_ent = torch.randn(b, T, generator=g), torch.randn(b, T, generator=g)  # weights of a loss of both

    grads = []
    for fn in ("full", "chunked"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fn == "full":
            lp, ent = _full(h, w, ids, temperature)
        else:
            lp, ent = shifted_logprobs(h, w, ids, None, temperature, chunk)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        grads.append((lp.detach(), ent.detach(), h.grad, w.grad))
    for name, a, c in zip(("logprobs", "entropy", "d hidden", "d weight"), *grads):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5, msg=name)
    assert grads[0][0][:, 0].abs().max() == 0 and grads[0][3].abs().max() > 0  # a real gradient was compared


def test_tied_embeddings_gradient_reaches_the_shared_weight():
    """Tied lm_head: the chunked function's weight gradient adds to the embedding's own, as autograd's would."""
    g = torch.Generator().manual_seed(0)
    V, H, b, T = 53, 8, 2, 7
    table = torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (b, T), generator=g)
    grads = []
    for chunked in (False, True):
        emb = torch.nn.Embedding(V, H)
        emb.weight.data.copy_(table)
        hidden = torch.tanh(emb(ids))  # (b, T, H): the same parameter feeds input and head
        if chunked:
            lp, ent = shifted_logprobs(hidden, emb.weight, ids, None, 1.0, 3)
        else:
            lp, ent = _full(hidden, emb.weight, ids, 1.0)
        (lp.sum() - 0.3 * ent.sum()).backward()
        grads.append(emb.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


def test_packed_rows_zero_at_sample_starts():
    """Position id 0 starts a sample in a packed row: nothing predicts it, so log-prob and entropy are 0."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(1, 8, 4, generator=g), torch.randn(11, 4, generator=g)
    ids = torch.randint(0, 11, (1, 8), generator=g)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    lp, ent = shifted_logprobs(hidden, weight, ids, pos, 1.0, 4)
    assert (lp[pos == 0] == 0).all() and (ent[pos == 0] == 0).all()
    assert (lp[pos != 0] < 0).all() and (ent[pos != 0] > 0).all()


def test_bf16_matches_the_bf16_linear_path():
    """In bf16 the chunked pass rounds where a bf16 lm_head + float32 log-softmax does: same values."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 6, 32, generator=g).bfloat16()
    weight = (torch.randn(301, 32, generator=g) * 0.2).bfloat16()
    ids = torch.randint(0, 301, (2, 6), generator=g)
    lp_full, ent_full = _full(hidden, weight, ids, 0.6)
    lp, ent = shifted_logprobs(hidden, weight, ids, None, 0.6, 4)
    torch.testing.assert_close(lp, lp_full, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ent_full, rtol=0, atol=1e-5)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        token_logprobs(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))


def test_logprob_gradient_alone():
    """The update uses the log-probs only (the entropy is a metric): backward skips the entropy's gradient."""
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(37, 8, generator=g)
    ids = torch.randint(0, 37, (2, 5), generator=g)
    grads = []
    for chunked in (False, True):
        h = hidden.clone().requires_grad_()
        lp, _ = shifted_logprobs(h, weight, ids, None, 0.9, 3) if chunked else _full(h, weight, ids, 0.9)
        lp.sum().backward()
        grads.append(h.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


def test_memory_plan_counts_one_chunk_of_logits():
    """colo.plan.memory: the lm_head term is one chunk's, whatever the micro-batch's tokens; the full-logits
    path it replaces grew with them (14 B x tokens x vocab)."""
    from colo.models.tiny import PRESETS
    from colo.plan.memory import model_shape, trainer_terms
    from colo.plan.settings import Settings

    m = model_shape(dict(PRESETS["qwen3-30b-a3b-L2"]))
    terms = [trainer_terms(m, Settings.of({"placement.num_gpus": 1, "placement.vllm_gpu_fraction": 0.4,
                                           "trainer.micro_batch_size": 1, "rollout.max_model_len": 4096,
                                           "trainer.packing": True, "trainer.max_tokens_per_micro_batch": budget,
                                           "trainer.logprob_chunk": 1024}))
             for budget in (4096, 32768)]
    # 20 B x 1024 x 151936 + the bf16 weight grad + the bf16 hidden states' grad: only the last grows with tokens
    assert terms[0]["logits"] < 4 * 2**30
    assert terms[1]["logits"] - terms[0]["logits"] == 2 * (32768 - 4096) * m.hidden
    assert terms[1]["activations"] > 7 * terms[0]["activations"]  # the layers' activations do grow
    t = terms[0]
    state = t["params"] + t["optim"] + t["ref"] + t["resident"]
    assert terms[0]["no_grad"] == terms[1]["no_grad"]  # the log-prob pass: the same at 4k and 32k tokens
    assert t["no_grad"] - state < 14 * 4096 * m.vocab  # less than the (4096, V) logits of the old pass alone


def test_fused_chunk_math_equals_eager():
    """trainer.compile's chunk math (colo.algo.logprobs._fused_forward / _fused_backward under torch.compile):
    the eager chunked path's values and gradients, with a temperature, a short last chunk and a loss of both
    outputs, then of the log-probs alone (the entropy's gradient None, as in the update). aot_eager on CPU: the
    formulas and the graphs are checked here, inductor's kernels by colo.bench.step --compare-compile on a GPU."""
    import torch._dynamo.utils

    g = torch.Generator().manual_seed(3)
    b, T, H, V = 2, 11, 16, 97
    hidden = torch.randn(b, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    ids = torch.randint(0, V, (b, T), generator=g)
    w_lp, w_ent = torch.randn(b, T, generator=g), torch.randn(b, T, generator=g)
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    for with_entropy in (True, False):
        got = []
        for backend in (None, "aot_eager"):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            lp, ent = shifted_logprobs(h, w, ids, None, 0.7, 8, backend)  # 20 tokens: chunks of 8, 8, 4
            ((lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0.0)).backward()
            got.append((lp.detach(), ent.detach(), h.grad, w.grad))
        for name, a, c in zip(("logprobs", "entropy", "d hidden", "d weight"), *got):
            torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6, msg=f"{name}, entropy in loss: {with_entropy}")
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames  # the fused path ran compiled


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("own_old,packed,backend", [(True, False, None), (False, True, None), (True, True, "aot_eager"),
                                                     (False, False, "aot_eager")])
def test_loss_gradient_in_the_chunk_loop_equals_autograd(loss_agg, own_old, packed, backend):
    """TokenLoss (colo.algo.loss) inside the chunk loop: the same log-probs and entropies, and the gradients wrt the
    hidden states and the lm_head weight that autograd takes through policy_loss, for every aggregation, with the
    old log-probs the forward's own (the step's one update) or given (PPO clip and dual-clip then bind), TIS, the
    KL term, a global token count, a loss scale, a packed row (position ids restarting) and the compiled chunk math."""
    from colo.algo.loss import LossOptions, TokenLoss, policy_loss

    g = torch.Generator().manual_seed(7)
    b, T, H, V, chunk, temp, scale = 3, 10, 16, 97, 4, 0.7, 2.0
    hidden = torch.randn(b, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    ids = torch.randint(0, V, (b, T), generator=g)
    pos = torch.cat([torch.arange(4), torch.arange(6)])[None].expand(b, T) if packed else None  # a sample starts at 4
    mask = (torch.rand(b, T, generator=g) > 0.3).float()
    mask[:, 0], mask[2] = 0.0, 0.0  # nothing scores position 0; one row holds no loss token
    adv = torch.tensor([1.3, -0.8, 0.5])
    with torch.no_grad():
        lp0, _ = shifted_logprobs(hidden, weight, ids, pos, temp, chunk)
    old = None if own_old else lp0 + 0.4 * torch.randn(b, T, generator=g)
    rollout, ref = lp0 + 0.3 * torch.randn(b, T, generator=g), lp0 + 0.2 * torch.randn(b, T, generator=g)
    opts = LossOptions(clip_low=0.2, clip_high=0.28, loss_agg=loss_agg, tis_cap=2.0, kl_coef=0.05, clip_ratio_c=3.0)
    counts = dict(token_count=float(mask.sum()) + 5.0, seq_count=4.0)  # global: more than this micro-batch holds

    got = []
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            tl = TokenLoss.of(old, adv, mask, opts, scale=scale, rollout_logprobs=rollout, ref_logprobs=ref, **counts)
            lp, ent, anchor = shifted_logprobs(h, w, ids, pos, temp, chunk, backend, token_loss=tl)
            assert not lp.requires_grad and float(anchor.detach()) == 0.0
            anchor.backward()
        else:
            lp, ent = shifted_logprobs(h, w, ids, pos, temp, chunk, backend)
            loss, _ = policy_loss(lp, lp.detach() if own_old else old, adv, mask, opts,
                                  rollout_logprobs=rollout, ref_logprobs=ref, **counts)
            (loss * scale).backward()
        got.append((lp.detach(), ent.detach(), h.grad, w.grad))
    (lp_a, ent_a, gh_a, gw_a), (lp_b, ent_b, gh_b, gw_b) = got
    assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b)
    assert gh_a.abs().sum() > 0 and gw_a.abs().sum() > 0
    torch.testing.assert_close(gh_b, gh_a, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw_b, gw_a, rtol=1e-5, atol=1e-7)


def test_token_weights_are_the_aggregation():
    """colo.algo.loss.token_weights: (x * weights).sum() is _aggregate's value, for each aggregation, with local or
    global counts."""
    from colo.algo.loss import LOSS_AGGS, _aggregate, token_weights

    g = torch.Generator().manual_seed(1)
    x, maskf = torch.randn(4, 7, generator=g), (torch.rand(4, 7, generator=g) > 0.4).float()
    maskf[3] = 0.0
    for agg in LOSS_AGGS:
        for tc, sc in ((None, None), (40.0, 9.0)):
            torch.testing.assert_close((x * token_weights(maskf, agg, tc, sc)).sum(), _aggregate(x, maskf, agg, tc, sc))
