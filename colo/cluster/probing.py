"""The functional check of a sync, driven over the cluster (colo.sync.probe holds the sequences and the measure).

    synced, policy = colo.loop.sync_all(cluster, seqs)      # the trainers push, then score seqs
    check_probe(cluster, cfg, seqs, policy, synced)          # every engine scores seqs; a mismatch raises

The trainers score before they offload (the sync call itself), the engines once they can generate (colocated:
after their KV cache wakes), so the check costs one forward of a few dozen tokens on each side and no extra
onload. Every engine is compared with trainer rank 0's scores: the ranks hold one policy.
"""
from __future__ import annotations

from colo.cluster.actors import Cluster
from colo.config import ColoConfig
from colo.sync.probe import TOLERANCE, ProbeScores, check, engine_scores, first_difference, tolerance_key


class SyncMismatch(RuntimeError):
    """After a sync whose bytes all arrived, an engine computes other log-probs than the trainer."""


def check_probe(c: Cluster, cfg: ColoConfig, seqs: list[list[int]] | None, policy: dict | None,
                synced: dict) -> None:
    """Every engine scores the sequences the trainers scored (nothing when `seqs` is None: the sync was not picked);
    a disagreement beyond model.dtype's tolerance (FP8's with rollout.quantization=fp8) raises SyncMismatch naming the
    engine and the first sublayer whose output differs. Updates `synced` with sync/probe and sync/probe_err (and
    sync/verified false on a mismatch)."""
    if seqs is None:
        return
    if policy is None:
        raise RuntimeError("the trainers' sync report holds no probe scores: a trainer built before the functional "
                           "check (colo.sync.probe) existed?")
    mine = ProbeScores(**policy["scores"])
    kind = tolerance_key(cfg.model.dtype, cfg.rollout.quantization)  # an FP8 engine: FP8's rounding is allowed
    tol = TOLERANCE.get(kind, TOLERANCE["bfloat16"])
    worst = 0.0
    for e, got in enumerate(c.engine_group.probe(seqs)):
        res = check(mine, engine_scores(got["tables"]), kind)
        worst = max(worst, res.err)
        if not res.ok:
            trace = c.engine_group.probe(seqs, trace=True, only=e)[0]["trace"]
            where = first_difference(policy["trace"], trace)
            synced["sync/verified"] = False
            raise SyncMismatch(
                f"engine {e} computes other log-probs than the trainer right after a weight sync whose every byte "
                f"arrived (median relative error {res.err:.3f} over {res.positions} positions, tolerance {tol} for "
                f"{kind}): a weight vLLM derives at load was not refreshed; "
                + (f"the first sublayer that differs: {where}" if where else
                   "no sublayer trace names the layer (only an eager engine can be traced: rollout.enforce_eager=true)")
                + f"; please report it with {cfg.run.dir}/error.log, your CPU or GPU model and the output of "
                f"`.venv/bin/python -m colo.bench.sync --model {cfg.model.path} --ranks 2 --check`")
    synced.update({"sync/probe": 1.0, "sync/probe_err": worst})
