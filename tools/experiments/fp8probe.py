"""The functional check's error that FP8's rounding alone causes: where colo.sync.probe.TOLERANCE["fp8"] comes from.

    python -m tools.experiments.fp8probe --json                    # CPU, ~1 min: the tiny presets, 3 seeds each
    python -m tools.experiments.fp8probe --preset qwen3-30b-a3b-L2 --seeds 1 --device cuda --json    # a real width

An engine that generates with FP8 weights computes other log-probs than the bf16 trainer, by design. This measures
how far apart colo.sync.probe's measure (per position, the RMS of the log-prob differences over the engine's top-8
tokens and the actual one, over the trainer's spread; the median over positions) puts them when nothing is wrong
but the rounding: the same transformers model scores the probe sequences with its bf16 weights (the trainer) and
with every weight colo quantizes replaced by dequantize(quantize(w)) (colo.sync.fp8: the attention projections and
the experts; router, embeddings, lm_head and norms untouched), and, with --activations (the default), each
quantized linear's input also rounded as vLLM's W8A8 block kernels round it (e4m3 per token and 128 channels,
dynamic scales; inside the experts, their input). For contrast it also measures the error of a stale engine: the
bf16 weights of another seed (what a sync that wrote nothing would leave).

Its JSON line: per model and seed the weight-only and W8A8 errors, and "max_w8a8", "stale_min". The tolerance is
set with margin above max_w8a8 and far below stale_min (docs/vllm-notes.md, "FP8 rollout").
Arguments are parsed before torch is imported.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

PRESETS = ("tiny", "tiny-fp8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", help="colo.models.tiny presets (default: tiny and tiny-fp8)")
    ap.add_argument("--seeds", type=int, default=3, help="random models per preset")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--no-activations", dest="activations", action="store_false",
                    help="weights only (no W8A8 rounding of the linears' inputs)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "colo-bench"))
    return ap.parse_args(argv)


def _act_qdq(x):  # (..., K) -> the same, each 128-channel group of each token rounded through e4m3 (vLLM's W8A8)
    import torch

    from colo.sync.fp8 import BLOCK, E4M3_MAX

    k = x.shape[-1]
    pad = (-k) % BLOCK
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(*x.shape[:-1], -1, BLOCK)
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(1e-10) / E4M3_MAX
    q = (xf / scale).to(torch.float8_e4m3fn).float() * scale
    return q.view(*x.shape[:-1], -1)[..., :k].to(x.dtype)


def quantized_names(model) -> list[str]:
    """The model's parameters colo's sender quantizes (colo.sync.fp8 with colo.rollout.quant's bf16 modules): the
    attention projections and the experts; never the router, embeddings, lm_head or norms."""
    return [n for n, p in model.named_parameters() if p.dim() >= 2 and (".self_attn." in n or ".experts." in n)]


def fp8_model(model, activations: bool):
    """`model` with its quantized weights through quantize-dequantize (and, with `activations`, the inputs of the
    quantized linears and of the experts rounded as W8A8 rounds them). Changes the model in place."""
    import torch

    from colo.sync.fp8 import dequantize_blocks, quantize_blocks

    with torch.no_grad():
        for name in quantized_names(model):
            p = model.get_parameter(name)
            q, s = quantize_blocks(p.data)
            p.data.copy_(dequantize_blocks(q, s, p.dtype))
    if activations:
        for name, mod in model.named_modules():
            leaf = name.rpartition(".")[2]
            if (".self_attn." in name and isinstance(mod, torch.nn.Linear)) or leaf == "experts":
                mod.register_forward_pre_hook(lambda _m, args: (_act_qdq(args[0]), *args[1:]))
    return model


def _model(args: argparse.Namespace, preset: str, seed: int, dev):
    """The preset's bf16 transformers model of `seed`: its checkpoint's weights, or (a preset without weights, e.g.
    qwen3-30b-a3b-L2) transformers' own random initialization under torch.manual_seed(seed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from colo.models.tiny import WITH_WEIGHTS, make_tiny_model

    path = make_tiny_model(Path(args.workdir) / f"fp8probe-{preset}-s{seed}", preset, seed)
    if preset in WITH_WEIGHTS:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
    torch.manual_seed(seed)
    with torch.device(dev):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16).eval()


def measure(args: argparse.Namespace) -> dict:
    import torch

    from colo.sync.probe import check, engine_scores, probe_sequences, trainer_scores

    def scores(model, ids):
        with torch.no_grad():
            return model(ids).logits.float()  # (S, T, V)

    def engine_view(logits, ids):  # vLLM's prompt log-probs: top-8 per position and the actual token
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        out = []
        for s in range(ids.shape[0]):
            seq = [None]
            for t in range(ids.shape[1] - 1):
                v, i = lp[s, t].topk(8)
                row = dict(zip(i.tolist(), v.tolist()))
                row[int(ids[s, t + 1])] = float(lp[s, t, ids[s, t + 1]])
                seq.append(row)
            out.append(seq)
        return engine_scores(out)

    rows, dev = [], torch.device(args.device)
    for preset in args.preset or PRESETS:
        for seed in range(args.seeds):
            ref = _model(args, preset, seed, dev)
            ids = torch.tensor(probe_sequences(ref.config.vocab_size), device=dev)  # (2, 24): the loop's sequences
            mine = trainer_scores(scores(ref, ids), ids)
            row = {"preset": preset, "seed": seed}
            for tag, act in (("weights", False), ("w8a8", True)):
                if act and not args.activations:
                    continue
                eng = fp8_model(_model(args, preset, seed, dev), act)
                row[tag] = check(mine, engine_view(scores(eng, ids), ids), "bfloat16").err
                del eng
            stale = _model(args, preset, seed + 100, dev)
            row["stale"] = check(mine, engine_view(scores(stale, ids), ids), "bfloat16").err
            del ref, stale
            rows.append(row)
            print(f"[fp8probe] {row}", file=sys.stderr, flush=True)
    key = "w8a8" if args.activations else "weights"
    return {"rows": rows, "max_weights": max(r["weights"] for r in rows),
            f"max_{key}": max(r[key] for r in rows), "stale_min": min(r["stale"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = measure(args)
    print(json.dumps(out, sort_keys=True) if args.json else
          f"FP8 probe error: weights only <= {out['max_weights']:.3f}, "
          f"W8A8 <= {out.get('max_w8a8', float('nan')):.3f}; "
          f"a stale engine >= {out['stale_min']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
