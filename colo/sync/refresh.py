"""Derived weights: after a sync writes checkpoint-layout bytes, vLLM's own post-load step runs again, as at load.

vLLM does not compute with the tensors it loads. After loading a checkpoint it runs one post-load step
(vllm.model_executor.model_loader.utils.process_weights_after_loading): every module's
`quant_method.process_weights_after_loading(module)`, then every attention layer's
`process_weights_after_loading(dtype)`. What that step derives depends on the backend and the ISA, for example
(vLLM 0.32, read in its source and measured where said):
- CPU linears: oneDNN or, on AMX, sgl-kernel handles packed from the weight, which is then replaced by an empty
  tensor; the lm_head and embedding keep theirs beside a packed copy; AMX converts small biases to float32;
- CPU MoE experts: w13/w2 re-laid out for the ISA's grouped GEMM (padded on AMX where the intermediate size is
  not a multiple of 32), and on a weight update vLLM 0.32 skips that step (below);
- MLA attention: W_UK_T / W_UV cut from kv_b_proj; on AMX, VNNI-packed copies of both and an emptied kv_b_proj
  weight (the attention layer then holds no parameter at all);
- causal-conv1d weights (Qwen3-Next) packed on AVX512-BF16, with a plain copy beside them;
- quantized weights and their scales (FP8 rollout, colo.sync.fp8): kernel layouts of the e4m3 weights and scales
  colo writes (sender placement), or, with vLLM's online FP8 (receiver placement), the quantization itself: the
  post-load step quantizes the bf16 staging tensors into the live e4m3 weights and scales.
Bytes written correctly into the loaded tensors can therefore leave the engine computing with stale derived ones:
a "verified" sync with wrong tokens (DeepSeek-V3 on an Intel AMX CPU, where the MLA layer has no parameter to
mark it as touched). No list of these cases is kept here: every sync ends by re-running that one step.

    targets:  param -> its checkpoint-layout tensor: the live param itself where vLLM kept that layout (the
              common case on CUDA: no copy), else a staging tensor allocated once (vLLM's record of the shapes
              it created at init, LAYERWISE_INFO, gives the layout)
    open:     modules' params := their checkpoint-layout tensors (with the loader attributes vLLM gave them,
              so vLLM's own load_weights can fill them: the reference mode)
    [write]:  colo's pieces, or vLLM's load_weights, into those tensors
    close:    per module, vLLM's order (attention layers last): its post-load step; what it produced is copied
              into the live tensors where shape and dtype still match (captured CUDA graphs keep their
              addresses), and replaces them where the layout changed (CPU packing)

Staging that vLLM's online quantization consumes (FP8's receiver placement: a bf16 copy of every quantized weight) is
transient: its storage is freed when close() is done and given back by stage() at the next sync's start, so it is
held only while a sync runs (colocated: while the KV cache sleeps), not through rollout and training.

A parameter that vLLM's post-load step creates (absent from its record of the init shapes: MLA's W_UK_T) is
derived: nothing writes it, the step recomputes it. vLLM 0.32 has its own in-place reload
(model_runner.reload_weights); it fails where a kernel tensor's shape changes (AMX's emptied kv_b_proj: "The size
of tensor a (0) must match the size of tensor b (512)") and skips the experts' packing on an update, so colo does
not call it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Target:
    """One parameter as a sync writes it."""

    tensor: torch.Tensor  # flat (numel,): the live param's storage, or a staging tensor in checkpoint layout
    shape: tuple[int, ...]  # checkpoint (logical) shape
    module: str  # owning module path
    pname: str  # its name in that module
    staged: bool  # the live param holds another layout (or nothing): written here, produced by close()
    pad_from: int | None = None  # first element of the vocabulary padding rows (None: no padding)
    shared: tuple[str, ...] = ()  # other modules holding this very parameter (tied lm_head)
    transient: bool = False  # staging for vLLM's online quantization: storage held only during a sync (stage())


@dataclass
class _Swap:
    """A module between open() and close(): its live tensors, to be written back into."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    nonpersistent: set[str] = field(default_factory=set)


def _vllm():
    """vLLM's reload records and helpers (imported late: this module is imported where vLLM is not)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    return LAYERWISE_INFO, SKIP_TENSORS, QuantizeMethodBase, is_deferred_attention_layer, restore_layer_refs


def _init_meta(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Meta tensors of the params vLLM created for `module` at init (shape, dtype, loader attributes)."""
    info = _vllm()[0]
    return dict(info[module].restore_metadata[0]) if module in info else {}


def has_post_load(module: torch.nn.Module) -> bool:
    """Whether vLLM's post-load step touches this module: a quant method's step, or an attention layer's."""
    _, _, base, is_attention, _ = _vllm()
    return isinstance(getattr(module, "quant_method", None), base) or is_attention(module)


