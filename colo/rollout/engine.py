"""RolloutEngine: the Ray actor that owns one vLLM `LLM` (colocated: DP rank r, beside trainer rank r).

    engine = RolloutEngine.options(num_gpus=f, num_cpus=0, scheduling_strategy=pg_r).remote(cfg, r, W, port)
    ray.get(engine.ready.remote())                        # {"rank", "device", "device_uuid", ...}
    arrays, _ = ray.get(engine.generate.remote(Generation.fresh([prompt_ids], n=8, max_tokens=256, seed=0)))
    samples = arrays.unpack()                             # colo.rollout.sample.Sample, 8 of them

Sleep/wake order of one RL step (docs/architecture.md): generate -> sleep(2) -> [train] -> wake_up(["weights"]) ->
begin_sync / load_bucket* / end_sync -> wake_up(["kv_cache", "scheduling"]) -> generate ...

Two ways to run, picked by `placement.device`:
- cuda: one vLLM data-parallel group with expert parallelism over all ranks, set up the only way measured
  to work inside Ray (docs/vllm-notes.md, "DP+EP inside Ray"): this actor takes 0 GPUs and drops
  CUDA_VISIBLE_DEVICES; vLLM's Ray executor puts its single worker into bundle 0 of our placement group
  with VLLM_RAY_PER_WORKER_GPUS = the vLLM fraction. The worker, not this actor, owns the GPU, so the
  device UUID comes from the worker (colo_describe).
- cpu: independent replicas (DP size 1, all experts local): vLLM's MoE data-parallel group fails on CPU.
  vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): measured on the tiny preset, that starts
  in ~3 s after import instead of ~30 s and takes ~0.95 GiB RSS instead of ~2.1 GiB over three processes
  (frontend, EngineCore, Worker). Threads are pinned to this rank's slice of the cores: vLLM's own
  "auto" binding pins every DP-size-1 engine to core 0 (it reserves the last core for the scheduler), so
  two engines on a 2-core host would share one core while the other idles.

Disaggregated mode (placement.mode): engine e owns whole GPUs of its own, runs tensor-parallel over
rollout.tp_size of them and is no DP group member (engines are independent replicas, prompts split by the
driver). GPU: vLLM's Ray executor places the TP workers in bundles 0..tp-1 of this engine's placement
group. CPU: TP 1 runs in-process as above; TP > 1 uses vLLM's multiprocess executor with one core set per
worker (VLLM_CPU_OMP_THREADS_BIND="0|1": vLLM's automatic binding refuses two workers on one NUMA node).
Weights arrive by broadcast from trainer rank 0 (join_weight_group); every TP worker takes part.

Log-probs are vLLM's "processed" log-probs: log softmax(logits / temperature) after top-k/top-p, i.e.
the distribution the token was actually sampled from (temperature 0: plain log softmax(logits)). The
trainer's recompute must divide its logits by the same temperature for the importance ratio to be 1.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from colo.config import ColoConfig, check_resolved, from_dict
from colo.run.logs import actor_output
from colo.models.archs import REPLAY_ARCHS, architecture, num_experts
from colo.rollout.capture import capture_by_prefill, from_vllm_output, ids_dtype
from colo.rollout.extension import WorkerExtension, qualname
from colo.rollout.generation import Generation
from colo.rollout.sample import Sample, SampleArrays, pack
from colo.rollout.quant import engine_quantization
from colo.host.shm import register_mapped, remove_scratch, scratch, sweep

if TYPE_CHECKING:
    from colo.rollout.engine_loop import Ask

def cores_for_rank(allowed: list[int], rank: int, dp_size: int) -> list[int]:
    """This rank's disjoint slice of the allowed cores (wrapping round when engines outnumber cores)."""
    allowed = sorted(allowed)
    per = max(1, len(allowed) // max(1, dp_size))
    start = (rank * per) % len(allowed)
    return [allowed[(start + i) % len(allowed)] for i in range(per)]


def read_model_json(model_path: str) -> dict:
    """The checkpoint's config.json, read once per vLLM engine (check_model_dir has seen that it exists)."""
    return json.loads((Path(model_path) / "config.json").read_text())


def has_linear_attention(model_json: dict) -> bool:
    """The checkpoint mixes in layers that are not softmax attention (Qwen3-Next's linear attention)."""
    return any(t not in ("full_attention", "sliding_attention") for t in model_json.get("layer_types") or [])


def has_experts(model_json: dict) -> bool:
    """The checkpoint has routed experts: vLLM (0.32) refuses enable_expert_parallel on a dense model ("Number
    of experts in the model must be greater than 0 when expert parallelism is enabled")."""
    return num_experts(model_json) > 0


def check_model_dir(path: str) -> None:
    """Fail before the ~10 s vLLM import when model.path is not a checkpoint directory."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"model.path {path!r} is not a local directory; fix: point model.path at an HF checkpoint dir "
            "(colo.plan.resolve turns Hub ids and auto:<preset> into one before actors start)")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path {path!r} has no config.json; fix: use a Hugging Face "
                                "checkpoint directory, e.g. one written by python -m colo.models.tiny")


class Engine:
    """One vLLM engine; methods are called directly by the driver (docs/contract.md "Actors").
    `RolloutEngine` below is its Ray actor. `extension`: the worker extension vLLM's workers get (a
    benchmark's subclass names its own, colo.bench.engines)."""

    extension: type = WorkerExtension

    def __init__(self, cfg: dict, rank: int, dp_size: int, dp_master_port: int, dp_master_addr: str = "",
                 dp_local_rank: int | None = None) -> None:
        """dp_master_addr: the node of engine DP rank 0 ("": this node's IP, right for a single engine);
        dp_local_rank: this engine's index among the DP engines on its node (colo.cluster.actors counts them)."""
        t0 = time.perf_counter()
        self.cfg: ColoConfig = from_dict(cfg)
        check_resolved(self.cfg, "RolloutEngine")  # resolved on the driver (colo.plan.resolve), never here
        self.log = actor_output(self.cfg.run.dir, self.cfg.run.verbose, "engine", rank)  # before vLLM says a word
        sweep()  # shared memory that dead processes of an earlier run left on this node (colo.host.shm)
        self.rank, self.dp_size = rank, dp_size
        self.device = self.cfg.placement.device
        self.disaggregated = self.cfg.placement.mode == "disaggregated"
        self.tp_size = int(self.cfg.rollout.tp_size) if self.disaggregated else 1
        check_model_dir(self.cfg.model.path)
        self.ray_gpu_ids = [str(g) for g in ray.get_gpu_ids()]  # before CUDA_VISIBLE_DEVICES is dropped
        self.cores: list[int] = []
        # vLLM reads its environment at import and engine start: everything is set before `import vllm`.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # legacy var that would silently override kv_cache_mb
        if self.device == "cpu":
            self._setup_cpu_env()
        elif self.disaggregated:
            self._setup_gpu_tp_env()
        else:
            self._setup_gpu_env(dp_master_addr or ray.util.get_node_ip_address(), dp_master_port, dp_local_rank)
        from colo.host.net import node_env

        os.environ.update(node_env())  # vLLM and the weight group's gloo (CPU) on the node's IP, not a loopback

        from colo.rollout.vllm_compat import FIX, VllmCompatError, require_vllm
        self.info = require_vllm()
        if self.info.is_cpu != (self.device == "cpu"):
            raise VllmCompatError(f"placement.device is {self.device} but vLLM {self.info.version} "
                                  f"({self.info.distribution}) is a {'CPU' if self.info.is_cpu else 'GPU'} build; {FIX}")
        self.moe_configs: str | None = None  # the fused-MoE kernel's tiles and why (GPU: _moe_tiles)
        self._start_llm()
        self.sleeping: set[str] = set()  # vLLM tags still asleep; generation waits for none
        self.start_s = time.perf_counter() - t0

    def _start_llm(self) -> None:
        """The vLLM engine for self.cfg (set up once the environment is; the test suite's warm clusters start another
        in place: tests/warm_clusters.py). How the engine's routing is captured depends on the model, so it is decided
        here, with the model."""
        from colo.host.heap import imports_frozen

        with imports_frozen():  # vLLM's import and its loader's gc.collect() calls, a fifth cheaper (colo.host.heap)
            from vllm import LLM

        self.model_json = read_model_json(self.cfg.model.path)
        self.routing, experts = routing_mode(self.model_json, self.device,
                                             self.cfg.rollout.routing_capture)  # None | "vllm" | "colo" | "prefill"
        self._ids_dtype = ids_dtype(experts)
        self.__dict__.pop("_moe_layer_ids", None)  # the MoE layers of the model loaded before, if any

        with scratch():  # vLLM's rendezvous file (vllm_dist_*) and sockets: removed at shutdown (colo.host.shm)
            self.llm = LLM(**self._llm_kwargs())
        if self.device == "cuda" or self.tp_size > 1:
            # vLLM's child processes (the GPU engine core, multiprocess executors) talk through psm_* queues in
            # /dev/shm that a killed engine leaves behind: colo takes them on, so the next sweep removes them
            register_mapped()
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        cache = self.llm.llm_engine.vllm_config.cache_config
        self.scheduler = {"chunked_prefill": bool(sched.enable_chunked_prefill),
                          "max_num_batched_tokens": int(sched.max_num_batched_tokens),
                          "max_num_seqs": int(sched.max_num_seqs),
                          "kv_cache_tokens": int(cache.num_gpu_blocks or 0) * int(cache.block_size)}

    def _llm_kwargs(self) -> dict[str, Any]:
        """vllm.LLM's arguments for self.cfg (colo.bench.sync's engine adds vLLM's own weight transfer)."""
        m, ro = self.cfg.model, self.cfg.rollout
        kwargs: dict[str, Any] = dict(
            model=m.path, dtype=m.dtype, seed=self.cfg.run.seed + self.rank, enforce_eager=ro.enforce_eager,
            max_model_len=ro.max_model_len, worker_extension_cls=qualname(self.extension),
            logprobs_mode="processed_logprobs",
            # vllm-cpu rejects enable_sleep_mode=True; LLM.sleep/wake_up still work there as no-ops.
            enable_sleep_mode=self.info.sleep_mode_available)
        if m.dummy_weights:
            kwargs["load_format"] = "dummy"
        # FP8 rollout and the KV cache dtype (colo.rollout.quant); the environment before vLLM starts (its Ray
        # workers get VLLM_* copied)
        quant, env = engine_quantization(self.cfg, json.loads((Path(m.path) / "config.json").read_text()))
        os.environ.update(env)
        kwargs.update(quant)
        if self.routing == "vllm":  # vLLM records each token's experts (colo.rollout.capture)
            kwargs["enable_return_routed_experts"] = True
        elif self.routing == "colo":  # colo's workers keep them beside the KV cache (colo.rollout.capture_cuda)
            from colo.rollout.capture_cuda import CONFIG_KEY

            kwargs["additional_config"] = {CONFIG_KEY: True}
        if self.tp_size > 1:
            kwargs["tensor_parallel_size"] = self.tp_size
        if self.device == "cpu":
            kwargs["kv_cache_memory_bytes"] = ro.kv_cache_mb * 2**20
            # Every request carries a seed. When vLLM splits a prompt over scheduler steps (chunked
            # prefill), it discards the token sampled after a partial chunk and rewinds that request's
            # generator by its offset, which CPU generators do not have ("CPU Generator does not use
            # offset": any step whose prompts exceed max_num_batched_tokens, 4096 on vllm-cpu). Without
            # chunking a prompt is scheduled whole or waits for the next step, so no sample is ever
            # discarded, each request's stream stays its own and a rollout stays a function of its
            # seeds; vLLM then sizes max_num_batched_tokens >= max_model_len, so every prompt fits
            # one step. GPU engines keep chunked prefill: CUDA generators rewind. docs/vllm-notes.md.
            kwargs["enable_chunked_prefill"] = False
            if has_linear_attention(self.model_json):
                # vLLM keeps the prefix cache of a hybrid (linear-attention) model only with chunked prefill
                # ("Chunked prefill is required for mamba cache mode 'align'"): such CPU engines go without
                kwargs["enable_prefix_caching"] = False
            if self.tp_size > 1:
                kwargs["distributed_executor_backend"] = "mp"
        elif self.disaggregated:
            kwargs.update(distributed_executor_backend="ray", gpu_memory_utilization=self.cfg.placement.vllm_gpu_fraction)
        else:
            kwargs.update(distributed_executor_backend="ray", enable_expert_parallel=has_experts(self.model_json),
                          gpu_memory_utilization=self.cfg.placement.vllm_gpu_fraction)
        if self.device == "cuda":
            self._moe_tiles(dp=self.dp_size if kwargs.get("enable_expert_parallel") else 1)
        return kwargs

    def _moe_tiles(self, dp: int) -> None:
        """The fused-MoE kernel's tiles: colo's tuned files where vLLM has none for this GPU (colo.rollout.moe_tuning),
        by VLLM_TUNED_CONFIG_FOLDER, set or cleared before vLLM starts; ready() says which."""
        from colo.rollout.moe_tuning import FOLDER, MoeLookup, cuda_device_name, moe_config_env

        lookup = MoeLookup.of(self.model_json, self.cfg.rollout.quantization == "fp8", dp, self.tp_size)
        given = os.environ.get("VLLM_TUNED_CONFIG_FOLDER")
        env, self.moe_configs = moe_config_env(self.cfg, lookup, cuda_device_name(), given)
        if given == str(FOLDER) and not env:  # ours, from an engine this process started before
            os.environ.pop("VLLM_TUNED_CONFIG_FOLDER")
        os.environ.update(env)

    def _setup_cpu_env(self) -> None:
        import torch

        if self.cfg.rollout.enforce_eager:
            # enforce_eager keeps vLLM's model out of torch.compile, but vLLM still compiles helper ops with
            # inductor (vllm/v1/sample/ops/logprobs.py: the sampled token's rank, on every generate that asks
            # for log-probs): on CPU a trace and a C++ build in each engine process, again for a new batch
            # shape; measured 2.1-2.5 CPU-seconds per process with inductor's cache warm, more on a fresh
            # machine (its first compile). Eager is exact here.
            # config.disable is read when a compiled function is called; the variable reaches TP workers.
            os.environ["TORCH_COMPILE_DISABLE"] = "1"
            torch._dynamo.config.disable = True
        allowed = sorted(os.sched_getaffinity(0))
        if self.tp_size > 1:  # worker processes, one core set each ("0|1"); this process keeps them all
            per = [cores_for_rank(allowed, t, self.tp_size) for t in range(self.tp_size)]
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, c)) for c in per)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core stays in this process
            self.cores = sorted({c for cs in per for c in cs})
            return
        self.cores = cores_for_rank(allowed, self.rank, self.dp_size)
        os.sched_setaffinity(0, self.cores)
        # Ray sets OMP_NUM_THREADS from the actor's num_cpus (1 for num_cpus=0); size the pool to our cores.
        # Must precede the vLLM import: vLLM's CPUWorker replaces torch.set_num_threads with a no-op.
        torch.set_num_threads(len(self.cores))
        os.environ["OMP_NUM_THREADS"] = str(len(self.cores))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # Only read by vLLM's multiprocess executor; kept consistent in case multiprocessing is re-enabled.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cores))

    def _setup_gpu_tp_env(self) -> None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        os.environ.update(VLLM_RAY_PER_WORKER_GPUS="1", VLLM_RAY_BUNDLE_INDICES=",".join(map(str, range(self.tp_size))))

    def _setup_gpu_env(self, master_addr: str, master_port: int, local_rank: int | None) -> None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        if local_rank is None:  # started alone (benchmarks, tests): ranks assumed packed node by node
            local_rank = self.rank % max(1, int(_node_resources().get("GPU", 1)))
        os.environ.update(
            VLLM_RAY_PER_WORKER_GPUS=str(self.cfg.placement.vllm_gpu_fraction), VLLM_RAY_BUNDLE_INDICES="0",
            VLLM_DP_RANK=str(self.rank), VLLM_DP_RANK_LOCAL=str(local_rank),
            VLLM_DP_SIZE=str(self.dp_size), VLLM_DP_MASTER_IP=master_addr, VLLM_DP_MASTER_PORT=str(master_port))

    # ------------------------------------------------------------------------------------------ info

    def ready(self) -> dict:
        """Rank, versions, where this engine runs, how it records routing (None: a dense model); on GPU the worker's
        device UUID for the rank check."""
        import psutil

        out = {"rank": self.rank, "dp_size": self.dp_size, "tp_size": self.tp_size, "device": self.device,
               "vllm_version": self.info.version, "vllm_distribution": self.info.distribution,
               "vllm_known_good": self.info.known_good, "pid": os.getpid(),
               "node_ip": ray.util.get_node_ip_address(), "ray_gpu_ids": self.ray_gpu_ids,
               "cpu_cores": self.cores, "start_s": round(self.start_s, 3),
               "rss_mb": round(psutil.Process().memory_info().rss / 2**20), "device_uuid": None,
               "scheduler": self.scheduler, "moe_configs": self.moe_configs, "routing": self.routing}
        if self.device == "cuda":
            out["device_uuid"] = self.describe()["device_uuid"]
        return out

    def describe(self) -> dict:
        """The worker extension's colo_describe: vLLM parameter names/shapes, expert map, device UUID."""
        return self._rpc("colo_describe")

    # ------------------------------------------------------------------------------------ generation

    def generate(self, g: Generation) -> tuple[SampleArrays, dict]:
        """The one generation path: g's samples through the engine loop (colo.rollout.engine_loop), conversations
        with algo.environment (colo.rollout.turns), then, with `g.routing`, the routing rows of what these weights
        forwarded (colo.rollout.capture: on GPU vLLM's own or colo's (capture_cuda), inside the loop; a capture pass
        on CPU). Returns the samples (in g's order) and stats ({"env_s"} for conversations)."""
        from colo.rollout.engine_loop import Sampling, run
        from colo.rollout.turns import Budget

        if self.sleeping:  # vLLM's scheduler stays paused: the engine loop would spin forever, not fail
            raise RuntimeError(f"generate() on rank {self.rank} while {sorted(self.sleeping)} still sleep; "
                               "fix: wake_up(None) or wake_up(['kv_cache', 'scheduling']) after the sync")
        self._own_threads()
        samples = g.samples.unpack()
        before = [(s.routed_rows, len(s.response_ids)) for s in samples]
        errors = [s.turns is not None and s.turns.env_error for s in samples]
        conv = self._conversations(g.rows) if self.cfg.algo.environment else None
        ro = self.cfg.rollout
        run(self.llm.llm_engine, samples, Budget(g.max_tokens, ro.max_turns, ro.max_model_len, ro.max_turn_tokens),
            Sampling(g.temperature, g.top_p, g.version), self._sampling_params, conv, g.stop_after,
            self._vllm_rows if g.routing and self.routing == "vllm" else None,
            self._slot_rows if g.routing and self.routing == "colo" else None)
        if g.routing and self.routing == "prefill":  # one capture pass over what these weights generated
            todo = [(s, rows) for s, (rows, r0) in zip(samples, before) if len(s.response_ids) > r0]
            seqs = [s.ids[:-1] for s, _ in todo]
            for (s, rows), ids in zip(todo, capture_by_prefill(self.llm, self._rpc, seqs, self._ids_dtype)):
                s.add_rows(ids[rows:])
        for s, had in zip(samples, errors):
            if s.turns is not None and s.turns.env_error and not had:
                print(f"colo: environment error: {s.turns.env_error}", flush=True)  # this engine's log
        return pack(samples), ({"env_s": conv.env_s} if conv is not None else {})

    def _sampling_params(self, s: Sample, ask: Ask) -> Any:
        """A request's vllm.SamplingParams (colo.bench.engines.LengthEngine imposes response lengths here)."""
        from colo.rollout.engine_loop import sampling_params

        return sampling_params(ask)

    def _vllm_rows(self, raw: Any, rows: int) -> Any:
        """vLLM's routed_experts of a request -> its (rows, M, K) ids, or None where vLLM recorded fewer (the sample
        then carries no routing: the routing/mismatch metric does without; R3 replay needs them, so it raises)."""
        if raw is None or len(raw) < rows:
            if self.cfg.algo.routing_replay == "r3":
                from_vllm_output(raw, self._moe_layers(), rows, self._ids_dtype)  # raises, naming what is missing
            print(f"colo: engine {self.rank}: a request came back with {0 if raw is None else len(raw)} routing rows "
                  f"of {rows}; its sample carries no routing", flush=True)
            return None
        return from_vllm_output(raw, self._moe_layers(), rows, self._ids_dtype)

    def _slot_rows(self, asks: list[tuple[str, int, int]]) -> list[Any]:
        """colo's capture (colo.rollout.capture_cuda): the rows of ended requests, (internal id, first row, rows
        expected) each, from TP worker 0; None for a request with fewer, as _vllm_rows has it (R3 replay raises)."""
        out = []
        for (rid, _, want), got in zip(asks, self._rpc("colo_take_routing", asks)):
            if got is None or len(got) < want:
                have = 0 if got is None else len(got)
                if self.cfg.algo.routing_replay == "r3":
                    raise RuntimeError(f"engine {self.rank}: colo's routing capture holds {have} rows of {want} for "
                                       f"request {rid}, and algo.routing_replay=r3 needs them all")
                print(f"colo: engine {self.rank}: a request came back with {have} routing rows of {want}; its sample "
                      "carries no routing", flush=True)
                out.append(None)
            else:
                out.append(np.asarray(got).astype(self._ids_dtype, copy=False))
        return out

    def _conversations(self, rows: dict[int, dict]) -> Any:
        """This call's environments (colo.rollout.turns), with this engine's tokenizer framing (made once)."""
        from colo.rollout.turns import Conversations

        if not hasattr(self, "_env"):
            from colo.data.prompts import load_tokenizer
            from colo.envs.base import load_environment
            from colo.envs.framing import ChatFraming
            from colo.envs.sandbox import permit_unsandboxed

            permit_unsandboxed(self.cfg.algo.unsafe_unsandboxed_tools)  # colo.envs.sandbox: where bwrap is missing
            tok = load_tokenizer(self.cfg.model.path)
            chat = bool(self.cfg.data.chat_template and getattr(tok, "chat_template", None))
            self._env = (load_environment(self.cfg.algo.environment),
                         ChatFraming(tok, self.cfg.data.system_prompt if chat else None, chat=chat))
        env_cls, framing = self._env
        algo = self.cfg.algo
        return Conversations(env_cls, framing, rows, algo.env_timeout_s, fail=algo.env_errors == "fail")

    def _moe_layers(self) -> list[int]:
        if not hasattr(self, "_moe_layer_ids"):
            self._moe_layer_ids = self._rpc("colo_moe_layers")
        return self._moe_layer_ids

    def probe(self, probe: dict) -> dict:
        """The sync's functional check (colo.sync.probe, colo.sync.layercheck): the layer check's forwards (its hooks
        installed on every worker, a prefill of the ids they give and one decode step, their records read back), then
        vLLM's log-probs of every position of probe["seqs"] (its top ENGINE_TOPK next tokens and the actual one).
        {"tables": per sequence and position, "layers": TP worker 0's records}."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._own_threads()

        from colo.sync.probe import ENGINE_TOPK

        if self.sleeping:
            raise RuntimeError(f"probe() on rank {self.rank} while {sorted(self.sleeping)} still sleep")
        ids = self._rpc_all("colo_check_start", probe["layers"])[0]
        try:  # a prefill, then one decode step (its kernels differ: MLA's absorbed projections serve decode only)
            self.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, s))) for s in ids],
                              SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False),
                              use_tqdm=False)
        finally:
            layers = self._rpc_all("colo_check_stop")[0]
            self._drop_prefix_cache()  # the forced forward's KV blocks must never serve a prompt
        # prompt log-probs never read the prefix cache (vLLM's default for them): every position is computed now
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=ENGINE_TOPK, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, s))) for s in probe["seqs"]], params,
                                 use_tqdm=False)
        tables = [[None if p is None else {int(t): float(lp.logprob) for t, lp in p.items()}
                   for p in o.prompt_logprobs] for o in outs]
        return {"tables": tables, "layers": layers}

    # ------------------------------------------------------------------------------------ sleep/wake

    def sleep(self, level: int) -> float:
        """Free KV cache (level 1: weights to host; level 2: weights dropped). No-op on CPU. Returns seconds."""
        t = time.perf_counter()
        self.llm.sleep(level=level)
        self.sleeping = {"weights", "kv_cache"}
        return time.perf_counter() - t

    def wake_up(self, tags: list[str] | None = None) -> float:
        """Re-allocate the tagged memory ("weights", "kv_cache"); "scheduling"/None resumes generation."""
        t = time.perf_counter()
        self.llm.wake_up(tags=tags)  # returns "fully awake" (bool): not used
        self.sleeping = set() if tags is None else self.sleeping - set(tags)
        return time.perf_counter() - t

    def shutdown(self) -> None:
        """Stop vLLM's engine core (and its worker processes, unlinking their shared memory) before Ray ends
        this actor, which would run no cleanup."""
        self.llm.llm_engine.engine_core.shutdown()
        remove_scratch()

    # ------------------------------------------------------------------ weight sync (receiver side)

    # Every call goes to all of this engine's workers (one, or tp_size in disaggregated mode); results are
    # summed over them, and each worker's coverage errors are kept, prefixed with its TP rank.

    def join_weight_group(self, address: dict, rank_base: int) -> list[int]:
        """Disaggregated: every TP worker joins trainer rank 0's broadcast group (colo.sync.transport)."""
        return self._rpc_all("colo_join_weight_group", address, rank_base)

    def begin_sync(self, handles: list[dict], expect: dict[str, int] | None, digest: bool = False) -> None:
        self._rpc_all("colo_begin_sync", handles, expect, digest)

    def load_bucket(self, buffer_id: int, pieces: list[dict]) -> dict:
        results = self._rpc_all("colo_load_bucket", buffer_id, pieces)
        return {"tensors": sum(r["tensors"] for r in results), "bytes": sum(r["bytes"] for r in results)}

    def end_sync(self, digest: bool) -> dict:
        results = self._rpc_all("colo_end_sync", digest)
        self._drop_prefix_cache()
        if len(results) == 1:
            return results[0]
        errors = [f"tp rank {t}: {e}" for t, r in enumerate(results) for e in r["errors"]]
        return {"tensors": sum(r["tensors"] for r in results), "bytes": sum(r["bytes"] for r in results),
                "verified": not errors, "errors": errors, "digest": results[0]["digest"]}

    def _drop_prefix_cache(self) -> None:
        """After every weight sync: cached KV blocks (and, on GPU, the routing vLLM stores with them) were
        computed by the old weights, and a prompt that hits them would be scored by a mix of two policies
        (NeMo-RL #4018 found entries 17 steps old). vLLM 0.32 clears the cache when it sleeps (level >= 1),
        but disaggregated engines never sleep, and a reset of an empty cache costs nothing, so always reset.
        tests/integration/test_engines_across_syncs.py fails without it."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(f"engine {self.rank}: vLLM refused to reset its prefix cache after a weight sync "
                               "(requests still running?)")

    def _rpc(self, method: str, *args: Any) -> Any:
        """TP worker 0's answer (describe: every worker of a TP engine holds the same names)."""
        return self._rpc_all(method, *args)[0]

    def _own_threads(self) -> None:
        """CPU: this call's thread runs vLLM's kernels on the rank's cores. Ray runs an actor's methods on threads of
        its concurrency groups (colo.cluster.actors), and a new thread starts with OpenMP's initial count (Ray's
        OMP_NUM_THREADS=1 for an actor of num_cpus=0), not the one __init__ set: vLLM-cpu's attention then finds
        its metadata built for another count ("Check failed: input->metadata->thread_num == thread_num (1 vs. 2)",
        one engine on 2 cores). torch._C's setter: vLLM's CPUWorker replaced torch.set_num_threads with a no-op."""
        import torch

        if self.cores and torch.get_num_threads() != len(self.cores):
            torch._C.set_num_threads(len(self.cores))

    def _rpc_all(self, method: str, *args: Any) -> list:
        self._own_threads()
        results = self.llm.collective_rpc(method, args=args)
        if len(results) != self.tp_size:
            raise RuntimeError(f"{method}: expected {self.tp_size} vLLM worker(s) per engine, got {len(results)}")
        return results


RolloutEngine = ray.remote(Engine)


def routing_mode(model_json: dict, device: str, capture: str = "vllm") -> tuple[str | None, int]:
    """How this engine reports routing (colo.rollout.capture): on GPU `capture` (rollout.routing_capture: "vllm",
    vLLM's own; "colo", colo.rollout.capture_cuda), "prefill" on CPU (a capture pass), or None for a model whose
    routers colo does not read (dense, other families); and the model's expert count (0 when None)."""
    if device != "cuda" and capture == "colo":
        raise ValueError("rollout.routing_capture=colo needs a CUDA engine (vLLM's Model Runner V2; vllm-cpu runs "
                         "the V1 runner and captures by a prefill pass); fix: rollout.routing_capture=vllm")
    if architecture(model_json) not in REPLAY_ARCHS:
        return None, 0
    return (capture if device == "cuda" else "prefill"), num_experts(model_json)


def _node_resources() -> dict:
    node_id = ray.get_runtime_context().get_node_id()
    return next((n.get("Resources", {}) for n in ray.nodes() if n.get("NodeID") == node_id), {})
