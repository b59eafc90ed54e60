"""Load an HF safetensors checkpoint into a sharded FSDP2 model: every rank reads only what it holds.

    checkpoint (*.safetensors, bf16, Hub layout) ──pread its rows──> this rank's shard (bf16) ──copy_──> fp32 DTensor shard
      dense tensor (d0, ...)       rows [r*ceil(d0/W), ...) of dim 0, the FSDP2 Shard(0) slice
      experts.{e}.gate_proj/up_proj  (I, H) each, for this rank's experts e only ─┐ fused on the fly into
      experts.{e}.down_proj          (H, I)                                        ┘ gate_up_proj / down_proj

No rank ever holds a full tensor, let alone the full model: the host peak is the rank's fp32 shard plus
one checkpoint tensor's rows in bf16 (before: rank 0 built the whole model in fp32 with from_pretrained,
120 GB for Qwen3-30B-A3B, and broadcast it tensor by tensor). The bytes are read with os.pread at the
offsets of the safetensors header, not through mmap, so untouched parts of a file never count against
the process's memory.

Bit-identical to `from_pretrained(dtype=float32)` + broadcast: both convert bf16 -> fp32 exactly, and the
fusion is the one transformers applies (colo.models.archs's per-family Hub names; gate rows then up rows,
as transformers' MergeModulelist + Concatenate(dim=1)). Strict like that path: a model parameter the
checkpoint lacks, or a checkpoint tensor no parameter takes, is an error naming them.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from colo.models.dtypes import SAFETENSORS, torch_dtype

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old checkpoints carry RoPE buffers; colo rebuilds them


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file


def read_index(model_dir: str | os.PathLike) -> dict[str, Entry]:
    """Every tensor of the checkpoint's safetensors files, from their headers (no tensor data is read)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors files; colo loads safetensors checkpoints "
                                "(fix: re-save the model with save_pretrained(safe_serialization=True))")
    out: dict[str, Entry] = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            dtype = torch_dtype(SAFETENSORS[meta["dtype"]])
            out[name] = Entry(f, dtype, tuple(meta["shape"]), 8 + n + meta["data_offsets"][0])
    return out


def read_rows(e: Entry, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of dim 0, as a (stop - start, ...) CPU tensor in the checkpoint's dtype."""
    row = torch.Size(e.shape[1:]).numel() * torch.empty((), dtype=e.dtype).element_size()
    buf = bytearray((stop - start) * row)
    if buf:
        fd = os.open(e.file, os.O_RDONLY)
        try:
            view, pos, end = memoryview(buf), 0, len(buf)
            while pos < end:  # pread may return less than asked for
                got = os.preadv(fd, [view[pos:]], e.offset + start * row + pos)
                if got <= 0:
                    raise OSError(f"{e.file}: short read at byte {e.offset + start * row + pos}")
                pos += got
        finally:
            os.close(fd)
    t = torch.frombuffer(buf, dtype=e.dtype) if buf else torch.empty(0, dtype=e.dtype)
    return t.view(stop - start, *e.shape[1:])


def _rows(p: torch.Tensor) -> tuple[int, int]:
    """Global dim-0 rows [start, stop) of this rank's shard (FSDP2: Shard(0), torch.chunk sizes)."""
    if not isinstance(p, DTensor):
        return 0, p.shape[0] if p.dim() else 1
    if list(p.placements) != [Shard(0)]:
        raise NotImplementedError(f"colo loads Shard(0) parameters only, not {p.placements}")
    world, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    per = -(-p.shape[0] // world)
    start = min(rank * per, p.shape[0])
    local = p.to_local().shape[0]
    if start + local > p.shape[0] or local != min(per, p.shape[0] - start):
        raise RuntimeError(f"unexpected shard of {tuple(p.shape)} on rank {rank}/{world}: {local} rows")
    return start, start + local


@torch.no_grad()
def load_sharded(model: nn.Module, model_dir: str | os.PathLike, skip: set[str] | frozenset[str] = frozenset()
                 ) -> dict[str, int]:
    """Fill every parameter's local shard, and every persistent buffer, from the checkpoint; returns
    {"tensors", "bytes_read"}; `skip`: parameters left as they are (LoRA's adapters). Where each trainer tensor lives
    on disk comes from the family's table
    (colo.models.archs.reference_segments, the names vLLM's own loader reads): the tensor itself under
    its Hub name, or per expert and part for experts the Hub keeps un-fused."""
    import re

    from colo.models.archs import ARCHS, HUB_LAYOUT, reference_segments

    index = read_index(model_dir)
    # a family the sync has no table for (refused for runs, colo.config.checks) may still be trained:
    # the Hub's common layout, names as in memory and experts per expert, is then what the disk must hold
    arch = ARCHS.get((model.config.architectures or [type(model).__name__])[0], HUB_LAYOUT)
    tie = bool(getattr(model.config, "tie_word_embeddings", False))
    used: set[str] = set()
    missing: list[str] = []
    read = 0
    persistent = [(n, b) for n, b in model.named_buffers() if _persistent(model, n)]
    for name, p in [*model.named_parameters(), *persistent]:
        if name in skip:  # LoRA's adapters: no checkpoint holds them (colo.trainer.adapters inits them)
            continue
        local = p.to_local() if isinstance(p, DTensor) else p.data  # (rows, ...) this rank's shard
        start, stop = _rows(p)
        segs = reference_segments(arch, name, tuple(p.shape))
        if len(segs) > 1:  # experts the Hub keeps per expert: (E, k*I, H) / (E, H, I) fused on the fly
            per_expert = sum(torch.Size(shape).numel() for _, _, shape in segs) // p.shape[0]
            flat = local.view(local.shape[0], -1)  # (rows, per_expert)
            for key, offset, shape in segs:
                used.add(key)  # the other experts' tensors are other ranks' to read, not unused
                e, within = divmod(offset, per_expert)
                if not start <= e < stop:
                    continue
                if key not in index or index[key].shape != shape:
                    missing.append(key if key not in index else f"{key} {index[key].shape} != {shape}")
                    continue
                t = read_rows(index[key], 0, shape[0])
                flat[e - start, within: within + t.numel()].copy_(t.view(-1))
                read += t.numel() * t.element_size()
            continue
        key = segs[0][0]
        if key not in index and tie and name == "lm_head.weight":
            key = "model.embed_tokens.weight"  # tied and saved once
        if key not in index:
            missing.append(key)
            continue
        if index[key].shape != tuple(p.shape):
            raise ValueError(f"{key}: checkpoint shape {index[key].shape} but the model's {name} is {tuple(p.shape)}")
        t = read_rows(index[key], start, stop)
        local.copy_(t.view(local.shape))
        used.add(key)
        read += t.numel() * t.element_size()
    ignore = [re.compile(r) for r in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    unused = sorted(k for k in index if k not in used and not k.endswith(IGNORED_SUFFIXES)
                    and not any(r.search(k) for r in ignore))
    if missing or unused:
        raise ValueError(f"checkpoint {model_dir} does not match the model: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unused {unused[:5]}{'...' if len(unused) > 5 else ''}")
    return {"tensors": len(used), "bytes_read": read}


def _persistent(model: nn.Module, name: str) -> bool:
    """A buffer that is in the state dict (DeepSeek's e_score_correction_bias), not one rebuilt at init
    (RoPE inv_freq, colo.trainer.fsdp.rebuild_buffers)."""
    module, _, leaf = name.rpartition(".")
    owner = model.get_submodule(module) if module else model
    return leaf not in getattr(owner, "_non_persistent_buffers_set", set())
