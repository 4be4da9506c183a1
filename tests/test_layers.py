"""kvlab's floors: import arrows go one way, modules stay small, every name is said once.

The import graph is read from the source (every ``import``, also those inside functions), so a
lazy import cannot hide a cycle; a module that loads a package's chapter modules by name
(:data:`LOADS_BY_NAME`: the catalog of exercises, the scenes' renderer) counts as importing
each of them.
"""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvlab"

#: the floors of the package, lowest first: a module imports only from its own floor or below
#: (CONTRIBUTING draws them). Each entry is a module or a package (and everything under it).
FLOORS = [
    ["base", "moved"],                       # errors, argument rules, runtime; old paths
    ["course.reference"],                    # oracles: they import only base.errors
    ["alloc"],                               # chapters 01-04, 09
    ["prefix"],                              # 05, 11
    ["manager"],                             # 06
    ["attention"],                           # 08, 09
    ["serving.pressure"],                    # 12's policies, plain rules
    ["serving"],                             # the simulator, the tiny engine, the generator
    ["course.viz", "course.widgets"],        # pictures (they read plain data)
    ["bench"],                               # the benchmarks
    ["course.checking"],                     # the machinery of a check
    ["course.exercises", "course.scenes"],   # each chapter's exercises; its scenes and figures
    ["course.check"],                        # the learner's door: catalog, progress
    ["course"],                              # solutions, the Colab cell
]
#: modules that import each module of a package by name, found on disk
LOADS_BY_NAME = {"course.check.catalog": "course.exercises.ch", "course.scenes.render": "course.scenes.ch"}
#: at most this many modules beside the subsystem folders at the top of the package
TOP_LEVEL_LIMIT = 8


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
        if name in LOADS_BY_NAME:  # loads its chapter modules by name
            deps.update(m for m in modules if m.startswith(LOADS_BY_NAME[name]))
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


def floor_of(name: str) -> int:
    """The floor of a module (its most specific entry in :data:`FLOORS`)."""
    best, depth = None, -1
    for i, entries in enumerate(FLOORS):
        for entry in entries:
            if (name == entry or name.startswith(entry + ".")) and entry.count(".") > depth:
                best, depth = i, entry.count(".")
    assert best is not None, f"kvlab.{name} is on no floor: add it to FLOORS"
    return best


def test_every_module_that_loads_modules_by_name_is_known():
    for name, path in _modules().items():
        if "iter_modules" in path.read_text():
            assert name in LOADS_BY_NAME, f"kvlab.{name} loads modules by name: list it in LOADS_BY_NAME"


def test_no_module_imports_a_floor_above_its_own():
    upward = [f"kvlab.{a} (floor {floor_of(a)}) imports kvlab.{b} (floor {floor_of(b)})"
              for a, deps in _import_graph().items() if a
              for b in deps if b and floor_of(b) > floor_of(a)]
    assert not upward, "\n".join(upward)


def test_the_floor_check_sees_an_upward_import():
    assert floor_of("alloc.paging") < floor_of("serving.hf.generator") < floor_of("course.check.catalog")
    assert floor_of("course.reference.alloc_ref") < floor_of("alloc.token_allocator")
    assert floor_of("serving.pressure") < floor_of("serving.sim.scheduler")


def test_oracles_import_only_the_errors_and_each_other():
    graph = _import_graph()
    for name, deps in graph.items():
        if name.startswith("course.reference"):
            assert all(d == "base.errors" or d.startswith("course.reference") for d in deps), \
                f"kvlab.{name} imports {sorted(deps)}"


def test_the_top_level_holds_the_subsystems_and_few_modules():
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(modules) <= TOP_LEVEL_LIMIT, modules
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert folders == {"base", "alloc", "prefix", "manager", "attention", "serving", "course", "bench"}, folders


def test_no_module_name_appears_twice():
    """A module's name says what it is, once: no ``alloc_checks`` on two floors."""
    names = Counter(n for p in ROOT.rglob("*.py")
                    for n in [p.parent.name if p.stem == "__init__" else p.stem]
                    if p.stem != "__main__" and not (p.stem == "__init__" and p.parent == ROOT))
    twice = sorted(n for n, c in names.items() if c > 1)
    assert not twice, f"module names used in more than one place: {twice}"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_modules_stay_small(name):
    """At most 450 lines a module; the checkers' modules at most 350 (they were the largest)."""
    limit = 350 if name.startswith(("course.check", "course.exercises")) else 450
    lines = _modules()[name].read_text().count("\n")
    assert lines <= limit, f"kvlab/{name.replace('.', '/')}.py has {lines} lines (at most {limit})"
