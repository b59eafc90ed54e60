"""colo's fused-MoE tile files (colo.rollout.moe_tuning): what they are copies of, and the folder vLLM is given only
where it has no file of its own for the engine's GPU and shape (device names given, no GPU needed).

    .venv/bin/python -m pytest tests/unit/test_moe_tuning.py -q
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from colo.config import load_config
from colo.models.tiny import PRESETS
from colo.rollout.moe_tuning import (FOLDER, SOURCES, MoeLookup, device_file_name, moe_config_env, tuned_folder,
                                     vllm_configs_dir)

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
QWEN3_30B = PRESETS["qwen3-30b-a3b"]


def _vllm() -> Path:
    d = vllm_configs_dir()
    if d is None or not d.is_dir():
        pytest.skip("no vLLM installed")
    return d


def test_colos_files_are_the_named_vllm_files() -> None:
    """Each shipped file is a byte copy of the vLLM file its table names (a vLLM whose H200 tuning changed shows here),
    and vLLM 0.32 has no file of that name itself (else the copy would be dead weight)."""
    vllm = _vllm()
    assert sorted(p.name for p in FOLDER.glob("*.json")) == sorted(SOURCES)
    for ours, theirs in SOURCES.items():
        assert (FOLDER / ours).read_bytes() == (vllm / theirs).read_bytes(), ours
        assert not (vllm / ours).exists(), f"vLLM ships {ours} now: drop colo's copy"
        assert all(int(k) > 0 for k in json.loads((FOLDER / ours).read_text())), ours  # vLLM reads int batch keys


def test_file_names_are_vllms() -> None:
    """The names vLLM looks up (fused_moe.get_config_file_name) for Qwen3-30B-A3B on one GPU: the H200's exist in
    vLLM's folder under exactly these names, in bf16 and block FP8; an H200 variant reads the H200's."""
    vllm = _vllm()
    for quantized in (False, True):
        lookup = MoeLookup.of(QWEN3_30B, quantized, ep=1, tp=1)
        assert (lookup.experts, lookup.intermediate) == (128, 768)
        assert (vllm / lookup.file_name(H200)).is_file(), lookup.file_name(H200)
    assert device_file_name(H100) == "NVIDIA_H100_80GB_HBM3"
    assert device_file_name("NVIDIA H200 NVL") == device_file_name("NVIDIA H200") == "NVIDIA_H200"
    assert MoeLookup.of(QWEN3_30B, True, ep=2, tp=1).file_name(H100) == \
        "E=64,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128,128].json"
    assert MoeLookup.of({"hidden_size": 64, "num_hidden_layers": 2}, False, 1, 1) is None  # dense: no MoE layers


def test_colos_folder_only_where_vllm_has_no_file(tmp_path: Path) -> None:
    vllm = _vllm()
    for quantized in (False, True):
        lookup = MoeLookup.of(QWEN3_30B, quantized, ep=1, tp=1)
        folder, why = tuned_folder(lookup, H100, vllm)  # vLLM 0.32 has none for the H100
        assert folder == FOLDER and "colo's" in why and "NVIDIA_H200" in why
        assert tuned_folder(lookup, H200, vllm) == (None, f"vLLM's own {lookup.file_name(H200)}")
        assert tuned_folder(lookup, "NVIDIA Fake GPU", vllm)[0] is None  # neither has one: vLLM's defaults
        later = tmp_path / f"vllm-{quantized}"  # a vLLM that ships the H100's own tuning wins over the copy
        later.mkdir()
        shutil.copy(FOLDER / lookup.file_name(H100), later / lookup.file_name(H100))
        assert tuned_folder(lookup, H100, later) == (None, f"vLLM's own {lookup.file_name(H100)}")
    ep2 = MoeLookup.of(QWEN3_30B, True, ep=2, tp=1)  # 64 local experts: no file anywhere
    assert tuned_folder(ep2, H100, vllm)[0] is None


def test_the_setting_and_a_users_folder() -> None:
    """rollout.moe_configs=vllm never sets the variable; a VLLM_TUNED_CONFIG_FOLDER set before colo stays (colo's own,
    left by an engine this process started before, is decided again)."""
    vllm = _vllm()
    lookup = MoeLookup.of(QWEN3_30B, True, ep=1, tp=1)
    colo, plain = load_config(None, []), load_config(None, ["rollout.moe_configs=vllm"])
    assert moe_config_env(colo, lookup, H100, vllm_dir=vllm)[0] == {"VLLM_TUNED_CONFIG_FOLDER": str(FOLDER)}
    assert moe_config_env(colo, lookup, H200, vllm_dir=vllm)[0] == {}
    assert moe_config_env(plain, lookup, H100, vllm_dir=vllm) == (
        {}, "vLLM's files or defaults (rollout.moe_configs=vllm)")
    env, why = moe_config_env(colo, lookup, H100, "/opt/tiles", vllm_dir=vllm)
    assert env == {} and "/opt/tiles" in why
    mine = moe_config_env(colo, lookup, H100, str(FOLDER), vllm_dir=vllm)[0]
    assert mine == {"VLLM_TUNED_CONFIG_FOLDER": str(FOLDER)}
