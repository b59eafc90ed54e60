"""What each way to fit costs per train step, as a ratio against the default, measured in one run.

    python -m tools.experiments.fit [--steps 6] [--device cpu|cuda] [--json]

Per option, the same train step as tools.experiments.trainmem (onload, old-log-prob pass, one PPO micro-batch,
optimizer step, offload) on one FSDP2 rank of a small Qwen3-MoE (4 layers, hidden 256, 16 experts top 4,
vocab 4096; micro batch 2 x 128 tokens by default). All options live in one process and take their steps
in turns (round r: one step of each), so load from other jobs hits them alike; the ratio is the median
over rounds 2..N of (option's step / the default's step in the same round), and the ratio of the fastest
rounds (other jobs only add time, so on a shared machine that one is the steadier). Then the optimizer
step alone, 3N interleaved rounds per option, fastest against the default's fastest. Options: the default (torch AdamW, fp32 state on the device), trainer.gradient_checkpointing,
trainer.optimizer_offload (state on the host, streamed per parameter), trainer.optimizer_dtype=bfloat16,
and the last two together. On CPU "host" and "device" are the same memory, so optimizer_offload's ratio
there is the cost of the per-parameter loop, not of the transfers; a GPU figure comes with a GPU run.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

OPTIONS = {
    "default": {},
    "gradient_checkpointing": {"gc": True},
    "optimizer_offload": {"optimizer_offload": True},
    "optimizer_dtype=bfloat16": {"optimizer_dtype": "bfloat16"},
    "optimizer_offload + bfloat16": {"optimizer_offload": True, "optimizer_dtype": "bfloat16"},
}
SHAPE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
             vocab_size=4096, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def main(argv: list[str] | None = None) -> None:
    from tools.experiments import trainmem

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mb", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    trainmem.init_world(device)
    steppers = {}
    for name, opts in OPTIONS.items():
        targs = trainmem.parse_args(["--preset", "tiny", "--layers", "4", "--mb", str(args.mb), "--seq", str(args.seq),
                                     "--device", args.device])
        targs.gc = opts.get("gc", False)
        targs.optimizer_offload = opts.get("optimizer_offload", False)
        targs.optimizer_dtype = opts.get("optimizer_dtype", "float32")
        targs.overrides = SHAPE
        steppers[name] = trainmem.Stepper(targs, device)
    secs: dict[str, list[float]] = {name: [] for name in OPTIONS}
    for _ in range(args.steps):  # interleaved: round r of every option runs under the same machine load
        for name, st in steppers.items():
            secs[name].append(st.step()["seconds"])
    opt_secs = _optimizer_steps(steppers, args.steps * 3)
    out: dict[str, dict] = {}
    for name, xs in secs.items():  # per round against the default's time in that round, then the median
        ratios = [x / d for x, d in zip(xs[1:], secs["default"][1:])]
        out[name] = {"step_s": round(statistics.median(xs[1:]), 4), "ratio": round(statistics.median(ratios), 3),
                     # the fastest round: other jobs only ever add time, so min/min is the steadier ratio
                     "min_s": round(min(xs[1:]), 4), "min_ratio": round(min(xs[1:]) / min(secs["default"][1:]), 3),
                     "all_s": [round(x, 3) for x in xs]}
    for name, xs in opt_secs.items():
        out[name]["optimizer_step_min_s"] = round(min(xs), 5)
        out[name]["optimizer_step_ratio"] = round(min(xs) / min(opt_secs["default"]), 3)
    if args.json:
        print(json.dumps({"device": args.device, "mb": args.mb, "seq": args.seq, "steps": args.steps, "options": out,
                          "torch": torch.__version__}))
        return
    print(f"train step on {args.device}, rounds 2..{args.steps}: median s, median of per-round ratios; fastest s, "
          "its ratio to the default's fastest")
    for name, v in out.items():
        print(f"  {name:30s} {v['step_s']:.3f} s  {v['ratio']:.2f}x   {v['min_s']:.3f} s  {v['min_ratio']:.2f}x   "
              f"optimizer step alone {v['optimizer_step_min_s'] * 1e3:.1f} ms {v['optimizer_step_ratio']:.2f}x")


def _optimizer_steps(steppers: dict, rounds: int) -> dict[str, list[float]]:
    """optimizer.step() alone on the device-resident model (fixed random grads), interleaved; seconds."""
    import time

    for st in steppers.values():
        st.off.onload([st.model], st.opt)
        for p in st.model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
    out: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(rounds):
        for name, st in steppers.items():
            if st.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            st.opt.step()
            if st.device.type == "cuda":
                torch.cuda.synchronize()
            out[name].append(time.perf_counter() - t0)
    return out


if __name__ == "__main__":
    main()
