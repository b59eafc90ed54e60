"""Rollout routing replay (R3) on the trainer's side: make HF MoE blocks use the engine's expert ids.

    tap = RouterTap(model)                          # forward hooks on every MoE router, once
    tap.set(ids, replay=True)                       # ids: (b, T, M, K) from the batch, NO_EXPERT where none
    logits = model(input_ids=...)                   # the experts run on the engine's ids
    differ, pairs = tap.mismatch(ids, valid)        # (token, layer) pairs whose own top-k set differs

Why: the engine and the trainer compute router logits with different kernels and precision, so at a
near-tie they pick different experts for the same token. The trainer then scores (and trains) a policy
that did not produce the sample. Replaying the engine's ids removes that part of the gap; the routing
weights still come from the trainer's own router logits, at the replayed ids, normalized the way the
family normalizes them, so the router keeps its gradient.

The hook replaces the router module's output `(router_logits, weights, ids)`: the MoE block hands those
to its experts, so nothing else in transformers changes. The router's input is the block's hidden states
flattened to (b*T, H) in row-major order: row r is token (r // T, r % T), which is how `ids` is laid out.
Gradient checkpointing re-runs a layer's forward in backward, after the forward has returned: the ids
therefore stay set until the next `set` (the trainer sets them before every forward, None for a batch
without them), so the recompute routes exactly as the forward did.

Families (transformers 5.19), by router class; each proven by tests/integration/test_engines_across_syncs.py (own ids
replayed give bit-identical outputs; other ids give the family formula):
- softmax, top-k, renormalize over the k when `norm_topk_prob`, cast to the logits' dtype: Qwen3-MoE,
  Qwen2-MoE (Qwen2MoeTopKRouter, Qwen3MoeTopKRouter).
- softmax, top-k, always renormalized, kept in float32: Mixtral (MixtralTopKRouter).
Others (DeepSeek-V3 / GLM-4.5's sigmoid + bias + groups, GPT-OSS, Qwen3-Next) are refused for r3
(colo.models.archs: no `router` in their table); their routing mismatch is not measured either.
"""
from __future__ import annotations

import torch
from torch import nn

from colo.algo.batch import no_expert  # "no engine id here": padding, the last token
from colo.models.archs import ARCHS

# HF router class -> (renormalize: "config" (norm_topk_prob) | "always", cast to the logits' dtype), from the
# family tables: a family with a `router` there is one colo.config lets replay (REPLAY_ARCHS)
ROUTERS: dict[str, tuple[str, bool]] = {a.router.cls: (a.router.renormalize, a.router.cast)
                                        for a in ARCHS.values() if a.router is not None}


def routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router module) of every MoE layer, in layer order."""
    out = []
    for name, m in model.named_modules():
        if type(m).__name__ in ROUTERS:
            parts = name.split(".")
            out.append((int(parts[parts.index("layers") + 1]), m))
    return sorted(out, key=lambda x: x[0])


def replay_weights(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(N, K) routing weights at `ids` from the router's own logits (N, E), as the family computes them."""
    renorm, cast = ROUTERS[type(router).__name__]
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)  # (N, K)
    if renorm == "always" or getattr(router, "norm_topk_prob", False):
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype) if cast else w


class RouterTap:
    """Forward hooks on every router of `model`: records the trainer's own top-k and, in replay, swaps in
    the given ids. With no ids set the model runs exactly as transformers wrote it."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = routers(model)
        self.ids: torch.Tensor | None = None  # (b, T, M, K) for the forward in progress
        self.replay = False
        self.own: dict[int, torch.Tensor] = {}  # MoE layer ordinal -> (b*T, K) the router's own top-k
        self.used: dict[int, torch.Tensor] = {}  # MoE layer ordinal -> (b*T, K) what the experts got
        for m, (_, router) in enumerate(self.layers):
            # compile-disabled: in a compiled decoder layer (trainer.compile) dynamo would trace the hook and guard
            # on its layer ordinal and on the ids' shape, recompiling per layer; it runs eagerly between graphs
            router.register_forward_hook(torch.compiler.disable(self._hook(m)))

    def _hook(self, m: int):
        def hook(router: nn.Module, args: tuple, out: tuple) -> tuple | None:
            if self.ids is None:
                return None
            logits, weights, own = out  # (N, E), (N, K), (N, K)
            self.own[m] = own.detach()
            if not self.replay:
                self.used[m] = own.detach()
                return None
            given = self.ids[:, :, m].reshape(own.shape).to(own.device)  # (N, K)
            none = given == no_expert(given.dtype)
            ids = torch.where(none, own, given.long())  # the trainer's own routing where the engine gave none
            self.used[m] = ids.detach()
            return logits, replay_weights(router, logits, ids), ids
        return hook

    def set(self, ids: torch.Tensor | None, replay: bool) -> None:
        """The engine's ids (b, T, M, K) of the micro-batch about to run forward (and backward), or None."""
        if ids is not None and ids.shape[2] != len(self.layers):
            raise RuntimeError(f"the batch carries routing for {ids.shape[2]} MoE layers, the model has "
                               f"{len(self.layers)}")
        self.ids, self.replay, self.own, self.used = ids, replay and ids is not None, {}, {}

    def mismatch(self, ids: torch.Tensor, valid: torch.Tensor) -> tuple[float, float]:
        """(pairs whose own top-k set differs from `ids`, pairs compared) over tokens where `valid` (b, T)
        and the engine gave ids, for the forward just run."""
        differ, pairs = self.mismatch_counts(ids, valid).tolist()
        return differ, pairs

    def mismatch_counts(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """mismatch's two counts as a (2,) float64 tensor on the routers' device, read by no one yet: a trainer
        adds them up over its micro-batches and reads them once, instead of waiting for the GPU twice per layer."""
        counts = None
        for m, own in self.own.items():
            given = ids[:, :, m].reshape(own.shape).to(own.device)  # (N, K)
            ok = valid.reshape(-1).to(own.device).bool() & (given != no_expert(given.dtype)).all(-1)
            same = (own.sort(-1).values == given.long().sort(-1).values).all(-1)  # (N,)
            here = torch.stack([(ok & ~same).sum(), ok.sum()]).double()
            counts = here if counts is None else counts + here
        return counts if counts is not None else torch.zeros(2, dtype=torch.float64, device=ids.device)
