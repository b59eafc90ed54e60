"""Resumable checkpoints (torch.distributed.checkpoint) and the final Hugging Face export.

A checkpoint directory holds:
    .metadata, __*_*.distcp     model + AdamW state, each rank writing only its own shards (LoRA: the adapters and
                                their AdamW state only; the frozen base is model.path's)
    rng_rank{r}.pt              that rank's torch / CUDA / Python / NumPy RNG states
    extra.json                  caller's plain data (step, data position, ...), written by rank 0
    ref/                        the frozen KL reference (algo.kl_coef > 0), weights only

DCP resharding means a checkpoint written by W ranks loads on any other W'. The RNG files do not
reshard; with a different world size they are skipped (the load reports it).

The HF export gathers one parameter at a time (peak: one full tensor per rank plus the export-dtype
copy on rank 0), then rank 0 writes config + safetensors via save_pretrained, which writes experts
back in the per-expert layout Hub checkpoints and vLLM's loader use, plus the source's tokenizer.
With LoRA, `export_adapter` writes the adapters as a PEFT folder (colo.models.lora has the layout), and export_hf
the merged weights (colo.trainer.adapters.merged_items) on request.
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
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor

from colo.models.lora import peft_key
from colo.trainer.adapters import LoraSpec, full_tensor
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


def _options(model: nn.Module) -> StateDictOptions:
    """LoRA (a model with frozen parameters): the checkpoint holds the trainable ones and their optimizer state only;
    the frozen base is the one model.path holds, loaded again at start. Loading sets those alone (strict=False: the
    base's keys are absent by design; dcp.load raises on any trainable key the checkpoint lacks)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> None:
    """Collective: every rank calls it with the same path (a directory on a shared filesystem)."""
    rank = dist.get_rank()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    msd, osd = get_state_dict(model, optimizer, options=_options(model))
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
    options = _options(model)
    msd, osd = get_state_dict(model, optimizer, options=options)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(src))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options)
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


def export_hf(path: str, model: nn.Module, source_dir: str | None, dtype: torch.dtype, items=None) -> None:
    """Collective: gather full weights to rank 0, which writes an HF checkpoint at `path`.

    `source_dir` (the model.path the trainer started from) supplies tokenizer and generation files. `items`: the
    (name, tensor) pairs to write instead of model.state_dict()'s (LoRA: colo.trainer.adapters.merged_items).
    """
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    full: dict[str, torch.Tensor] = {}
    for name, t in (model.state_dict().items() if items is None else items):
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


def _peft_tensor(name: str, part: str, t: torch.Tensor) -> torch.Tensor:
    """colo's adapter tensor in PEFT's layout (colo.models.lora): a Linear's as it is; an expert's A (E, r, in) ->
    (E r, in), B (E, out, r) -> (out, r E)."""
    if name.endswith(".weight"):
        return t
    return t.reshape(-1, t.shape[-1]) if part == "A" else t.permute(1, 2, 0).reshape(t.shape[1], -1)


@torch.no_grad()
def export_adapter(path: str, model: nn.Module, spec: LoraSpec, base_path: str, dtype: torch.dtype) -> None:
    """Collective: a PEFT adapter folder at `path` (adapter_config.json from peft's LoraConfig, adapter_model.
    safetensors in `dtype`, the base's tokenizer files), written by rank 0."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors: dict[str, torch.Tensor] = {}
    linears, experts = [], []
    for weight, names in getattr(model, "colo_lora", {}).items():
        for part, name in zip(("A", "B"), names):
            full = full_tensor(model.get_parameter(name))
            if rank == 0:
                tensors[peft_key(weight, part)] = _peft_tensor(weight, part, full).to("cpu", dtype).contiguous()
        (linears if weight.endswith(".weight") else experts).append(weight.rpartition(".")[0]
                                                                     if weight.endswith(".weight") else weight)
    if rank == 0:
        from peft import LoraConfig
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        # peft refuses dropout on target_parameters (its ParamWrapper): inference never applies it anyway
        LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0 if experts else spec.dropout,
                   target_modules=sorted(linears) or None, target_parameters=experts or None, bias="none",
                   task_type="CAUSAL_LM", base_model_name_or_path=base_path).save_pretrained(str(out))
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        _copy_side_files(base_path, out)
    if dist.is_initialized():
        dist.barrier()

