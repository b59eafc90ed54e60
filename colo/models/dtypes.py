"""Dtype names as the config, the sync's wire format and safetensors headers spell them -> torch dtypes.

One table for the whole package: the config says "bfloat16", the weight sync's pieces carry the same
names (plain data over Ray and vLLM's RPC), and safetensors headers use their own codes ("BF16").
"""
from __future__ import annotations

import torch

SAFETENSORS = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
               "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def torch_dtype(name: str) -> torch.dtype:
    """torch.<name>, refusing anything that is not a dtype ("float32" -> torch.float32)."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    """The inverse: torch.bfloat16 -> "bfloat16"."""
    return str(dt).removeprefix("torch.")
