"""The trainer's memory per stage of a train step, measured, next to what colo.plan.memory predicts.

    python -m tools.experiments.trainmem --preset qwen3-30b-a3b --layers 2 --mb 2 --seq 4096 [--gc] [--device cuda]
        [--optimizer-dtype bfloat16] [--optimizer-offload] [--steps 2] [--json]

One FSDP2 rank (world 1) of the preset with `--layers` decoder layers and random weights, on `--device`;
per step: onload (after the first), the no-grad old-log-prob pass, one PPO micro-batch (forward, backward,
entropy: the same calls as colo.trainer.worker.Trainer._ppo_micro), the optimizer step, offload. On CUDA it
reports each stage's peak allocated and reserved bytes (torch.cuda.max_memory_*), and the plan's figures
for the same settings: `fwd_bwd` (state + activations + logits + gathered units) and `step`. This is how
colo.plan.memory's activation and logits terms are checked against a GPU; docs/benchmarks.md has the runs.
Needs torch and transformers only (no Ray, no vLLM): it runs on a bare GPU host.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mb", type=int, default=1, help="micro_batch_size (sequences)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (max_model_len)")
    ap.add_argument("--gc", action="store_true", help="gradient checkpointing")
    ap.add_argument("--optimizer-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--optimizer-offload", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def _model_dir(preset: str, layers: int, overrides: dict | None = None) -> tuple[str, dict]:
    from colo.models.tiny import PRESETS, preset_config

    cfg = preset_config(preset)
    cfg.num_hidden_layers = cfg.max_window_layers = layers
    for k, v in (overrides or {}).items():
        setattr(cfg, k, v)
    out = tempfile.mkdtemp(prefix="colo-trainmem-")
    cfg.save_pretrained(out)
    return out, dict(PRESETS[preset], num_hidden_layers=layers, max_window_layers=layers, **(overrides or {}))


class Meter:
    """Peak allocated/reserved per stage on CUDA (reset between stages); RSS on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.out = device, {}

    def __enter__(self):  # noqa: ANN204
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return self

    def stage(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.out[name] = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
            torch.cuda.reset_peak_memory_stats()
        else:
            import psutil

            self.out[name] = {"rss": psutil.Process().memory_info().rss}

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        return None


def init_world(device: torch.device) -> None:
    """A process group of one rank (gloo on CPU, NCCL on CUDA), as FSDP2 needs one."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


class Stepper:
    """One sharded model with its optimizer and the Trainer's step, runnable one step at a time (tools.experiments.fit
    interleaves several, so that a busy machine slows every option alike)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from colo.trainer.fsdp import build_sharded
        from colo.trainer.offload import Offloader
        from colo.trainer.optim import make_optimizer

        self.device, self.steps = device, 0
        path, self.config_json = _model_dir(args.preset, args.layers, getattr(args, "overrides", None))
        mesh = init_device_mesh(device.type, (1,))
        self.model = build_sharded(path, dummy=True, mesh=mesh, device=device, gradient_checkpointing=args.gc)
        self.opt = make_optimizer(self.model.parameters(), lr=1e-6, weight_decay=0.0, state_dtype=args.optimizer_dtype,
                                  on_host=args.optimizer_offload, device=device)
        self.off = Offloader(device)
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, int(self.config_json["vocab_size"]), (args.mb, args.seq), generator=gen)  # (b, T)
        self.am = torch.ones_like(self.ids)
        self.mask = torch.ones(args.mb, args.seq)
        self.mask[:, : args.seq // 8] = 0  # a prompt part, as rollouts have
        self.adv = torch.randn(args.mb, generator=gen)

    def step(self) -> dict:
        """Onload (after the first), old log-probs, one PPO micro-batch, optimizer step, offload."""
        from colo.algo.loss import LossOptions, gather_logprobs, policy_loss, token_entropy

        d, model, opt = self.device, self.model, self.opt
        ids, am, mask = self.ids.to(d), self.am.to(d), self.mask.to(d)
        t0 = time.perf_counter()
        with Meter(d) as m:
            if self.steps:
                self.off.onload([model], opt)
            m.stage("onload")
            pos = (am.cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():  # Trainer._logprobs: old log-probs
                old = gather_logprobs(model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits,
                                      ids)
            m.stage("old_logprobs")
            # Trainer._ppo_micro
            logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
            lp = gather_logprobs(logits, ids)
            loss, _ = policy_loss(lp, old, self.adv.to(d), mask,
                                  LossOptions(clip_low=0.2, clip_high=0.28), token_count=float(mask.sum()))
            loss.backward()
            with torch.no_grad():
                float((token_entropy(logits.detach()) * mask).sum())
            del logits, lp, loss
            m.stage("fwd_bwd")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            m.stage("step")
            self.off.offload([model], opt)
            m.stage("offload")
        self.steps += 1
        return {"stages": m.out, "seconds": time.perf_counter() - t0}


def run(args: argparse.Namespace) -> dict:
    """One measurement (see the module docstring); `args.overrides` (optional) changes the preset's config."""
    from colo.plan.memory import activation_bytes, model_shape, plan_memory
    from colo.plan.settings import Settings

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    init_world(device)
    st = Stepper(args, device)
    config_json, model = st.config_json, st.model
    steps = [st.step() for _ in range(args.steps)]
    s = Settings.of({"placement.num_gpus": 1, "placement.vllm_gpu_fraction": 0.3, "trainer.micro_batch_size": args.mb,
                     "rollout.max_model_len": args.seq, "trainer.packing": False,
                     "trainer.gradient_checkpointing": args.gc, "trainer.optimizer_offload": args.optimizer_offload,
                     "trainer.optimizer_dtype": args.optimizer_dtype})
    plan = plan_memory(config_json, s, None)
    rows = dict(plan.rows)
    no_buf = lambda phase: sum(v.get(phase, 0.0) for n, v in plan.rows  # noqa: E731
                               if not n.startswith(("overhead", "vLLM", "sync buffers", "allocator")))
    dist.destroy_process_group()
    return {"preset": args.preset, "layers": args.layers, "mb": args.mb, "seq": args.seq, "gc": args.gc,
            "optimizer_dtype": args.optimizer_dtype, "optimizer_offload": args.optimizer_offload,
            "device": str(device), "params": model_shape(config_json).numel,
            "measured": steps[-1]["stages"], "step_seconds": [round(x["seconds"], 3) for x in steps],
            "plan": {"fwd_bwd": no_buf("train"), "step": no_buf("step"),
                     "activations": activation_bytes(model_shape(config_json), s),
                     "rows_train": {n: v.get("train", 0.0) for n, v in rows.items() if "train" in v}},
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out))
        return
    G = 2**30
    meas = out["measured"]
    print(f"{out['preset']} L{out['layers']} mb {out['mb']} x seq {out['seq']} gc {out['gc']} on {out['device']}")
    for k, v in meas.items():
        print(f"  {k:13s} " + "  ".join(f"{kk} {vv / G:7.2f} GiB" for kk, vv in v.items()))
    print(f"  plan fwd_bwd {out['plan']['fwd_bwd'] / G:.2f} GiB, step {out['plan']['step'] / G:.2f} GiB")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
