"""Policy loss: PPO-clip with asymmetric clipping, truncated importance sampling and optional k3 KL.

Per token t of a response (all tensors (B, T), aligned so position t scores input_ids[t]):

    ratio_t = exp(logp_t - old_t)                              trainer now vs trainer before update
    pg_t    = max(-A * ratio_t, -A * clip(ratio_t, 1 - clip_low, 1 + clip_high))
    w_t     = min(exp(old_t - rollout_t), tis_cap)  (no grad)  vLLM sampled, trainer scores: the
              two disagree (bf16 kernels, MoE routing ties), so the rollout is slightly off-policy
    loss_t  = w_t * pg_t + kl_coef * k3(ref_t, logp_t)

and `loss_agg` reduces loss_t over masked tokens:

    token-mean           sum_{b,t} m*loss / token_count     (token_count: GLOBAL masked tokens)
    seq-mean-token-sum   sum_b (sum_t m*loss)          / seq_count
    seq-mean-token-mean  sum_b (sum_t m*loss / sum_t m) / seq_count

Why the global counts: the trainer splits the step's batch over FSDP ranks and micro-batches and
sums gradients (FSDP reduce-scatter averages over ranks; the trainer undoes that or scales by world
size). Dividing every piece by the same global count makes the summed gradient equal the gradient of
one process seeing the whole batch. With the local defaults, each micro-batch is weighted equally
regardless of how many tokens it holds.

Hazard: positions outside the mask (prompt, padding) hold arbitrary log-probs (rollout log-probs are
0 there), so exp() of their differences may overflow; inf * 0 is nan, which would poison the loss and
every gradient. Differences are zeroed off-mask *before* exp.
"""

from __future__ import annotations

import torch

LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_agg: str = "token-mean",
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    token_count: float | torch.Tensor | None = None,
    seq_count: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss to backpropagate, plus detached scalar metrics.

    logprobs (B, T) carries the grad; old_logprobs, rollout_logprobs, ref_logprobs (B, T) are
    treated as constants; advantages (B,) or (B, T); loss_mask (B, T) (bool/int/float).
    `tis_cap=None` with rollout_logprobs given means an uncapped importance weight; `tis_cap=0`
    turns the correction off (config's meaning of 0; a literal cap of 0 would zero the loss).
    `seq_count` is the seq-mean analogue of token_count (default: local sequences with at least one
    masked token, so zero-mask padding rows never dilute the mean).

    Metrics are local means over masked tokens (0-dim float tensors, detached: the caller decides
    when to .item(), so a GPU trainer does not sync per micro-batch): clip_frac, approx_kl (k3 of
    old vs new), tis_mean, pg_loss (the aggregated policy-gradient part), and kl_ref when kl_coef > 0.
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"shape mismatch: logprobs {tuple(logprobs.shape)}, old_logprobs "
            f"{tuple(old_logprobs.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    mask = loss_mask.to(torch.bool)  # (B, T)
    maskf = mask.to(logprobs.dtype)  # (B, T)
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    old = old_logprobs.detach()

    log_ratio = torch.where(mask, logprobs - old, torch.zeros_like(logprobs))  # (B, T)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)  # (B, T)

    metrics: dict[str, torch.Tensor] = {}
    n_local = maskf.sum().clamp(min=1.0)
    with torch.no_grad():
        # a token counts as clipped when the clipped branch wins, i.e. its gradient is cut off
        metrics["clip_frac"] = ((pg_clipped > pg_unclipped) & mask).sum() / n_local
        metrics["approx_kl"] = ((ratio - 1.0 - log_ratio) * maskf).sum() / n_local

    if tis_cap is not None and tis_cap < 0:
        raise ValueError(f"tis_cap must be >= 0 (0 = off), got {tis_cap}")
    if rollout_logprobs is not None and tis_cap != 0:
        with torch.no_grad():
            tis_log = torch.where(mask, old - rollout_logprobs.to(old.dtype), torch.zeros_like(old))
            tis_w = torch.exp(tis_log)
            if tis_cap is not None:
                tis_w = torch.clamp(tis_w, max=tis_cap)
            metrics["tis_mean"] = (tis_w.to(maskf.dtype) * maskf).sum() / n_local
        pg = pg * tis_w.to(pg.dtype)
    else:
        metrics["tis_mean"] = torch.ones((), dtype=maskf.dtype)

    pg_loss = _aggregate(pg, maskf, loss_agg, token_count, seq_count)
    loss = pg_loss
    if kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        # k3 estimator of KL(pi || ref) on samples from pi: exp(d) - d - 1 >= 0, d = ref - logp
        d = torch.where(mask, ref_logprobs.detach().to(logprobs.dtype) - logprobs,
                        torch.zeros_like(logprobs))
        kl = torch.exp(d) - d - 1.0  # (B, T)
        kl_loss = _aggregate(kl, maskf, loss_agg, token_count, seq_count)
        loss = loss + kl_coef * kl_loss
        metrics["kl_ref"] = ((kl.detach() * maskf).sum() / n_local)
    metrics["pg_loss"] = pg_loss.detach()
    return loss, metrics


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


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position: (B, T, V) -> (B, T) float32.

    Computed in float32 (bf16 log-softmax loses the small probabilities that dominate the tail).
    Memory: one (B, T, V) float32 temporary; call it under no_grad on a micro-batch.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    return -(logp.exp() * logp).sum(dim=-1)  # (B, T)


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
