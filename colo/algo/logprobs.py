"""Log-probs and entropy of the sampled tokens straight from the last hidden states, chunk by chunk.

    lp, ent = token_logprobs(hidden, weight, targets, temperature, chunk)   # (N, H), (V, H), (N,) -> (N,), (N,)
    lp, ent = shifted_logprobs(hidden, weight, input_ids, position_ids, temperature, chunk)   # (b, T) each

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

Gradients, per token with p = softmax(z), z = logits / temperature, target y, entropy H:
    d lp / d z = onehot(y) - p          d H / d z = -p * (log p + H)

`compile_backend` (trainer.compile): each chunk's math after the matmul (cast, temperature, log-sum-exp, entropy;
in backward the gradient wrt the logits) runs as one torch.compile'd function per direction, the same formulas
without in-place ops: the eager path makes ~10 passes over a (chunk, V) float32 tensor per chunk (on an H100 at 4k,
~2 s of a 4.7 s train phase's kernels, colo.bench.step --profile), the fused one reads the (chunk, V) logits in
the weight's dtype once or twice and writes the gradient once.
"""
from __future__ import annotations

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
            if backend is not None:
                lp[s:e], ent[s:e], lse[s:e] = _compiled(_fused_forward, backend)(
                    hidden[s:e] @ weight.t(), targets[s:e], temperature)
                continue
            z = _chunk_logits(hidden[s:e], weight, temperature)  # (c, V)
            m = torch.logsumexp(z, dim=-1)  # (c,)
            lp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - m
            pz = torch.exp(z - m[:, None]).mul_(z).sum(-1)  # (c,) sum p * z
            ent[s:e] = m - pz
            lse[s:e] = m
        # an output the loss never uses (the entropy: a metric, under no_grad) gets None in backward, not zeros
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.backend = temperature, chunk, backend
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_h = torch.empty_like(hidden) if need_h else None
        g_w = torch.zeros_like(weight) if need_w else None
        n = hidden.shape[0]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]  # (c, H)
            if ctx.backend is not None:
                g = _compiled(_fused_backward, ctx.backend)(
                    h @ weight.t(), targets[s:e], lse[s:e], ent[s:e], None if g_lp is None else g_lp[s:e],
                    None if g_ent is None else g_ent[s:e], t)  # (c, V) in the weight's dtype
                if need_h:
                    g_h[s:e] = g @ weight
                if need_w:
                    g_w.addmm_(g.t(), h)
                continue
            z = _chunk_logits(h, weight, t)  # (c, V)
            logp = z.sub_(lse[s:e, None])  # (c, V) log p, in place of z
            p = logp.exp()  # (c, V)
            if g_ent is not None:  # d H / d z = -p * (log p + H), in place of log p
                g = logp.add_(ent[s:e, None]).mul_(p).mul_(-g_ent[s:e, None])  # (c, V) d loss / d z
            else:
                g = torch.zeros_like(p)
            if g_lp is not None:
                g.sub_(p * g_lp[s:e, None])
                g.scatter_add_(1, targets[s:e, None], g_lp[s:e, None].float())
            if t != 1.0:
                g.div_(t)
            g = g.to(weight.dtype)
            if need_h:
                g_h[s:e] = g @ weight
            if need_w:
                g_w.addmm_(g.t(), h)
        return g_h, g_w, None, None, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk: int = DEFAULT_CHUNK, compile_backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[targets] and the entropy of that distribution, per token.

    hidden (N, H), weight (V, H) (the lm_head's, tied or not: its gradient flows to whichever parameter it
    is), targets (N,) long in [0, V). Returns two (N,) float32 tensors, both differentiable."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden (N, H) and targets (N,) expected, got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _ChunkedLogprobs.apply(hidden, weight, targets.long(), float(temperature), int(chunk), compile_backend)


def shifted_logprobs(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                     position_ids: torch.Tensor | None = None, temperature: float = 1.0,
                     chunk: int = DEFAULT_CHUNK, compile_backend: str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, T) log-probs and entropies aligned as the batch contract has them (colo.algo.loss.gather_logprobs):
    out[:, t] scores input_ids[:, t] with the distribution at position t - 1; out[:, 0] = 0.

    hidden (b, T, H): the decoder's last hidden states (after the final norm). `position_ids` (b, T), for packed
    rows: where a sample starts (position 0) nothing before it predicts it, so out is 0 there too."""
    b, T, H = hidden.shape
    h = hidden[:, :-1].reshape(-1, H)  # (b*(T-1), H)
    tgt = input_ids[:, 1:].reshape(-1).to(hidden.device)  # (b*(T-1),)
    lp, ent = token_logprobs(h, weight, tgt, temperature, chunk, compile_backend)
    lp = torch.nn.functional.pad(lp.view(b, T - 1), (1, 0), value=0.0)  # (b, T)
    ent = torch.nn.functional.pad(ent.view(b, T - 1), (1, 0), value=0.0)  # (b, T)
    if position_ids is not None:
        keep = (position_ids.to(hidden.device) != 0).to(lp.dtype)  # (b, T)
        lp, ent = lp * keep, ent * keep
    return lp, ent
