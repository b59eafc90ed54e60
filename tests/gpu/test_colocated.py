"""One GPU: a TrainWorker (FSDP2 world 1, nccl) and a RolloutEngine (vLLM) share it in one placement group.

    bash tests/gpu/run.sh                                     # what a GPU host runs (all GPU tests + bench)
    PYTHONPATH=. python -m pytest tests/gpu/test_colocated.py -x -q    (~2-3 min on one H100/H200)

The oracle is vLLM itself: weights perturbed in the trainer and pushed over CUDA IPC must give the same
greedy tokens as a fresh engine that loads the trainer's export_hf checkpoint from disk. Sleep levels 1
and 2 must give back >= 90% of the memory the engine took at start (device-wide torch.cuda.mem_get_info,
read from the trainer process on the same GPU), and generation must be intact after waking.
Tests run in file order and share one engine (module fixture); -x stops at the first failure.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from gpu_helpers import LOGPROB_ATOL, PERTURB_SCALE, free_port, greedy, gpu_config, stop_engines, gpu_trainer

pytestmark = pytest.mark.gpu
FREED_MIN = 0.90  # share of the engine's start-up memory a sleep must give back


def start_trainers(cfg, pgs: list) -> tuple[list, list[dict]]:
    from colo.config import to_dict
    from colo.cluster.placement import scheduling

    cls, d, port = ray.remote(gpu_trainer()), to_dict(cfg), free_port()
    trainers = [cls.options(num_gpus=cfg.placement.train_gpu_fraction, num_cpus=1,
                            scheduling_strategy=scheduling(pg)).remote(d, r, len(pgs), "127.0.0.1", port)
                for r, pg in enumerate(pgs)]
    return trainers, ray.get([t.setup.remote() for t in trainers])


def start_engines(cfg, pgs: list, setups: list[dict]) -> tuple[list, list[dict]]:
    """The engines beside the trainers already started there (`setups`: their setup() reports), then the product's
    rank and device checks (check_alignment). Here alone the actors start in two stages, not together as
    colo.cluster.actors.start_cluster (gpu_helpers.gpu_cluster) starts them: the test measures what the engine alone
    takes of the GPU."""
    from colo.cluster.actors import check_alignment
    from colo.config import to_dict
    from colo.cluster.placement import scheduling
    from colo.rollout.engine import RolloutEngine

    d, port = to_dict(cfg), free_port()
    engines = [RolloutEngine.options(num_gpus=0, num_cpus=0, scheduling_strategy=scheduling(pg))
               .remote(d, r, len(pgs), port) for r, pg in enumerate(pgs)]
    readies = ray.get([e.ready.remote() for e in engines])
    check_alignment(setups, readies, colocated=True)
    return engines, readies


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from colo.models.tiny import make_tiny_model
    from colo.cluster.placement import create_placement, init_ray, plan_placement, remove_placement

    root = tmp_path_factory.mktemp("colo-gpu")
    model = make_tiny_model(root / "tiny", "tiny", 0)
    cfg = gpu_config(str(model), num_gpus=1)
    plan = plan_placement(cfg)
    init_ray(plan)
    pgs = create_placement(plan)
    engines: list = []
    try:
        trainers, setups = start_trainers(cfg, pgs)
        free_before = ray.get(trainers[0].gpu_free.remote())  # trainer up, engine not yet
        engines, readies = start_engines(cfg, pgs, setups)
        free_awake = ray.get(trainers[0].gpu_free.remote())
        state = {"cfg": cfg, "pgs": pgs, "trainer": trainers[0], "engine": engines[0], "setup": setups[0],
                 "ready": readies[0], "engine_bytes": free_before - free_awake, "root": root}
        print(f"\n[gpu] engine start {readies[0]['start_s']:.1f} s, took {state['engine_bytes'] / 2**30:.2f} GiB")
        yield state
    finally:
        stop_engines(engines)
        for e in engines:
            ray.kill(e)
        remove_placement(pgs)
        ray.shutdown()


def test_colocated_on_one_gpu(pair):
    assert pair["setup"]["device"].startswith("cuda")
    assert pair["ready"]["device_uuid"] == pair["setup"]["device_uuid"], "CUDA IPC needs one GPU"
    assert pair["engine_bytes"] > 2**30, "the engine should hold its KV cache (gpu_memory_utilization)"


def test_sync_over_cuda_ipc_changes_generation(pair):
    trainer, engine = pair["trainer"], pair["engine"]
    before = greedy([engine])[0]
    assert ray.get(trainer.perturb_weights.remote(1, PERTURB_SCALE)) > 0
    rep = ray.get(trainer.sync_weights.remote([engine]))
    print(f"\n[gpu] sync (first) {rep['seconds'] * 1e3:.1f} ms, {rep['bytes']} bytes, {rep['tensors']} pieces")
    assert rep["verified"], rep["errors"]
    assert rep["bytes"] == rep["loaded_bytes"] > 0
    rep2 = ray.get(trainer.sync_weights.remote([engine]))  # steady state: plan and IPC handles reused
    print(f"[gpu] sync (steady) {rep2['seconds'] * 1e3:.1f} ms")
    assert rep2["verified"] and rep2["bytes"] == rep["bytes"]
    synced = greedy([engine])[0]
    assert [t for t, _ in synced] != [t for t, _ in before], "perturbation invisible: the test could not fail"
    pair["synced"] = synced


def _sleep_and_measure(pair: dict, level: int) -> float:
    trainer, engine = pair["trainer"], pair["engine"]
    awake = ray.get(trainer.gpu_free.remote())
    secs = ray.get(engine.sleep.remote(level))
    asleep = ray.get(trainer.gpu_free.remote())
    share = (asleep - awake) / pair["engine_bytes"]
    print(f"\n[gpu] sleep level {level}: {secs:.3f} s, freed {(asleep - awake) / 2**30:.2f} GiB "
          f"of {pair['engine_bytes'] / 2**30:.2f} GiB ({share:.1%})")
    pair.setdefault("sleep", {})[level] = {"seconds": secs, "freed_bytes": asleep - awake, "share": share}
    return share


def test_sleep_level1_frees_memory_and_wakes_intact(pair):
    assert "synced" in pair
    share = _sleep_and_measure(pair, 1)
    assert share >= FREED_MIN
    t = ray.get(pair["engine"].wake_up.remote(None))
    print(f"[gpu] wake (level 1) {t:.3f} s")
    assert [x for x, _ in greedy([pair["engine"]])[0]] == [x for x, _ in pair["synced"]]


def test_sleep_level2_then_sync_restores_generation(pair):
    """Level 2 drops the weights: the RL order wake(weights) -> sync -> wake(kv_cache, scheduling)."""
    trainer, engine = pair["trainer"], pair["engine"]
    share = _sleep_and_measure(pair, 2)
    assert share >= FREED_MIN
    tw = ray.get(engine.wake_up.remote(["weights"]))
    rep = ray.get(trainer.sync_weights.remote([engine]))  # the same IPC buffers, opened before the sleep
    tk = ray.get(engine.wake_up.remote(["kv_cache", "scheduling"]))
    print(f"[gpu] wake weights {tw:.3f} s, sync {rep['seconds'] * 1e3:.1f} ms, wake kv {tk:.3f} s")
    assert rep["verified"], rep["errors"]
    got = greedy([engine])[0]
    assert [x for x, _ in got] == [x for x, _ in pair["synced"]]


def test_synced_engine_equals_engine_loaded_from_disk(pair):
    """export_hf -> a fresh engine (own, smaller GPU share in the same bundle) loads it -> same greedy."""
    from colo.config import to_dict
    from colo.cluster.placement import scheduling
    from colo.rollout.engine import RolloutEngine

    assert "synced" in pair
    export = Path(pair["root"]) / "export"
    ray.get(pair["trainer"].export_hf.remote(str(export)))
    d = to_dict(pair["cfg"])
    # 0.4 trainer + 0.4 engine + 0.15 fresh <= 1 bundle GPU; 0.15 of an H100 is ~12 GiB, plenty for tiny
    d["model"].update(path=str(export), dummy_weights=False)
    d["placement"]["vllm_gpu_fraction"] = 0.15
    fresh = RolloutEngine.options(num_gpus=0, num_cpus=0, scheduling_strategy=scheduling(pair["pgs"][0])).remote(
        d, 0, 1, free_port())
    try:
        want = greedy([fresh])[0]
    finally:
        stop_engines([fresh])
        ray.kill(fresh)
    got = pair["synced"]
    assert [t for t, _ in got] == [t for t, _ in want]
    diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[1], w[1]))
    print(f"\n[gpu] synced vs disk-loaded: tokens equal, max |dlogprob| {diff:.4f}")
    assert diff <= LOGPROB_ATOL
