"""Policy loss: PPO-clip with asymmetric clipping, dual-clip, truncated importance sampling and k3 KL.

Per token t of a response (all tensors (B, T), aligned so position t scores input_ids[t]):

    ratio_t = exp(clamp(logp_t - old_t, -20, 20))              trainer now vs trainer before update
    pg_t    = max(-A * ratio_t, -A * clip(ratio_t, 1 - clip_low, 1 + clip_high))
    pg_t    = min(pg_t, -A * clip_ratio_c)   only where A < 0 and clip_ratio_c > 0 (dual-clip)
    w_t     = min(exp(clamp(old_t - rollout_t, -20, 20)), tis_cap)  (no grad)  vLLM sampled, trainer scores: the
              two disagree (bf16 kernels, MoE routing ties), so the rollout is slightly off-policy
    kl_t    = clamp(exp(d_t) - d_t - 1, -10, 10),  d_t = clamp(ref_t - logp_t, -20, 20)
    loss_t  = w_t * pg_t + kl_coef * kl_t

rollout_t is the behaviour log-prob of each token: what vLLM reported when it sampled it. In loop.mode=async a
response may mix tokens of several weight versions, each with its own behaviour log-prob; the same formula is
then decoupled PPO: the ratio's trust region is around pi_old (old_t, the trainer's recompute before the
update) and w_t, truncated, corrects behaviour -> pi_old (docs/loss.md, "Tokens from older weights").

kl_t is the k3 estimator of KL(pi || ref) on tokens sampled from pi (unbiased for the sequence KL,
always >= 0, low variance; Schulman's "approximating KL"). The clamps (verl's low_var_kl, slime) keep
one token whose log-ratio has run away from dominating the step; outside them the token's KL term has
no gradient. Dual-clip (Ye et al. 2020, verl's clip_ratio_c): with A < 0 the PPO term -A * ratio grows
without bound as the ratio grows, so a token the policy now strongly prefers but the rollout punished
can produce an arbitrarily large update; the bound -A * c caps it (the token then has no gradient).

and `loss_agg` reduces loss_t over masked tokens:

    token-mean           sum_{b,t} m*loss / token_count     (token_count: GLOBAL masked tokens)
    seq-mean-token-sum   sum_b (sum_t m*loss)          / seq_count
    seq-mean-token-mean  sum_b (sum_t m*loss / sum_t m) / seq_count

Why the global counts: the trainer splits the step's batch over FSDP ranks and micro-batches and
sums gradients (FSDP reduce-scatter averages over ranks; the trainer undoes that or scales by world
size). Dividing every piece by the same global count makes the summed gradient equal the gradient of
one process seeing the whole batch. With the local defaults, each micro-batch is weighted equally
regardless of how many tokens it holds. For the same reason the aggregated parts (pg_loss, kl_loss)
returned as metrics are additive: their sum over micro-batches and ranks is the mini-batch's value.

Hazard: positions outside the mask (prompt, padding) hold arbitrary log-probs (rollout log-probs are
0 there), so exp() of their differences may overflow; inf * 0 is nan, which would poison the loss and
every gradient. Differences are zeroed off-mask *before* exp.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from colo.config import AlgoConfig

LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_LOG_RATIO_CLAMP = 20.0  # |ref - logp| beyond this is treated as this (exp(20) ~ 5e8)
KL_CLAMP = 10.0  # a token's k3 term is at most this
LOG_RATIO_CLAMP = 20.0  # PPO ratio and TIS weight: |log-ratio| beyond this is this (verl, slime: +-20)


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The loss's options, named as algo.* names them: `LossOptions.of(cfg.algo)` in the trainer, one object through
    policy_loss, TokenLoss and their per-token terms. The defaults are each term's off (tests build options by hand).

    `tis_cap=None` with rollout log-probs given means an uncapped importance weight; `tis_cap=0` turns the correction
    off (the config's meaning of 0; a literal cap of 0 would zero the loss). `clip_ratio_c` > 1 bounds the loss of
    negative-advantage tokens at -A * clip_ratio_c; 0 is off."""
    clip_low: float
    clip_high: float
    loss_agg: str = "token-mean"
    tis_cap: float | None = None
    kl_coef: float = 0.0
    clip_ratio_c: float = 0.0

    def __post_init__(self) -> None:
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {self.loss_agg!r}")
        if self.clip_ratio_c != 0 and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (0 = off), got {self.clip_ratio_c}")
        if self.tis_cap is not None and self.tis_cap < 0:
            raise ValueError(f"tis_cap must be >= 0 (0 = off), got {self.tis_cap}")

    @classmethod
    def of(cls, algo: AlgoConfig) -> LossOptions:
        """From the config's algo section: its fields of the same names."""
        values = {f.name: getattr(algo, f.name) for f in dataclasses.fields(cls)}
        return cls(**{k: v if v is None or k == "loss_agg" else float(v) for k, v in values.items()})


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    opts: LossOptions,
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    token_count: float | torch.Tensor | None = None,
    seq_count: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss to backpropagate, plus detached scalar metrics.

    logprobs (B, T) carries the grad; old_logprobs, rollout_logprobs, ref_logprobs (B, T) are
    treated as constants; advantages (B,) or (B, T); loss_mask (B, T) (bool/int/float); `opts` the
    clips, the aggregation, the TIS cap and the KL weight (LossOptions).
    `seq_count` is the seq-mean analogue of token_count (default: local sequences with at least one
    masked token, so zero-mask padding rows never dilute the mean).

    Metrics (0-dim float tensors, detached: the caller decides when to .item(), so a GPU trainer does
    not sync per micro-batch) come in two kinds. Local means over masked tokens, which a caller
    combines weighted by its token count: clip_frac (the PPO clip cut the gradient), clip_frac/dual
    (the dual-clip bound did), approx_kl (k3 of old vs new), tis_mean, and kl_ref (the token mean of
    kl_t) when kl_coef > 0. Aggregated parts of the loss, additive over micro-batches and ranks when
    token_count/seq_count are global: pg_loss and, when kl_coef > 0, kl_loss (before kl_coef), so
    loss = pg_loss + kl_coef * kl_loss.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"shape mismatch: logprobs {tuple(logprobs.shape)}, old_logprobs "
            f"{tuple(old_logprobs.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    if opts.kl_coef > 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    mask = loss_mask.to(torch.bool)  # (B, T)
    maskf = mask.to(logprobs.dtype)  # (B, T)
    t = _token_terms(logprobs, old_logprobs, advantages, mask, opts, rollout_logprobs, ref_logprobs)
    metrics: dict[str, torch.Tensor] = {}
    n_local = maskf.sum().clamp(min=1.0)
    with torch.no_grad():
        # a token counts as clipped when the clipped branch wins, i.e. its gradient is cut off
        metrics["clip_frac"] = ((t["pg_clipped"] > t["pg_unclipped"]) & mask).sum() / n_local
        metrics["clip_frac/dual"] = t["dual"].sum() / n_local
        metrics["approx_kl"] = ((t["ratio"] - 1.0 - t["log_ratio"]) * maskf).sum() / n_local
        tis_w = t["tis_w"]
        metrics["tis_mean"] = (torch.ones((), dtype=maskf.dtype) if tis_w is None
                               else (tis_w.to(maskf.dtype) * maskf).sum() / n_local)
    pg_loss = _aggregate(t["pg"], maskf, opts.loss_agg, token_count, seq_count)
    loss = pg_loss
    if t["kl"] is not None:
        kl_loss = _aggregate(t["kl"], maskf, opts.loss_agg, token_count, seq_count)
        loss = loss + opts.kl_coef * kl_loss
        metrics["kl_ref"] = ((t["kl"].detach() * maskf).sum() / n_local)
        metrics["kl_loss"] = kl_loss.detach()
    metrics["pg_loss"] = pg_loss.detach()
    return loss, metrics