def is_attention(module: torch.nn.Module) -> bool:
    return _vllm()[3](module)


def _quantizes_online(module: torch.nn.Module) -> bool:
    """vLLM's online quantization (rollout.quantization=fp8, sync.fp8_in=receiver) makes this module's weights from
    the checkpoint-layout ones in its post-load step: the staging tensors are its input only."""
    from vllm.model_executor.layers.quantization.online.fp8 import OnlineLinearBase
    from vllm.model_executor.layers.quantization.online.moe_base import OnlineMoEMethodBase

    return isinstance(getattr(module, "quant_method", None), (OnlineLinearBase, OnlineMoEMethodBase))


def _vocab_rows(module: torch.nn.Module) -> int | None:
    """Rows of a vocab-parallel embedding / lm_head shard that hold vocabulary; the rest is padding."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if not isinstance(module, VocabParallelEmbedding):
        return None
    si = module.shard_indices
    if si.added_vocab_end_index > si.added_vocab_start_index:  # LoRA extra vocabulary: not a layout colo writes
        raise RuntimeError(f"{type(module).__name__} with added vocabulary is not supported by colo's sync")
    return int(si.org_vocab_end_index - si.org_vocab_start_index)


def build_targets(model: torch.nn.Module) -> tuple[dict[str, Target], dict[str, list[str]]]:
    """(targets, derived): every param a sync writes, and per module the params vLLM's post-load step creates."""
    _, skip, _, _, _ = _vllm()
    modules = dict(model.named_modules())
    canonical = {id(m): p for p, m in modules.items()}  # a module registered twice (MoE's gate) counts once
    every = dict(model.named_modules(remove_duplicate=False))
    holders: dict[int, list[str]] = {}  # id(param) -> every distinct module holding it (tied weights)
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(canonical[id(every[name.rpartition(".")[0]])])
    targets: dict[str, Target] = {}
    derived: dict[str, list[str]] = {}
    for name, param in model.named_parameters():
        mpath, _, pname = name.rpartition(".")
        module = modules[mpath]
        meta = _init_meta(module).get(pname)
        if meta is None and pname not in skip and has_post_load(module):
            derived.setdefault(mpath, []).append(pname)  # created by the post-load step (MLA's W_UK_T)
            continue
        shape = tuple(meta.shape) if meta is not None else tuple(param.shape)
        dtype = meta.dtype if meta is not None else param.dtype
        numel = int(torch.Size(shape).numel())
        same = param.numel() == numel and param.dtype == dtype and param.data.is_contiguous()
        transient = False
        if same:
            flat = param.data.view(-1)  # written in place; the post-load step (if any) reads it from there
        elif has_post_load(module):
            flat = torch.empty(numel, dtype=dtype, device=param.device)  # the live param holds another layout
            transient = _quantizes_online(module)
            if transient:
                flat.untyped_storage().resize_(0)  # held from stage() to close() only
        else:
            raise RuntimeError(f"{name}: live param {tuple(param.shape)} {param.dtype} is not writable as {shape} "
                               f"{dtype}, and no post-load step of vLLM's produces it")
        rows = _vocab_rows(module) if pname in ("weight", "bias") else None
        pad_from = rows * int(torch.Size(shape[1:]).numel()) if rows is not None and rows < shape[0] else None
        shared = tuple(m for m in dict.fromkeys(holders[id(param)]) if m != mpath)
        targets[name] = Target(flat, shape, mpath, pname, not same, pad_from, shared, transient)
    return targets, derived


