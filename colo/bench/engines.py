"""The benchmark's actor classes: colo's Trainer and Engine plus what only a benchmark needs.

    start_cluster(cfg, plan, trainer_cls=BenchTrainer, engine_cls=BenchEngine)        # colo.bench.sync
    start_cluster(cfg, plan, trainer_cls=BenchTrainer, engine_cls=VllmIpcEngine)      # ... timing vLLM's engine

BenchTrainer runs the yardsticks (colo.bench.yardsticks) and perturbs its shards, so that a sync that
changes nothing cannot pass for one that works; BenchEngine reads back what vLLM holds (parameter
digests); VllmIpcEngine also builds vLLM's own CUDA-IPC weight-transfer engine. Only VllmIpcEngine
switches on VLLM_ALLOW_INSECURE_SERIALIZATION (vLLM's IPC handles carry Python classes, which its
msgpack RPC refuses otherwise); colo's own sync sends plain data and never needs it.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from colo.bench.lengths import LengthModel
from colo.bench.yardsticks import broadcast_weights_baseline, push_weights_baseline, push_weights_vllm_ipc
from colo.rollout.engine import Engine
from colo.rollout.engine_loop import Ask
from colo.rollout.generation import Generation
from colo.rollout.extension import WorkerExtension
from colo.rollout.sample import Sample, SampleArrays, Status, pack
from colo.sync.checksum import checksum
from colo.trainer.worker import Trainer


class BenchTrainer(Trainer):
    def sync_baseline(self, engines: list) -> dict:
        """The straightforward colocated sync into engines[0] (this rank's engine)."""
        self._check_ready()
        return push_weights_baseline(self.model, engines[0], self.cfg.sync)

    def broadcast_baseline(self, engines: list) -> dict:
        """The straightforward disaggregated sync: a broadcast and a load_weights per tensor."""
        self._check_ready()
        return broadcast_weights_baseline(self.model, engines, self._weight_group, self.cfg.sync)

    def sync_vllm_ipc(self, engines: list) -> dict:
        """vLLM's own packed CUDA-IPC weight transfer into every engine (rank 0 sends the handles)."""
        self._check_ready()
        return push_weights_vllm_ipc(self.model, engines, self.cfg.sync)

    def set_digest(self, on: bool) -> None:
        """sync.digest for the next syncs (colo.bench.sync --checksum-ratio): the Sender reads it at every push."""
        self.cfg.sync.digest = bool(on)

    @torch.no_grad()
    def perturb_weights(self, seed: int, scale: float) -> int:
        """Add noise to this rank's shards (no collectives); returns elements touched. The benchmark's --check
        and the GPU tests use it so a sync that changes nothing cannot pass for one that works."""
        gen = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + self.rank)
        n = 0
        for _, p in self.model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p.data
            if local.numel() == 0:  # uneven expert split: an empty shard
                continue
            std = local.float().std(correction=0).clamp_min(0.02)  # norms are all 1.0: std 0
            noise = torch.randn(local.shape, generator=gen, device=local.device)
            local.add_((noise * scale * std).to(local.dtype))
            n += local.numel()
        return n


class BenchWorkerExtension(WorkerExtension):
    """colo's worker extension plus what only the benchmark reads back from vLLM's workers."""

    def colo_param_digest(self) -> dict[str, int]:
        """The checksum (colo.sync.checksum) of every live vLLM parameter, whatever layout vLLM keeps it in."""
        return {n: checksum(p.data) for n, p in self.model_runner.model.named_parameters()}  # type: ignore[attr-defined]

    def colo_load_transient(self, pieces: list[dict], handle: dict) -> dict:
        """The straightforward baseline's bucket (colo.bench.yardsticks): its own fresh buffer, opened for this
        bucket only and let go after it, then loaded as colo's own buckets are."""
        from colo.sync.transport import close_transient, open_transient

        st = self._colo_get_state()
        assert st.coverage is not None, "colo_load_transient before colo_begin_sync"
        buf, seg = open_transient(handle, torch.device(self.device))  # type: ignore[attr-defined]
        try:
            return self._colo_load_pieces(st, buf, pieces, handle["kind"])
        finally:
            del buf  # the last view: the mapping can close
            close_transient(seg)


