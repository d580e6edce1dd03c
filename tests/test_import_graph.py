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
    """Guards the test itself: modules, package __init__ edges, lazy and TYPE_CHECKING imports are all found."""
    assert {"tierckpt", "tierckpt.native.layout", "tierckpt.backends", "tierckpt.backends.base", "tierckpt.cache_api"} <= set(MODULES)
    pairs = {(e.importer, e.imported) for e in EDGES}
    assert ("tierckpt.native.metadata", "tierckpt.native.layout") in pairs
    assert ("tierckpt.backends.local", "tierckpt.native.keys") in pairs and ("tierckpt.backends.local", "tierckpt.native") in pairs
    assert ("tierckpt.store", "tierckpt.backends") in pairs
    assert ("tierckpt.manager.api", "tierckpt.io.scheduler") in pairs and ("tierckpt.manager.api", "tierckpt.io") in pairs
    assert not any(e.importer == e.imported for e in EDGES)
    assert any(e.lazy for e in EDGES) and any(not e.lazy for e in EDGES)
    assert any(e.typing_only for e in EDGES), "the walk must see the TYPE_CHECKING imports (they count)"


def test_a_relative_import_resolves_against_its_package() -> None:
    """Guards the walk: a relative import (none in the sources today, all are absolute) names the module it would load."""
    (one_up,) = ast.parse("from ..keys import validate_key").body
    (here,) = ast.parse("from . import layout").body
    assert isinstance(one_up, ast.ImportFrom) and isinstance(here, ast.ImportFrom)
    assert _resolve("tierckpt.backends.local", one_up) == "tierckpt.keys"
    assert _resolve("tierckpt.native", here) == "tierckpt.native"
    assert _targets("tierckpt.native.metadata", here) == ["tierckpt.native.layout"]


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
    """The node disk cache (``tierckpt.node.disk``) and the memory tier (``tierckpt.node.memory``) are links on
    the write-back engine (the modules at the top of ``tierckpt.node``): what they share lives there, neither
    link imports the other, and the engine imports neither (TYPE_CHECKING imports included)."""
    links = ("tierckpt.node.disk", "tierckpt.node.memory")
    crossing = [e for e in EDGES for a, b in (links, links[::-1])
                if e.importer.startswith(f"{a}.") and (e.imported == b or e.imported.startswith(f"{b}."))]
    assert not crossing, "\n".join(map(str, crossing))
    engine = [e for e in EDGES if _node_level(e.importer) == "node" and not e.importer.startswith(links)
              and e.imported.startswith(links)]
    assert not engine, "the engine imports neither link:\n" + "\n".join(map(str, engine))


# -- packages by responsibility ----------------------------------------------------------------------------
MAY_IMPORT: dict[str, frozenset[str]] = {name: frozenset(allowed.split()) for name, allowed in {
    # shared, low-level modules
    "errors": "", "progress": "", "gc_pause": "", "_moved": "",
    "units": "errors", "deadline": "errors", "comm": "errors", "call_args": "errors",
    "monitor": "progress",
    # the format tierckpt writes, and torch objects <-> entries: pure
    "native": "errors",
    "state": "errors native",
    "planner": "errors native",
    # storage: the floor, the I/O loop, the node tiers, the one place that assembles the chain
    "backends": "errors deadline native",
    "io": "errors deadline native backends",
    "node": "errors comm deadline units monitor progress native io backends",
    "store": "errors backends io node",
    # checkpoints read in place, then the two lifecycles
    "formats": "errors call_args deadline progress native state io backends node store",
    "saving": "errors call_args comm deadline gc_pause monitor progress native state formats planner io backends node store",
    "loading": "errors call_args comm deadline gc_pause monitor progress native state formats planner io backends node store",
    "sharded": "errors native state",
    # what users call, and what sits on top of it
    "cache_api": "errors call_args progress native io backends node store loading",
    "manager": "errors comm native formats io backends node store loading saving",
    "reports": "errors call_args deadline monitor native formats io store loading manager",
    "convert": "errors call_args progress native state formats planner io backends store loading saving",
    "integrations": "errors call_args comm native state formats io store loading saving manager",
    "demo": "tierckpt monitor backends",
    "cli": "errors call_args deadline units progress monitor native state formats io backends node store loading saving "
           "convert manager cache_api reports demo",
    "__main__": "cli",
    "tierckpt": "errors gc_pause _moved cache_api loading saving manager monitor reports sharded state",
}.items()}
"""Each package of ``src/tierckpt`` (and each top-level module) -> what it may import: a layering, lowest first.
A new top-level module or package gets its line here (the tests below name it until it has one)."""


