"""colo's routed-expert capture on CUDA engines (rollout.routing_capture=colo): top-k ids kept beside the KV.

    LLM(..., additional_config={CONFIG_KEY: True})      # colo.rollout.engine, before the workers build their runners
    llm.collective_rpc("colo_take_routing", args=([(internal_id, first_row, rows), ...],))   # ended requests' rows

Why: vLLM's own capture (`enable_return_routed_experts`) commits every request's rows on the engine core's thread in
every decode step (a Python pass over the batch, a host store keyed by block hash), host work that a short model's
decode step cannot hide. Here the host does nothing per step: a row per KV slot lives on the GPU,

    R (num_slots + 1, M, K) uint8 | int16   R[block_id * block_size + offset] = that slot's token's ids, MoE layer m
                                            R[num_slots]: the dummy row, where padding (slot -1) writes

written by every MoE layer's router hook (BaseRouter.set_capture_fn, bound through vLLM's own
bind_routed_experts_capturer) at the step's slots (`runner.block_tables.slot_mappings[0]`, the persistent tensor
attention writes its KV through), and read once per ended request: its block-table row gathered into pinned host
memory when the runner frees it (`finish_requests`, before any step can hand its blocks to another request), handed
over by the RPC. Rows are as fresh as the KV they sit beside: a prefix-cache hit reads the rows stored when its
block was computed (the engine drops the prefix cache at every weight sync), a recomputed token rewrites its slot.

Binding happens right after GPUModelRunner.initialize_kv_cache, before CUDA graphs are captured (a hook bound
later is missing from every captured graph): `install()` wraps that method when colo's worker extension is imported,
which vLLM does in each worker after resolving its worker class and before building it. Under graphs the hook's
Python runs only while a graph is captured; replay re-runs its kernels on the same persistent tensors.

The hook reuses vLLM's RoutedExpertsCapturer.capture for which rows of `topk_ids` are this DP rank's tokens (naive
DP dispatch, modular kernels, sequence-parallel shards); only its final `device_buffer[:n, layer] = ids` lands in R
(SlotRows). Requests are captured when their id starts with REQUEST_PREFIX (colo.rollout.engine_loop names them),
so generations without routing leave nothing behind. The pure slot arithmetic (write_rows, gather_rows, trim_rows)
is tested on CPU (tests/unit/test_capture_cuda.py); the rest needs Model Runner V2, i.e. CUDA
(tests/gpu/test_routing_gpu.py compares its rows with vLLM's on the same forwards).
"""
from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable

import numpy as np
import torch

from colo.algo.batch import no_expert
from colo.rollout.capture import ids_dtype, moe_layers

REQUEST_PREFIX = "colo-r3-"  # vLLM request ids of requests whose rows are kept (vLLM appends "-<8 chars>")
CONFIG_KEY = "colo_routing_capture"  # vllm_config.additional_config key that turns the capture on in the workers

Ask = tuple[str, int, int]  # (vLLM's internal request id, first row wanted, rows wanted)


# ---------------------------------------------------------------------------------------- slot arithmetic (pure)

def write_rows(rows: torch.Tensor, slots: torch.Tensor, layer: int, ids: torch.Tensor) -> None:
    """rows (S + 1, M, K): write ids (n, K) of MoE layer `layer` at KV slots (n,) int64; slot -1 (padding) goes to
    the dummy last row. Device ops on the given tensors only, so a CUDA graph can replay them."""
    index = torch.where(slots < 0, rows.shape[0] - 1, slots)
    rows[:, layer].index_copy_(0, index, ids.to(rows.dtype))


