"""The layer check's hooks: forwards of a transformers or a vLLM model with every site's input fixed.

    with Forcing(model, spec, "hf", model.config) as f:       # the trainer (transformers, FSDP2 or not)
        f.add_logits(model.colo_probe(torch.tensor(f.hf_ids)))  # (S, T + 1, V): one forward of every row
    trainer = f.records()

    f = Forcing(model, spec, "vllm", hf_config).__enter__()   # the engine's worker (colo_check_start)
    llm.generate(f.ids, max_tokens=2)                         # a prefill and one decode step, vLLM's own kernels
    f.__exit__(); f.add_logits(model.compute_logits(f.final)); f.add_embedding_rows(...)   # colo_check_stop
    engine = f.records()

The same module paths exist in both (the checkpoint's structure): `model.embed_tokens` (GPT-OSS in vLLM:
`embedding`), `model.layers.N.{input_layernorm, *attn, post_attention_layernorm, mlp}`, `model.norm`; a MoE mlp has
a router (transformers: a `*Router` module whose F.linear gives the logits; vLLM: its `gate` / `router` linear).
What differs is handled here: vLLM's norms take and return (hidden, residual) (the residual is set to zeros, so
the norm sees exactly the forced input), vLLM runs padded or several sequences as rows of one (N, H) batch, and
vLLM's forward may be a dummy batch of its data-parallel group (the hooks act only on the forward whose token ids
are the check's, and the decode step after it: the embedding's pre-hook says which).

Inputs and designed routing come from colo.sync.layercheck; records are bucketed there too. A site or a forward the
hooks never saw (a captured CUDA graph runs no Python) is missing from the records, which the comparison reports.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from colo.models.archs import num_experts
from colo.sync.layercheck import bucket, forced_logits, group_size, packed, row_vector, sequences, site_inputs

ATTENTION = ("self_attn", "attn", "linear_attn")
MLP = ("mlp", "block_sparse_moe", "feed_forward")
EMBEDDING = ("embed_tokens", "embedding", "wte")
EMBED, EMBED_ROWS = "model.embed_tokens", "model.embed_tokens (every row)"  # site labels: HF module paths
EMBED_CHUNK = 8192  # vocabulary rows per lookup when every row is compared (vLLM side)


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def _child(module: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return name, child
    return None


def hf_router(mlp: nn.Module) -> nn.Module | None:
    """transformers 5: the MoE block's router module (Qwen3MoeTopKRouter, DeepseekV3TopkRouter, GptOssTopKRouter)."""
    return next((m for m in mlp.children() if type(m).__name__.lower().endswith("router")), None)


def vllm_router(mlp: nn.Module) -> nn.Module | None:
    """vLLM 0.32: the MoE block's router linear (`gate`, GPT-OSS's `router`), beside its FusedMoE `experts`."""
    if not isinstance(getattr(mlp, "experts", None), nn.Module):
        return None
    found = _child(mlp, ("gate", "router"))
    return found[1] if found else None


