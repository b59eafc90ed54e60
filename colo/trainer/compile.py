"""trainer.compile: torch.compile each decoder layer, so the elementwise work between the matmuls runs fused.

    parallelize(model, mesh, compile_backend="inductor")   # compile_layers(layers) before fully_shard
    compile_stats()                                         # frames, graphs, graph breaks, compile seconds

Why: on an H100 the eager train phase's kernels were 60% elementwise and 19% matmul (a `colo.bench.step --profile`
of qwen3-30b-a3b-L4 at 4k): fp32 RMSNorms, rotary, the router's softmax / top-k, the experts' SiLU, each
a kernel of its own that reads and writes the whole activation. Inductor fuses them per graph. The log-prob chunks'
math, the rest of that elementwise work, is compiled in colo.algo.logprobs (parallelize hands it the backend).
Measured against eager in one run: the train phase 1.51x on an H100, 1.74x on an H200 (docs/benchmarks.md, "What
each trainer setting buys").

How, after torchtitan's apply_compile: each decoder layer is compiled in place (`layer.compile()`: parameter
names stay those of the checkpoint and the sync) before fully_shard, so FSDP2's hooks run outside the graphs
(dynamo skips them). What stays eager, each a graph break inside the layer:
- the attention call (colo.trainer.attention._attention, compile-disabled): its kernel is one flash varlen call
  or SDPA per sample either way, and a packed row's bounds vary with every micro-batch (attention.Bounds);
- the routing hook (colo.algo.replay.RouterTap, compile-disabled): per-layer state dynamo would guard on;
- the FSDP2 hooks of the experts' own unit (dynamo skips FSDP hooks).
Shapes: packed micro-batches have a token count of their own each. dynamo's automatic dynamic shapes compile each
graph once for the first count and once more with the count symbolic, then reuse it: no padding of the row,
a bounded number of compiles (compile_stats counts them), all in the first step on a GPU since colo.algo.packing
spreads each step's tokens evenly over its micro-batches: a small remainder micro-batch used to fail a guard of the
symbolic graphs and recompile every layer in later steps (docs/benchmarks/2026-11-27-l12-train-phase.md).
dynamic=True from the start was slower to compile
(the tiny model on 2 shared CPU cores, one run each: 42 s against 18 s for the first step).
"""
from __future__ import annotations

from torch import nn

RECOMPILE_LIMIT = 32
"""Graphs per code object (dynamo's default 8): all layers share one code object, and each graph is compiled for
grad and no-grad (update, log-prob pass), trainable and frozen weights (policy, KL reference), a static then a
dynamic token count, and, on the padded path, a dynamic batch dimension."""


def compile_layers(layers: nn.ModuleList, backend: str = "inductor") -> None:
    """Compile every decoder layer in place (module.compile: names, parameters and hooks stay the module's)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for layer in layers:
        layer.compile(backend=backend)


def compile_stats() -> dict[str, float]:
    """This process's dynamo figures so far: frames compiled (every layer function, resume function after a graph
    break and recompile for a failed guard counts once), graphs, graph breaks, and the seconds dynamo and its
    backend spent compiling forward graphs plus inductor's backward compiles (AOT autograd compiles a backward
    graph at the first backward through it)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(sum(v) for k, v in compilation_time_metrics.items() if k in ("_compile.compile_inner",
                                                                               "compile_fx.<locals>.bw_compiler"))
    return {"frames": float(counters["frames"]["ok"]), "graphs": float(counters["stats"]["unique_graphs"]),
            "graph_breaks": float(sum(counters["graph_break"].values())), "compile_s": float(seconds)}
