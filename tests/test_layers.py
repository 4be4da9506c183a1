"""kvlab's floors: import arrows go one way, modules stay small.

The import graph is read from the source (every ``import``, also those inside functions), so a
lazy import cannot hide a cycle; a package that loads its chapter modules by name
(``kvlab.check``'s catalog, ``kvlab.scenes``) counts as importing each of them.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvlab"

#: the modules of the cache manager's floor and what is built on it (chapters 05-08, 11)
CORE = ["errors", "radix_node", "radix_cache", "hash_chain", "hash_cache_views", "hash_cache", "req",
        "cache_regions", "cache_manager_checks", "cache_manager_undo", "cache_manager", "kvcache",
        "attention", "engine", "sim", "sim.scheduler", "sim.timeline", "sim.workloads", "sim.caches", "reference",
        "reference.attention", "reference.radix", "reference.hashchain", "viz.tree",
        "scenes.ch05_radix", "scenes.ch06_cache_req", "scenes.ch07_serving_loop",
        "scenes.ch08_attention", "scenes.ch11_hash_cache", "sim.compare"]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _import_graph() -> dict[str, set[str]]:
    """module -> the kvlab modules it imports (names relative to ``kvlab``, "" is the package)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    child = f"{target}.{alias.name}".lstrip(".")
                    deps.add(child if child in modules else target)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                deps.update(n[len("kvlab."):] for n in names if n and n.startswith("kvlab."))
        if "iter_modules" in path.read_text():  # loads its chapter modules by name
            deps.update(m for m in modules if m.startswith(f"{package}.ch"))
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_anywhere_in_kvlab():
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_model_never_imports_the_view_and_oracles_stand_below_what_they_check():
    graph = _import_graph()
    for name in CORE:
        if name.startswith(("sim", "radix", "hash", "cache", "req", "engine", "kvcache", "attention")):
            assert not any(d.startswith(("viz", "widgets", "scenes")) for d in graph[name]), name
    for name in ("reference", "reference.attention", "reference.radix", "reference.hashchain"):
        assert graph[name] <= {"errors", "reference.paging", "reference.alloc", "reference.attention",
                               "reference.radix", "reference.hashchain"}, f"{name} imports {graph[name]}"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_modules_stay_small(name):
    """At most 450 lines a module; the checkers' modules at most 350 (they were the largest)."""
    limit = 350 if name == "check" or name.startswith("check.") else 450
    lines = _modules()[name].read_text().count("\n")
    assert lines <= limit, f"kvlab/{name.replace('.', '/')}.py has {lines} lines (at most {limit})"
