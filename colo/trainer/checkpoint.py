"""Resumable checkpoints (torch.distributed.checkpoint) and the final Hugging Face export.

A checkpoint directory holds:
    .metadata, __*_*.distcp     model + AdamW state, each rank writing only its own shards
    rng_rank{r}.pt              that rank's torch / CUDA / Python / NumPy RNG states
    extra.json                  caller's plain data (step, data position, ...), written by rank 0
    ref/                        the frozen KL reference (algo.kl_coef > 0), weights only

DCP resharding means a checkpoint written by W ranks loads on any other W'. The RNG files do not
reshard; with a different world size they are skipped (the load reports it).

The HF export gathers one parameter at a time (peak: one full tensor per rank plus the export-dtype
copy on rank 0), then rank 0 writes config + safetensors via save_pretrained, which writes experts
back in the per-expert layout Hub checkpoints and vLLM's loader use, plus the source's tokenizer.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor

from colo.trainer.fsdp import rebuild_buffers


def _rng_state() -> dict[str, Any]:
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> None:
    """Collective: every rank calls it with the same path (a directory on a shared filesystem)."""
    rank = dist.get_rank()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    msd, osd = get_state_dict(model, optimizer)
    _dcp_save({"model": msd, "optim": osd}, out)
    torch.save(_rng_state(), out / f"rng_rank{rank}.pt")
    if rank == 0:
        # json, not pickle: the loop's resume state stays readable and version-proof
        (out / "extra.json").write_text(json.dumps(extra, indent=1, sort_keys=True))
    dist.barrier()


def _dcp_save(state: dict, out: Path) -> None:
    """dcp.save, with an OSError of a rank (a full disk) raised as itself: DCP wraps it in a CheckpointException
    whose message names only the ranks ("CheckpointException ranks:dict_keys([0])")."""
    try:
        dcp.save(state, checkpoint_id=str(out))
    except CheckpointException as e:
        first = next((f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()), None)
        if isinstance(first, OSError):
            raise first from e
        raise


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective counterpart of `save`; returns the `extra` dict saved with it.

    get_state_dict initialises empty AdamW states (a zero-lr step with zero grads) so a fresh
    optimizer has tensors for DCP to load into; the loaded values then replace them in place.
    """
    src = Path(path)
    if not (src / ".metadata").exists():
        raise FileNotFoundError(f"{src} is not a colo checkpoint (no DCP .metadata)")
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(src))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    extra = json.loads((src / "extra.json").read_text())
    rng = src / f"rng_rank{dist.get_rank()}.pt"
    saved_ranks = len(list(src.glob("rng_rank*.pt")))
    if rng.exists() and saved_ranks == dist.get_world_size():
        _set_rng_state(torch.load(rng, weights_only=False))
    dist.barrier()
    return extra


def save_weights(path: str, model: nn.Module) -> None:
    """Collective: a model's weights alone (the frozen KL reference) as a DCP checkpoint at `path`."""
    _dcp_save({"model": get_model_state_dict(model)}, Path(path))
    dist.barrier()


def load_weights(path: str, model: nn.Module) -> bool:
    """Collective counterpart of `save_weights`; False (nothing loaded) when `path` holds none."""
    if not (Path(path) / ".metadata").exists():
        return False
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    dist.barrier()
    return True


def export_hf(path: str, model: nn.Module, source_dir: str | None, dtype: torch.dtype) -> None:
    """Collective: gather full weights to rank 0, which writes an HF checkpoint at `path`.

    `source_dir` (the model.path the trainer started from) supplies tokenizer and generation files.
    """
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    full: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        # full_tensor is an all-gather: every rank must walk the same names in the same order
        t = t.full_tensor() if isinstance(t, DTensor) else t
        if rank == 0:
            full[name] = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype)
        del t
    if rank == 0:
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
        hf.load_state_dict(full, assign=True, strict=True)
        rebuild_buffers(hf)
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        hf.save_pretrained(out)
        _copy_side_files(source_dir, out)
    dist.barrier()


def _copy_side_files(source_dir: str | None, out: Path) -> None:
    """Tokenizer, chat template, generation config: everything but weights and config.json."""
    if not source_dir or not Path(source_dir).is_dir():
        return
    skip_suffix = (".safetensors", ".bin", ".pt", ".pth")
    skip_name = {"config.json", "model.safetensors.index.json", "colo_preset.json"}
    for f in Path(source_dir).iterdir():
        if f.is_file() and f.name not in skip_name and not f.name.endswith(skip_suffix):
            shutil.copy2(f, out / f.name)