class Refresher:
    """Re-runs vLLM's post-load step for the modules a sync wrote (module doc): open(), write, close()."""

    def __init__(self, model: torch.nn.Module, targets: dict[str, Target], dtype: torch.dtype) -> None:
        self.model, self.targets, self.dtype = model, targets, dtype
        self.modules = dict(model.named_modules())
        self.by_module: dict[str, list[Target]] = {}
        for t in targets.values():
            for m in (t.module, *t.shared):
                self.by_module.setdefault(m, []).append(t)
        self.swapped: dict[str, _Swap] = {}

    def stage(self) -> None:
        """Give transient staging its storage back (a sync is starting: it writes there)."""
        for t in self.targets.values():
            if t.transient and t.tensor.untyped_storage().nbytes() == 0:
                t.tensor.untyped_storage().resize_(t.tensor.numel() * t.tensor.element_size())

    def _release(self) -> None:
        """Free transient staging once the post-load step has consumed it (CUDA: back to the driver, so vLLM's
        KV cache can wake into it)."""
        freed = [t for t in self.targets.values() if t.transient and t.tensor.untyped_storage().nbytes()]
        for t in freed:
            t.tensor.untyped_storage().resize_(0)
        if freed and freed[0].tensor.device.type == "cuda":
            torch.cuda.empty_cache()

    def post_load_modules(self) -> list[str]:
        return [m for m in self.modules if has_post_load(self.modules[m])]

    def open(self, modules: set[str]) -> None:
        """Give each of `modules` that has a post-load step its checkpoint-layout tensors as params."""
        _, _, _, _, restore_refs = _vllm()
        for mpath in [m for m in self.modules if m in modules and m not in self.swapped]:
            module = self.modules[mpath]
            if not has_post_load(module):
                continue
            meta = _init_meta(module)
            swap = _Swap({k: v for k, v in module._parameters.items() if v is not None},
                         {k: v for k, v in module._buffers.items() if v is not None},
                         set(module._non_persistent_buffers_set))
            for t in self.by_module.get(mpath, []):
                p = torch.nn.Parameter(t.tensor.view(t.shape), requires_grad=False)
                if t.pname in meta:  # the loader attributes vLLM set at init (weight_loader, output_dim, ...)
                    m = restore_refs(meta[t.pname], module)
                    p.__class__ = m.__class__
                    p.__dict__.update(m.__dict__)
                elif t.pname in swap.params:
                    p.__dict__.update(swap.params[t.pname].__dict__)
                module._parameters[t.pname] = p
            self.swapped[mpath] = swap

    @torch.no_grad()
    def close(self) -> int:
        """Run the post-load step of every opened module (attention layers last, as vLLM's loader does) and every
        attention layer (MLA derives from another module's weight), then write back. Returns modules refreshed."""
        if not self.swapped:
            self._release()
            return 0
        order = [m for m in self.modules if m in self.swapped and not is_attention(self.modules[m])]
        order += [m for m in self.modules if is_attention(self.modules[m])]
        for mpath in order:
            module = self.modules[mpath]
            if is_attention(module):
                module.process_weights_after_loading(self.dtype)
            else:
                _post_load(module)
            swap = self.swapped.pop(mpath, None)
            if swap is not None:
                _write_back(module, swap)
        self.swapped = {}
        if next(iter(self.targets.values())).tensor.device.type == "cuda":
            torch.cuda.synchronize()
        self._release()
        return len(order)

    def refresh(self, modules: set[str], write: Callable[[], None] | None = None) -> int:
        """open(modules), `write` (vLLM's load_weights, reference mode), close()."""
        self.open(modules)
        if write is not None:
            write()
        return self.close()


def _post_load(module: torch.nn.Module) -> None:
    """One module's post-load step as vLLM's loader runs it at load (model_loader/utils.py)."""
    if hasattr(module, "_already_called_process_weights_after_loading"):
        delattr(module, "_already_called_process_weights_after_loading")  # online quantization runs once otherwise
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

    qm = module.quant_method
    # only the unquantized method has the gap below; vLLM's FP8 MoE methods build their kernel anew at every
    # post-load step and never run the experts' own step (a FlashInfer CUTLASS one would transform twice)
    update = isinstance(qm, UnquantizedFusedMoEMethod) and getattr(qm, "moe_kernel", None) is not None
    qm.process_weights_after_loading(module)
    if update:
        # vLLM 0.32's UnquantizedFusedMoEMethod._setup_kernel runs the experts' own post-load step (on CPU: the
        # grouped-GEMM packing) only at the first load, not on a weight update: the kernel would read the
        # checkpoint layout as packed (measured on AVX512-BF16: wrong tokens). Run it as the first load did.
        fused = getattr(qm.moe_kernel, "fused_experts", None)
        if fused is not None:
            fused.process_weights_after_loading(module)
    if hasattr(module, "update_param_tp_status"):
        module.update_param_tp_status()


def _write_back(module: torch.nn.Module, swap: _Swap) -> None:
    """Put what the post-load step produced into the live tensors (same shape and dtype: copied, so addresses a
    CUDA graph captured stay valid) or in their place (a layout change, CPU only); the live objects stay
    registered where they were kept."""
    for kind, live in (("_parameters", swap.params), ("_buffers", swap.buffers)):
        table = getattr(module, kind)
        for name, old in live.items():
            new = table.get(name)
            if new is None or new is old:
                continue
            if new.shape == old.shape and new.dtype == old.dtype and new.device == old.device:
                if new.data_ptr() != old.data_ptr():
                    old.data.copy_(new.data)
                table[name] = old
            elif old.device.type == "cuda":
                raise RuntimeError(f"{type(module).__name__}.{name}: vLLM's post-load step changed its layout from "
                                   f"{tuple(old.shape)} {old.dtype} to {tuple(new.shape)} {new.dtype} on the GPU, "
                                   "where captured CUDA graphs hold its address; colo cannot refresh it in place")