def request_slots(block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """(b,) block ids of a request -> (b * block_size,) its KV slots, position order."""
    offsets = torch.arange(block_size, device=block_ids.device)
    return (block_ids.long()[:, None] * block_size + offsets).reshape(-1)


def gather_rows(rows: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """(b * block_size, M, K): the rows of a request's blocks, row p = its token at position p."""
    return rows.index_select(0, request_slots(block_ids, block_size))


def trim_rows(rows: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Rows first .. first + count of a request's (its tokens forwarded, from the first the sample lacks); fewer
    when its blocks hold fewer (the caller says what is missing)."""
    return rows[first:first + count]


# ---------------------------------------------------------------------------------- the hook vLLM's routers call

class SlotRows:
    """Stands in for RoutedExpertsCapturer.device_buffer: capture() ends in `device_buffer[:n, layer_id] = ids`
    with this DP rank's n tokens, which this turns into a write at the step's first n KV slots."""

    def __init__(self, rows: torch.Tensor, slots: torch.Tensor, layer_index: dict[int, int]) -> None:
        self.rows, self.slots, self.layer_index = rows, slots, layer_index  # slots: (max_num_batched_tokens,)
        self.shape = (slots.shape[0], max(layer_index) + 1, rows.shape[2])  # capture() bounds-checks layer_id

    def __setitem__(self, key: tuple, ids: torch.Tensor) -> None:
        span, layer_id = key
        if not (isinstance(span, slice) and span.start in (None, 0) and span.step is None):
            raise TypeError(f"vLLM's RoutedExpertsCapturer.capture wrote {key!r}, not [:n, layer]: colo's slot "
                            "capture (colo.rollout.capture_cuda) needs updating for this vLLM")
        write_rows(self.rows, self.slots[:ids.shape[0]], self.layer_index[layer_id], ids)


class SlotCapturer:
    """What vLLM's RoutedExpertsCapturer.capture reads of its `self` (dp_rank, tp_size, device_buffer), so that its
    choice of this DP rank's rows is vLLM's own. A hook bound before (vLLM's, when its flag is on too) keeps
    being called."""

    def __init__(self, rows: SlotRows, dp_rank: int, tp_size: int, before: dict[int, Callable]) -> None:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

        self.device_buffer, self.dp_rank, self.tp_size, self.before = rows, dp_rank, tp_size, before
        self._vllm_capture = RoutedExpertsCapturer.capture

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:  # (n, K) logical ids, before EPLB mapping
        self._vllm_capture(self, layer_id, topk_ids)
        if layer_id in self.before:
            self.before[layer_id](topk_ids)


def bound_hooks(model: torch.nn.Module) -> dict[int, Callable]:
    """The router hooks already bound per MoE layer (vLLM's capturer, when enable_return_routed_experts is on),
    colo's own of an earlier binding left out."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    out = {}
    for m in model.modules():
        if not isinstance(m, MoERunner):
            continue
        sink = getattr(getattr(m, "routed_experts", None), "routing_sink", None)
        fn = sink.capture_fn if sink is not None else getattr(m.router, "capture_fn", None)
        if fn is not None and not isinstance(getattr(getattr(fn, "func", None), "__self__", None), SlotCapturer):
            out[int(m.layer_id)] = fn
    return out


# ------------------------------------------------------------------------------------------------- worker side

class SlotCapture:
    """One engine worker's capture: R, its hooks on the routers, the ended requests' rows until taken."""

    def __init__(self, runner: Any) -> None:
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        tables = runner.block_tables
        check_layout(runner)
        self.tables, self.states, self.stream = tables, runner.req_states, runner.main_stream
        self.block_size = int(tables.block_sizes[0])
        num_slots = int(runner.kv_cache_config.num_blocks) * self.block_size
        layers = moe_layers(runner.model)
        experts, k = runner.model_config.get_num_experts(), runner.model_config.get_num_experts_per_tok()
        dtype = getattr(torch, ids_dtype(experts).name)
        self.rows = torch.full((num_slots + 1, len(layers), k), no_expert(dtype), dtype=dtype, device=runner.device)
        writer = SlotRows(self.rows, tables.slot_mappings[0], {layer: m for m, layer in enumerate(layers)})
        parallel = runner.vllm_config.parallel_config
        bind_routed_experts_capturer(runner.model, SlotCapturer(writer, parallel.data_parallel_rank,
                                                                parallel.tensor_parallel_size,
                                                                bound_hooks(runner.model)))
        self.answers = get_tp_group().is_first_rank  # TP ranks hold the same rows: one hands them over
        self.lock = threading.Lock()  # Ray's compiled-graph thread frees requests while an RPC may take rows
        self.kept: dict[str, tuple[torch.Tensor, torch.cuda.Event]] = {}  # request id -> pinned rows, their copy
        self.taken_early: set[str] = set()  # taken before the runner freed them: nothing to keep then
        free = type(runner).finish_requests.__get__(runner)  # the class's: a second binding does not nest
        runner.finish_requests = functools.partial(self._finish, free)

    def _finish(self, free: Callable[[Any], None], scheduler_output: Any) -> None:
        """GPUModelRunner.finish_requests, first keeping the rows of colo's finished and preempted requests: it runs
        at the start of the step whose schedule may hand their blocks to other requests, so the gather is enqueued
        before any forward that could overwrite them. A preempted request's rows are kept in case it is aborted
        before it runs again; a later finish replaces them."""
        with self.lock:
            ended = scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set())
            for rid in ended:
                if not (self.answers and rid.startswith(REQUEST_PREFIX)):
                    continue
                if rid in self.taken_early:
                    self.taken_early.discard(rid)
                elif rid in self.states.req_id_to_index:
                    self.kept[rid] = self._gather(rid)
            free(scheduler_output)

    def _gather(self, rid: str) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The request's rows copied into pinned memory on the runner's stream, and the event that says when."""
        idx = self.states.req_id_to_index[rid]
        blocks = self.tables.block_tables[0].gpu[idx, :int(self.tables.num_blocks.np[0, idx])]
        with torch.cuda.stream(self.stream):
            rows = gather_rows(self.rows, blocks, self.block_size)  # (blocks * block_size, M, K)
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return host, done

    def take(self, asks: list[Ask]) -> list[np.ndarray | None]:
        """Each asked request's rows (trimmed), None where none are held. A request the runner has not freed yet (an
        abort that no step delivered) is gathered now from its block-table row: its blocks go to no other request
        before the runner frees it."""
        if not self.answers:
            return [None] * len(asks)
        with self.lock:
            held = []
            for rid, _, _ in asks:
                if rid in self.states.req_id_to_index:
                    self.kept.pop(rid, None)
                    self.taken_early.add(rid)
                    held.append(self._gather(rid))
                else:
                    held.append(self.kept.pop(rid, None))
        out: list[np.ndarray | None] = []
        for h, (_, first, count) in zip(held, asks):
            if h is None:
                out.append(None)
                continue
            host, done = h
            done.synchronize()
            out.append(trim_rows(host, first, count).numpy())
        return out


def check_layout(runner: Any) -> None:
    """Refuse runners whose tokens do not map one-to-one onto the slots of one KV cache group."""
    tables = runner.block_tables
    problems = []
    if len(tables.block_sizes) != 1:
        problems.append(f"{len(tables.block_sizes)} KV cache groups (a hybrid model)")
    if getattr(runner, "pcp_manager", None) is not None:
        problems.append("prefill context parallelism")
    if getattr(runner, "ubatch_runner", None) is not None:
        problems.append("dual-batch overlap (micro-batches write other slots)")
    if problems:
        raise RuntimeError(f"rollout.routing_capture=colo: vLLM's runner has {', '.join(problems)}, which colo's slot "
                           "capture does not handle; fix: rollout.routing_capture=vllm")


def wanted(vllm_config: Any) -> bool:
    extra = vllm_config.additional_config
    return isinstance(extra, dict) and bool(extra.get(CONFIG_KEY))


def install() -> None:
    """Wrap GPUModelRunner.initialize_kv_cache (Model Runner V2) once in a CUDA vLLM worker process, so the capture
    binds where vLLM binds its own, before CUDA graphs; elsewhere (the driver, an engine actor, CPU workers) do
    nothing. vLLM resolves its worker class, importing vllm.v1.worker.gpu_worker, before it imports colo's
    extension; CPU workers import that module too, hence the platform check."""
    if "vllm.v1.worker.gpu_worker" not in sys.modules:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    original = GPUModelRunner.initialize_kv_cache
    if getattr(original, "_colo_slot_capture", False):
        return

    @functools.wraps(original)
    def initialize_kv_cache(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, kv_cache_config, *args, **kwargs)
        profiling = kwargs.get("is_profiling", args[0] if args else False)
        if not profiling and wanted(self.vllm_config):  # the profiling KV cache is torn down again: vLLM's too
            self._colo_slots = SlotCapture(self)

    initialize_kv_cache._colo_slot_capture = True  # type: ignore[attr-defined]
    GPUModelRunner.initialize_kv_cache = initialize_kv_cache


class SlotRouting:
    """The slot capture's method of colo's vLLM worker extension (colo.rollout.extension)."""

    def colo_take_routing(self, asks: list[Ask]) -> list[np.ndarray | None]:
        slots = getattr(self.model_runner, "_colo_slots", None)  # type: ignore[attr-defined]
        if slots is None:
            raise RuntimeError("rollout.routing_capture=colo, but this vLLM worker bound no slot capture: it needs "
                               "Model Runner V2 on CUDA (VLLM_USE_V2_MODEL_RUNNER unset or 1, no feature that makes "
                               "vLLM fall back to V1); fix: rollout.routing_capture=vllm")
        return slots.take(asks)
