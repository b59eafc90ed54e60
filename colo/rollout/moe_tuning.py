"""Tile configs for vLLM's fused-MoE Triton kernel where vLLM ships none for the GPU: colo's copies, handed to vLLM
through VLLM_TUNED_CONFIG_FOLDER.

    lookup = MoeLookup.of(config_json, quantized=True, ep=1, tp=1)   # the file name vLLM will look for, per device
    env, why = moe_config_env(cfg, lookup, "NVIDIA H100 80GB HBM3")  # {"VLLM_TUNED_CONFIG_FOLDER": ...} or {}
    os.environ.update(env)                                           # before vLLM starts (Ray workers copy VLLM_*)

Why: on Hopper vLLM 0.32 runs Qwen3-MoE's experts with its Triton fused-MoE kernel, in bf16 and in block FP8 with
DeepGEMM off (fused_moe/oracle/fp8.py moves TRITON first for block FP8 on sm90 without expert parallelism; with it,
FlashInfer CUTLASS, which colo's GPU bundle leaves out, then DeepGEMM, which colo turns off, then TRITON). The kernel
takes its tiles (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, warps, stages) per batch size from a JSON file named by the local
experts E, the intermediate size N, the device, the dtype and the block (fused_moe.get_config_file_name), looked up
in VLLM_TUNED_CONFIG_FOLDER first, then in vLLM's own configs folder, and falls back to get_default_config. For
Qwen3-30B-A3B on one GPU (E=128, N=768) vLLM 0.32.0 ships both files for the H200 and neither for the H100
(NVIDIA_H100_80GB_HBM3): an H100 runs bf16 and FP8 on the defaults.

colo's files (colo/rollout/moe_configs), byte copies of vLLM 0.32.0's (tests/unit/test_moe_tuning.py checks them
against the installed vLLM's):
    E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3.json
        <- E=128,N=768,device_name=NVIDIA_H200.json
    E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128,128].json
        <- E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json
The H100 SXM and the H200 are one chip (GH100: 132 SMs, 50 MB L2, the same tensor cores, the same Triton code) with
different memory (3.35 against 4.8 TB/s): the H200's tiles are a borrowed tuning, not the H100's own, and what they
buy is measured, not assumed: tests/gpu/run.sh step `moecfg` (colo.bench.rollout, vLLM alone with and without them,
bf16 and FP8).

When (rollout.moe_configs=colo, the default): only where the engine's own lookup (its device, E local experts, N,
dtype, block) finds no file in the installed vLLM, so a vLLM that ships a tuning for the device always wins; a
VLLM_TUNED_CONFIG_FOLDER already in the environment is left as it is. rollout.moe_configs=vllm: never. The variable
also switches vLLM's MoE-LoRA kernels to their own tuned-file lookup (lora/layers/fused_moe.py); colo serves no LoRA
through vLLM (sync.lora=adapter is refused), so that path is not reached.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colo.config import ColoConfig
from colo.models.archs import num_experts

FOLDER = Path(__file__).resolve().parent / "moe_configs"
SOURCES = {"E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3.json": "E=128,N=768,device_name=NVIDIA_H200.json",
           "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128,128].json":
               "E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"}
"""colo's file -> the vLLM 0.32.0 file it copies (module docstring)."""
FP8_BLOCK = (128, 128)  # colo.rollout.quant.BLOCK: the engine's weight_block_size


def vllm_configs_dir() -> Path | None:
    """The installed vLLM's fused-MoE configs folder, found without importing vLLM (None: no vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "model_executor" / "layers" / "fused_moe" / "configs"


def device_file_name(device_name: str) -> str:
    """The device part of vLLM 0.32's file names: get_device_name_as_file_name (whitespace and '/' -> '_'), and every
    H200 variant as NVIDIA_H200 (get_config_file_name)."""
    name = re.sub(r"[\s/]+", "_", device_name)
    return "NVIDIA_H200" if "H200" in name.split("_") else name


@dataclass(frozen=True)
class MoeLookup:
    """What vLLM's fused-MoE kernel looks its tiles up by, short of the device: the engine's local experts and
    intermediate size per partition, the dtype string ("fp8_w8a8" or none for bf16) and the block."""
    experts: int
    intermediate: int
    dtype: str | None
    block: tuple[int, int] | None

    @classmethod
    def of(cls, config_json: dict[str, Any], quantized: bool, ep: int, tp: int) -> MoeLookup | None:
        """The engine's lookup: experts split over `ep` (expert parallelism), the intermediate size over `tp`
        (try_get_optimal_moe_config: E, N = the local w2's (E, H, N)); None for a dense model."""
        experts = num_experts(config_json)
        inter = int(config_json.get("moe_intermediate_size") or 0)
        if not experts or not inter:
            return None
        return cls(experts // max(1, ep), inter // max(1, tp), "fp8_w8a8" if quantized else None,
                   FP8_BLOCK if quantized else None)

    def file_name(self, device_name: str) -> str:
        """The file vLLM looks for on `device_name` (fused_moe.get_config_file_name)."""
        dtype = f",dtype={self.dtype}" if self.dtype else ""
        block = f",block_shape=[{self.block[0]},{self.block[1]}]" if self.block else ""
        return f"E={self.experts},N={self.intermediate},device_name={device_file_name(device_name)}{dtype}{block}.json"


def tuned_folder(lookup: MoeLookup | None, device_name: str, vllm_dir: Path | None, ours: Path = FOLDER
                 ) -> tuple[Path | None, str]:
    """(the folder for VLLM_TUNED_CONFIG_FOLDER, or None; why, in a few words): ours only where vLLM has no file of
    this lookup's name and we do."""
    if lookup is None:
        return None, "no fused MoE layers"
    name = lookup.file_name(device_name)
    if vllm_dir is not None and (vllm_dir / name).is_file():
        return None, f"vLLM's own {name}"
    if (ours / name).is_file():
        return ours, f"colo's {name} (a copy of vLLM's {SOURCES.get(name, '?')})"
    return None, f"vLLM's defaults (no {name} in vLLM or colo)"


def cuda_device_name() -> str:
    """GPU 0's name as vLLM reads it (through NVML where it can: no CUDA context in this process)."""
    from vllm.platforms import current_platform

    return str(current_platform.get_device_name(0))


def moe_config_env(cfg: ColoConfig, lookup: MoeLookup | None, device_name: str, user_folder: str | None = None,
                   vllm_dir: Path | None = None) -> tuple[dict[str, str], str]:
    """({"VLLM_TUNED_CONFIG_FOLDER": colo's folder} or {}, which tiles the engine's MoE layers run and why), for
    rollout.moe_configs on `device_name` (module docstring). user_folder: a VLLM_TUNED_CONFIG_FOLDER already set."""
    if cfg.rollout.moe_configs == "vllm":
        return {}, "vLLM's files or defaults (rollout.moe_configs=vllm)"
    if user_folder and Path(user_folder) != FOLDER:  # ours: set by an engine this process started before
        return {}, f"VLLM_TUNED_CONFIG_FOLDER={user_folder}, set before colo (left as it is)"
    folder, why = tuned_folder(lookup, device_name, vllm_dir if vllm_dir is not None else vllm_configs_dir())
    return ({"VLLM_TUNED_CONFIG_FOLDER": str(folder)} if folder is not None else {}), why
