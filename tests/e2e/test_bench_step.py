"""python -m colo.bench.step on CPU with the tiny preset: real RL steps at imposed long-tail lengths, packed and
padded in one run (bare --compare: trainer.packing=true,false); the JSON line carries the figures the benchmark promises, and packing measurably
removes the padding the padded path computes on."""
from __future__ import annotations

import json

import pytest
from conftest import run_cli

KEYS = ("tokens_per_s_per_gpu", "generated_tokens_per_s", "train_mfu", "compute_mfu", "padding_fraction", "phases",
        "logprob_peak_gb", "logprob_pass_gb", "alloc_retries", "update_reserved_gb")


def test_bench_step_compare_on_cpu(tmp_path) -> None:
    res = run_cli("--preset", "tiny", "--device", "cpu", "--steps", "1",
                  "--warmup", "1", "--prompts", "2", "--n", "4", "--prompt-len", "8", "--max-tokens", "48",
                  "--compare", "--profile", "--json", "--workdir", str(tmp_path), timeout=900, module="colo.bench.step")
    assert res.returncode == 0, res.stderr[-3000:]
    # --profile: the warm-up step's train phase as an operator table, once per layout (rank 0's matmuls in it)
    assert res.stderr.count("profile of step 0's train phase") == 2 and "aten::mm" in res.stderr
    out = json.loads([x for x in res.stdout.splitlines() if x.startswith("{")][-1])
    assert out["compare"] == {"key": "trainer.packing", "values": [True, False]}
    for layout in (out, out["versus"]):
        for key in KEYS:
            assert key in layout, key
        assert layout["train_mfu"] is None and layout["logprob_peak_gb"] is None  # CPU: no peak FLOP/s, no allocator
        assert layout["alloc_retries"] == 0 and layout["update_reserved_gb"] is None
        assert layout["tokens_per_s_per_gpu"] > 0 and layout["generated_tokens_per_s"] > 0
        phases = layout["phases"]
        assert set(phases) >= {"rollout", "reward", "sleep", "train", "wait", "sync", "offload", "wake", "step",
                               "onload", "logprob", "update", "optim", "train_call", "entry_wait", "batch", "batch_cpu",
                               "driver_gc"}
        assert 0 < phases["logprob"] + phases["update"] + phases["optim"] <= phases["train_call"]
        assert 0 <= phases["entry_wait"] <= phases["train_call"] - phases["update"]
        assert 0 <= phases["driver_gc"] < phases["step"]
        assert 0 < phases["batch"] and phases["batch"] + phases["train_call"] + phases["onload"] <= phases["train"]
        assert 0 < phases["batch_cpu"] <= phases["batch"] + 0.01
        # the long tail: lengths drawn per sample, median a quarter of max_tokens; most stop before the limit
        assert 4 < layout["response_len_mean"] < 40 and layout["truncated_frac"] < 0.5
        # the bench's reward varies (colo.bench.stepreward): every step trains
        assert all(m["grad_norm"] > 0 for m in layout["train_metrics"]), layout["train_metrics"]
    padded = out["versus"]
    assert out["packing"] is True and out["tokens_per_step"] == padded["tokens_per_step"]  # same workload
    assert out["padding_fraction"] <= 0.05
    assert padded["padding_fraction"] > 0.2  # rows padded to the longest of a long tail
    # the ratios are those of the two variants' own figures, each way round as documented (packed over padded)
    sp = out["speedup"]
    assert sp["tokens_per_s_per_gpu"] == out["tokens_per_s_per_gpu"] / padded["tokens_per_s_per_gpu"]
    assert sp["train"] == padded["phases"]["train"] / out["phases"]["train"]
    assert sp["step"] == padded["phases"]["step"] / out["phases"]["step"]


def test_bench_step_compare_async(tmp_path) -> None:
    """`python -m colo.bench.step --compare loop.mode=async,sync --repeats 2`: the async step at imposed long-tail
    lengths and sync mode on the same cluster, twice in turn (A B, B A), with the ratio per repeat and its spread; a
    JSON line after each repeat, which colo.bench.combine reads. With per-prompt lengths (the iid ones are the other
    test's), so the per-prompt draw runs on resumed samples too (colo.bench.engines.LengthEngine._sampling_params).
    Every step trains (the reward varies: non-zero grad_norm), and with one update per step no
    forward-only pass gives the old log-probs in either mode (trainer.old_logprobs=auto, resolved to update)."""
    res = run_cli("--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "1", "--repeats", "2",
                  "--versus-warmup", "0", "--prompts", "2", "--n", "4", "--prompt-len", "8", "--max-tokens", "48",
                  "--json", "--workdir", str(tmp_path), "--compare", "loop.mode=async,sync",
                  "--lengths", "per-prompt", "rollout.oversample=2", timeout=900, module="colo.bench.step")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [x for x in res.stdout.splitlines() if x.startswith("{")]
    assert [json.loads(x)["repeats_done"] for x in lines] == [1, 2]  # one line per repeat: a cut-off call keeps some
    out = json.loads(lines[-1])
    print(out)
    assert [(b["variant"], b["repeat"], b["steps"]) for b in out["blocks"]] == [
        ("async", 0, 1), ("sync", 0, 1), ("sync", 1, 1), ("async", 1, 1)]  # A B, B A: a drift hits both alike
    st = out["stats"]
    assert st["pairs"] == 2 and st["ratio"]["n"] == 2
    assert st["ratio"]["min"] <= st["ratio"]["median"] <= st["ratio"]["max"]
    assert st["ratio_of_totals"] == pytest.approx(out["speedup"]["tokens_per_s_per_gpu"])
    for layout in (out, out["versus"]):
        assert all(m["grad_norm"] > 0 for m in layout["train_metrics"]), layout["train_metrics"]
        assert layout["phases"]["logprob"] == 0.0  # no forward-only pass for the old log-probs, async or not
    assert "old log-prob pass 0" in res.stderr and "old log-prob pass 1" not in res.stderr
    f = tmp_path / "async.json"
    f.write_text(res.stdout)
    combined = run_cli(str(f), module="colo.bench.combine", timeout=60)
    assert combined.returncode == 0, combined.stderr
    assert "loop.mode: async over sync: median" in combined.stdout and "per call (1)" in combined.stdout
    assert out["tokens_per_s_per_gpu"] > 0 and out["overrides"] == ["rollout.oversample=2"]
    assert out["lengths"]["model"] == "per-prompt" and out["lengths"]["rho"] > 0
    sync = out["versus"]
    assert out["mode"] == "async" and "async" not in sync and sync["tokens_per_s_per_gpu"] > 0
    assert out["speedup"]["tokens_per_s_per_gpu"] == out["tokens_per_s_per_gpu"] / sync["tokens_per_s_per_gpu"]
    a = out["async"]
    assert a["staleness_max"] <= 1 and 0 <= a["offpolicy_frac"] <= 1 and a["completed"] > 0
    assert a["carried"] > 0, "a long tail with twice the prompts in flight must leave samples unfinished"
    assert a["resumed"] > 0, "no carried sample was resumed: the per-prompt draw on resumed requests did not run"