class _FirstLinear(TorchFunctionMode):
    """Inside a transformers router's forward: its first F.linear (the router logits) is recorded and replaced."""

    def __init__(self, replace: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.replace, self.done = replace, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear and not self.done:
            self.done = True
            return self.replace(out)
        return out


class Forcing:
    """Hooks on `model` for the layer check's forward(s) (module doc). `side`: "hf" | "vllm"; `config`: the HF
    config (dict or object) of the model, for its experts and routing groups.

    Rows are counted in the trainer's order: sequence s's T prompt tokens, then one decoded token after them, so
    S * (T + 1) rows. transformers runs them in one forward of (S, T + 1) tokens; vLLM in two, the prefill of the S
    prompts and the decode step after it (max_tokens=2), whose kernels differ: MLA's absorbed W_UK_T / W_UV, for one,
    serve only decode tokens. Each forward's rows map to trainer rows (`phases`)."""

    def __init__(self, model: nn.Module, spec: dict, side: str, config: Any, decode: bool = True) -> None:
        """`decode` (vLLM): the decode step runs eagerly, so its hooks run (not where it replays a CUDA graph)."""
        self.model, self.spec, self.side = model, spec, side
        self.experts = num_experts(config)
        self.ids = sequences(spec, self.experts)  # (S, T): the prompts
        count, per = len(self.ids), len(self.ids[0])
        self.rows = count * (per + 1)
        prompt = torch.tensor([s * (per + 1) + t for s in range(count) for t in range(per)])  # prefill row -> row
        decoded = torch.tensor([s * (per + 1) + per for s in range(count)])
        self.prompt_rows = prompt
        # the decoded position's token is not compared (its embedding is replaced by the forced inputs): any id does
        self.hf_ids = [s + s[:1] for s in self.ids]  # (S, T + 1)
        self.phases = [torch.arange(self.rows)] if side == "hf" else [prompt, decoded] if decode else [prompt]
        self.notes = [] if side == "hf" or decode else [
            "the decode step's kernels are not checked: the engine replays captured CUDA graphs for decode "
            "(rollout.enforce_eager=false), where no hook runs"]
        self._expect = torch.tensor([t for s in (self.hf_ids if side == "hf" else self.ids) for t in s])
        self.crafted = (forced_logits(self.rows, self.experts, int(_get(config, "num_experts_per_tok") or 1),
                                      group_size(config)) if self.experts else None)
        self.vocab = int(_get(config, "vocab_size") or 0)
        base = getattr(model, "model", model)
        found = _child(base, EMBEDDING)
        if found is None or not isinstance(getattr(base, "layers", None), nn.ModuleList) or \
                not isinstance(getattr(base, "norm", None), nn.Module):
            raise RuntimeError(f"{type(model).__name__}: the layer check needs model.embed_tokens, model.layers and "
                               "model.norm (a decoder-only LM of a family colo maps)")
        self.embed, self.layers, self.norm = found[1], base.layers, base.norm
        self.phase, self.active, self.waiting = -1, False, True  # the forward in progress; hooks act; next one is ours
        self.parts: dict[str, dict[int, torch.Tensor]] = {}  # site -> phase -> (its rows, D) records
        self.extra: dict[str, torch.Tensor] = {}  # records outside the forward: every embedding row, lm_head
        self.order: list[str] = []  # every site this side expects, forward order
        self.routing: dict[str, list[int]] = {}  # "model.layers.L.mlp" -> each row's dominant expert (transformers)
        self.problems: list[str] = []
        self._final: dict[int, torch.Tensor] = {}  # phase -> the final norm's (rows, H) output
        self._inputs: dict[int, torch.Tensor] = {}
        self._handles: list = []
        self._undo: list[Callable[[], None]] = []

    @property
    def _here(self) -> torch.Tensor:
        """The trainer rows of the forward in progress, in its row order."""
        return self.phases[self.phase]

    # ------------------------------------------------------------------------------------------ install

    def __enter__(self) -> Forcing:
        self._hook(self.embed, pre=self._guard, post=self._record(EMBED, embedding=True))
        self.order += [EMBED, EMBED_ROWS]
        for i, layer in enumerate(self.layers):
            attn, mlp = _child(layer, ATTENTION), _child(layer, MLP)
            for need, what in ((attn, "attention"), (mlp, "mlp")):
                if need is None:
                    raise RuntimeError(f"model.layers.{i}: no {what} module the layer check knows")
            for name in ("input_layernorm", "post_attention_layernorm"):
                if not isinstance(getattr(layer, name, None), nn.Module):
                    raise RuntimeError(f"model.layers.{i}: no {name} (the layer check forces its input)")
            self._site(layer.input_layernorm, f"model.layers.{i}.input_layernorm", 2 * i)
            self._hook(attn[1], post=self._record(f"model.layers.{i}.self_attn"))
            self.order.append(f"model.layers.{i}.self_attn")
            self._site(layer.post_attention_layernorm, f"model.layers.{i}.post_attention_layernorm", 2 * i + 1)
            router = (hf_router if self.side == "hf" else vllm_router)(mlp[1])
            if router is not None and self.crafted is not None:
                self._force_router(router, f"model.layers.{i}.mlp.gate")
                self.order.append(f"model.layers.{i}.mlp.gate")
                if self.side == "hf" and isinstance(getattr(mlp[1], "experts", None), nn.Module):
                    self._hook(mlp[1].experts, pre=self._routing(f"model.layers.{i}.mlp"))
            self._hook(mlp[1], post=self._record(f"model.layers.{i}.mlp"))
            self.order.append(f"model.layers.{i}.mlp")
        self._site(self.norm, "model.norm", 2 * len(self.layers), keep=True)
        self.order.append("lm_head")
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        for undo in reversed(self._undo):
            undo()
        self._handles, self._undo, self.active = [], [], False

    def _hook(self, module: nn.Module, pre: Callable | None = None, post: Callable | None = None) -> None:
        if pre is not None:
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        if post is not None:
            self._handles.append(module.register_forward_hook(post, with_kwargs=True))

    def _site(self, norm: nn.Module, label: str, site: int, keep: bool = False) -> None:
        """A norm whose input is forced (site's fixed input) and whose output is recorded."""
        self._hook(norm, pre=self._force(site), post=self._record(label, keep=keep))
        self.order.append(label)

    # ------------------------------------------------------------------------------------------ hooks

    def _guard(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The embedding sees each forward's token ids: the first forward of the check is the one whose ids are the
        check's, the next ones (vLLM's decode step) follow it; anything else (a data-parallel group's dummy batch)
        passes through untouched."""
        ids = (args[0] if args else kwargs.get("input_ids")).reshape(-1)
        if self.phase == -1:
            self.waiting = ids.numel() >= self._expect.numel() and \
                torch.equal(ids[: self._expect.numel()].to("cpu", torch.long), self._expect)
        self.active = self.waiting and self.phase + 1 < len(self.phases)
        if self.active:
            self.phase += 1
            self.waiting = False
        return None

    def _input(self, site: int, like: torch.Tensor) -> torch.Tensor:
        """The forced input of `site` for the forward in progress: (its rows, H) in like's dtype and device."""
        if site not in self._inputs:
            self._inputs[site] = site_inputs(self.spec, site, self.rows, like.shape[-1])  # (rows, H) float32
        return self._inputs[site][self._here].to(like.device, like.dtype)

    def _force(self, site: int) -> Callable:
        def pre(module: nn.Module, args: tuple, kwargs: dict):
            if not self.active:
                return None
            key = None if args else next(k for k in ("x", "hidden_states") if k in kwargs)
            x = args[0] if args else kwargs[key]
            flat = x.reshape(-1, x.shape[-1]).clone()  # (N, H): N >= its rows (padding, a DP group's batch)
            flat[: len(self._here)] = self._input(site, x)
            new = flat.view(x.shape)
            # vLLM's fused residual add: a zero residual makes the norm see exactly the forced input
            zero = lambda a: torch.zeros_like(a) if torch.is_tensor(a) and a.shape == x.shape else a  # noqa: E731
            kw = {k: zero(v) if k == "residual" else v for k, v in kwargs.items()}
            if key is not None:
                kw[key] = new
                return args, kw
            return (new, *map(zero, args[1:])), kw
        return pre

    def _record(self, label: str, keep: bool = False, embedding: bool = False) -> Callable:
        def post(module: nn.Module, args: tuple, kwargs: dict, output: Any):
            if not self.active:
                return None
            out = output[0] if isinstance(output, (tuple, list)) else output
            if out is None:  # a vLLM module that writes into the buffer it was given
                out = kwargs.get("output")
            flat = out.reshape(-1, out.shape[-1])[: len(self._here)].detach()  # (its rows, H)
            self.parts.setdefault(label, {})[self.phase] = bucket(flat, self.spec["buckets"]).cpu()
            if embedding and self.side == "hf":  # every vocabulary row, from the (gathered) weight itself
                w = module.weight[: self.vocab or None]  # (V, H)
                self.extra[EMBED_ROWS] = (w.float() @ row_vector(self.spec, w.shape[1]).to(w.device))[:, None].cpu()
            if keep:  # the final norm: this forward of the check ends here
                self._final[self.phase] = flat
                self.active, self.waiting = False, True
            return None
        return post

    def _replace_logits(self, label: str, logits: torch.Tensor) -> torch.Tensor:
        """Record the router's own logits (rows, E) and hand the designed ones on (colo.sync.layercheck)."""
        flat = logits.reshape(-1, logits.shape[-1])
        n = len(self._here)
        self.parts.setdefault(label, {})[self.phase] = flat[:n].detach().float().cpu()
        new = flat.clone()
        new[:n] = self.crafted[self._here].to(new.device, new.dtype)
        return new.view(logits.shape)

    def _force_router(self, router: nn.Module, label: str) -> None:
        if self.side == "vllm":
            def post(module: nn.Module, args: tuple, kwargs: dict, output: Any):
                if not self.active:
                    return None
                if isinstance(output, tuple):
                    return (self._replace_logits(label, output[0]), *output[1:])
                return self._replace_logits(label, output)
            self._hook(router, post=post)
            return
        original, own = router.forward, "forward" in router.__dict__

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return original(*args, **kwargs)
            with _FirstLinear(lambda out: self._replace_logits(label, out)):
                return original(*args, **kwargs)

        router.forward = forward
        self._undo.append(lambda: setattr(router, "forward", original) if own else delattr(router, "forward"))

    def _routing(self, label: str) -> Callable:
        """transformers' experts(hidden, ids (N, K), weights (N, K) or (N, E)): each row's dominant expert."""
        def pre(module: nn.Module, args: tuple, kwargs: dict):
            if not self.active:
                return None
            given = [a for a in (*args[1:], *kwargs.values()) if torch.is_tensor(a)]
            ids = next(a for a in given if not a.is_floating_point())[: self.rows]  # transformers: one forward
            weights = next(a for a in given if a.is_floating_point())[: self.rows].float()
            if weights.shape[-1] == ids.shape[-1]:
                dom = ids.gather(1, weights.argmax(1, keepdim=True))[:, 0]
            else:
                dom = weights.argmax(1)
            self.routing[label] = [int(e) for e in dom.tolist()]
            missing = sorted(set(range(self.experts)) - set(self.routing[label]))
            if missing:
                self.problems.append(f"{label}: the designed routing made no token's main expert of {missing[:8]}: "
                                     "their weights were not checked")
            return None
        return pre

    # ------------------------------------------------------------------------------------------ results

    @property
    def final(self) -> torch.Tensor | None:
        """(rows seen, H) the final norm's outputs in trainer-row order: vLLM's lm_head is run on them."""
        if not self._final:
            return None
        return torch.cat([self._final[p] for p in sorted(self._final)])

    def add_logits(self, logits: torch.Tensor) -> None:
        """Logits (rows or (S, T + 1), V) of the final norm's forced outputs, in final's row order: lm_head, every
        vocabulary row of it."""
        self.extra["lm_head"] = bucket(logits.reshape(-1, logits.shape[-1]), self.spec["buckets"]).cpu()

    @torch.no_grad()
    def add_embedding_rows(self, device: torch.device) -> None:
        """vLLM: every vocabulary row through the engine's own embedding module, projected (transformers: in the
        embedding's hook, from its weight)."""
        out = []
        r = None
        for a in range(0, self.vocab, EMBED_CHUNK):
            e = self.embed(torch.arange(a, min(a + EMBED_CHUNK, self.vocab), device=device))  # (n, H)
            r = row_vector(self.spec, e.shape[-1]).to(e.device) if r is None else r
            out.append((e.float() @ r).cpu())
        self.extra[EMBED_ROWS] = torch.cat(out)[:, None]

    def records(self) -> dict:
        """Plain data for the driver: each site's (rows, D) float32 values (layercheck.packed) with the trainer rows
        it holds (`index`: the phases seen; the embedding, its prompt rows only), in this side's forward order."""
        seen = sorted({p for parts in self.parts.values() for p in parts})
        index = torch.cat([self.phases[p] for p in seen]) if seen else torch.zeros(0, dtype=torch.long)
        sites, rows = {}, {}
        for label, parts in self.parts.items():
            if sorted(parts) != seen:
                self.problems.append(f"{label}: recorded in {len(parts)} of the {len(seen)} forwards")
                continue
            value = torch.cat([parts[p] for p in seen])
            keep = torch.isin(index, self.prompt_rows) if label == EMBED else torch.ones(len(index), dtype=torch.bool)
            sites[label], rows[label] = packed(value[keep]), index[keep].tolist()
        for label, value in self.extra.items():
            sites[label] = packed(value)
            rows[label] = index.tolist() if label == "lm_head" else list(range(value.shape[0]))
        return {"order": list(self.order), "sites": sites, "rows": rows, "routing": dict(self.routing),
                "problems": list(self.problems), "notes": list(self.notes), "forwards": len(seen),
                "expected_forwards": len(self.phases)}
