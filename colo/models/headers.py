"""A checkpoint's weights against its config.json, from the safetensors headers alone, before anything starts.

    problems = weight_problems("/ckpt")     # [] or what does not match, e.g. "model.layers.0.mlp.experts.4... missing"

A checkpoint whose files disagree with its config.json (4 experts saved, 8 in the config; a q_proj of another
shape) otherwise fails in every trainer rank after Ray and the engines started, as a 58-line chained traceback.
The headers hold every tensor's name and shape and cost milliseconds to read; the model that config.json
describes is built on the meta device (no memory), and each of its parameters and persistent buffers is looked
up the way colo.trainer.load reads it (the family's Hub names, experts per expert: colo.models.archs).
"""
from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old checkpoints carry RoPE buffers (colo.trainer.load)
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def header_shapes(model_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the directory's *.safetensors files (headers only)."""
    out: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return out


def weight_problems(model_dir: str | os.PathLike) -> list[str]:
    """What does not match between config.json's model and the safetensors files: tensors missing, of another
    shape, or that no parameter takes (each a short phrase, the worst first); [] when they match."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from colo.models.archs import ARCHS, HUB_LAYOUT, reference_segments

    index = header_shapes(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    arch = ARCHS.get((config.architectures or [type(model).__name__])[0], HUB_LAYOUT)
    tie = bool(getattr(config, "tie_word_embeddings", False))
    missing, wrong, used = [], [], set()
    buffers = [(n, b) for n, b in model.named_buffers() if _persistent(model, n)]
    for name, p in [*model.named_parameters(), *buffers]:
        for key, _, shape in reference_segments(arch, name, tuple(p.shape)):
            if key not in index and tie and name == "lm_head.weight":
                key = "model.embed_tokens.weight"  # tied and saved once
            if key not in index:
                missing.append(key)
            elif index[key] != tuple(shape):
                wrong.append(f"{key} is {list(index[key])} in the files, {list(shape)} for config.json")
            used.add(key)
    ignore = [re.compile(r) for r in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    unused = sorted(k for k in index if k not in used and not k.endswith(IGNORED_SUFFIXES)
                    and not any(r.search(k) for r in ignore))
    out = []
    experts = _experts_hint(index, missing, unused, config)
    if experts:
        out.append(experts)
    if wrong:
        out.append(f"{len(wrong)} tensor(s) of another shape (first: {wrong[0]})")
    if missing:
        out.append(f"{len(missing)} tensor(s) missing (first: {missing[0]})")
    if unused:
        out.append(f"{len(unused)} tensor(s) no parameter takes (first: {unused[0]})")
    return out


def _experts_hint(index: dict, missing: list[str], unused: list[str], config) -> str | None:
    """Where the mismatch is the number of experts, say so in the config's terms."""
    from colo.models.archs import num_experts

    if not any(_EXPERT.search(k) for k in missing + unused):
        return None
    held = {int(m.group(1)) for k in index if (m := _EXPERT.search(k))}
    want = num_experts(config.to_dict())
    if not held or want is None or len(held) == want:
        return None
    return f"config.json has {want} experts per MoE layer, the files hold {len(held)} (experts {min(held)}-{max(held)})"


def _persistent(model, name: str) -> bool:
    module, _, leaf = name.rpartition(".")
    owner = model.get_submodule(module) if module else model
    return leaf not in getattr(owner, "_non_persistent_buffers_set", set())
