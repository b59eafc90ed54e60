"""Log-probs and entropy of the sampled tokens straight from the last hidden states, chunk by chunk.

    lp, ent = token_logprobs(hidden, weight, targets, temperature, chunk)   # (N, H), (V, H), (N,) -> (N,), (N,)
    lp, ent = shifted_logprobs(hidden, weight, input_ids, position_ids, temperature, chunk)   # (b, T) each
    lp, ent, anchor = shifted_logprobs(..., token_loss=TokenLoss.of(...)); anchor.backward()  # the loss's gradient

Why: the straightforward path (model(...).logits, then log-softmax) holds (tokens, V) float32 logits for a
whole micro-batch, and autograd keeps them for backward: 151,936 x 4 bytes per token on Qwen3, 2.5 GB for one
4k-token sequence, more than the layer activations. Here the lm_head runs on `chunk` tokens at a time and
nothing of size V outlives its chunk: forward keeps only the hidden states (alive anyway) and the per-token
log-sum-exp; backward recomputes each chunk's logits (one extra lm_head matmul per chunk, ~1/(6 x layers) of
the step's FLOPs on a 48-layer model) and turns them into gradients for the hidden states and the weight at
once. Peak memory of the pass: O(chunk x V), whatever the number of tokens.

Numerics are the straightforward path's, op for op: logits in the weight's dtype (bf16 on GPU), cast to float32,
divided by the temperature in float32 (what vLLM's sampler scores, colo.algo.loss.scale_logits); the log-prob
is logit - logsumexp, the entropy logsumexp - sum(p * logit). The gradient wrt the logits is cast back to the
weight's dtype before the two matmuls, as autograd does through a bf16 Linear; the weight's gradient is summed
over chunks in its own dtype (addmm: float32 accumulation inside each chunk, one rounding per chunk).

`token_loss` (colo.algo.loss.TokenLoss, the update with trainer.loss_in_lm_head): the loss is a weighted sum of
per-token terms, so each chunk's d loss / d logp is known as soon as its log-probs are; the chunk's logits turn
into the gradients wrt its hidden states and the weight right there, in forward, and backward recomputes nothing
(three lm_head matmuls per token instead of four). The log-probs come back as constants and a zero scalar, the
anchor, carries the gradient: anchor.backward() is the loss's backward.

Gradients, per token with p = softmax(z), z = logits / temperature, target y, entropy H:
    d lp / d z = onehot(y) - p          d H / d z = -p * (log p + H)

`compile_backend` (trainer.compile): each chunk's math after the matmul (cast, temperature, log-sum-exp, entropy;
in backward the gradient wrt the logits) runs as one torch.compile'd function per direction, the same formulas
without in-place ops: the eager path makes ~10 passes over a (chunk, V) float32 tensor per chunk (on an H100 at 4k,
~2 s of a 4.7 s train phase's kernels, colo.bench.step --profile), the fused one reads the (chunk, V) logits in
the weight's dtype once or twice and writes the gradient once.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

DEFAULT_CHUNK = 1024  # tokens per lm_head chunk: 1024 x 151,936 x 4 bytes = 0.6 GB per float32 copy


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """(c, H) @ (V, H)^T in the weight's dtype -> (c, V) float32 / temperature (a new tensor)."""
    z = (h @ weight.t()).float()
    return z.div_(temperature) if temperature != 1.0 else z


def _fused_forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(c, V) logits in the weight's dtype, (c,) targets -> (c,) log-prob, entropy, log-sum-exp (compiled)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    m = torch.logsumexp(z, dim=-1)  # (c,)
    lp = z.gather(1, targets[:, None]).squeeze(1) - m
    ent = m - (torch.exp(z - m[:, None]) * z).sum(-1)
    return lp, ent, m


