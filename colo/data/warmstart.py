"""A tiny base that has learned its task: the `tiny` preset after a supervised warm-up, for LoRA jobs on CPU.

    python -m colo.data.warmstart OUT_DIR --preset tiny-arith --seed 0

LoRA adapts a pretrained model; the `tiny` preset is random. With its embeddings and lm_head frozen at random a
tiny model cannot learn the arithmetic task at all, adapters or not (measured: the supervised loss stalls at ~4.6,
the entropy of the answers alone, where a full fine-tune reaches ~1.0 in 40 steps). So `auto:tiny-arith` is the base
the default job's own warm-up makes (configs/tiny-cpu.yaml: 70 steps of 128 answers, AdamW at 3e-3, on the task
written as `auto:arith` writes it, the same examples colo.data.inputs.RunInputs.sft_batch draws), trained here in one
process on the full model and saved like a preset; configs/tiny-cpu-lora.yaml then runs RL with LoRA from it.

Built once per (preset, seed) and kept in the per-user cache like every preset (colo.models.build: ~10 CPU-s on the
2-core machine the first time).
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from colo.models import build

MARKER = "colo_preset.json"
WARM_PRESETS = {"tiny-arith": ("tiny", "arith")}  # preset -> (the random preset it starts from, its task)
STEPS, EXAMPLES, LR = 70, 128, 3e-3  # configs/tiny-cpu.yaml's warm-up: sft_warmup_steps, prompts x n, sft_lr


def _write(tmp: Path, preset: str, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from colo.data.inputs import RunInputs
    from colo.data.prompts import load_tokenizer
    from colo.data.tasks import make_task, sft_examples
    from colo.models.tiny import make_tiny_model

    base, task = WARM_PRESETS[preset]
    with tempfile.TemporaryDirectory() as work:
        src = make_tiny_model(Path(work) / "model", base, seed=seed)
        train, _ = make_task(task, Path(work) / "data", seed=seed)
        tok = load_tokenizer(str(src))
        inputs = RunInputs(Path(work), tok, None, [], sft_examples(train), chat_template=True, seed=seed)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        for step in range(STEPS):
            b = inputs.sft_batch(EXAMPLES, step)
            logits = model(b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1].float()  # (B, T-1, V)
            lp = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]  # (B, T-1)
            mask = b["loss_mask"][:, 1:].float()
            loss = -(lp * mask).sum() / mask.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        model.to(torch.bfloat16).save_pretrained(tmp)
        for f in src.iterdir():  # config.json (with its keys for transformers 4 readers), tokenizer, template
            if f.is_file() and f.name != MARKER and f.suffix != ".safetensors":
                (tmp / f.name).write_bytes(f.read_bytes())


def make_warm_model(out_dir: str | os.PathLike, preset: str = "tiny-arith", seed: int = 0) -> Path:
    """Write the warm preset's checkpoint dir (idempotent; a copy of the per-user cache's build when it has one)."""
    if preset not in WARM_PRESETS:
        raise ValueError(f"unknown warm preset {preset!r}; choose from {sorted(WARM_PRESETS)}")
    marker = {"preset": preset, "seed": seed, "steps": STEPS, "examples": EXAMPLES, "lr": LR}
    here = Path(__file__).resolve().parent
    sources = [__file__, here / "tasks.py", here / "inputs.py", here.parent / "models" / "tiny.py",
               here.parent / "models" / "tokenizer.py"]
    return build.build_cached(out_dir, MARKER, marker, lambda tmp: _write(tmp, preset, seed), sources=sources)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="tiny-arith", choices=sorted(WARM_PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(make_warm_model(args.out_dir, args.preset, args.seed))


if __name__ == "__main__":
    main()
