"""TrainWorker: one FSDP2 rank of the policy, a Ray actor colocated with one vLLM engine.

    setup ─ [sft_step] ─ onload ─ train_step ─ sync_weights ─ offload ─ … ─ save_checkpoint
    (every method is collective: the driver calls it on all ranks at once)

Collective hazard: FSDP2 all-gathers per layer in forward and reduce-scatters in backward, so every
rank must run the *same number* of forward/backward passes. Ranks can hold different row counts,
so micro-batch counts are agreed with an all-reduce MAX and a rank that runs out pads with a
zero-loss-mask copy of one of its rows (zero gradient, same collectives).

Loss scaling: policy_loss divides by the GLOBAL token (or sequence) count of the mini-batch, summed
over ranks and micro-batches; FSDP's reduce-scatter averages over ranks, so each micro loss is
scaled by world size. The summed gradient then equals that of one process seeing the whole mini-batch.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from colo.algo.loss import gather_logprobs, policy_loss, token_entropy
from colo.algo.parity import gap_metrics, logprob_gap
from colo.algo.routing import RouterTap
from colo.logs import actor_output
from colo.shm import sweep
from colo.sync.transport import device_uuid
from colo.trainer import checkpoint
from colo.trainer.fsdp import DTYPES, build_sharded, expert_shard_range, num_experts
from colo.trainer.offload import Offloader, state_bytes
from colo.trainer.optim import make_optimizer


def _namespace(d: Any) -> Any:
    return SimpleNamespace(**{k: _namespace(v) for k, v in d.items()}) if isinstance(d, dict) else d


def load_cfg(cfg: dict) -> Any:
    """colo.config.from_dict when it exists, else attribute access over the plain dict."""
    try:
        from colo.config import from_dict
    except ImportError:
        return _namespace(cfg)
    return from_dict(cfg)


def _rows(batch: dict, idx: torch.Tensor, dummy: bool) -> dict[str, torch.Tensor]:
    """Rows `idx` of every (B, ...) tensor; `dummy` zeroes the loss mask (collectives only)."""
    out = {k: v[idx] for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 1}
    if dummy:
        out["loss_mask"] = torch.zeros_like(out["loss_mask"])
    return out


class Trainer:
    """The plain class; `TrainWorker` below is its Ray actor. Tests and benchmarks use either."""

    def __init__(self, cfg: dict, rank: int, world_size: int, master_addr: str, master_port: int):
        self.cfg_dict = cfg
        self.cfg = load_cfg(cfg)
        self.log = actor_output(str(self.cfg.run.dir), bool(self.cfg.run.verbose), "trainer", rank)
        sweep()  # shared memory that dead processes of an earlier run left on this node (colo.shm)
        self.rank, self.world_size = rank, world_size
        self.init_method = f"tcp://{master_addr}:{master_port}"
        self.model = self.ref_model = self.optimizer = None
        self.offloaded = False
        self._sync_state: dict = {}

    # ---- setup -------------------------------------------------------------------------------
    def setup(self) -> dict:
        """Join the process group (gloo on CPU, nccl on GPU), then build the model and optimizer."""
        t0 = time.perf_counter()
        c = self.cfg
        want = str(getattr(c.placement, "device", "auto"))
        if want == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("placement.device is cuda but this TrainWorker sees no GPU")
        if want == "cpu" or not torch.cuda.is_available():
            # Ray hands CPU actors fake GPU ids through CUDA_VISIBLE_DEVICES; hide them so nothing
            # below tries CUDA. Two cores are shared with vLLM: one thread each.
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
            torch.set_num_threads(1)
            self.device, backend = torch.device("cpu"), "gloo"
        else:
            # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU: it is always index 0 here
            self.device, backend = torch.device("cuda", 0), "nccl"
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=self.init_method, rank=self.rank,
                                world_size=self.world_size)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        return {**self._build(), "seconds": time.perf_counter() - t0}

    def _build(self) -> dict:
        """Model (FSDP2), optional frozen reference copy and AdamW for self.cfg (collective)."""
        c = self.cfg
        seed = int(c.trainer.seed)
        torch.manual_seed(seed)
        self.param_dtype = DTYPES[str(c.model.dtype)]
        build = dict(dummy=bool(c.model.dummy_weights), mesh=self.mesh, device=self.device,
                     param_dtype=self.param_dtype, seed=seed)
        self.model = build_sharded(
            str(c.model.path), gradient_checkpointing=bool(
                getattr(c.trainer, "gradient_checkpointing", False)), **build)
        self.ref_model = None
        if float(c.algo.kl_coef) > 0:
            # frozen copy of the initial policy; never built when the KL term is off
            self.ref_model = build_sharded(str(c.model.path), **build).requires_grad_(False)
        self._offloader = Offloader(self.device)
        self.routing = RouterTap(self.model)  # R3 and the routing-mismatch metric (colo.algo.routing)
        self._routing_counts = [0.0, 0.0]  # (pairs differing, pairs compared) of the last policy log-prob pass
        self.optimizer = make_optimizer(self.model.parameters(), lr=float(c.trainer.lr),
                                        weight_decay=float(c.trainer.weight_decay),
                                        state_dtype=str(getattr(c.trainer, "optimizer_dtype", "float32")),
                                        on_host=bool(getattr(c.trainer, "optimizer_offload", False)),
                                        device=self.device)
        experts = num_experts(self.model.config)
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.device),
                "device_uuid": device_uuid(self.device),  # the id the colocated engine reports
                "params": sum(p.numel() for p in self.model.parameters()),
                **state_bytes([self.model], None),
                "experts": expert_shard_range(experts, self.world_size, self.rank) if experts else None}

    # ---- forward pieces ----------------------------------------------------------------------
    def _check_ready(self) -> None:
        if self.model is None:
            raise RuntimeError("TrainWorker.setup() was not called")
        if self.offloaded:
            raise RuntimeError("TrainWorker is offloaded: call onload() before using the model")

    def _forward(self, model: torch.nn.Module, mb: dict, temperature: float = 1.0) -> torch.Tensor:
        ids = mb["input_ids"].to(self.device)  # (b, T)
        am = mb["attention_mask"].to(self.device)  # (b, T)
        # positions count real tokens, so left padding (if a caller uses it) matches vLLM's
        pos = (am.long().cumsum(-1) - 1).clamp(min=0)  # (b, T)
        if model is self.model:  # the engine's (b, T, M, K) expert ids, kept through backward's recompute
            self.routing.set(mb.get("routed_experts"), replay=str(self.cfg.algo.routing_replay) == "r3")
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
        return logits if temperature == 1.0 else logits / temperature  # (b, T, V)

    @property
    def _policy_temperature(self) -> float:
        """vLLM reports log-probs after temperature scaling, so the RL log-probs (old, new, ref) use the
        same temperature; otherwise the TIS weight and logprob_diff compare different distributions."""
        t = float(self.cfg.rollout.temperature)
        return t if t > 0 else 1.0

    def _agree(self, values: list[int | float], op: dist.ReduceOp) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _micro_plan(self, idx: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
        """Micro-batches of `idx` rows; the count is agreed over ranks (pads with dummies)."""
        mbs = max(1, int(self.cfg.trainer.micro_batch_size))
        chunks = list(idx.split(mbs)) if idx.numel() else []
        n = int(self._agree([len(chunks)], dist.ReduceOp.MAX)[0])
        filler = idx[:1] if idx.numel() else torch.zeros(1, dtype=torch.long)
        return [(c, False) for c in chunks] + [(filler, True)] * (n - len(chunks))

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)  # (B, T)
        routing = [0.0, 0.0]  # (token, MoE layer) pairs: own top-k differs from the engine's, compared
        for idx, dummy in self._micro_plan(torch.arange(batch["input_ids"].shape[0])):
            mb = _rows(batch, idx, dummy)
            lp = gather_logprobs(self._forward(model, mb, self._policy_temperature),
                                 batch["input_ids"][idx].to(self.device))
            if not dummy:
                out[idx] = lp.float().cpu()
                if model is self.model and "routed_experts" in mb:  # real rows only: padding rows score nothing
                    valid = mb["attention_mask"] * (mb["loss_mask"].sum(1, keepdim=True) > 0)  # (b, T)
                    routing = [a + b for a, b in zip(routing, self.routing.mismatch(mb["routed_experts"], valid))]
        if model is self.model:
            self._routing_counts = routing
        # forward-only passes leave the root and last layer gathered (reshard_after_forward=False,
        # meant for a backward that never comes); the sync reads params and expects DTensor shards
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        return out

    def compute_logprobs(self, batch: dict) -> torch.Tensor:
        """(B, T) float32 on CPU; out[:, t] = log p(input_ids[t] | input_ids[:t]), out[:, 0] = 0."""
        self._check_ready()
        return self._logprobs(self.model, batch)

    # ---- updates -----------------------------------------------------------------------------
    def _optim_step(self, lr: float | None = None) -> float:
        """Clip and step; `lr` overrides trainer.lr for this step only (the warm-up uses its own)."""
        for g in self.optimizer.param_groups:
            g["lr"] = float(self.cfg.trainer.lr) if lr is None else lr
        clip = float(self.cfg.trainer.grad_clip)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              clip if clip > 0 else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def sft_step(self, batch: dict) -> dict:
        """One AdamW step of token-mean cross-entropy on loss_mask tokens (the whole batch)."""
        self._check_ready()
        rows = torch.arange(batch["input_ids"].shape[0])
        tokens = self._agree([float(batch["loss_mask"].sum())], dist.ReduceOp.SUM)[0]
        loss_sum = 0.0
        for idx, dummy in self._micro_plan(rows):
            mb = _rows(batch, idx, dummy)
            lp = gather_logprobs(self._forward(self.model, mb), mb["input_ids"].to(self.device))
            mask = mb["loss_mask"].to(self.device, torch.float32)  # (b, T)
            loss = -(lp * mask).sum() / max(tokens, 1.0)
            (loss * self.world_size).backward()
            loss_sum += float(loss.detach())
        sft_lr = float(self.cfg.trainer.sft_lr)
        grad_norm = self._optim_step(sft_lr if sft_lr > 0 else None)
        loss = self._agree([loss_sum], dist.ReduceOp.SUM)[0]
        self._release_cache()
        return {"sft_loss": loss, "grad_norm": grad_norm, "tokens": tokens}

    def _ppo_micro(self, mb: dict, old: torch.Tensor, ref: torch.Tensor | None,
                   token_count: float, seq_count: float) -> dict[str, torch.Tensor]:
        """Forward + backward of one micro-batch; returns detached, token-weighted metric sums."""
        a = self.cfg.algo
        mask = mb["loss_mask"].to(self.device)  # (b, T)
        logits = self._forward(self.model, mb, self._policy_temperature)  # (b, T, V)
        lp = gather_logprobs(logits, mb["input_ids"].to(self.device))  # (b, T)
        rollout = mb.get("rollout_logprobs")
        loss, met = policy_loss(
            lp, old.to(self.device), mb["advantages"].to(self.device), mask,
            clip_low=float(a.clip_low), clip_high=float(a.clip_high), loss_agg=str(a.loss_agg),
            rollout_logprobs=None if rollout is None else rollout.to(self.device),
            tis_cap=None if a.tis_cap is None else float(a.tis_cap),
            ref_logprobs=None if ref is None else ref.to(self.device), kl_coef=float(a.kl_coef),
            token_count=token_count, seq_count=seq_count)
        (loss * self.world_size).backward()
        n = mask.float().sum()
        with torch.no_grad():
            out = {k: v.detach().float() * n for k, v in met.items()}  # local means -> sums
            out["entropy"] = (token_entropy(logits.detach()) * mask).sum()
        out["loss"], out["tokens"] = loss.detach().float(), n
        return out

    def train_step(self, batch: dict) -> dict:
        """PPO-clip: recompute old log-probs, then epochs x mini-batches of AdamW steps.

        Returns global metrics (identical on every rank): loss (mean over updates), grad_norm
        (mean, and /max), entropy, clip_frac, approx_kl, tis_mean, pg_loss, [kl_ref] as global token
        means, logprob_diff/mean = |trainer - vLLM| log-prob on sampled tokens, pre-update, and
        trainer/lr, the learning rate the optimizer stepped with.
        """
        self._check_ready()
        t, a = self.cfg.trainer, self.cfg.algo
        B = batch["input_ids"].shape[0]
        mask = batch["loss_mask"].float()  # (B, T)
        old = self._logprobs(self.model, batch)  # (B, T) the policy before this step
        ref = batch.get("ref_logprobs")
        if float(a.kl_coef) > 0 and ref is None:
            ref = self._logprobs(self.ref_model, batch)
        minis = list(torch.arange(B).tensor_split(max(1, int(t.mini_batches))))
        M = len(minis)
        # one all-reduce for every mini-batch's global token and sequence counts
        counts = self._agree([float(mask[m].sum()) for m in minis]
                             + [float((mask[m].sum(1) > 0).sum()) for m in minis],
                             dist.ReduceOp.SUM)
        sums: dict[str, torch.Tensor] = {}
        norms: list[float] = []
        for _ in range(max(1, int(t.epochs))):
            for m, rows in enumerate(minis):
                for idx, dummy in self._micro_plan(rows):
                    got = self._ppo_micro(_rows(batch, idx, dummy), old[idx],
                                          None if ref is None else ref[idx],
                                          max(counts[m], 1.0), max(counts[M + m], 1.0))
                    for k, v in got.items():
                        sums[k] = sums.get(k, 0.0) + v
                norms.append(self._optim_step())
        keys = sorted(sums)
        tot = dict(zip(keys, self._agree([float(sums[k]) for k in keys], dist.ReduceOp.SUM)))
        updates = max(1, int(t.epochs)) * M
        tokens = max(tot.pop("tokens"), 1.0)
        out = {"loss": tot.pop("loss") / updates, "grad_norm": sum(norms) / len(norms),
               "grad_norm/max": max(norms), "updates": updates,
               "trainer/lr": float(self.optimizer.param_groups[0]["lr"])}  # as the optimizer ran it
        out.update({k: v / tokens for k, v in tot.items()})
        out.update(self._parity(batch, old))
        self._release_cache()
        return out

    def _parity(self, batch: dict, old: torch.Tensor) -> dict:
        """Trainer vs engine before the update, global over ranks: the log-prob gap of the sampled tokens
        (colo.algo.parity) and, when the batch carries the engine's routing, routing/mismatch: the share of
        (token, MoE layer) pairs whose trainer top-k set differs from the engine's (replay or not)."""
        out: dict = {}
        if "rollout_logprobs" in batch:
            gap = logprob_gap(old, batch["rollout_logprobs"], batch["loss_mask"])
            sums = dict(zip(("gap_abs", "gap_k3", "gap_tokens"),
                            self._agree([gap["gap_abs"], gap["gap_k3"], gap["gap_tokens"]], dist.ReduceOp.SUM)))
            sums["gap_max"] = self._agree([gap["gap_max"]], dist.ReduceOp.MAX)[0]
            out.update(gap_metrics(sums))
        if "routed_experts" in batch:
            differ, pairs = self._agree(self._routing_counts, dist.ReduceOp.SUM)
            out["routing/mismatch"] = differ / max(pairs, 1.0)
        return out

    def _release_cache(self) -> None:
        """Hand the allocator's cached blocks back to the driver at the end of training: next, vLLM wakes its
        weights on this GPU, and the train phase's cache (activations, logits, the optimizer step's
        temporaries: ~25% above the allocated peak, measured) would otherwise still be held beside them.
        colo.memplan's sync phase counts on it."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- memory, sync, checkpoints -----------------------------------------------------------
    def _models(self) -> list[torch.nn.Module]:
        return [m for m in (self.model, self.ref_model) if m is not None]

    def offload(self) -> dict:
        out = self._offloader.offload(self._models(), self.optimizer)
        self.offloaded = True
        return out

    def onload(self) -> dict:
        out = self._offloader.onload(self._models(), self.optimizer)
        self.offloaded = False
        return out

    def memory(self) -> dict:
        """Memory at the end of a loop phase. GPU: the whole device's use (this trainer, the colocated
        vLLM and anything else on it: cudaMemGetInfo) and this trainer's allocator peak since the last
        call, which is then reset, so each phase reports its own peak. CPU: the process's resident memory."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return {"device_used_gb": (total - free) / 2**30, "trainer_peak_gb": peak / 2**30}
        import psutil

        return {"trainer_rss_gb": psutil.Process().memory_info().rss / 2**30}

    def sync_weights(self, engine: Any) -> dict:
        """Colocated: push this rank's weights into the engine on the same GPU."""
        self._check_ready()
        from colo.sync.sender import push_weights  # lazy: the sync path imports vLLM-side helpers

        return push_weights(self.model, engine, self.cfg.sync, self._sync_state)

    def prepare_sync(self, engines: list) -> dict:
        """Plan the weight sync against the engines' description now, before any step (collective): a
        model the sync cannot map fails here, naming every unmapped trainer tensor and every vLLM param
        nothing writes, all at once. Colocated: `engines` is this rank's engine; disaggregated: all."""
        self._check_ready()
        from colo.sync.sender import check_names, plan_summary, prepare_broadcast, prepare_push

        if str(self.cfg.placement.mode) == "colocated":
            if str(getattr(self.cfg.sync, "mode", "direct")) == "load_weights":
                return check_names(self.model, engines[0])  # the straightforward path keeps no plan
            state = prepare_push(self.model, engines[0], self.cfg.sync, self._sync_state)
        else:
            state = prepare_broadcast(self.model, engines, getattr(self, "_weight_group", None), self.cfg.sync,
                                      self._sync_state)
        return plan_summary(state)

    # Disaggregated: rank 0 opens a broadcast group (colo.sync.broadcast) that every engine worker joins;
    # the driver calls open_weight_group, then join_weight_group here and on the engines at the same time.
    def open_weight_group(self, world: int) -> dict:
        """Rank 0: start the group's rendezvous; returns its address (plain data) for the engines."""
        from colo.sync.broadcast import WeightGroupHost

        if self.rank != 0:
            raise RuntimeError(f"open_weight_group on trainer rank {self.rank}: only rank 0 broadcasts weights")
        self._group_host = WeightGroupHost(ray.util.get_node_ip_address(), world)
        return self._group_host.address

    def join_weight_group(self) -> int:
        self._weight_group = self._group_host.join(self.device)
        return self._weight_group.rank

    def broadcast_weights(self, engines: list) -> dict:
        """Disaggregated: every rank takes part in the gathers; rank 0 broadcasts to every engine worker."""
        self._check_ready()
        from colo.sync.sender import broadcast_weights

        group = getattr(self, "_weight_group", None)
        if self.rank == 0 and group is None:
            raise RuntimeError("broadcast_weights before join_weight_group on trainer rank 0")
        return broadcast_weights(self.model, engines, group, self.cfg.sync, self._sync_state)

    def save_checkpoint(self, path: str, extra: dict) -> None:
        checkpoint.save(path, self.model, self.optimizer, extra)

    def load_checkpoint(self, path: str) -> dict:
        return checkpoint.load(path, self.model, self.optimizer)

    def export_hf(self, path: str) -> None:
        was_offloaded = self.offloaded
        if was_offloaded:  # the gather is a device collective (NCCL cannot all-gather host memory)
            self.onload()
        checkpoint.export_hf(path, self.model, str(self.cfg.model.path),
                             DTYPES[str(self.cfg.model.dtype)])
        if was_offloaded:
            self.offload()

    def local_shard(self, name: str) -> torch.Tensor:
        """This rank's shard of parameter `name` as a CPU tensor (tests, debugging)."""
        p = self.model.get_parameter(name)
        return (p.to_local() if hasattr(p, "to_local") else p).detach().cpu().clone()

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

    def release_sync_buffers(self) -> None:
        """Unlink the sync's shared-memory segments now: they are named files in /dev/shm, and
        ray.kill/ray.shutdown end actors without running atexit hooks (measured: one leaked per rank and run)."""
        bufs = self._sync_state.pop("buffers", None)
        if bufs is not None:
            bufs.close()
        self._sync_state.clear()

    def shutdown(self) -> None:
        self.release_sync_buffers()
        group = getattr(self, "_weight_group", None)
        if group is not None:
            group.close()
        if dist.is_initialized():
            dist.destroy_process_group()


TrainWorker = ray.remote(Trainer)
