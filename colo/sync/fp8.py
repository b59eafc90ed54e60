"""FP8 rollout in the weight path: the trainer's bf16 weights become vLLM's block-FP8 weights inside the sync.

    plan = Fp8Plan.of(arch, trainer_shapes, engine.describe())   # None: the engine holds no FP8 weight
    shapes = plan.shapes                                         # trainer shapes + each `<name>_scale_inv`
    tensors = plan.quantize(unit_tensors, timings)               # per FSDP unit, after the source (and LoRA's merge)
    tensors = fp8_pack.quantize_unit(plan, unit_tensors, timings)  # CUDA: quantized as the pieces are packed
    q, s = quantize_blocks(w)                                    # (..., N, K) -> fp8 (..., N, K), fp32 (..., n, k)
    w_approx = dequantize_blocks(q, s)

The format is the one Qwen's and DeepSeek's FP8 checkpoints use and vLLM 0.32's `Fp8Config` loads: e4m3
(`torch.float8_e4m3fn`) weights in their usual (out, in) layout and one float32 `weight_scale_inv` per 128 x 128
block, (ceil(N/128), ceil(K/128)), such that w ~= q * scale. MoE experts: `w13_weight` (E, 2I, H) with
`w13_weight_scale_inv` (E, 2I/128, H/128) and `w2_weight` (E, H, I) with `w2_weight_scale_inv` (E, H/128, I/128),
each expert quantized as its own matrix. quantize_blocks is vLLM's `per_block_cast_to_fp8`
(vllm/utils/deep_gemm.py, what its online `fp8_per_block` quantization calls per linear and per expert) written for
a batch of matrices: the same operations in the same order (the amax of each block clamped at 1e-4, the scale =
amax / 448 as a division by the Python float, then x * (1 / scale) in float32 cast to e4m3), so each element comes
out bit for bit what vLLM computes on CPU (tests/unit/test_sync_fp8.py); on CUDA, against vLLM's compiled function,
untested until tests/gpu/test_fp8_gpu.py runs on a GPU.

Who quantizes (sync.fp8_in): "sender" (the default) quantizes here, on the trainer's GPU while packing: half the
bytes travel, the expert fast path still holds (each rank quantizes the experts it owns, never gathered), and the
engine, created as for a block-FP8 checkpoint (colo.rollout.quant), receives e4m3 bytes and scales it writes as they
are; vLLM's post-load step (kernel layouts of weights and scales) is then re-run by colo.sync.refresh. On CUDA the
sender's quantization is fused into the packing copy (colo.sync.fp8_pack: one pass from the shard to the buffer's
e4m3 bytes, the same bytes as quantize_blocks on CUDA); on CPU quantize_blocks runs per unit before packing. "receiver":
the engine runs vLLM's own online FP8 (`fp8_per_block`), receives bf16 into staging tensors and quantizes them in
that post-load step. Both give the same bytes: vLLM quantizes a fused qkv_proj (or gate_up_proj) whole, colo each
of its parts, which is the same blocks when every part but the last has a multiple of 128 rows (vLLM refuses a
block-FP8 layer otherwise, and Fp8Plan.of checks it too).

The plan side: a trainer tensor whose destination vLLM holds in e4m3 gets a companion `<name>_scale_inv` of the
scale shape, which the name rules (colo.sync.plan) map like its base: stacked parts to row offsets of the fused
scale, experts by module to `w13_weight_scale_inv` / `w2_weight_scale_inv`. The byte check then covers the e4m3
bytes and the scales as written (coverage and digests), and the functional check compares the engine with the
bf16 trainer within FP8's own tolerance (colo.sync.probe.TOLERANCE["fp8"]).

LoRA (trainer.lora_rank > 0, sync.lora=merged): the source hands out W + s B A (colo.sync.merge, in
ParamSource.iter_units); this quantizes what the source hands out, so the merge comes first, in bf16, and the
quantization second, never the reverse.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from colo.models.archs import Arch, numel
from colo.models.dtypes import torch_dtype

BLOCK = 128  # rows and columns of one scale block (vLLM's weight_block_size [128, 128])
FP8_DTYPE = "float8_e4m3fn"  # the engine's dtype name for a quantized weight (describe())
SCALE = "_scale_inv"  # vLLM's (and the FP8 checkpoints') suffix of a block-scale param: w ~= q * scale
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: vLLM's get_fp8_min_max() on CUDA and CPU (not ROCm's fnuz)
AMAX_FLOOR = 1e-4  # vLLM clamps each block's amax at this, so an all-zero block gets a finite scale
CHUNK_ELEMS = 1 << 25  # elements quantized at once: the float32 temporaries of a whole expert tensor stay ~0.5 GiB


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """(..., N, K) -> (..., ceil(N/128), ceil(K/128))."""
    *lead, n, k = (int(s) for s in shape)
    return (*lead, -(-n // BLOCK), -(-k // BLOCK))


@torch.no_grad()
def quantize_blocks(x: torch.Tensor, via: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., N, K) -> (q (..., N, K) e4m3, scale (..., ceil(N/128), ceil(K/128)) float32), each trailing matrix
    quantized as vLLM's per_block_cast_to_fp8 quantizes one (module docstring). `via`: round x to this dtype first
    (the engine's bf16: an FSDP2 expert shard is the float32 master copy, and vLLM quantizes the bf16 weight it
    would have loaded). Chunked over the leading dims: no float32 copy of a whole expert tensor is made."""
    if x.dim() < 2:
        raise ValueError(f"block FP8 quantizes matrices, got shape {tuple(x.shape)}")
    n, k = x.shape[-2:]
    mats = x.reshape(-1, n, k)  # (M, N, K)
    q = torch.empty(mats.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((mats.shape[0], *scale_shape((n, k))), dtype=torch.float32, device=x.device)
    per = max(1, CHUNK_ELEMS // max(1, n * k))
    for i in range(0, mats.shape[0], per):
        part = mats[i: i + per]
        q[i: i + per], s[i: i + per] = _quantize(part if via is None else part.to(via))
    return q.view(x.shape), s.view(*x.shape[:-2], *s.shape[1:])


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, N, K) -> ((M, N, K) e4m3, (M, n, k) float32): per_block_cast_to_fp8's operations, batched."""
    m, n, k = x.shape
    np_, kp = -(-n // BLOCK) * BLOCK, -(-k // BLOCK) * BLOCK
    padded = x
    if (np_, kp) != (n, k):  # vLLM pads with zeros to whole blocks (they never raise a block's amax)
        padded = x.new_zeros((m, np_, kp))
        padded[:, :n, :k] = x
    view = padded.view(m, np_ // BLOCK, BLOCK, kp // BLOCK, BLOCK)
    amax = view.abs().float().amax(dim=(2, 4), keepdim=True).clamp(AMAX_FLOOR)  # (m, n, 1, k, 1)
    sf = amax / E4M3_MAX  # a Python float divisor, as vLLM: the exact kernel vLLM's own call runs
    q = (view * (1.0 / sf)).to(torch.float8_e4m3fn)
    return q.view(m, np_, kp)[:, :n, :k], sf.view(m, np_ // BLOCK, kp // BLOCK)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q (..., N, K) e4m3 and its block scales -> q * scale in `dtype` (what the engine's weights stand for)."""
    n, k = q.shape[-2:]
    s = scale.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :n, :k]  # (..., N, K)
    return (q.float() * s).to(dtype)


class Fp8PlanError(ValueError):
    """The engine holds FP8 weights in a layout colo's quantization does not produce (named)."""


@dataclass
class Fp8Plan:
    """Which trainer tensors the sender quantizes, and the shapes of their scale companions (module docstring)."""

    quantized: dict[str, tuple[int, ...]]  # trainer name -> its shape (the tensors quantized)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # trainer shapes, each companion after its base
    dtype: str = "bfloat16"  # the engine's unquantized dtype: what a weight is rounded to before it is quantized

    @classmethod
    def of(cls, arch: Arch, trainer_shapes: dict[str, tuple[int, ...]], describe: dict, segs: list
           ) -> Fp8Plan | None:
        """The plan for an engine's describe(), given the trainer tensors' segments there (colo.sync.plan's
        direct_mapping of `trainer_shapes`: the name rules stay in one place); None when no param is e4m3. Raises
        Fp8PlanError naming every trainer tensor that lands in both e4m3 and other params, or whose block rows do
        not line up in a fused param."""
        params = describe["params"]
        if not any(p["dtype"] == FP8_DTYPE for p in params.values()):
            return None
        kinds: dict[str, set[bool]] = {}
        for s in segs:
            if not s.fill and s.dst in params:
                kinds.setdefault(s.src, set()).add(params[s.dst]["dtype"] == FP8_DTYPE)
        errors = [f"{n}: written into e4m3 and non-e4m3 vLLM params at once" for n, k in kinds.items() if len(k) > 1]
        quantized = {n: tuple(trainer_shapes[n]) for n, k in kinds.items() if k == {True}}
        errors += [f"{n}: shape {list(s)} is not a matrix or a stack of expert matrices" for n, s in quantized.items()
                   if len(s) not in (2, 3)]
        errors += _misaligned_parts(arch, quantized)
        if errors:
            raise Fp8PlanError("the engine's FP8 weights do not match colo's block quantization:\n  "
                               + "\n  ".join(errors))
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in trainer_shapes.items():
            shapes[name] = tuple(shape)
            if name in quantized:
                shapes[name + SCALE] = scale_shape(shape)
        others = [p["dtype"] for p in params.values() if p["dtype"] != FP8_DTYPE] or ["bfloat16"]
        return cls(quantized, shapes, max(set(others), key=others.count))

    @property
    def wire_bytes_saved(self) -> int:
        """Bytes a sync does not carry against bf16 (one per element, less 4 per block scale)."""
        return sum(numel(s) - 4 * numel(scale_shape(s)) for s in self.quantized.values())

    def quantize(self, tensors: dict[str, tuple[torch.Tensor, int]], timings: dict[str, float]
                 ) -> dict[str, tuple[torch.Tensor, int]]:
        """One unit's {name: (tensor, first row)} with every quantized tensor replaced by its e4m3 bytes and its scale
        added as `<name>_scale_inv` (an expert shard's rows are whole experts: the scale starts at the same row).
        On CUDA the sender calls colo.sync.fp8_pack.quantize_unit instead (quantized as the pieces are packed)."""
        t = time.perf_counter()
        out = dict(tensors)
        for name in [n for n in tensors if n in self.quantized]:
            w, row = tensors[name]
            q, s = quantize_blocks(w, via=torch_dtype(self.dtype))
            out[name], out[name + SCALE] = (q, row), (s, row)
        timings["quantize"] = timings.get("quantize", 0.0) + time.perf_counter() - t
        return out


def _misaligned_parts(arch: Arch, quantized: dict[str, tuple[int, ...]]) -> list[str]:
    """Parts of a fused vLLM linear (q/k/v, gate/up) other than the last whose rows are not whole 128-row blocks: the
    parts' scales would not be the fused weight's rows (vLLM refuses such a block-FP8 layer as well)."""
    errors = []
    for name, shape in quantized.items():
        module = name.rpartition(".")[0]
        for hf, vl, slot in arch.stacked:
            if not module.endswith("." + hf):
                continue
            last = max(s for _, v, s in arch.stacked if v == vl)
            if slot != last and shape[0] % BLOCK:
                errors.append(f"{name}: {shape[0]} rows, not a multiple of {BLOCK}, inside vLLM's fused {vl}")
    return errors
