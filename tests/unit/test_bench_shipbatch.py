"""python -m colo.bench.shipbatch on CPU: a step's shard reaches a Ray actor as tensors and as colo.algo.batch.to_wire's
numpy arrays, whole either way (the actor counts what from_wire gives it); and the wire format round-trips a batch."""
from __future__ import annotations

import json

import numpy as np
import torch


def test_wire_format_round_trips_a_batch() -> None:
    from colo.algo.batch import from_wire, to_wire

    batch = {"input_ids": torch.arange(6).view(2, 3), "loss_mask": torch.ones(2, 3),
             "routed": torch.zeros(2, 3, 4, dtype=torch.uint8), "bf16": torch.ones(2, dtype=torch.bfloat16),
             "note": "kept"}
    wire = to_wire(batch)
    assert isinstance(wire["input_ids"], np.ndarray) and torch.is_tensor(wire["bf16"]) and wire["note"] == "kept"
    for a in wire.values():  # Ray hands arrays over read-only: from_wire must not keep them
        if isinstance(a, np.ndarray):
            a.setflags(write=False)
    back = from_wire(wire)
    for k, v in batch.items():
        assert back[k] == v if k == "note" else (torch.equal(back[k], v) and back[k].dtype == v.dtype), k
    back["loss_mask"][0, 0] = 5.0  # a tensor of its own: writable, and the wire's array is untouched
    assert wire["loss_mask"][0, 0] == 1.0
    assert all(from_wire(back)[k] is back[k] for k in back)  # tensors pass as they are


def test_bench_ships_a_shard_both_ways(ray_cluster, capsys) -> None:
    from colo.bench.shipbatch import main

    assert main(["--samples", "8", "--max-tokens", "256", "--prompt-len", "16", "--reps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["seconds"]) == {"tensors", "arrays"} and all(v > 0 for v in out["seconds"].values())
    assert out["samples"] == 8 and out["shard_mb"] > 0 and out["tensors_over_arrays"] > 0
