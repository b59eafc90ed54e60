"""The trainer's AdamW, and two ways to make its state smaller on the GPU.

    opt = make_optimizer(model.parameters(), lr=1e-6, weight_decay=0.0, state_dtype="float32", on_host=False,
                         device=device)

- default (float32, on the device): torch.optim.AdamW. On CUDA it runs the foreach kernels, whose step
  holds one fp32 temporary per parameter (sqrt(exp_avg_sq), torch/optim/adam.py): 20 bytes per parameter
  at the step's peak, which the memory plan (colo.plan.memory) counts.
- `state_dtype="bfloat16"`: exp_avg and exp_avg_sq stored in bf16 (4 instead of 8 bytes per parameter),
  updated in fp32 a piece of a parameter at a time (at most SLICE elements) and written back with stochastic
  rounding. Round-to-nearest would freeze exp_avg_sq: multiplying by beta2 = 0.999 moves a bf16 value by less
  than half its last bit, so it never decays; stochastic rounding keeps the expectation exact.
- `on_host=True`: the state lives in host memory (pinned on CUDA) for good; each step streams one
  piece's state to the device, updates it there and copies it back. Colocated runs already move the
  state host <-> device once per RL step when trainer.offload=true; with the state on the host that
  traffic moves into the optimizer step instead, and the GPU never holds more than two pieces' state.
  On CUDA the copies overlap the math: piece i+1's state comes in on one stream and piece i-1's goes
  out on another while piece i's update runs: 2.26x the serial loop on the L12 slice's state (docs/benchmarks.md,
  "What each trainer setting buys").
  colo.trainer.offload leaves such state where it is (`keeps_state_on_host`).

State tensors keep the parameter's DTensor sharding (a DTensor around the local shard, wherever it lives),
so torch.distributed.checkpoint saves and reshards them like torch.optim.AdamW's.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from colo.models.dtypes import torch_dtype

STATE_DTYPES = ("float32", "bfloat16")  # config CHOICES["trainer.optimizer_dtype"]
SLICE = 1 << 25  # elements StreamedAdamW updates at a time by default (fp32 temporaries of 128 MiB each)


def clip_and_step(params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer, clip: float) -> float:
    """Clip the global grad norm to `clip` (0: no clipping), step, zero the grads; returns the norm (the same on
    every FSDP rank: it is the full tensor's). A non-finite norm (inf/nan gradients) skips the step: stepping
    would write nan into every weight and into AdamW's moments for good."""
    params = list(params)
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def make_optimizer(params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float,
                   state_dtype: str = "float32", on_host: bool = False,
                   device: torch.device | str = "cpu") -> torch.optim.Optimizer:
    """torch's AdamW for the default; colo's StreamedAdamW when the state is bf16 or on the host."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"optimizer state dtype {state_dtype!r} is not one of {sorted(STATE_DTYPES)}")
    if state_dtype == "float32" and not on_host:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return StreamedAdamW(params, lr=lr, weight_decay=weight_decay, state_dtype=torch_dtype(state_dtype),
                         on_host=on_host, device=torch.device(device))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _part(t: torch.Tensor, piece: slice | None) -> torch.Tensor:
    """`piece` of a tensor's local values, flattened (a view: writes land in the tensor); None: the whole tensor."""
    t = _local(t)
    return t if piece is None else t.view(-1)[piece]


def _pieces(p: torch.Tensor, size: int) -> list[slice | None]:
    """The slices of `size` elements StreamedAdamW steps `p` by. One fused expert tensor of Qwen3-30B-A3B holds
    403M elements: updated whole, its fp32 temporaries (moments, denominator, rounding noise) took ~10 GB at once,
    which at the end of a train phase the allocator's cache, cut into activation-sized blocks, could not serve
    without a retry (cudaFree of the whole cache, a device sync); and the copies in and out overlapped the math
    only at that coarse grain. A non-contiguous shard is stepped whole."""
    local = _local(p)
    n = local.numel()
    if n <= size or not (local.is_contiguous() and _local(p.grad).is_contiguous()):
        return [None]
    return [slice(a, min(a + size, n)) for a in range(0, n, size)]


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A state tensor with `param`'s sharding around `local` (not DTensor.from_local: that would move it
    to the mesh's device)."""
    return DTensor(local, param._spec, requires_grad=False) if isinstance(param, DTensor) else local


def round_to_bf16(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Stochastic rounding fp32 -> bf16: add uniform noise below bf16's last bit, then truncate.

    fp32 bits are sign-magnitude, so the noise moves the magnitude up by [0, 1) bf16 units for either
    sign and truncation rounds it down: the result is the upper neighbour with probability equal to the
    distance from the lower one, E[result] = x."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class StreamedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's defaults) with fp32 math, one parameter at a time, state in
    `state_dtype` on the host or on the parameter's device. Same update as torch.optim.AdamW in fp32."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 state_dtype: torch.dtype = torch.float32, on_host: bool = False,
                 device: torch.device = torch.device("cpu")) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))
        self.state_dtype, self.keeps_state_on_host, self.device = state_dtype, on_host, device
        self.piece_elements = SLICE  # tools.experiments.optimizer's "whole" yardstick sets it past every parameter
        self._gen: dict[torch.device, torch.Generator] = {}
        # torch's load_state_dict casts every state tensor to its param's dtype and device (fp32, the GPU):
        # put a resumed state back where and how this optimizer keeps it
        self.register_load_state_dict_post_hook(lambda opt: opt._relayout())

    @torch.no_grad()
    def _relayout(self) -> None:
        for p, st in self.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    fresh = self._new_state(p)[key]
                    _local(fresh).copy_(_local(st[key]))
                    st[key] = fresh

    def _new_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        local = _local(p)
        where = "cpu" if self.keeps_state_on_host else local.device
        pin = self.keeps_state_on_host and self.device.type == "cuda"
        zeros = [torch.zeros(local.shape, dtype=self.state_dtype, device=where, pin_memory=pin) for _ in range(2)]
        return {"step": torch.tensor(0.0), "exp_avg": _like(p, zeros[0]), "exp_avg_sq": _like(p, zeros[1])}

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.state_dtype != torch.bfloat16:
            return None
        if device not in self._gen:  # fixed seed: a run's rounding noise is reproducible
            self._gen[device] = torch.Generator(device=device).manual_seed(0x5EED)
        return self._gen[device]

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch's signature)
        loss = closure() if closure is not None else None
        work = []  # (group, param, piece) this step updates
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:  # an empty shard gets its state and step too: every rank saves the same keys
                    st.update(self._new_state(p))
                st["step"] += 1
                if _local(p).numel():
                    work.extend((group, p, piece) for piece in _pieces(p, self.piece_elements))
        if self.keeps_state_on_host and self.device.type == "cuda":
            self._step_streamed(work)
        else:
            for group, p, piece in work:
                m, v = (_part(self.state[p][k], piece).to(_local(p).device, torch.float32)
                        for k in ("exp_avg", "exp_avg_sq"))
                self._write_back(p, piece, *self._update(group, p, piece, m, v))
        return loss

    def _update(self, group: dict, p: torch.Tensor, piece: slice | None, m: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The AdamW step of one piece of a parameter (_pieces) on its fp32 moments `m`, `v` (updated in place);
        returns the moments as they are stored (bf16 with stochastic rounding, or fp32)."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        t = float(self.state[p]["step"])
        w, g32 = _part(p, piece), _part(p.grad, piece).float()  # this rank's shard, or a flat piece of it
        m.lerp_(g32, 1 - b1)
        v.mul_(b2).addcmul_(g32, g32, value=1 - b2)
        w.mul_(1 - lr * wd)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
        w.addcdiv_(m.to(w.dtype), denom.to(w.dtype), value=-lr / (1 - b1 ** t))
        gen = self._generator(w.device)
        return tuple(round_to_bf16(x, gen) if gen is not None else x.to(self.state_dtype) for x in (m, v))

    def _write_back(self, p: torch.Tensor, piece: slice | None, m: torch.Tensor, v: torch.Tensor) -> None:
        for key, new in (("exp_avg", m), ("exp_avg_sq", v)):
            _part(self.state[p][key], piece).copy_(new)

    def _step_streamed(self, work: list[tuple[dict, torch.Tensor, slice | None]]) -> None:
        """The step with the state in pinned host memory: while piece i's math runs on the compute stream,
        piece i+1's state comes in on one copy stream and piece i-1's goes out on another, so the two
        copy engines and the SMs work at once (done one after the other, the copies were most of the step).
        The state crosses the bus in its own dtype (bf16: half the bytes) and is cast on the GPU."""
        compute = torch.cuda.current_stream(self.device)
        if not hasattr(self, "_streams"):
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        h2d, d2h = self._streams

        def fetch(p: torch.Tensor, piece: slice | None) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
            with torch.cuda.stream(h2d):
                m, v = (_part(self.state[p][k], piece).to(self.device, non_blocking=True)
                        for k in ("exp_avg", "exp_avg_sq"))
            return m, v, h2d.record_event()

        ahead = fetch(*work[0][1:]) if work else None
        for i, (group, p, piece) in enumerate(work):
            m_in, v_in, arrived = ahead
            ahead = fetch(*work[i + 1][1:]) if i + 1 < len(work) else None  # overlaps this piece's math
            compute.wait_event(arrived)
            for x in (m_in, v_in):  # allocated on h2d, read here: not reused before compute is past it
                x.record_stream(compute)
            out = self._update(group, p, piece, m_in.float(), v_in.float())
            done = compute.record_event()
            with torch.cuda.stream(d2h):
                d2h.wait_event(done)
                for key, new in zip(("exp_avg", "exp_avg_sq"), out):
                    new.record_stream(d2h)  # made on compute, read by the copy out
                    _part(self.state[p][key], piece).copy_(new, non_blocking=True)
        # the host copies must land before anyone reads the state (the next step, a checkpoint, an offload)
        torch.cuda.synchronize(self.device)