def _node_level(module: str) -> str:
    """The package (or top-level module) ``module`` belongs to: ``tierckpt.node.disk.catalog`` -> ``node``."""
    return module.split(".")[1] if "." in module else module


def _package_edges(module_edges: list[Edge]) -> dict[tuple[str, str], list[Edge]]:
    """The import edges between packages (and top-level modules), each with the module edges behind it."""
    edges: dict[tuple[str, str], list[Edge]] = {}
    for e in module_edges:
        pair = (_node_level(e.importer), _node_level(e.imported))
        if pair[0] != pair[1]:
            edges.setdefault(pair, []).append(e)
    return edges


def _across_the_layers(module_edges: list[Edge]) -> list[str]:
    return [f"{a} -> {b}: {edges[0]}" for (a, b), edges in sorted(_package_edges(module_edges).items())
            if b not in MAY_IMPORT.get(a, ())]


def test_each_package_imports_only_what_its_layer_may() -> None:
    nodes = {_node_level(m) for m in MODULES}
    assert not nodes - set(MAY_IMPORT), f"give these a line in MAY_IMPORT: {sorted(nodes - set(MAY_IMPORT))}"
    wrong = _across_the_layers(EDGES)
    assert not wrong, "imports across the layering (move the code, or change MAY_IMPORT with a reason):\n" + "\n".join(wrong)


def test_the_layering_check_flags_an_import_up() -> None:
    """Guards the check: the node tiers importing the loader, or the format importing the storage, is flagged."""
    up = [Edge("tierckpt.node.memory.link", "tierckpt.loading.api", "x.py", 1, True),
          Edge("tierckpt.native.layout", "tierckpt.backends", "y.py", 2, False),
          Edge("tierckpt.loading.api", "tierckpt.native.layout", "z.py", 3, False)]
    assert [line.split(":")[0] for line in _across_the_layers(up)] == ["native -> backends", "node -> loading"]


def test_the_layering_has_no_cycle() -> None:
    """The allowed imports themselves form layers: no package may import one that may import it back."""
    allowed = [Edge(a, b, "MAY_IMPORT", 0, False) for a, bs in MAY_IMPORT.items() for b in sorted(bs)]
    assert not _cycles(allowed), _report(_cycles(allowed))
    assert all(b in MAY_IMPORT for bs in MAY_IMPORT.values() for b in bs), "MAY_IMPORT names a package it does not list"


def test_the_tree_shows_its_architecture() -> None:
    """At most 20 modules at the top level; counting each package and each top-level module as one node, at most
    40 nodes and 220 import edges between them."""
    top_level = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top_level) <= 20, f"{len(top_level)} top-level modules (put each in the package of its job): {top_level}"
    nodes = {_node_level(m) for m in MODULES}
    edges = _package_edges(EDGES)
    assert len(nodes) <= 40 and len(edges) <= 220, f"{len(nodes)} nodes, {len(edges)} edges"


def test_every_package_says_its_job_and_what_it_may_import() -> None:
    silent = [name for name, path in MODULES.items() if path.name == "__init__.py" and name.count(".") == 1
              and "may import" not in (ast.get_docstring(ast.parse(path.read_text())) or "").lower()]
    assert not silent, f"packages whose docstring does not say their job and what they may import: {silent}"