def _fused_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
                    g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """d loss / d logits (c, V) in the logits' dtype, from the (c, V) logits and the forward's (c,) lse, entropy
    (compiled): the eager backward's formulas, op for op, without in-place updates."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logp = z - lse[:, None]  # (c, V)
    p = logp.exp()
    g = -((logp + ent[:, None]) * p * g_ent[:, None]) if g_ent is not None else torch.zeros_like(p)
    if g_lp is not None:
        g = (g - p * g_lp[:, None]).scatter_add(1, targets[:, None], g_lp[:, None].float())
    if temperature != 1.0:
        g = g / temperature
    return g.to(logits.dtype)


@functools.cache
def _compiled(fn, backend: str):
    """fn under torch.compile, once per backend (dynamo then keeps one graph per chunk length: the full chunk and
    a dynamic one for the last)."""
    return torch.compile(fn, backend=backend)


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                 backend: str | None) -> tuple[torch.Tensor, ...]:
    """One chunk's forward: (c,) log-prob, entropy, log-sum-exp, and its logits as the chunk's gradient wants them
    next (compiled: (c, V) in the weight's dtype; eager: float32 / temperature)."""
    if backend is not None:
        logits = h @ weight.t()  # (c, V)
        return (*_compiled(_fused_forward, backend)(logits, targets, temperature), logits)
    z = _chunk_logits(h, weight, temperature)  # (c, V)
    m = torch.logsumexp(z, dim=-1)  # (c,)
    lp = z.gather(1, targets[:, None]).squeeze(1) - m
    pz = torch.exp(z - m[:, None]).mul_(z).sum(-1)  # (c,) sum p * z
    return lp, m - pz, m, z


def _chunk_grad(logits: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                ent: torch.Tensor, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, temperature: float,
                backend: str | None) -> torch.Tensor:
    """(c, V) d loss / d logits in the weight's dtype, from _chunk_stats's logits (eager: consumed in place)."""
    if backend is not None:
        return _compiled(_fused_backward, backend)(logits, targets, lse, ent, g_lp, g_ent, temperature)
    logp = logits.sub_(lse[:, None])  # (c, V) log p, in place of z
    p = logp.exp()  # (c, V)
    if g_ent is not None:  # d H / d z = -p * (log p + H), in place of log p
        g = logp.add_(ent[:, None]).mul_(p).mul_(-g_ent[:, None])  # (c, V) d loss / d z
    else:
        g = torch.zeros_like(p)
    if g_lp is not None:
        g.sub_(p * g_lp[:, None])
        g.scatter_add_(1, targets[:, None], g_lp[:, None].float())
    if temperature != 1.0:
        g.div_(temperature)
    return g.to(weight.dtype)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)  # (N,)
        ent = torch.empty_like(lp)  # (N,)
        lse = torch.empty_like(lp)  # (N,) kept for backward
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            lp[s:e], ent[s:e], lse[s:e], _ = _chunk_stats(hidden[s:e], weight, targets[s:e], temperature, backend)
        # an output the loss never uses (the entropy: a metric, under no_grad) gets None in backward, not zeros
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.backend = temperature, chunk, backend
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        t, chunk, backend = ctx.temperature, ctx.chunk, ctx.backend
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_h = torch.empty_like(hidden) if need_h else None
        g_w = torch.zeros_like(weight) if need_w else None
        n = hidden.shape[0]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]  # (c, H)
            logits = h @ weight.t() if backend is not None else _chunk_logits(h, weight, t)  # recomputed
            g = _chunk_grad(logits, weight, targets[s:e], lse[s:e], ent[s:e], None if g_lp is None else g_lp[s:e],
                            None if g_ent is None else g_ent[s:e], t, backend)  # (c, V)
            if need_h:
                g_h[s:e] = g @ weight
            if need_w:
                g_w.addmm_(g.t(), h)
        return g_h, g_w, None, None, None, None


