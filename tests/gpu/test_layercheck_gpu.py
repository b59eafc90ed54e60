"""The functional check on a GPU (colo.sync.layercheck, colo.sync.probe): its noise, a compiled engine, its cost.

    bash tests/gpu/run.sh 540                   # STEPS="layers" for this one alone
    PYTHONPATH=. python -m pytest tests/gpu/test_layercheck_gpu.py -x -q -s      (~6-8 min on one H100)

One trainer and one colocated vLLM engine per case, bf16:
1. the tiny preset, eager: a correct sync passes both halves of the check, prefill and decode sites alike; a sync
   whose trainer moved and whose engine kept the old weights fails, naming sites (the check can fail);
2. the tiny preset, compiled with CUDA graphs (rollout.enforce_eager=false, vLLM's default): the prefill's hooks run
   (colo bypasses torch.compile for the check's forward), the decode step is noted as unchecked (sync/layer_decode 0);
3. qwen3-30b-a3b-L4 (4 layers of the real width, 128 experts, random weights): the noise of a correct sync at
   that width, and the check's seconds on each side, the first time and again (warm: what a later check costs).
`[gpu] layers` lines carry the figures for docs/benchmarks.md: each case's worst site, its end-to-end median and
4th-worst position, against their tolerances, and the seconds.
"""
from __future__ import annotations

import time

import pytest
import ray
import torch

from gpu_helpers import PERTURB_SCALE, gpu_cluster, gpu_config

pytestmark = pytest.mark.gpu

CASES = {"tiny eager": ("tiny", True), "tiny compiled": ("tiny", False), "L4 eager": ("qwen3-30b-a3b-L4", True)}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory: pytest.TempPathFactory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from colo.models.tiny import WITH_WEIGHTS, make_tiny_model

    preset, eager = CASES[request.param]
    model = make_tiny_model(tmp_path_factory.mktemp("colo-gpu") / preset, preset, 0)
    cfg = gpu_config(str(model), num_gpus=1, rollout__enforce_eager=eager, model__dummy_weights=preset not in
                     WITH_WEIGHTS, placement__vllm_gpu_fraction=0.3)
    with gpu_cluster(cfg) as c:
        yield {"case": request.param, "cfg": cfg, "trainer": c.trainers[0], "engine": c.engines[0]}


def _check(pair, probe: dict, rep: dict):
    from colo.sync import layercheck
    from colo.sync.probe import ProbeScores, check, engine_scores

    t0 = time.perf_counter()
    got = ray.get(pair["engine"].probe.remote(probe))
    engine_s = time.perf_counter() - t0
    res = check(ProbeScores(**rep["probe"]["scores"]), engine_scores(got["tables"]), "bfloat16")
    layers = layercheck.compare(rep["probe"]["layers"], got["layers"], layercheck.TOLERANCE["bfloat16"])
    return res, layers, engine_s


def test_a_correct_sync_passes_and_a_stale_engine_fails(pair) -> None:
    from colo.sync import layercheck
    from colo.sync.probe import FEW_TOLERANCE, TOLERANCE, ProbeSchedule

    trainer = pair["trainer"]
    probe = ProbeSchedule(512, pair["cfg"].rollout.max_model_len, 1).next()
    ray.get(trainer.sync_weights.remote([pair["engine"]]))  # warm: the plan, buffers, the first load
    t0 = time.perf_counter()
    ray.get(trainer.sync_weights.remote([pair["engine"]]))
    sync_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rep = ray.get(trainer.sync_weights.remote([pair["engine"]], probe))
    trainer_s = time.perf_counter() - t0 - sync_s  # the policy's two probe forwards, inside its sync call
    assert rep["verified"] and rep["digest_checked"], rep["errors"][:5]
    res, layers, engine_s = _check(pair, probe, rep)
    t0 = time.perf_counter()  # the same check again, warm: what each later check (1 sync in 10) costs
    again = ray.get(trainer.sync_weights.remote([pair["engine"]], probe))
    trainer_again_s = time.perf_counter() - t0 - sync_s
    *_, engine_again_s = _check(pair, probe, again)
    print(f"\n[gpu] layers {pair['case']}: worst site {layers.err:.4f} (tolerance {layercheck.TOLERANCE['bfloat16']}), "
          f"end to end median {res.err:.4f} (tolerance {TOLERANCE['bfloat16']}), 4th-worst position {res.few:.4f} "
          f"(tolerance {FEW_TOLERANCE['bfloat16']}); check {trainer_s:.2f} s trainer + {engine_s:.2f} s engine, again "
          f"{trainer_again_s:.2f} + {engine_again_s:.2f} s, a sync {sync_s:.3f} s; notes {layers.notes}")
    assert res.ok and layers.ok, (res.err, res.few, layers.summary())
    compiled = not pair["cfg"].rollout.enforce_eager
    assert bool(layers.notes) == compiled, layers.notes  # a graph-replayed decode is named, never silently passed
    # the engine keeps the old weights while the trainer moves: the check must fail, naming sites
    assert ray.get(trainer.perturb_weights.remote(3, PERTURB_SCALE)) > 0
    moved = ray.get(trainer._probe.remote(probe))
    _, stale, _ = _check(pair, probe, {"probe": moved})
    assert not stale.ok and stale.failed, "a stale engine passed the layer check"
    print(f"[gpu] layers {pair['case']} stale engine: {stale.summary()[:300]}")
    ray.get(trainer.sync_weights.remote([pair["engine"]]))  # the engine catches up
