"""The functional check's error that FP8's rounding alone causes: where the "fp8" tolerances come from
(colo.sync.probe.TOLERANCE, FEW_TOLERANCE; colo.sync.layercheck.TOLERANCE).

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
bf16 weights of another seed (what a sync that wrote nothing would leave). The layer check (colo.sync.layercheck)
is measured the same way: the worst site's error of each model against the bf16 one, on the check's fixed inputs.

Its JSON line: per model and seed the weight-only and W8A8 errors (the median, the FEW-th worst position, the layer
check's worst site), and their maxima ("max_w8a8", "max_few_w8a8", "max_layer_w8a8") and the stale engine's minima.
The tolerances are set with margin above the maxima and below the stale minima (docs/vllm-notes.md, "FP8 rollout").
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

    from colo.sync.forcing import Forcing
    from colo.sync.layercheck import compare, layer_spec
    from colo.sync.probe import check, engine_scores, probe_sequences, trainer_scores

    def layers(model):  # the layer check's records of a transformers model (as the trainer takes them)
        with torch.no_grad(), Forcing(model, layer_spec(model.config.vocab_size, 128), "hf", model.config) as f:
            f.add_logits(model(torch.tensor(f.hf_ids, device=dev)).logits.float())
        return f.records()

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
            mine, base = trainer_scores(scores(ref, ids), ids), layers(ref)
            row = {"preset": preset, "seed": seed}
            for tag, act in (("weights", False), ("w8a8", True), ("stale", None)):
                if act and not args.activations:
                    continue
                eng = _model(args, preset, seed + 100, dev) if act is None else fp8_model(_model(args, preset, seed,
                                                                                                  dev), act)
                res = check(mine, engine_view(scores(eng, ids), ids), "bfloat16")
                row[tag], row[f"few_{tag}"] = res.err, res.few
                row[f"layer_{tag}"] = compare(base, layers(eng), float("inf")).err
                del eng
            del ref
            rows.append(row)
            print(f"[fp8probe] {row}", file=sys.stderr, flush=True)
    key = "w8a8" if args.activations else "weights"
    out = {"rows": rows, "max_weights": max(r["weights"] for r in rows), "stale_min": min(r["stale"] for r in rows),
           "few_stale_min": min(r["few_stale"] for r in rows), "layer_stale_min": min(r["layer_stale"] for r in rows)}
    for k in {"weights", key}:
        out.update({f"max_{k}": max(r[k] for r in rows), f"max_few_{k}": max(r[f"few_{k}"] for r in rows),
                    f"max_layer_{k}": max(r[f"layer_{k}"] for r in rows)})
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from colo.sync.probe import FEW

    out = measure(args)
    print(json.dumps(out, sort_keys=True) if args.json else
          f"FP8 probe error (median, {FEW}th worst position, layer check's worst site): weights only <= "
          f"{out['max_weights']:.3f}, {out['max_few_weights']:.3f}, {out['max_layer_weights']:.3f}; W8A8 <= "
          f"{out.get('max_w8a8', float('nan')):.3f}, {out.get('max_few_w8a8', float('nan')):.3f}, "
          f"{out.get('max_layer_w8a8', float('nan')):.3f}; a stale engine >= {out['stale_min']:.3f}, "
          f"{out['few_stale_min']:.3f}, {out['layer_stale_min']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