class BenchEngine(Engine):
    extension = BenchWorkerExtension

    def load_transient(self, pieces: list[dict], handle: dict) -> dict:
        """One bucket of the straightforward baseline, from a buffer of its own (colo_load_transient)."""
        results = self._rpc_all("colo_load_transient", pieces, handle)
        return {"tensors": sum(r["tensors"] for r in results), "bytes": sum(r["bytes"] for r in results)}

    def param_digest(self) -> list[dict[str, int]]:
        """Per worker, a checksum of every vLLM parameter as it is now: tells whether two sync paths wrote
        the same values (colo.bench.sync checks vLLM's IPC engine against colo's sync with it)."""
        return self._rpc_all("colo_param_digest")


class VllmIpcEngine(BenchEngine):
    """BenchEngine that also builds vLLM's own weight-transfer engine (`LLM(weight_transfer_config=...)` and
    the LLM's weight-update methods). CUDA only: it moves CUDA IPC handles."""

    def __init__(self, cfg: dict, *args: Any, **kwargs: Any) -> None:
        from colo.config import from_dict
        from colo.rollout.vllm_compat import require_weight_transfer_device

        require_weight_transfer_device(from_dict(cfg).placement.device)  # before vLLM is imported and started
        # read by vLLM's msgpack encoder in every process it starts: set before vLLM is imported
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        super().__init__(cfg, *args, **kwargs)

    def _llm_kwargs(self) -> dict[str, Any]:
        from colo.rollout.vllm_compat import require_weight_transfer

        require_weight_transfer(self.device)
        return {**super()._llm_kwargs(), "weight_transfer_config": {"backend": "ipc"}}

    def vllm_init_weight_transfer(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})  # the trainer's wire params (packed)

    def vllm_start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def vllm_update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def vllm_finish_weight_update(self) -> None:
        self.llm.finish_weight_update()
        self._drop_prefix_cache()  # as the product sync does after every update


# ---- colo.bench.step: the RL step at imposed response lengths --------------------------------------------

class LengthEngine(Engine):
    """An Engine whose responses have imposed lengths: random weights never sample EOS on purpose, so the
    length of each response is drawn (colo.bench.lengths.LengthModel, from the sample's own seed and, with the
    per-prompt model, the prompt's token ids: the same step gives the same lengths in every run, and a carried sample
    keeps both) and imposed with min_tokens = max_tokens = that length and ignore_eos. A sample that ends short of
    the budget reports Status.COMPLETED, as one that sampled EOS would. The length model is iid until set_lengths."""

    lengths = LengthModel()

    def set_lengths(self, kind: str, rho: float) -> dict:
        self.lengths = LengthModel(kind, rho)
        return self.lengths.describe()

    def generate(self, g: Generation) -> tuple[SampleArrays, dict]:
        self._budget = g.max_tokens  # _sampling_params draws each length within it
        arrays, stats = super().generate(g)
        samples = arrays.unpack()
        for s in samples:
            if s.status is Status.TRUNCATED and len(s.response_ids) < g.max_tokens:
                s.status = Status.COMPLETED
        return pack(samples), stats

    def _sampling_params(self, s: Sample, ask: Ask) -> Any:
        """The sample's imposed length less the tokens it has."""
        from vllm import SamplingParams

        p = super()._sampling_params(s, ask)
        left = self.lengths.length(s.seed, self._budget, s.prompt_ids) - len(s.response_ids)
        return SamplingParams(n=1, max_tokens=left, min_tokens=left, ignore_eos=True, temperature=p.temperature,
                              top_p=p.top_p, logprobs=0, detokenize=p.detokenize, seed=p.seed)


