"""The Python heap of a long-lived process: its heavy imports with the cyclic garbage collector paused, then frozen.

    with imports_frozen():
        from vllm import LLM      # ~0.6M objects that live as long as the process

Why: importing vLLM creates about 600,000 tracked objects, and the collector's full passes over a growing heap
cost a fifth of the import (paused, then one pass and the freeze: 0.80x its CPU-seconds on a 2-core EPYC,
tools/experiments/import_gc.py, docs/benchmarks.md). vLLM's model loader then calls gc.collect() twice per engine
start, each a pass over the whole heap again (~1 CPU-s together) unless what the imports made is frozen (gc.freeze:
kept out of every later pass).
Objects created later, such as the loader's transient tensors, are still collected as before. One pass runs before
the freeze, so the imports' own garbage is not kept; the heap is unfrozen at exit, so the interpreter's last
collection still finalizes it (nanobind, under Triton, reports its objects as leaked otherwise).
"""
from __future__ import annotations

import atexit
import contextlib
import gc
from typing import Iterator

_unfreeze_at_exit = False


@contextlib.contextmanager
def imports_frozen() -> Iterator[None]:
    global _unfreeze_at_exit
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        if enabled:
            gc.enable()
        if not _unfreeze_at_exit:
            atexit.register(gc.unfreeze)
            _unfreeze_at_exit = True
