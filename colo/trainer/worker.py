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
The metrics follow the same rule (docs/loss.md): aggregated parts (loss, pg_loss, kl_loss) are summed
over ranks and micro-batches, token means are weighted by each micro-batch's token count, so every
metric is what one process on the whole batch would report, whatever the layout.

Modes: log-prob passes (old, reference) run in eval mode, the update in train mode (dropout, HF's
gradient checkpointing, which only acts while training).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time

import ray
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from colo.algo.batch import from_wire
from colo.algo.loss import LossOptions, TokenLoss, policy_loss
from colo.algo.packing import Packed, pack_bins
from colo.algo.parity import gap_metrics, logprob_gap
from colo.algo.replay import RouterTap
from colo.config import ColoConfig, check_resolved, from_dict
from colo.models.dtypes import torch_dtype
from colo.run.commands import merged_export
from colo.run.logs import actor_output
from colo.host.shm import sweep
from colo.sync.forcing import Forcing
from colo.sync.probe import trainer_scores
from colo.sync.sender import Sender
from colo.sync.transport import WeightGroup, WeightGroupHost, device_uuid
from colo.trainer import checkpoint
from colo.trainer.adapters import LoraSpec, merged_items, trainable
from colo.models.archs import expert_shard_range, num_experts
from colo.trainer.fsdp import build_sharded, hold_gathered, persistent_buffers, reduce_next_backward
from colo.trainer.offload import Offloader, state_bytes
from colo.trainer.optim import clip_and_step, make_optimizer

ADDITIVE = ("pg_loss", "kl_loss")  # policy_loss metrics already divided by global counts: summed, not weighted


def _rows(batch: dict, idx: torch.Tensor, dummy: bool) -> dict[str, torch.Tensor]:
    """Rows `idx` of every (B, ...) tensor; `dummy` zeroes the loss mask (collectives only)."""
    out = {k: v[idx] for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 1}
    if dummy:
        out["loss_mask"] = torch.zeros_like(out["loss_mask"])
    return out


