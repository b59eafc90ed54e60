"""python -m colo.bench.rollout on CPU with the tiny preset: vLLM alone (LLM.generate) and colo's colocated rollout
phase decode the same requests, and the JSON line says how they compare and where the difference goes."""
from __future__ import annotations

import json
import math

from conftest import run_cli


def test_bench_rollout_against_vllm_alone_on_cpu(tmp_path) -> None:
    res = run_cli("--preset", "tiny", "--device", "cpu", "--prompts", "2", "--n", "2", "--prompt-len", "8",
                  "--max-tokens", "12", "--reps", "1", "--json", "--workdir", str(tmp_path), timeout=900,
                  module="colo.bench.rollout")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads([x for x in res.stdout.splitlines() if x.startswith("{")][-1])
    vllm, colo = out["vllm"], out["colocated"]
    # the same requests: every variant of either side generated the tokens the lengths impose (each side checks
    # per sample that they are the requests' lengths)
    tokens = {r["output_tokens"] for side in (vllm, colo) for r in side.values() if isinstance(r, dict) and
              "output_tokens" in r}
    assert len(tokens) == 1 and tokens.pop() > 4
    assert out["vs_vllm_best"] == colo["colo"]["tokens_per_s"] / vllm["plain"]["tokens_per_s"] > 0
    where = out["where"]
    assert set(where) == {"logprobs", "detokenize", "seeds", "params", "scheduling", "engine", "routing", "wake_sleep",
                          "rest"}
    assert math.isclose(where["params"] * where["scheduling"] * where["engine"], out["vs_vllm_best"], rel_tol=1e-9)
    assert math.isclose(where["routing"] * where["wake_sleep"] * where["rest"], where["engine"], rel_tol=1e-9)
    assert colo["sync_verified"] is True and all(v > 0 for v in where.values())
    assert colo["routing_capture"] == "prefill"  # CPU's capture: every routing call's samples had all their rows
    paired = out["vs_vllm_per_call"]  # the same call index on both sides: the same requests
    assert paired["n"] == len(colo["colo"]["all_tokens_per_s"]) == len(vllm["plain"]["all_tokens_per_s"]) == 1
    assert math.isclose(paired["median"], colo["colo"]["all_tokens_per_s"][0] / vllm["plain"]["all_tokens_per_s"][0])
    assert out["vs_vllm"] == paired["median"]  # the headline: paired calls, not each side's best


def test_bench_rollout_compares_engine_settings_on_cpu(tmp_path) -> None:
    """--compare KEY=A,B: the phases once per value, each engine built with it (model.dtype here: float32's KV cache
    holds half bf16's tokens in the same rollout.kv_cache_mb), and A over B from the cells' own figures."""
    res = run_cli("--preset", "tiny", "--device", "cpu", "--prompts", "2", "--n", "2", "--prompt-len", "8",
                  "--max-tokens", "12", "--reps", "2", "--phases", "vllm", "--toggles", "none",
                  "--compare", "model.dtype=bfloat16,float32", "--json", "--workdir", str(tmp_path), timeout=900,
                  module="colo.bench.rollout")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads([x for x in res.stdout.splitlines() if x.startswith("{")][-1])
    bf16, fp32 = out["cells"]
    assert (bf16["settings"], fp32["settings"]) == ({"model.dtype": "bfloat16"}, {"model.dtype": "float32"})
    assert bf16["vllm"]["kv_cache_tokens"] == 2 * fp32["vllm"]["kv_cache_tokens"] > 0
    (row,) = out["compare"]["model.dtype"]
    a, b = bf16["vllm"]["plain"], fp32["vllm"]["plain"]
    assert row["at"] == {} and math.isclose(row["ratio_best"], a["tokens_per_s"] / b["tokens_per_s"])
    assert row["per_rep"]["n"] == len(a["all_tokens_per_s"]) == len(b["all_tokens_per_s"]) == 2
    paired = sorted(x / y for x, y in zip(a["all_tokens_per_s"], b["all_tokens_per_s"]))
    assert math.isclose(row["ratio"], row["per_rep"]["median"]) and math.isclose(row["ratio"], sum(paired) / 2)
