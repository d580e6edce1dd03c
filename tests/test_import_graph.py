"""The import graph of ``src/tierckpt``, read with ``ast``: no cycles.

Every ``import``/``from ... import`` of a project module counts, at module level or inside a function
(a lazy import still closes a cycle, it only defers it), and so does one under ``if TYPE_CHECKING:``
(it never runs, but the two modules still know each other: a protocol in the lower one breaks it).
Importing ``tierckpt.a.b`` from outside the package ``tierckpt.a`` also runs ``tierckpt/a/__init__.py``, so that edge is added too. A cycle fails with its chain of modules and
the file and line of each import.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


SRC = Path(__file__).resolve().parents[1] / "src" / "tierckpt"
"""This checkout's sources (not whichever copy of the package is installed)."""
ROOT = "tierckpt"

@dataclass(frozen=True, slots=True)
class Edge:
    """``importer`` imports ``imported`` at ``file:line``, by a statement naming ``named`` (``imported``
    itself or a module below it); ``lazy``: inside a function body."""

    importer: str
    imported: str
    file: str
    line: int
    lazy: bool
    named: str = ""
    typing_only: bool = False
    """Under ``if TYPE_CHECKING:`` (it closes a cycle all the same)."""

    def __str__(self) -> str:
        how = ", lazy" if self.lazy else ", TYPE_CHECKING" if self.typing_only else ""
        return f"{self.importer} -> {self.imported} ({self.file}:{self.line}{how})"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative levels resolved against ``importer``)."""
    if not node.level:
        return node.module or ""
    package = importer if _is_package(importer) else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _targets(importer: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Project modules an import statement loads: the named module, or each imported submodule."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == ROOT]
    base = _resolve(importer, node)
    if base.split(".")[0] != ROOT:
        return []
    subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
    return subs or [base]


def _with_packages(importer: str, target: str) -> list[str]:
    """``target`` and the packages above it whose ``__init__`` the import runs (those not above ``importer``)."""
    parts = target.split(".")
    chain = [".".join(parts[:i]) for i in range(2, len(parts))] + [target]
    return [m for m in chain if m in MODULES and not importer.startswith(m + ".") and m != importer]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never executed, counted all the same)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def _edges_of(module: str) -> list[Edge]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = _type_checking_nodes(tree)
    lazy_nodes = {
        id(n)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for n in ast.walk(fn)
    }
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(module, node):
                for imported in _with_packages(module, target):
                    file = str(path.relative_to(SRC.parent))
                    edges.append(Edge(module, imported, file, node.lineno, id(node) in lazy_nodes, target,
                                      id(node) in typing_only))
    return edges


EDGES = [e for m in MODULES for e in _edges_of(m)]


def _cycles(edges: list[Edge]) -> list[list[Edge]]:
    """Cycles (lists of edges, the last returning to the first module): in each strongly connected
    component of more than one module (or with a self-import), the shortest cycle through each of its
    modules, without repeats."""
    graph: dict[str, list[Edge]] = {}
    for e in edges:
        graph.setdefault(e.importer, []).append(e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph.get(v, []):
            w = e.imported
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    cycles: list[list[Edge]] = []
    seen: set[frozenset[tuple[str, str]]] = set()
    for component in components:
        first = min(component)
        if len(component) == 1 and not any(e.imported == first for e in graph.get(first, [])):
            continue
        for start in sorted(component):
            cycle = _shortest_cycle(graph, start, component)
            shape = frozenset((e.importer, e.imported) for e in cycle)
            if shape not in seen:
                seen.add(shape)
                cycles.append(cycle)
    return cycles


def _shortest_cycle(graph: dict[str, list[Edge]], start: str, component: set[str]) -> list[Edge]:
    """The shortest chain of edges from ``start`` back to itself inside ``component`` (breadth first)."""
    paths: dict[str, list[Edge]] = {start: []}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for e in sorted(graph.get(v, []), key=lambda e: (e.imported, e.line)):
                if e.imported == start:
                    return paths[v] + [e]
                if e.imported in component and e.imported not in paths:
                    paths[e.imported] = paths[v] + [e]
                    nxt.append(e.imported)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def _report(cycles: list[list[Edge]]) -> str:
    lines = [f"{len(cycles)} import cycle(s) in src/tierckpt:"]
    for cycle in cycles:
        lines.append("  " + " -> ".join([cycle[0].importer] + [e.imported for e in cycle]))
        lines += [f"      {e}" for e in cycle]
    return "\n".join(lines)


def test_the_walk_sees_the_package() -> None:
    """Guards the test itself: modules, relative imports, package __init__ edges and lazy imports are all found."""
    assert {"tierckpt", "tierckpt.native.layout", "tierckpt.backends", "tierckpt.backends.base", "tierckpt.cache_api"} <= set(MODULES)
    pairs = {(e.importer, e.imported) for e in EDGES}
    assert ("tierckpt.native.metadata", "tierckpt.native.layout") in pairs  # from .layout import ...
    assert ("tierckpt.backends.local", "tierckpt.native.keys") in pairs  # from ..keys import ...
    assert ("tierckpt.store", "tierckpt.backends") in pairs  # from .backends import ...
    assert ("tierckpt.manager.api", "tierckpt.io.scheduler") in pairs and ("tierckpt.manager.api", "tierckpt.io") in pairs
    assert not any(e.importer == e.imported for e in EDGES)
    assert any(e.lazy for e in EDGES) and any(not e.lazy for e in EDGES)
    assert any(e.typing_only for e in EDGES), "the walk must see the TYPE_CHECKING imports (they count)"


def test_a_type_checking_import_closes_a_cycle() -> None:
    """Guards the walk: an import under ``if TYPE_CHECKING:`` is an edge (it closes a cycle like any other)."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .keys import X\n")
    (imp,) = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "keys"]
    assert id(imp) in _type_checking_nodes(tree)
    a, b = "tierckpt.native.layout", "tierckpt.native.keys"
    edges = [Edge(a, b, "x.py", 1, False), Edge(b, a, "y.py", 3, False, typing_only=True)]
    (cycle,) = _cycles(edges)
    assert "TYPE_CHECKING" in _report([cycle])


def test_cycle_finder_reports_a_chain() -> None:
    a, b, c = "tierckpt.native.layout", "tierckpt.native.keys", "tierckpt.errors"
    edges = [Edge(a, b, "x.py", 1, False), Edge(b, c, "y.py", 2, True), Edge(c, a, "z.py", 3, False)]
    (cycle,) = _cycles(edges)
    assert [e.importer for e in cycle] == [c, a, b]  # from the smallest name, back to it
    assert "tierckpt.errors -> tierckpt.native.layout (z.py:3)" in _report([cycle])
    assert _cycles(edges[:2]) == []


def test_no_import_cycle() -> None:
    cycles = _cycles(EDGES)
    assert not cycles, _report(cycles)


def test_the_node_tiers_do_not_import_each_other() -> None:
    """The node disk cache and the memory tier are links on the write-back engine (``tierckpt.node``):
    what they share lives there, and neither package imports the other (TYPE_CHECKING imports included)."""
    crossing = [e for e in EDGES for a, b in (("cache", "tiers"), ("tiers", "cache"))
                if e.importer.startswith(f"tierckpt.{a}.") and e.imported.startswith(f"tierckpt.{b}")]
    assert not crossing, "\n".join(map(str, crossing))
    assert not [e for e in EDGES if e.importer.startswith("tierckpt.node") and
                e.imported.startswith(("tierckpt.node.disk", "tierckpt.node.memory"))], "the engine imports neither link"