def _token_terms(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 opts: LossOptions, rollout_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None) -> dict:
    """Each token's terms of the module docstring's formulas, (B, T) or (N,) alike (`mask` bool): "pg" (dual-clip
    and the TIS weight applied), "kl" (None when kl_coef is 0), and what the metrics read. policy_loss aggregates
    them; TokenLoss differentiates them chunk by chunk inside the lm_head's loop."""
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 and logprobs.dim() == 2 else adv  # (B, 1) or as logprobs
    old = old_logprobs.detach()
    log_ratio = torch.where(mask, logprobs - old, torch.zeros_like(logprobs))
    # exp(95) is inf in fp32 and exp(25) gives a gradient of ~7e10 * |A|; clamped, such a token has none
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - opts.clip_low, 1.0 + opts.clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    dual = torch.zeros_like(mask)
    if opts.clip_ratio_c > 0:
        bound = -adv * opts.clip_ratio_c  # only binding where A < 0
        dual = (adv < 0) & (pg > bound) & mask
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    tis_w = None
    if rollout_logprobs is not None and opts.tis_cap != 0:
        with torch.no_grad():
            tis_log = torch.where(mask, old - rollout_logprobs.to(old.dtype), torch.zeros_like(old))
            tis_log = torch.clamp(tis_log, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # uncapped (tis_cap=None): finite
            tis_w = torch.exp(tis_log)
            if opts.tis_cap is not None:
                tis_w = torch.clamp(tis_w, max=opts.tis_cap)
        pg = pg * tis_w.to(pg.dtype)
    kl = k3_kl(logprobs, ref_logprobs.detach().to(logprobs.dtype), mask) if opts.kl_coef > 0.0 else None
    return {"log_ratio": log_ratio, "ratio": ratio, "pg_unclipped": pg_unclipped, "pg_clipped": pg_clipped,
            "dual": dual, "pg": pg, "tis_w": tis_w, "kl": kl}


@dataclasses.dataclass
class TokenLoss:
    """policy_loss token by token: each token's loss, weighted as the aggregation weights it, so that its gradient
    wrt the token's log-prob is the one autograd takes through policy_loss. colo.algo.logprobs calls it inside the
    lm_head's chunk loop, where each chunk's logits are at hand: the chunk's gradient is formed there, in forward,
    and backward never recomputes the logits (one lm_head matmul per token less; docs/loss.md).

    Every tensor is laid out as the log-probs it meets: (b, T) as built by `of`, then packed, then shifted and
    flattened (`map`). `weight` folds in the mask, the aggregation's divisor and the loss scale."""
    weight: torch.Tensor  # float: d total / d loss_t
    mask: torch.Tensor  # bool
    advantages: torch.Tensor  # per token
    old: torch.Tensor | None  # None: the log-probs themselves (the step's one update: trainer.old_logprobs=update)
    rollout: torch.Tensor | None
    ref: torch.Tensor | None
    opts: LossOptions

    @classmethod
    def of(cls, old_logprobs: torch.Tensor | None, advantages: torch.Tensor, loss_mask: torch.Tensor,
           opts: LossOptions, *, token_count: float, seq_count: float, scale: float = 1.0,
           rollout_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None) -> "TokenLoss":
        """From policy_loss's (b, T) arguments (advantages (b,) or (b, T)) and its global counts; `scale`
        multiplies the loss (the trainer's world size)."""
        maskf = loss_mask.to(torch.float32)  # (b, T)
        adv = advantages.to(torch.float32)
        adv = adv[:, None].expand_as(maskf) if adv.dim() == 1 else adv  # (b, T)
        weight = token_weights(maskf, opts.loss_agg, token_count, seq_count) * scale  # (b, T)
        return cls(weight, loss_mask.to(torch.bool), adv, old_logprobs, rollout_logprobs,
                   ref_logprobs if opts.kl_coef > 0.0 else None, opts)

    def map(self, fn) -> "TokenLoss":
        """The same loss with `fn` applied to each per-token tensor (a layout change)."""
        def f(x):
            return None if x is None else fn(x)
        return dataclasses.replace(self, weight=fn(self.weight), mask=fn(self.mask), advantages=fn(self.advantages),
                                   old=f(self.old), rollout=f(self.rollout), ref=f(self.ref))

    def __call__(self, logprobs: torch.Tensor, s: int, e: int) -> torch.Tensor:
        """(e - s,) weighted losses of tokens s..e (flat layout) at `logprobs`, their float32 log-probs."""
        t = _token_terms(logprobs, logprobs if self.old is None else self.old[s:e], self.advantages[s:e],
                         self.mask[s:e], self.opts, None if self.rollout is None else self.rollout[s:e],
                         None if self.ref is None else self.ref[s:e])
        loss = t["pg"] if t["kl"] is None else t["pg"] + self.opts.kl_coef * t["kl"]
        return loss * self.weight[s:e]


def token_weights(maskf: torch.Tensor, loss_agg: str, token_count: float | torch.Tensor | None,
                  seq_count: float | torch.Tensor | None) -> torch.Tensor:
    """(B, T) each token's coefficient in _aggregate, the mask included: _aggregate(x, maskf, ...) equals
    (x * token_weights(maskf, ...)).sum() up to rounding."""
    if loss_agg == "token-mean":
        denom = maskf.sum().clamp(min=1.0) if token_count is None else token_count
        return maskf / denom
    seq_tokens = maskf.sum(dim=1, keepdim=True)  # (B, 1)
    denom = (seq_tokens > 0).sum().clamp(min=1) if seq_count is None else seq_count
    if loss_agg == "seq-mean-token-sum":
        return maskf / denom
    if loss_agg == "seq-mean-token-mean":
        return maskf / seq_tokens.clamp(min=1.0) / denom
    raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Clamped k3 estimate of KL(pi || ref) per token, (B, T); 0 off-mask.

    d = ref - logp on a token sampled from pi; exp(d) - d - 1 >= 0 has expectation KL(pi || ref).
    """
    d = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs))
    d = torch.clamp(d, -KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(d) - d - 1.0, -KL_CLAMP, KL_CLAMP)


def _aggregate(
    per_token: torch.Tensor,  # (B, T)
    maskf: torch.Tensor,  # (B, T)
    loss_agg: str,
    token_count: float | torch.Tensor | None,
    seq_count: float | torch.Tensor | None,
) -> torch.Tensor:
    # Multiplying by the mask (rather than indexing) keeps the graph attached to every element, so a
    # rank holding only zero-mask padding rows still backpropagates and joins FSDP's collectives.
    masked = per_token * maskf
    if loss_agg == "token-mean":
        denom = maskf.sum().clamp(min=1.0) if token_count is None else token_count
        return masked.sum() / denom
    seq_tokens = maskf.sum(dim=1)  # (B,)
    if loss_agg == "seq-mean-token-sum":
        per_seq = masked.sum(dim=1)  # (B,)
    else:  # seq-mean-token-mean
        per_seq = masked.sum(dim=1) / seq_tokens.clamp(min=1.0)  # (B,)
    denom = (seq_tokens > 0).sum().clamp(min=1) if seq_count is None else seq_count
    return per_seq.sum() / denom


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, T, V) logits in float32, divided by `temperature`: what vLLM's sampler scores.

    vLLM casts the model's logits to float32 *before* dividing by the temperature. Dividing the bf16
    logits first rounds each quotient to 8 mantissa bits: at T = 0.6 on synthetic Qwen-vocab logits that
    moved log-probs by 0.014-0.023 on average and up to 0.2 (issue 13; tests/unit/test_algo_loss.py), as
    large as the mismatch TIS corrects.

    Memory: one float32 copy, divided in place (the caller's tensor is never modified), so bf16 logits
    cost 4 + 2 bytes per element here, not 4 + 4 + 2 for a cast followed by a division.
    """
    if temperature == 1.0:
        return logits.float()
    return logits.to(torch.float32, copy=True).div_(temperature)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the distribution that scores each token: (B, T, V) -> (B, T) float32.

    Aligned like `gather_logprobs`: out[:, t] is the entropy of the distribution at logits[:, t - 1],
    the one that produced input_ids[t] (so loss_mask selects the response's own distributions);
    out[:, 0] = 0. Computed in float32 (bf16 log-softmax loses the small probabilities that dominate
    the tail). Memory: one (B, T-1, V) float32 temporary; call it under no_grad on a micro-batch.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
    ent = -(logp.exp() * logp).sum(dim=-1)  # (B, T-1)
    return torch.nn.functional.pad(ent, (1, 0), value=0.0)  # (B, T)


def gather_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs aligned as in the batch contract: out[:, t] = log p(ids[t] | ids[:t]).

    logits (B, T, V) from a causal LM (logits[:, t] predicts ids[t + 1]); input_ids (B, T).
    Returns (B, T) float32 with out[:, 0] = 0 (no prediction for the first token). Uses
    gather - logsumexp rather than a full log_softmax so only one (B, T-1, V) float32 copy exists.
    """
    lg = logits[:, :-1].float()  # (B, T-1, V)
    tgt = input_ids[:, 1:].unsqueeze(-1)  # (B, T-1, 1)
    lp = lg.gather(-1, tgt).squeeze(-1) - torch.logsumexp(lg, dim=-1)  # (B, T-1)
    return torch.nn.functional.pad(lp, (1, 0), value=0.0)  # (B, T)
