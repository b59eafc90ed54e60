"""The colo package's import graph has no cycle: every `import` of a colo module anywhere in a file (at
module level or inside a function: a lazy import still ties the two modules together), except under
`if TYPE_CHECKING:`, is an edge. A cycle means two modules a reader cannot understand one before the
other (the sync's sender and its benchmark yardstick once imported each other); an upward import (a floor
importing one above it, FLOORS below) means a module that cannot be read before what is built on it.
Pure ast: no colo module is run."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "colo"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if _type_checking_only(node, parents):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from colo.x import y`: y is a submodule or a name in colo.x
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in targets if t in files and t != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None; iterative DFS with three colours."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        colour[start] = GREY
        while stack:
            node, todo = stack[-1]
            if not todo:
                colour[node] = BLACK
                stack.pop()
                continue
            nxt = todo.pop()
            if colour[nxt] == GREY:
                path = [n for n, _ in stack]
                return path[path.index(nxt):] + [nxt]
            if colour[nxt] == WHITE:
                colour[nxt] = GREY
                stack.append((nxt, sorted(graph[nxt])))
    return None


def test_find_cycle_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_colo_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert "colo.sync.sender" in graph and "colo.sync.plan" in graph["colo.sync.sender"]  # the walk sees edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The floors of the package, lowest first. A module may import its own floor and the floors below, never one
# above: a reader can learn the package bottom-up, and a new module has one obvious place. Same-floor imports
# are allowed (config reads prompt data sources; data.inputs reads the config); the cycle test above keeps
# them acyclic.
FLOORS: list[tuple[str, ...]] = [
    ("colo.models", "colo.host", "colo.run"),  # what a model family is; this host's shm and ports; run outputs
    ("colo.config", "colo.data", "colo.algo", "colo.envs"),  # the job: its settings, its data, its RL math, its environments
    ("colo.plan", "colo.sync"),  # whether it fits; the weight path
    ("colo.trainer", "colo.rollout"),  # the two actors
    ("colo.cluster",),  # where they run: placement, nodes, the actors started and their group handles
    ("colo.loop", "colo.runlife", "colo.prepare", "colo.materialize", "colo.launch", "colo.__main__",
     "colo.bench"),  # the driver: the run and its life, the front door and the run dir, the CLI; the benchmarks
]


def floor_of(module: str) -> int | None:
    """The floor of a colo module (its package's), None for the bare `colo` package."""
    for i, floor in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in floor):
            return i
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (floor {floor_of(a)}) -> {b} (floor {floor_of(b)})" for a, targets in graph.items()
                  for b in targets if floor_of(a) is not None and floor_of(b) is not None and floor_of(b) > floor_of(a))


def test_upward_imports_are_seen() -> None:
    assert upward_imports({"colo.config.checks": {"colo.plan.memory", "colo.models.archs"}}) == [
        "colo.config.checks (floor 1) -> colo.plan.memory (floor 2)"]


def test_every_module_has_a_floor_and_imports_none_above_it() -> None:
    graph = import_graph()
    homeless = sorted(m for m in graph if m != "colo" and floor_of(m) is None)
    assert not homeless, f"modules on no floor (add their package to FLOORS): {homeless}"
    up = upward_imports(graph)
    assert not up, "upward imports:\n  " + "\n  ".join(up)


def imports_outside(prefix: str) -> list[str]:
    """Every `import X` / `from X import` in colo/ whose X is `prefix` or below it, as "module -> X" (lazy and
    TYPE_CHECKING imports included: a product module may not even name an experiment's types)."""
    found = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{module_name(path)} -> {n}" for n in names if n == prefix or n.startswith(prefix + ".")]
    return sorted(found)


def test_colo_never_imports_tools() -> None:
    """tools/ (answered experiments) is built on colo, never the reverse: the product runs without it, and an
    experiment can be deleted without touching colo/."""
    assert (ROOT / "tools" / "experiments").is_dir()  # the walk below looks for something that exists
    assert not imports_outside("tools"), "colo imports tools/: " + ", ".join(imports_outside("tools"))
    assert imports_outside("colo.sync")  # the walk sees colo's own imports


def test_no_two_modules_share_a_file_name() -> None:
    """`colo/algo/routing.py` and `colo/rollout/routing.py` read alike in tracebacks and `git log`; every module
    file name says which module it is (package __init__/__main__ aside)."""
    seen: dict[str, list[str]] = {}
    for p in PKG.rglob("*.py"):
        if p.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert not {k: v for k, v in seen.items() if len(v) > 1}, {k: v for k, v in seen.items() if len(v) > 1}


def test_contract_layout_names_every_module_and_only_those() -> None:
    """docs/contract.md's package layout is how a newcomer finds a module: it lists every module file (as
    pkg/file.py, relative to colo/) and nothing that is gone."""
    text = (ROOT / "docs" / "contract.md").read_text()
    block = text.split("## Package layout", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^  ((?:[a-z_]+/)?[a-z_][a-z0-9_]*\.py) ", block, flags=re.MULTILINE))
    modules = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if p.name != "__init__.py"}
    assert modules <= listed, f"modules missing from docs/contract.md's layout: {sorted(modules - listed)}"
    assert listed <= modules, f"docs/contract.md's layout names files that do not exist: {sorted(listed - modules)}"
