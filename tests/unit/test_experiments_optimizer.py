"""python -m tools.experiments.optimizer on CPU: its JSON line and the bit-identity check (on CPU both variants run the
same loop; tests/gpu/test_optim_gpu.py checks the overlapped CUDA path against the serial one)."""
from __future__ import annotations

import json


def test_bench_optimizer_prints_every_variant_and_checks_them(capsys) -> None:
    from tools.experiments.optimizer import main

    assert main(["--preset", "tiny", "--device", "cpu", "--steps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bit_identical"] is True and out["params"] > 700_000
    assert out["streamed_s"] > 0 and out["serial_s"] > 0 and out["whole_s"] > 0 and out["ratio"] > 0
    assert set(out["peak_gb"]) == {"streamed", "whole", "serial"} and out["whole_ratio"] > 0
