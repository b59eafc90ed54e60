"""StreamedAdamW's step with its state in host memory (trainer.optimizer_offload): the product, whose copies in and
out overlap the math on two CUDA streams, one piece of at most colo.trainer.optim.SLICE elements at a time, against
two yardsticks in one run on parameters shaped like a preset's: "serial", the same pieces one after the other on one
stream (what colo ran before 54e474e), and "whole", streamed as the product but each parameter in one piece
(colo before f943e94: a fused expert tensor's fp32 temporaries at once).

    python -m tools.experiments.optimizer --preset qwen3-30b-a3b-L12 --device cuda --json

One rank's whole model (world 1): fp32 parameters and gradients on the device, the AdamW state (`--state-dtype`,
bf16 by default as the GPU runs use it) pinned on the host; each variant steps `--steps` times after `--warmup`.
First both take three steps from the same start on the preset's first parameters and must end bit-identical
(same math, the same stochastic-rounding draws in the same order: only the copies' timing differs). Prints seconds
per step of each, their ratios to the product, and (CUDA) each one's allocated peak during its steps above what the
parameters, gradients and state held before; on CPU there are no streams and all run one loop (the check still runs).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from colo.trainer.optim import StreamedAdamW, _local, _part


class SerialAdamW(StreamedAdamW):
    """The yardstick: each parameter's state in, its math, its state out, one after the other on one stream."""

    def _step_streamed(self, work: list) -> None:
        for group, p, piece in work:
            m, v = (_part(self.state[p][k], piece).to(self.device, torch.float32, non_blocking=True)
                    for k in ("exp_avg", "exp_avg_sq"))
            for key, new in zip(("exp_avg", "exp_avg_sq"), self._update(group, p, piece, m, v)):
                _part(self.state[p][key], piece).copy_(new, non_blocking=True)
        torch.cuda.synchronize(self.device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--state-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def _params(preset: str, device: torch.device, limit: int | None = None) -> list[torch.nn.Parameter]:
    """The preset's trainer parameters (colo.plan.memory's list of them), fp32, each with a gradient; the first
    ones up to `limit` elements when given."""
    from colo.models.tiny import preset_config
    from colo.plan.memory import model_shape

    gen = torch.Generator(device=device).manual_seed(0)
    out, total = [], 0
    for spec in model_shape(preset_config(preset).to_dict()).params:
        if limit is not None and out and total + spec.numel > limit:
            break
        p = torch.nn.Parameter(torch.empty(spec.shape, device=device).normal_(0, 0.02, generator=gen))
        p.grad = torch.empty_like(p).normal_(0, 1e-3, generator=gen)
        out.append(p)
        total += spec.numel
    return out


def _optimizer(cls: type, params: list, args: argparse.Namespace, device: torch.device,
               whole: bool = False) -> StreamedAdamW:
    opt = cls(params, lr=1e-3, weight_decay=0.01, state_dtype=getattr(torch, args.state_dtype), on_host=True,
              device=device)
    if whole:
        opt.piece_elements = max(p.numel() for p in params)
    return opt


def _seconds_per_step(opt: StreamedAdamW, args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    """(seconds per measured step, the allocated peak over all steps above the start, GB; 0 on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    times = []
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.step()  # returns once the state's host copies have landed
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(device) - before) / 1e9 if device.type == "cuda" else 0.0
    return sum(times) / len(times), peak


def bit_identical(args: argparse.Namespace, device: torch.device, limit: int = 64 << 20) -> bool:
    """Both variants, three steps from the same start on the preset's first parameters (up to `limit` elements):
    the same weights and state to the bit."""
    ends = []
    for cls in (StreamedAdamW, SerialAdamW):
        params = _params(args.preset, device, limit)
        opt = _optimizer(cls, params, args, device)
        for _ in range(3):
            opt.step()
        ends.append([p.detach().cpu() for p in params]
                    + [_local(opt.state[p][k]).cpu() for p in params for k in ("exp_avg", "exp_avg_sq")])
    return all(torch.equal(a, b) for a, b in zip(*ends))


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    same = bit_identical(args, device)
    params = _params(args.preset, device)  # the whole model, one rank: both variants step the same tensors
    secs, peaks = {}, {}
    for name, cls, whole in (("streamed", StreamedAdamW, False), ("whole", StreamedAdamW, True),
                             ("serial", SerialAdamW, False)):
        opt = _optimizer(cls, params, args, device, whole)
        secs[name], peaks[name] = _seconds_per_step(opt, args, device)
        del opt  # its pinned state goes before the next one's is made
    numel = sum(p.numel() for p in params)
    return {"preset": args.preset, "device": str(device), "params": numel, "state_dtype": args.state_dtype,
            "state_gb": round(numel * 2 * (2 if args.state_dtype == "bfloat16" else 4) / 1e9, 2),
            "steps": args.steps, "streamed_s": round(secs["streamed"], 4), "serial_s": round(secs["serial"], 4),
            "whole_s": round(secs["whole"], 4), "ratio": round(secs["serial"] / secs["streamed"], 3),
            "whole_ratio": round(secs["whole"] / secs["streamed"], 3),
            "peak_gb": {k: round(v, 2) for k, v in peaks.items()}, "bit_identical": same}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = measure(args)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['preset']}: {out['params'] / 1e9:.2f}B params, state {out['state_gb']} GB "
              f"({out['state_dtype']}) on the host: streamed {out['streamed_s']:.3f} s/step, "
              f"serial {out['serial_s']:.3f} s/step ({out['ratio']:.2f}x), each parameter whole {out['whole_s']:.3f} "
              f"s/step ({out['whole_ratio']:.2f}x); step peaks {out['peak_gb']} GB; "
              f"bit-identical: {out['bit_identical']}")
    return 0 if out["bit_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
