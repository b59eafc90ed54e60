"""colo.host.heap: heavy imports with the cyclic collector paused, then the survivors frozen, the imports' own
garbage not among them.

    .venv/bin/python -m pytest -q tests/unit/test_host_heap.py
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, weakref
    from colo.host.heap import imports_frozen

    class Node:
        pass

    before = gc.get_freeze_count()
    with imports_frozen():
        assert not gc.isenabled()  # paused while the imports run
        import json.decoder, email.parser  # stands in for vLLM: modules that live as long as the process
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle only the collector frees: the imports' garbage
        gone = weakref.ref(a)
        kept = Node()
        kept.me = kept
        del a, b
    assert gc.isenabled(), "the collector is on again"
    assert gone() is None, "garbage made during the imports was frozen instead of collected"
    assert gc.get_freeze_count() > before  # what lives on is frozen
    n = gc.get_freeze_count()
    with imports_frozen():  # again (an engine restarted in place): nothing breaks, the count only grows
        pass
    assert gc.get_freeze_count() >= n
    gc.disable()
    with imports_frozen():
        pass
    assert not gc.isenabled(), "a collector the caller had off stays off"
    print("heap ok")
""")


def test_imports_run_with_the_collector_paused_and_their_survivors_frozen() -> None:
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "heap ok", p.stderr[-2000:]
    assert "leaked" not in p.stderr  # unfrozen at exit: the interpreter's last collection finalizes it all
