"""The first thing to run on a GPU host after tests/gpu/device-install.sh: does the bundle work at all?

    source /tmp/site/env.sh && python3 tests/gpu/bundle_check.py [OUT_DIR=/tmp/bundle-check]

Prints the versions and where each package was imported from, starts Ray and reads the GPU from a Ray task,
builds colo's tiny Qwen3-MoE checkpoint, and runs vLLM on it: a greedy generate, a level-1 sleep and wake, a
level-2 sleep and wake followed by a reload of the checkpoint's weights (colo's sync path in miniature), and
the greedy tokens again. Ends with `bundle_check: ok` and exits 0, or names the step that failed and exits 1.
Takes ~1-2 minutes on an H100 (most of it vLLM's start).
"""
import json
import os
import sys
import time
import traceback

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/bundle-check"


def step(name: str, fn):
    t0 = time.time()
    try:
        res = fn()
    except Exception:
        traceback.print_exc()
        print(f"bundle_check: FAILED at {name}", flush=True)
        sys.exit(1)
    print(f"[bundle_check] {name}: {time.time() - t0:.1f}s {'' if res is None else res}", flush=True)
    return res


def versions() -> str:
    import ray
    import torch
    import transformers
    import triton
    import vllm

    mods = dict(torch=torch, vllm=vllm, ray=ray, transformers=transformers, triton=triton)
    out = {k: [m.__version__, os.path.dirname(m.__file__)] for k, m in mods.items()}
    out["cuda"] = [torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count()]
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    out["LD_PRELOAD"] = os.environ.get("LD_PRELOAD", "")
    assert vllm.__version__.startswith("0.32."), vllm.__version__
    assert torch.cuda.is_available(), "no CUDA device visible"
    return json.dumps(out)


def ray_gpu() -> str:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_gpus=1)
    def probe():
        import torch

        return torch.cuda.get_device_name(0), round(torch.cuda.mem_get_info()[0] / 2**30, 1)

    try:
        return ray.get(probe.remote(), timeout=120)
    finally:
        ray.shutdown()


def main() -> None:
    step("versions", versions)
    step("ray task on the GPU", ray_gpu)
    from colo.models.tiny import make_tiny_model

    path = str(step("tiny checkpoint", lambda: make_tiny_model(os.path.join(OUT, "tiny"), "tiny")))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = step("vLLM start", lambda: LLM(model=path, enforce_eager=True, enable_sleep_mode=True,
                                        gpu_memory_utilization=0.25, max_model_len=256, seed=0))
    greedy = SamplingParams(temperature=0, max_tokens=8)
    prompts = [TokensPrompt(prompt_token_ids=[5, 17, 42, 99, 7, 3]), TokensPrompt(prompt_token_ids=[11, 12, 13])]

    def gen():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]

    first = step("generate", gen)

    def sleep_wake(level: int):
        import torch

        free0 = torch.cuda.mem_get_info()[0]
        llm.sleep(level=level)
        freed = (torch.cuda.mem_get_info()[0] - free0) / 2**30
        llm.wake_up(tags=["weights"])
        if level == 2:  # weights were discarded: load them again, as a sync would
            llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])
        return f"freed {freed:.2f} GiB"

    step("sleep 1 + wake", lambda: sleep_wake(1))
    again = step("generate after sleep 1", gen)
    step("sleep 2 + wake + reload", lambda: sleep_wake(2))
    after2 = step("generate after sleep 2", gen)
    if not (first == again == after2):
        print(f"bundle_check: FAILED: greedy tokens changed: {first} {again} {after2}", flush=True)
        sys.exit(1)
    print("bundle_check: ok", flush=True)


if __name__ == "__main__":
    main()
