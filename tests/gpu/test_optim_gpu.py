"""StreamedAdamW with its state on the host (trainer.optimizer_offload) on a GPU: the copies in and out overlap
the math on two CUDA streams (colo.trainer.optim); the result must be the one-stream loop's to the bit."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float32"])
def test_streamed_host_step_equals_the_serial_loop(state_dtype: str) -> None:
    from tools.experiments.optimizer import bit_identical, parse_args

    args = parse_args(["--preset", "qwen3-30b-a3b-L2", "--device", "cuda", "--state-dtype", state_dtype])
    assert bit_identical(args, torch.device("cuda"), limit=256 << 20)