class _ChunkedLossGrad(torch.autograd.Function):
    """The chunk loop with the loss's gradient taken inside it (`token_loss`, colo.algo.loss.TokenLoss): each chunk's
    logits turn into their log-probs, then at once into the gradient wrt the hidden states and the weight, so backward
    only hands those on, scaled by the anchor's gradient. The log-probs and entropies come out as constants: the
    anchor (a zero scalar) carries the loss's gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, backend: str | None, token_loss) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)  # (N,)
        ent = torch.empty_like(lp)  # (N,)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_h = torch.empty_like(hidden) if need_h else None  # (N, H)
        g_w = torch.zeros_like(weight) if need_w else None  # (V, H)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]  # (c, H)
            lp[s:e], ent[s:e], lse, logits = _chunk_stats(h, weight, targets[s:e], temperature, backend)
            with torch.enable_grad():  # the chunk's d loss / d log-prob: autograd through the loss's own formulas
                x = lp[s:e].detach().requires_grad_()
                (g_lp,) = torch.autograd.grad(token_loss(x, s, e).sum(), x, allow_unused=True)
            if g_lp is None:  # no token of the chunk reaches the loss
                g_lp = torch.zeros_like(x)
            g = _chunk_grad(logits, weight, targets[s:e], lse, ent[s:e], g_lp, None, temperature, backend)
            if need_h:
                g_h[s:e] = g @ weight
            if need_w:
                g_w.addmm_(g.t(), h)
        ctx.grads = g_h, g_w
        ctx.mark_non_differentiable(lp, ent)
        return lp, ent, torch.zeros((), dtype=torch.float32, device=hidden.device)

    @staticmethod
    def backward(ctx, _g_lp, _g_ent, g_anchor: torch.Tensor):
        g_h, g_w = ctx.grads
        ctx.grads = None  # freed with this backward, not with the graph
        return (None if g_h is None else g_h.mul_(g_anchor.to(g_h.dtype)),
                None if g_w is None else g_w.mul_(g_anchor.to(g_w.dtype)), None, None, None, None, None)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk: int = DEFAULT_CHUNK, compile_backend: str | None = None, token_loss=None
                   ) -> tuple[torch.Tensor, ...]:
    """log softmax(hidden @ weight.T / temperature)[targets] and the entropy of that distribution, per token.

    hidden (N, H), weight (V, H) (the lm_head's, tied or not: its gradient flows to whichever parameter it
    is), targets (N,) long in [0, V). Returns two (N,) float32 tensors, both differentiable. With `token_loss`
    (colo.algo.loss.TokenLoss in this flat layout) the loss's gradient is taken in the chunk loop: the two come
    back as constants, with a third output, a zero scalar whose backward() is the loss's."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden (N, H) and targets (N,) expected, got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if token_loss is not None:
        return _ChunkedLossGrad.apply(hidden, weight, targets.long(), float(temperature), int(chunk), compile_backend,
                                      token_loss)
    return _ChunkedLogprobs.apply(hidden, weight, targets.long(), float(temperature), int(chunk), compile_backend)


def shifted_logprobs(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                     position_ids: torch.Tensor | None = None, temperature: float = 1.0,
                     chunk: int = DEFAULT_CHUNK, compile_backend: str | None = None, token_loss=None
                     ) -> tuple[torch.Tensor, ...]:
    """(b, T) log-probs and entropies aligned as the batch contract has them (colo.algo.loss.gather_logprobs):
    out[:, t] scores input_ids[:, t] with the distribution at position t - 1; out[:, 0] = 0.

    hidden (b, T, H): the decoder's last hidden states (after the final norm). `position_ids` (b, T), for packed
    rows: where a sample starts (position 0) nothing before it predicts it, so out is 0 there too. `token_loss`
    (colo.algo.loss.TokenLoss, laid out (b, T) as input_ids): see token_logprobs; a third output then carries
    the loss's gradient."""
    b, T, H = hidden.shape
    h = hidden[:, :-1].reshape(-1, H)  # (b*(T-1), H)
    tgt = input_ids[:, 1:].reshape(-1).to(hidden.device)  # (b*(T-1),)
    keep = None if position_ids is None else position_ids.to(hidden.device) != 0  # (b, T)
    if token_loss is not None:  # the same shift and flattening, and no gradient where a sample starts
        token_loss = token_loss.map(lambda x: x[:, 1:].reshape(-1))
        if keep is not None:
            flat = keep[:, 1:].reshape(-1)
            token_loss = dataclasses.replace(token_loss, weight=token_loss.weight * flat, mask=token_loss.mask & flat)
    out = token_logprobs(h, weight, tgt, temperature, chunk, compile_backend, token_loss)
    lp = torch.nn.functional.pad(out[0].view(b, T - 1), (1, 0), value=0.0)  # (b, T)
    ent = torch.nn.functional.pad(out[1].view(b, T - 1), (1, 0), value=0.0)  # (b, T)
    if keep is not None:
        lp, ent = lp * keep.to(lp.dtype), ent * keep.to(ent.dtype)
    return (lp, ent) if token_loss is None else (lp, ent, out[2])
