"""python -m tools.experiments.packed_attention on CPU: each kernel's time against per-sample SDPA on the same
packed rows, and each variant equal to it (outputs and gradients)."""
import json

from tools.experiments.packed_attention import main, row_lengths, parse_args


def test_rows_are_long_tail_and_fill_the_budget() -> None:
    args = parse_args(["--tokens", "8192"])
    rows = [row_lengths(r, args) for r in range(3)]
    assert all(sum(r) == 8192 for r in rows)
    assert rows[0] != rows[1]  # a new set of lengths each rep, as in training
    assert max(max(r) for r in rows) <= 256 + 4096


def test_cpu_run_prints_ratios_and_agreement(capsys) -> None:
    assert main(["--device", "cpu", "--tokens", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                 "--prompt-len", "8", "--max-tokens", "128", "--reps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["ms"]) == {"per_sample_default", "padded"}  # CPU: no cuDNN to leave out, no varlen kernel
    assert out["vs_default"]["per_sample_default"] == 1.0 and out["ms"]["padded"] > 0
    assert out["max_abs_diff"]["padded"] < 1e-4  # the padded layout computes the same attention
    assert out["padded_slots_ratio"] > 1.0
