"""python -m tools.experiments.buildbatch on CPU: the driver's batch building timed with torch's threads and with
one, idle and with a core kept busy, on samples shaped like a step's (R3 ids included); the build it times is colo.loop's."""
from __future__ import annotations

import json

import torch


def test_bench_batch_times_every_variant_and_restores_the_threads(capsys) -> None:
    from tools.experiments.buildbatch import main

    threads = torch.get_num_threads()
    assert main(["--samples", "8", "--max-tokens", "256", "--prompt-len", "16", "--reps", "1", "--busy", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["seconds"]) == {f"idle_{threads}_threads", "idle_1_thread", f"busy_{threads}_threads",
                                   "busy_1_thread"}
    assert all(v > 0 for v in out["seconds"].values()) and out["over_one_thread"]["busy_1_thread"] == 1.0
    assert out["samples"] == 8 and out["tokens"] > 8 * 16 and torch.get_num_threads() == threads
