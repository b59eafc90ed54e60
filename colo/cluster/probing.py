"""The functional check of a sync, driven over the cluster (colo.sync.probe and colo.sync.layercheck hold the measures).

    synced, policy = colo.loop.sync_all(cluster, probe)     # the trainers push, then score and record the probe
    check_probe(cluster, cfg, probe, policy, synced)         # every engine does the same; a mismatch raises

The trainers run the probe before they offload (the sync call itself), the engines once they can generate
(colocated: after their KV cache wakes), so the check costs two short forwards on each side and no extra onload.
Every engine is compared with trainer rank 0's records: the ranks hold one policy.
"""
from __future__ import annotations

from colo.cluster.actors import Cluster
from colo.config import ColoConfig
from colo.sync import layercheck
from colo.sync.probe import FEW, FEW_TOLERANCE, TOLERANCE, ProbeScores, check, engine_scores, tolerance_key


class SyncMismatch(RuntimeError):
    """After a sync whose bytes all arrived, an engine computes other outputs than the trainer."""


def check_probe(c: Cluster, cfg: ColoConfig, probe: dict | None, policy: dict | None, synced: dict) -> None:
    """Every engine runs `probe` as the trainers did (nothing when it is None: the sync was not picked). Two
    comparisons per engine, each against model.dtype's tolerances (FP8's with rollout.quantization=fp8): every layer
    on fixed inputs (colo.sync.layercheck) and the end-to-end log-probs (colo.sync.probe). A disagreement raises
    SyncMismatch naming the engine and every module (and expert) that differs. Updates `synced` with sync/probe,
    sync/probe_err (the worst engine's end-to-end median), sync/layer_err (its worst layer site), sync/layer_decode
    (1: every engine's decode step was checked too) and, on a mismatch, sync/verified false."""
    if probe is None:
        return
    if policy is None or "layers" not in policy:
        raise RuntimeError("the trainers' sync report holds no probe records: a trainer built before the functional "
                           "check (colo.sync.probe, colo.sync.layercheck) existed?")
    mine = ProbeScores(**policy["scores"])
    kind = tolerance_key(cfg.model.dtype, cfg.rollout.quantization)  # an FP8 engine: FP8's rounding is allowed
    worst, worst_layer, decode, bad = 0.0, 0.0, 1.0, []
    for e, got in enumerate(c.engine_group.probe(probe)):
        res = check(mine, engine_scores(got["tables"]), kind)
        layers = layercheck.compare(policy["layers"], got["layers"], layercheck.TOLERANCE.get(kind, 0.05))
        worst, worst_layer = max(worst, res.err), max(worst_layer, layers.err)
        decode = min(decode, 0.0 if layers.notes else 1.0)
        if not (res.ok and layers.ok):
            bad.append((e, res, layers))
    # sync/layer_decode 0: an engine replays CUDA graphs for decode, whose kernels the layer check then cannot see
    synced.update({"sync/probe": 1.0, "sync/probe_err": worst, "sync/layer_err": worst_layer,
                   "sync/layer_decode": decode})
    if not bad:
        return
    synced["sync/verified"] = False
    e, res, layers = bad[0]
    tol, few = TOLERANCE.get(kind, TOLERANCE["bfloat16"]), FEW_TOLERANCE.get(kind, FEW_TOLERANCE["bfloat16"])
    where = layers.summary() or "every layer agrees on fixed inputs"
    others = f" (engines {', '.join(str(b[0]) for b in bad[1:])} too)" if len(bad) > 1 else ""
    raise SyncMismatch(
        f"engine {e}{others} computes other outputs than the trainer right after a weight sync whose every byte "
        f"arrived: {where} (layer tolerance {layercheck.TOLERANCE.get(kind, 0.05):g} for {kind}); end to end over "
        f"{res.positions} positions the median relative error is {res.err:.3g} (tolerance {tol:g}) and the "
        f"{FEW}th worst {res.few:.3g} (tolerance {few:g}); a weight the engine holds or derives at load is not the "
        f"trainer's; please report it with {cfg.run.dir}/error.log, your CPU or GPU model and the output of "
        f"`.venv/bin/python -m colo.bench.sync --model {cfg.model.path} --ranks 2 --check`")