class Trainer:
    """The plain class; `TrainWorker` below is its Ray actor. Tests and benchmarks use either."""

    def __init__(self, cfg: dict, rank: int, world_size: int, master_addr: str, master_port: int):
        # plain data over Ray, the typed tree from here on: resolved on the driver (colo.plan.resolve), never here
        self.cfg: ColoConfig = from_dict(cfg)
        check_resolved(self.cfg, "TrainWorker")
        self.log = actor_output(str(self.cfg.run.dir), bool(self.cfg.run.verbose), "trainer", rank)
        sweep()  # shared memory that dead processes of an earlier run left on this node (colo.host.shm)
        self.rank, self.world_size = rank, world_size
        self.init_method = f"tcp://{master_addr}:{master_port}"
        self.model = self.ref_model = self.optimizer = None
        self.ref_frozen = False  # the reference holds the policy of the first RL step (see _freeze_reference)
        self.offloaded = False
        self.consecutive_skipped = 0  # optimizer steps skipped in a row for a non-finite grad norm
        self.sender = None  # colo.sync.sender.Sender, built by prepare_sync
        self._slots = [0.0, 0.0]  # (token slots computed, real sample tokens) of the train step in progress
        self._packed: Packed | None = None  # the layout of the micro-batch last scored (packed) or None (padded)
        self._group_host: WeightGroupHost | None = None
        self._weight_group: WeightGroup | None = None  # disaggregated, rank 0: the broadcast group

    # ---- setup -------------------------------------------------------------------------------
    def setup(self) -> dict:
        """Join the process group (gloo on CPU, nccl on GPU), then build the model and optimizer."""
        t0 = time.perf_counter()
        c = self.cfg
        want = c.placement.device
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
        from colo.host.net import node_env

        os.environ.update(node_env())  # gloo on the node's own interface: peers on other nodes reach it
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
        self.param_dtype = torch_dtype(c.model.dtype)
        experts = None if c.trainer.experts_implementation == "auto" else str(c.trainer.experts_implementation)
        build = dict(dummy=bool(c.model.dummy_weights), mesh=self.mesh, device=self.device,
                     param_dtype=self.param_dtype, seed=seed, experts_implementation=experts,
                     compile_backend="inductor" if c.trainer.compile else None)
        self.lora = LoraSpec.of(c.trainer)  # LoRA: a frozen base, adapters beside it (colo.trainer.adapters)
        self.model = build_sharded(c.model.path, gradient_checkpointing=c.trainer.gradient_checkpointing,
                                   lora=self.lora, **build)
        self.ref_model, self.ref_frozen = None, False
        if float(c.algo.kl_coef) > 0:
            # the same sharding as the policy, so the first train_step copies shards locally; random until
            # then (never read before). Never built when the KL term is off.
            self.ref_model = build_sharded(str(c.model.path), **{**build, "dummy": True}).requires_grad_(False)
            self.ref_model.eval()
        self._offloader = Offloader(self.device)
        self.routing = RouterTap(self.model)  # R3 and the routing-mismatch metric (colo.algo.replay)
        self._routing_counts = self._no_routing()  # (pairs differing, pairs compared) of the last policy pass
        self.optimizer = make_optimizer(trainable(self.model), lr=float(c.trainer.lr),
                                        weight_decay=float(c.trainer.weight_decay),
                                        state_dtype=c.trainer.optimizer_dtype, on_host=c.trainer.optimizer_offload,
                                        device=self.device)
        experts = num_experts(self.model.config)
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.device),
                "device_uuid": device_uuid(self.device),  # the id the colocated engine reports
                "params": sum(p.numel() for p in self.model.parameters()),
                "trainable_params": sum(p.numel() for p in trainable(self.model)),
                **state_bytes([self.model], None),
                "experts": expert_shard_range(experts, self.world_size, self.rank) if experts else None}

    # ---- forward pieces ----------------------------------------------------------------------
    def _check_ready(self) -> None:
        if self.model is None:
            raise RuntimeError("TrainWorker.setup() was not called")
        if self.offloaded:
            raise RuntimeError("TrainWorker is offloaded: call onload() before using the model")

    def _score(self, model: torch.nn.Module, mb: dict, temperature: float = 1.0, dummy: bool = False,
               token_loss: TokenLoss | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(b, T) float32 log-probs and entropies of the micro-batch's tokens, aligned as the batch contract has
        them, from logits / temperature divided in float32 as vLLM's sampler does (colo.algo.logprobs: the
        lm_head runs by chunks, no (b, T, V) logits). Packed (trainer.packing): the rows' real tokens run as one
        row and the results come back in the padded (b, T) layout, so everything downstream is unchanged.
        `token_loss` ((b, T) on the device, trainer.loss_in_lm_head): the loss's gradient is taken in the lm_head's
        chunk loop; the log-probs are then constants and the third output, else None, carries the gradient."""
        ids = self._up(mb["input_ids"])  # (b, T)
        am = self._up(mb["attention_mask"])  # (b, T)
        routed = None if mb.get("routed_experts") is None else self._up(mb["routed_experts"])  # (b, T, M, K)
        chunk = int(self.cfg.trainer.logprob_chunk)
        # planned on the host (no syncs), its index then on the device
        packed = Packed.of(mb["attention_mask"]).to(self._up) if self.cfg.trainer.packing else None
        b, T = ids.shape
        self._slots[0] += packed.tokens if packed else b * T  # token slots computed
        if not dummy:  # real tokens: shard fillers (sample_index -1) and dummy micro-batches are padding
            real = mb["attention_mask"]  # (b, T) on the host
            if "sample_index" in mb:
                real = real * (mb["sample_index"] >= 0)[:, None]
            self._slots[1] += float(real.sum())
        if packed is not None:
            ids, pos, am = packed.pack(ids), packed.position_ids, None  # (1, N) each
            routed = None if routed is None else packed.pack(routed)  # (1, N, M, K): token by token, as ids
        else:
            # positions count real tokens, so left padding (if a caller uses it) matches vLLM's
            pos = (am.long().cumsum(-1) - 1).clamp(min=0)  # (b, T)
        if model is self.model:  # the engine's expert ids, kept through backward's recompute
            self.routing.set(routed, replay=str(self.cfg.algo.routing_replay) == "r3")
        bounds = packed.bounds if packed is not None else None
        if token_loss is not None and packed is not None:
            token_loss = token_loss.map(packed.pack)  # (1, N): token by token, as ids
        lp, ent, *anchor = model.colo_logprobs(ids, am, pos, temperature, chunk, bounds, token_loss)  # (b, T) or (1, N)
        if packed is not None:
            lp, ent = packed.unpack(lp), packed.unpack(ent)  # (b, T)
            self._packed = packed
        else:
            self._packed = None
        return lp, ent, (anchor[0] if anchor else None)

    @property
    def _policy_temperature(self) -> float:
        """vLLM reports log-probs after temperature scaling, so the RL log-probs (old, new, ref) use the
        same temperature; otherwise the TIS weight and logprob_diff compare different distributions."""
        t = float(self.cfg.rollout.temperature)
        return t if t > 0 else 1.0

    def _up(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on this rank's device. On CUDA through pinned memory, not waiting: a copy from pageable
        memory first waits for every kernel queued before it, and a micro-batch made dozens of them, each one
        leaving the GPU idle while the host queued the next kernels."""
        if self.device.type != "cuda" or t.device.type == "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _no_routing(self) -> torch.Tensor:
        return torch.zeros(2, dtype=torch.float64, device=self.device)

    def _agree(self, values: list[int | float], op: dist.ReduceOp) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _micro_plan(self, idx: torch.Tensor, batch: dict) -> list[tuple[torch.Tensor, bool]]:
        """Micro-batches of `idx` rows; the count is agreed over ranks (pads with dummies).

        Packing: rows grouped by trainer.max_tokens_per_micro_batch real tokens (colo.algo.packing), the shard's
        filler rows (sample_index -1: zero loss, there only to even out padded row counts) left out.
        Padded: trainer.micro_batch_size rows at a time."""
        t = self.cfg.trainer
        if t.packing:
            if "sample_index" in batch and idx.numel():
                idx = idx[batch["sample_index"][idx] >= 0]
            lengths = batch["attention_mask"][idx].sum(1).tolist()
            chunks = [idx[torch.tensor(b, dtype=torch.long)] for b in pack_bins(lengths, int(t.max_tokens_per_micro_batch))]
        else:
            chunks = list(idx.split(max(1, int(t.micro_batch_size)))) if idx.numel() else []
        n = int(self._agree([len(chunks)], dist.ReduceOp.MAX)[0])
        filler = idx[:1] if idx.numel() else torch.zeros(1, dtype=torch.long)
        return [(c, False) for c in chunks] + [(filler, True)] * (n - len(chunks))

    def _passes(self, model: torch.nn.Module, plan: list[tuple[torch.Tensor, bool]], backward: bool):
        """The micro-batches of one pass. trainer.gather_once keeps the model's FSDP units gathered across them
        (colo.trainer.fsdp.hold_gathered) and, with backward, reduces the gradients at the last one only: every
        rank runs the same number of micro-batches (_micro_plan agrees them), so the reductions match."""
        if not self.cfg.trainer.gather_once:
            yield from plan
            return
        hold_gathered(model, True)
        try:
            for i, item in enumerate(plan):
                if backward and i == len(plan) - 1:
                    reduce_next_backward(model)
                yield item
        finally:
            hold_gathered(model, False)

    def _count_routing(self, mb: dict) -> None:
        """Right after the policy's forward over `mb`: adds its (token, MoE layer) pairs whose own top-k differs
        from the engine's, and the pairs compared, to the step's routing counts (routing/mismatch, _parity)."""
        if "routed_experts" not in mb:
            return
        valid = self._up(mb["attention_mask"] * (mb["loss_mask"].sum(1, keepdim=True) > 0))  # (b, T) real rows
        if self._packed is not None:  # the tap saw the packed row: compare token by token there
            valid = self._packed.pack(valid)
        # the engine's ids as _score handed them to the tap: on the device, in the layout the forward ran
        self._routing_counts = self._routing_counts + self.routing.mismatch_counts(self.routing.ids, valid)

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)  # (B, T)
        scored: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, their (b, T) log-probs on the device)
        if model is self.model:
            self._routing_counts = self._no_routing()
        training = model.training
        model.eval()  # the log-probs of the policy itself, not of one dropout draw of it
        try:
            for idx, dummy in self._passes(model, self._micro_plan(torch.arange(batch["input_ids"].shape[0]), batch),
                                           backward=False):
                mb = _rows(batch, idx, dummy)
                lp, _, _ = self._score(model, mb, self._policy_temperature, dummy)
                if not dummy:
                    scored.append((idx, lp.float()))  # to the host after the pass: .cpu() would wait here
                    if model is self.model:
                        self._count_routing(mb)
        finally:
            model.train(training)
        for idx, lp in scored:
            out[idx] = lp.cpu()
        # forward-only passes leave the root and last layer gathered (reshard_after_forward=False,
        # meant for a backward that never comes); the sync reads params and expects DTensor shards
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        return out

    def compute_logprobs(self, batch: dict) -> torch.Tensor:
        """(B, T) float32 on CPU; out[:, t] = log p(input_ids[t] | input_ids[:t]), out[:, 0] = 0."""
        self._check_ready()
        return self._logprobs(self.model, from_wire(batch))

    # ---- updates -----------------------------------------------------------------------------
    def _optim_step(self, lr: float | None = None) -> float:
        """Clip and step; `lr` overrides trainer.lr for this step only (the warm-up uses its own)."""
        for g in self.optimizer.param_groups:
            g["lr"] = float(self.cfg.trainer.lr) if lr is None else lr
        norm = clip_and_step(trainable(self.model), self.optimizer, float(self.cfg.trainer.grad_clip))
        # skipped (non-finite norm) in a row, over RL and warm-up steps; every rank counts alike (global norm)
        self.consecutive_skipped = 0 if math.isfinite(norm) else self.consecutive_skipped + 1
        return norm

    def sft_step(self, batch: dict) -> dict:
        """One AdamW step of token-mean cross-entropy on loss_mask tokens (the whole batch)."""
        self._check_ready()
        batch = from_wire(batch)  # tensors, or the numpy arrays TrainerGroup sends
        rows = torch.arange(batch["input_ids"].shape[0])
        tokens = self._agree([float(batch["loss_mask"].sum())], dist.ReduceOp.SUM)[0]
        loss_sum = 0.0
        self.model.train()
        for idx, dummy in self._passes(self.model, self._micro_plan(rows, batch), backward=True):
            mb = _rows(batch, idx, dummy)
            lp, _, _ = self._score(self.model, mb, 1.0, dummy)
            mask = self._up(mb["loss_mask"]).float()  # (b, T)
            loss = -(lp * mask).sum() / max(tokens, 1.0)
            (loss * self.world_size).backward()
            loss_sum = loss_sum + loss.detach().float()  # read after the last backward
        sft_lr = float(self.cfg.trainer.sft_lr)
        grad_norm = self._optim_step(sft_lr if sft_lr > 0 else None)
        loss = self._agree([float(loss_sum)], dist.ReduceOp.SUM)[0]
        self._release_cache()
        return {"sft_loss": loss, "grad_norm": grad_norm, "tokens": tokens}

    def _ppo_micro(self, mb: dict, old: torch.Tensor | None, ref: torch.Tensor | None,
                   token_count: float, seq_count: float, dummy: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Forward + backward of one micro-batch; returns detached, token-weighted metric sums and the old
        log-probs it used (b, T). `old` None: the step's one update, whose own forward is the policy before it
        (trainer.old_logprobs=update): its log-probs, detached, are the old ones."""
        a = self.cfg.algo
        mask = self._up(mb["loss_mask"])  # (b, T)
        old = None if old is None else self._up(old)
        adv = self._up(mb["advantages"])
        rollout = None if mb.get("rollout_logprobs") is None else self._up(mb["rollout_logprobs"])
        ref = None if ref is None else self._up(ref)
        opts, counts = LossOptions.of(a), dict(token_count=token_count, seq_count=seq_count)
        # trainer.loss_in_lm_head: the same loss, its gradient taken token by token inside the lm_head's chunk loop
        token_loss = TokenLoss.of(old, adv, mask, opts, scale=float(self.world_size),
                                  rollout_logprobs=rollout, ref_logprobs=ref, **counts) \
            if self.cfg.trainer.loss_in_lm_head else None
        lp, ent, anchor = self._score(self.model, mb, self._policy_temperature, dummy, token_loss)  # (b, T) each
        if old is None:
            old = lp.detach()
            if not dummy:
                self._count_routing(mb)  # before backward, whose recompute would run the router again
        with torch.no_grad() if anchor is not None else contextlib.nullcontext():  # the value and the metrics
            loss, met = policy_loss(lp, old, adv, mask, opts, rollout_logprobs=rollout, ref_logprobs=ref, **counts)
        (anchor if anchor is not None else loss * self.world_size).backward()
        n = mask.float().sum()
        with torch.no_grad():
            # token means -> token-weighted sums; the aggregated parts are already additive (global counts)
            out = {k: v.detach().float() * (1.0 if k in ADDITIVE else n) for k, v in met.items()}
            out["entropy"] = (ent.detach() * mask).sum()
        out["loss"], out["tokens"] = loss.detach().float(), n
        return out, old

    @torch.no_grad()
    def _freeze_reference(self) -> None:
        """Copy the policy's shards into the reference model (no collectives: both are sharded alike).

        The KL term pulls toward the policy RL started from. That is the policy after the SFT warm-up,
        not model.path: a reference rebuilt from disk would pull the policy back to before the warm-up."""
        for (name, p), (ref_name, r) in zip(self.model.named_parameters(), self.ref_model.named_parameters()):
            assert name == ref_name, (name, ref_name)
            (r.to_local() if hasattr(r, "to_local") else r).copy_(p.to_local() if hasattr(p, "to_local") else p)
        for (_, b), (_, rb) in zip(persistent_buffers(self.model), persistent_buffers(self.ref_model)):
            rb.copy_(b)
        self.ref_frozen = True

    def train_step(self, batch: dict) -> dict:
        """PPO-clip: old log-probs (a forward-only pass, or the one update's own: trainer.old_logprobs), then
        epochs x mini-batches of AdamW steps.

        Returns global metrics (identical on every rank, the same for any rank / micro-batch layout):
        loss, pg_loss, [kl_loss] (each update's aggregated value, averaged over updates), grad_norm
        (mean, and /max), entropy, clip_frac, clip_frac/dual, approx_kl, tis_mean, [kl_ref] as global
        token means over all updates, logprob_diff/mean = |trainer - vLLM| log-prob on sampled tokens,
        pre-update, and trainer/lr, the learning rate the optimizer stepped with.
        """
        self._check_ready()
        batch = from_wire(batch)  # tensors, or the numpy arrays TrainerGroup sends (colo.algo.batch.to_wire)
        t, a = self.cfg.trainer, self.cfg.algo
        self._slots = [0.0, 0.0]
        B = batch["input_ids"].shape[0]
        mask = batch["loss_mask"].float()  # (B, T)
        if self.ref_model is not None and not self.ref_frozen:
            self._freeze_reference()
        minis = list(torch.arange(B).tensor_split(max(1, int(t.mini_batches))))
        M = len(minis)
        # one update: the policy before this step is the one its forward runs (trainer.old_logprobs=update, which
        # validate() allows for one update per step only)
        own_old = t.old_logprobs == "update"
        if own_old:
            old = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)  # (B, T), filled by the update
            self._routing_counts = self._no_routing()
        else:
            old = self._logprobs(self.model, batch)  # (B, T) the policy before this step
        ref = batch.get("ref_logprobs")
        if float(a.kl_coef) > 0 and ref is None:
            ref = self._logprobs(self.ref_model, batch)
        self.model.train()
        # one all-reduce for every mini-batch's global token and sequence counts
        counts = self._agree([float(mask[m].sum()) for m in minis]
                             + [float((mask[m].sum(1) > 0).sum()) for m in minis],
                             dist.ReduceOp.SUM)
        sums: dict[str, torch.Tensor] = {}
        norms: list[float] = []
        scored: list[tuple[torch.Tensor, torch.Tensor]] = []  # own_old: (rows, the log-probs the update used)
        for _ in range(max(1, int(t.epochs))):
            for m, rows in enumerate(minis):
                for idx, dummy in self._passes(self.model, self._micro_plan(rows, batch), backward=True):
                    got, used = self._ppo_micro(_rows(batch, idx, dummy), None if own_old else old[idx],
                                                None if ref is None else ref[idx],
                                                max(counts[m], 1.0), max(counts[M + m], 1.0), dummy)
                    if own_old and not dummy:
                        scored.append((idx, used))  # to the host after the passes: .cpu() would wait here
                    for k, v in got.items():
                        sums[k] = sums.get(k, 0.0) + v
                norms.append(self._optim_step())
        for idx, used in scored:
            old[idx] = used.float().cpu()
        keys = sorted(sums)
        tot = dict(zip(keys, self._agree([float(sums[k]) for k in keys], dist.ReduceOp.SUM)))
        updates = max(1, int(t.epochs)) * M
        tokens = max(tot.pop("tokens"), 1.0)
        out = {k: tot.pop(k) / updates for k in ("loss", *ADDITIVE) if k in tot}  # mean over updates
        finite = [x for x in norms if math.isfinite(x)]  # the others were skipped (clip_and_step)
        out |= {"grad_norm": sum(finite) / len(finite) if finite else float("nan"),
                "grad_norm/max": max(finite) if finite else float("nan"), "updates": updates,
                "train/skipped_steps": len(norms) - len(finite), "train/consecutive_skipped": self.consecutive_skipped,
                "trainer/lr": float(self.optimizer.param_groups[0]["lr"])}  # as the optimizer ran it
        out.update({k: v / tokens for k, v in tot.items()})
        out.update(self._parity(batch, old))
        slots, real = self._agree(self._slots, dist.ReduceOp.SUM)
        # the share of token slots the train phase computed (every log-prob and update pass) that held no
        # sample: padding, shard fillers, dummy micro-batches. The one metric that depends on the layout.
        out |= {"train/padding_fraction": 1.0 - real / max(slots, 1.0), "train/token_slots": slots,
                "train/real_tokens": real, "train/old_logprob_pass": 0.0 if own_old else 1.0}
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
            differ, pairs = self._agree(self._routing_counts.tolist(), dist.ReduceOp.SUM)
            out["routing/mismatch"] = differ / max(pairs, 1.0)
        return out

    def _release_cache(self) -> None:
        """Hand the allocator's cached blocks back to the driver at the end of training: next, vLLM wakes its
        weights on this GPU, and the train phase's cache (activations, logits, the optimizer step's
        temporaries: ~25% above the allocated peak, measured) would otherwise still be held beside them.
        colo.plan.memory's sync phase counts on it."""
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

    # The weight sync (colo.sync.sender). `engines`: colocated, [the engine on this rank's GPU];
    # disaggregated, every engine (rank 0 broadcasts to them; the other ranks only take part in the gathers).
    def prepare_sync(self, engines: list) -> dict:
        """Plan the weight sync against the engines' description now, before any step (collective): a
        model the sync cannot map fails here, naming every unmapped trainer tensor and every vLLM param
        nothing writes, all at once."""
        self._check_ready()

        if self.sender is None:
            if self.cfg.placement.mode == "colocated":
                self.sender = Sender.colocated(self.model, self.cfg.sync, engines[0])
            else:
                if self.rank == 0 and self._weight_group is None:
                    raise RuntimeError("a disaggregated sync before join_weight_group on trainer rank 0")
                self.sender = Sender.broadcast(self.model, self.cfg.sync, engines, self._weight_group)
        return self.sender.summary()

    def sync_weights(self, engines: list, probe: dict | None = None) -> dict:
        """Push this rank's weights: the sync report (raises colo.sync.sender.SyncError when unverified); with `probe`
        (colo.sync.probe) also the policy's scores and layer records for the driver's check. Collective."""
        self.prepare_sync(engines)
        report = self.sender.push()
        if probe is not None:
            report["probe"] = self._probe(probe)
        return report

    @torch.no_grad()
    def _probe(self, probe: dict) -> dict:
        """The policy's log-probs of probe["seqs"] and its layer check records (colo.sync.probe, colo.sync.forcing):
        eager (a compiled layer would compile again for these shapes), in eval mode, no routing replay."""
        self._check_ready()
        ids = torch.tensor(probe["seqs"], dtype=torch.long, device=self.device)  # (S, T)
        training = self.model.training
        self.model.eval()
        self.routing.set(None, replay=False)
        try:
            with torch.compiler.set_stance("force_eager"), Forcing(self.model, probe["layers"], "hf",
                                                                   self.model.config) as forced:
                logits = self.model.colo_probe(ids)  # (S, T, V) float32: not the layer check's ids, so not forced
                forced.add_logits(self.model.colo_probe(torch.tensor(forced.hf_ids, device=self.device)))
        finally:
            self.model.train(training)
        for m in self.model.modules():  # as after any forward-only pass (_logprobs): shards for the next sync
            if isinstance(m, FSDPModule):
                m.reshard()
        return {"scores": dataclasses.asdict(trainer_scores(logits, ids)), "layers": forced.records()}

    # Disaggregated: rank 0 opens a broadcast group (colo.sync.transport) that every engine worker joins;
    # the driver calls open_weight_group, then join_weight_group here and on the engines at the same time.
    def open_weight_group(self, world: int) -> dict:
        """Rank 0: start the group's rendezvous; returns its address (plain data) for the engines."""
        if self.rank != 0:
            raise RuntimeError(f"open_weight_group on trainer rank {self.rank}: only rank 0 broadcasts weights")
        self._group_host = WeightGroupHost(ray.util.get_node_ip_address(), world)
        return self._group_host.address

    def join_weight_group(self) -> int:
        self._weight_group = self._group_host.join(self.device)
        return self._weight_group.rank

    def save_checkpoint(self, path: str, extra: dict) -> None:
        if self.ref_frozen:  # the reference is the policy of the first RL step, which no file holds
            checkpoint.save_weights(os.path.join(path, "ref"), self.ref_model)
        checkpoint.save(path, self.model, self.optimizer, extra)  # last: its extra.json marks "complete"

    def load_checkpoint(self, path: str) -> dict:
        extra = checkpoint.load(path, self.model, self.optimizer)
        if self.ref_model is not None:
            # a checkpoint without one (saved with kl_coef 0) freezes the resumed policy at the next step
            self.ref_frozen = checkpoint.load_weights(os.path.join(path, "ref"), self.ref_model)
        return extra

    def export_hf(self, path: str) -> None:
        was_offloaded = self.offloaded
        if was_offloaded:  # the gather is a device collective (NCCL cannot all-gather host memory)
            self.onload()
        if self.lora is None:
            checkpoint.export_hf(path, self.model, self.cfg.model.path, torch_dtype(self.cfg.model.dtype))
        else:  # the adapter as a PEFT folder; the merged weights beside it on request (trainer.lora_export_merged)
            checkpoint.export_adapter(path, self.model, self.lora, self.cfg.model.path, torch.float32)
        if self.lora is not None and self.cfg.trainer.lora_export_merged:
            self.export_merged(str(merged_export(path)))
        if was_offloaded:
            self.offload()

    def export_merged(self, path: str) -> None:  # LoRA: an HF checkpoint of W + s B A (colo.sync.merge)
        checkpoint.export_hf(path, self.model, self.cfg.model.path, self.param_dtype, merged_items(self.model))

    def release_sync_buffers(self) -> None:
        """Unlink the sync's shared-memory segments now: they are named files in /dev/shm, and
        ray.kill/ray.shutdown end actors without running atexit hooks (measured: one leaked per rank and run)."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def shutdown(self) -> None:
        self.release_sync_buffers()
        if self._weight_group is not None:
            self._weight_group.close()
        if dist.is_initialized():
            dist.destroy_process_group()


TrainWorker = ray.remote(Trainer)
