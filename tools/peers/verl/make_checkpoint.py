"""The one checkpoint the side-by-side loads: a colo preset's config and tokenizer with random bf16 weights, saved once
as a Hugging Face checkpoint that colo (`colo.bench.step --model DIR`) and verl (`actor_rollout_ref.model.path=DIR`)
both read, so neither system initializes its own weights.

    python tools/peers/verl/make_checkpoint.py /tmp/peers/qwen3-30b-a3b-L4                  # GPU host python, ~1 min
    python tools/peers/verl/make_checkpoint.py /tmp/peers-tiny --preset tiny --device cpu   # CPU check, seconds

The config.json and tokenizer are colo.models.tiny's for the preset (its small BPE: token ids < 512, config vocab
151936 for the Qwen3-30B-A3B slices). The weights: transformers' own init of Qwen3MoeForCausalLM from the seed, in
bf16, built on --device (the L4 slice is 3.1B parameters: ~6 GB written); save_pretrained writes the experts in the
Hub's per-expert layout (`mlp.experts.{e}.{gate,up,down}_proj.weight`), which transformers 5.9 (verl), 5.17 (the
host) and 5.19 (colo) fuse on load and vLLM 0.24 and 0.32 load directly. Idempotent: a directory whose
peers_checkpoint.json names the same preset and seed is returned as it is.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

MARKER = "peers_checkpoint.json"


def build(out: Path, preset: str, seed: int, device: str) -> Path:
    """out holding the checkpoint (built unless its marker already names preset and seed)."""
    marker = {"preset": preset, "seed": seed}
    try:
        if json.loads((out / MARKER).read_text()) == marker:
            return out
    except (OSError, ValueError):
        pass
    import torch
    from transformers import Qwen3MoeForCausalLM

    from colo.models.tiny import make_tiny_model, preset_config

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        meta = make_tiny_model(tmp / "colo", preset, seed)  # colo's config.json and tokenizer for the preset
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(device):
            model = Qwen3MoeForCausalLM(preset_config(preset))
        model.save_pretrained(tmp / "ckpt", max_shard_size="4GB")
        del model
        for p in meta.iterdir():  # colo's config.json (rope_theta and num_experts kept for older readers), tokenizer
            if p.is_file() and p.name not in ("colo_preset.json", "model.safetensors", "generation_config.json"):
                shutil.copy2(p, tmp / "ckpt" / p.name)
        (tmp / "ckpt" / MARKER).write_text(json.dumps(marker) + "\n")
        for p in (tmp / "ckpt").iterdir():
            p.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        (tmp / "ckpt").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def describe(out: Path) -> dict:
    """What the checkpoint holds: parameter count, bytes, tensors, whether the experts are per-expert on disk."""
    from safetensors import safe_open

    names, numel, nbytes = [], 0, 0
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                n = 1
                for d in shape:
                    n *= d
                names.append(k)
                numel += n
                nbytes += 2 * n
    return {"dir": str(out), "tensors": len(names), "params": numel, "gib": round(nbytes / 2**30, 2),
            "per_expert_layout": any(".mlp.experts.0.gate_proj.weight" in k for k in names),
            "fused_expert_names": sum(k.endswith("experts.gate_up_proj") for k in names)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--preset", default="qwen3-30b-a3b-L4", help="a colo.models.tiny preset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="where the weights are initialized (cuda: seconds for "
                    "the L4 slice)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = build(Path(args.out).resolve(), args.preset, args.seed, args.device)
    print(json.dumps({**describe(out), "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