class StepTrainer(Trainer):
    """Trainer plus what colo.bench.step reads: the layout switch (packed or padded, one build for both),
    the peak memory and seconds of the policy's log-prob pass, the seconds of the onload, the updates'
    forward + backward and the optimizer steps (device-synchronized), the seconds of the whole train_step call
    in the trainer (what the train phase spends outside it is the batch's building and its way here and back),
    and the step's token sums for the FLOPs."""

    def set_layout(self, layout: dict) -> None:
        """A colo.bench.step variant's trainer settings (its COMPARABLE keys), all at once."""
        self.set_packing(layout["trainer.packing"])
        self.set_old_logprobs(layout["trainer.old_logprobs"])
        self.set_loss_in_lm_head(layout["trainer.loss_in_lm_head"])
        self.set_gather_once(layout["trainer.gather_once"])
        self.set_compile(layout["trainer.compile"])

    def set_packing(self, on: bool) -> None:
        self.cfg.trainer.packing = bool(on)

    def set_old_logprobs(self, how: str) -> None:
        self.cfg.trainer.old_logprobs = str(how)

    def set_loss_in_lm_head(self, on: bool) -> None:
        self.cfg.trainer.loss_in_lm_head = bool(on)

    def set_gather_once(self, on: bool) -> None:
        self.cfg.trainer.gather_once = bool(on)

    def set_compile(self, on: bool) -> None:
        """trainer.compile on the built model: its decoder layers and log-prob chunk math compiled (inductor, as
        colo.trainer.fsdp builds them with trainer.compile) or back to eager (nn.Module.compile's attribute cleared)."""
        from colo.trainer.compile import compile_layers
        from colo.trainer.fsdp import decoder_layers

        self.cfg.trainer.compile = bool(on)
        for model in self._models():
            model.colo_compile_backend = "inductor" if on else None  # the log-prob chunks' math (fsdp._logprob_forward)
            layers = decoder_layers(model)
            if on and layers[0]._compiled_call_impl is None:
                compile_layers(layers, "inductor")
            elif not on:
                for layer in layers:
                    layer._compiled_call_impl = None

    def compile_figures(self) -> dict:
        from colo.trainer.compile import compile_stats

        return compile_stats()

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def _sync(self) -> float:
        import time

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def onload(self) -> dict:
        t0 = self._sync()
        out = super().onload()
        self._onload_s = self._sync() - t0
        return out

    def _optim_step(self, lr: float | None = None) -> float:
        t0 = self._sync()
        out = super()._optim_step(lr)
        self._optim_s += self._sync() - t0
        return out

    def _micro_plan(self, idx: torch.Tensor, batch: dict) -> list[tuple[torch.Tensor, bool]]:
        """Trainer._micro_plan, its micro-batches' real token counts recorded (0: a dummy that keeps ranks in step):
        the step's shapes, which a compiled trainer may recompile for (bench/micro_batches, bench/micro_tokens_max)."""
        plan = super()._micro_plan(idx, batch)
        mask = batch["attention_mask"]
        self._plans.append([0 if dummy else int(mask[rows].sum()) for rows, dummy in plan])
        return plan

    def _logprobs(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        import time

        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        t0 = time.perf_counter()
        out = super()._logprobs(model, batch)
        if cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self._lp_mem = (peak / 2**30, (peak - before) / 2**30)
        else:
            self._lp_mem = (None, None)
        self._lp_s = time.perf_counter() - t0
        return out

    def profile_next_step(self) -> None:
        """Run the next train_step under torch.profiler; its kernel table is then `profile_table()`."""
        self._profile = True

    def profile_table(self, rows: int = 25) -> str:
        """The profiled step's operators by their own device time (CPU time where there is no GPU)."""
        prof = getattr(self, "_prof", None)
        if prof is None:
            return ""
        key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
        return table + (self._device_gaps(prof) if self.device.type == "cuda" else "")

    @staticmethod
    def _device_gaps(prof) -> str:  # noqa: ANN001 (torch.profiler.profile)
        """How much of the profiled span the GPU ran anything (the union of its kernels' and copies' intervals),
        and the idle gaps between them: where the host, not the device, set the pace."""
        from torch.autograd import DeviceType

        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
        if not spans:
            return "\n[device] no device events\n"
        busy, gaps, (lo, hi) = 0.0, [], spans[0]
        for start, end in spans[1:]:
            if start > hi:
                busy += hi - lo
                gaps.append(start - hi)
                lo, hi = start, end
            else:
                hi = max(hi, end)
        busy += hi - lo
        whole = spans[-1][1] - spans[0][0]
        big = sorted(gaps, reverse=True)
        return (f"\n[device] busy {busy / 1e6:.3f} s of {whole / 1e6:.3f} s from its first to its last kernel; "
                f"{sum(g > 1000 for g in gaps)} idle gaps over 1 ms ({sum(g for g in gaps if g > 1000) / 1e6:.3f} s), "
                f"{sum(g > 100 for g in gaps)} over 0.1 ms ({sum(g for g in gaps if g > 100) / 1e6:.3f} s); "
                f"the longest (ms): {', '.join(f'{g / 1e3:.1f}' for g in big[:12])}\n")

    def _alloc_retries(self) -> int:
        """The caching allocator's cudaMalloc retries so far: each one frees every cached block and
        synchronizes the device, the signature of a train phase that runs at the edge of memory."""
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def train_step(self, batch: dict) -> dict:
        import contextlib
        import time

        import torch.distributed as dist

        from colo.algo.batch import from_wire

        entered, cpu = time.perf_counter(), time.process_time()
        batch = from_wire(batch)  # as Trainer.train_step takes it (timed: a part of the trainer's call)
        self._optim_s, self._lp_s, self._lp_mem = 0.0, 0.0, (None, None)  # no pass when trainer.old_logprobs skips it
        self._plans: list[list[int]] = []  # every pass's micro-batches (_micro_plan)
        retries = self._alloc_retries()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        prof = contextlib.nullcontext()
        if getattr(self, "_profile", False):
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            prof = self._prof = profile(activities=acts)
            self._profile = False
        waited = time.perf_counter()
        t0 = self._sync()  # what the GPU still had queued when the call came (none is expected)
        waited = t0 - waited
        with prof:
            out = super().train_step(batch)
            t1 = self._sync()
        # _logprobs reset the peak: this one is of the updates (and the optimizer step)
        reserved = torch.cuda.max_memory_reserved(self.device) / 2**30 if self.device.type == "cuda" else None
        real = batch["sample_index"] >= 0 if "sample_index" in batch else torch.ones(len(batch["input_ids"]), dtype=torch.bool)
        lengths = batch["attention_mask"][real].sum(1).double()  # (B',) prompt + response tokens per sample
        sums = self._agree([float(lengths.sum()), float((lengths ** 2).sum()), float(real.sum())], dist.ReduceOp.SUM)
        peak, own = self._lp_mem
        onload, self._onload_s = getattr(self, "_onload_s", 0.0), 0.0
        out |= {"bench/tokens": sums[0], "bench/tokens_sq": sums[1], "bench/samples": sums[2],
                "bench/logprob_s": self._lp_s, "bench/optim_s": self._optim_s,
                "bench/update_s": t1 - t0 - self._lp_s - self._optim_s,  # forward + backward of the updates
                "bench/onload_s": onload,  # this step's (the loop onloads right before train_step)
                "bench/entry_wait_s": waited,
                "bench/logprob_peak_gb": peak, "bench/logprob_pass_gb": own,
                "bench/alloc_retries": self._alloc_retries() - retries, "bench/update_reserved_gb": reserved,
                "bench/micro_batches": sum(len(p) for p in self._plans),  # over every pass: log-prob and updates
                "bench/micro_tokens_max": max((t for p in self._plans for t in p), default=0)}
        out["bench/train_call_s"] = time.perf_counter() - entered  # this call, here; the rest is the driver's and Ray's
        # the process's CPU time in it, every thread: the host's work for the same tokens (far below train_call on a
        # GPU that sets the pace; on CPU, beside train_call, how much of the call it waited for a core)
        out["bench/train_call_cpu_s"] = time.process_time() - cpu
        return out
