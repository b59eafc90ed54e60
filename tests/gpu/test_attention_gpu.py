"""colo's packed-row attention on CUDA: the varlen kernel (one flash-attention call per row) and per-sample SDPA
without cuDNN give what per-sample SDPA gives (torch's own backend choice), outputs and gradients, in bf16 with
GQA. Runs on the host's torch alone (no vLLM, no Ray): `python3 -m pytest --noconftest tests/gpu/test_attention_gpu.py`."""
import pytest
import torch

from colo.trainer.attention import packed_attention, per_sample, varlen

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("kernel", ["varlen", "per_sample"])
def test_packed_kernels_equal_per_sample_sdpa(kernel) -> None:
    dev = torch.device("cuda")
    if kernel == "varlen":
        assert packed_attention(dev) == "varlen", "torch.nn.attention.varlen missing: the packed path is per-sample"
    bounds = (0, 300, 301, 1500, 4000, 4096)  # a one-token sample among long ones
    g = torch.Generator(device=dev).manual_seed(0)
    q0 = torch.randn(1, 32, 4096, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k0, v0 = (torch.randn(1, 4, 4096, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    grad = torch.randn(1, 4096, 32, 128, device=dev, dtype=torch.bfloat16, generator=g)
    results = []
    for fn in ((lambda q, k, v: per_sample(q, k, v, bounds, 128 ** -0.5, cudnn=True)),
               (lambda q, k, v: (varlen if kernel == "varlen" else per_sample)(q, k, v, bounds, 128 ** -0.5))):
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
        out = fn(q, k, v)
        assert out.shape == (1, 4096, 32, 128)
        out.backward(grad)
        results.append([out.float(), q.grad.float(), k.grad.float(), v.grad.float()])
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
