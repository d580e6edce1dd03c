"""The shape the sources keep, read with ``ast``: no mutable state at module level in the node cache
(what a process holds per cache directory lives in its :class:`~tierckpt.node.disk.uploader.Uploader`, which
:func:`tierckpt.store.uploader_of` keeps), and code above the storage chain reaches it only through its hooks.
Module size is not capped: a module holds one concept whole (the package layering is in ``test_import_graph``)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tierckpt"
"""This checkout's sources (not whichever copy of the package is installed)."""

_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "WeakSet", "WeakValueDictionary",
                  "WeakKeyDictionary", "Lock", "RLock"}


def _mutable_module_state(path: Path) -> list[str]:
    """``file:line name`` for each module-level name bound to a mutable container or a lock, and each
    ``global`` statement (a function rebinding module state)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in tree.body:
        targets: list[ast.expr] = []
        value = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        names = [t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
        if not names or value is None:
            continue
        call = value.func if isinstance(value, ast.Call) else None
        called = call.attr if isinstance(call, ast.Attribute) else call.id if isinstance(call, ast.Name) else None
        if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
                called in _MUTABLE_CALLS):
            found.append(f"{path.relative_to(SRC)}:{node.lineno} {', '.join(names)}")
    found += [f"{path.relative_to(SRC)}:{n.lineno} global {', '.join(n.names)}"
              for n in ast.walk(tree) if isinstance(n, ast.Global)]
    return found


def test_the_node_cache_keeps_no_module_level_state() -> None:
    found = [line for path in sorted((SRC / "node" / "disk").glob("*.py")) for line in _mutable_module_state(path)]
    assert found == [] and len(list((SRC / "node" / "disk").glob("*.py"))) > 5, (
        "module-level mutable state in tierckpt/node/disk:\n" + "\n".join(found))


def test_the_check_finds_module_state() -> None:
    """Guards the check itself: it sees the registries that do exist at module level elsewhere."""
    assert any("_UPLOADERS" in line for line in _mutable_module_state(SRC / "store.py"))
    assert any("global _instance" in line for line in _mutable_module_state(SRC / "io" / "scheduler.py"))


# -- the chain is opaque above it ---------------------------------------------------------------------------
_CHAIN_PACKAGES = ("backends", "node", "io")
"""Where the storage chain's classes live (and may know each other); ``store.py`` assembles the chain."""
_CHAIN_INSIDE = ("backends", "node")
_CHAIN_ROOTS = {"Backend", "ObjectWriter", "StoreStatus"}
_CHAIN_WORDS = ("backend", "store", "tier", "link", "below", "chain")
"""Names of the values a probe of the chain would name."""


def _chain_classes() -> set[str]:
    """Every class of the chain's packages that is (by its bases, transitively) a backend, a link, a writer
    or a store status, with the durability protocols: what code above the chain must never ``isinstance``."""
    bases: dict[str, set[str]] = {}
    for sub in _CHAIN_PACKAGES:
        for path in sorted((SRC / sub).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    plain = [b.value if isinstance(b, ast.Subscript) else b for b in node.bases]  # Base[T]: Base
                    bases[node.name] = {b.id if isinstance(b, ast.Name) else b.attr for b in plain
                                        if isinstance(b, (ast.Name, ast.Attribute))}
    found = set(_CHAIN_ROOTS) | {"Durable", "Revocable"}
    while True:
        more = {name for name, of in bases.items() if of & found} - found
        if not more:
            return found
        found |= more


def _above_the_chain() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py"))
            if p.relative_to(SRC).parts[0] not in _CHAIN_INSIDE and p.name != "store.py"]


def _names_in(node: ast.expr) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))}


def _reaches_into_the_chain(path: Path, classes: set[str]) -> list[str]:
    """``file:line what`` for each ``isinstance`` on a chain class, ``getattr`` probe of a backend or store,
    and ``type: ignore[attr-defined|union-attr|arg-type]`` on a line that names one, in ``path``."""
    source = path.read_text()
    where = path.relative_to(SRC) if path.is_relative_to(SRC) else path.name
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
            continue
        if node.func.id == "isinstance" and _names_in(node.args[1]) & classes:
            found.append(f"{where}:{node.lineno} isinstance(..., {ast.unparse(node.args[1])})")
        probed = ast.unparse(node.args[0]).lower()
        if node.func.id in ("getattr", "hasattr") and any(word in probed for word in _CHAIN_WORDS):
            found.append(f"{where}:{node.lineno} {node.func.id}({ast.unparse(node.args[0])}, ...)")
    for lineno, line in enumerate(source.splitlines(), 1):
        code, _, comment = line.partition("# type: ignore")
        if comment.startswith(("[attr-defined]", "[union-attr]", "[arg-type]")) and any(
                word in code.lower() for word in _CHAIN_WORDS):
            found.append(f"{where}:{lineno} type: ignore{comment.split()[0]}")
    return found


def test_code_above_the_chain_reaches_links_only_through_its_hooks() -> None:
    """The loader, the saver, the manager, the CLI and the formats ask a store for what they need through the
    capability hooks of :class:`tierckpt.backends.base.Backend`, never by a link's class, an attribute
    probe, or a type checker silenced to reach one (``store.below``)."""
    classes = _chain_classes()
    found = [line for path in _above_the_chain() for line in _reaches_into_the_chain(path, classes)]
    assert not found, "code above the storage chain reaches into it:\n" + "\n".join(found)


def test_the_chain_check_sees_what_it_forbids(tmp_path: Path) -> None:
    """Guards the check itself: it knows the link classes, and flags each way of reaching into a link."""
    classes = _chain_classes()
    assert {"MemoryLink", "TieredBackend", "MemoryTier", "LinkStatus", "ScheduledBackend", "Link"} <= classes
    above = {str(p.relative_to(SRC)) for p in _above_the_chain()}
    assert {"loading/api.py", "saving/api.py", "cli/main.py"} <= above and "store.py" not in above
    assert not {name for name in above if name.startswith(("node/", "backends/"))}
    probe = tmp_path / "probe_of_the_chain.py"
    lines = ["if isinstance(backend, (MemoryTier, int)):", "    pass",
             "mapped = getattr(p.backend, 'mapped_writer', None)",
             "below = store.below  # type: ignore[attr-defined]",
             "seconds = getattr(args, 'timeout', None)"]
    probe.write_text("\n".join(lines) + "\n")
    found = _reaches_into_the_chain(probe, classes)
    assert [line.split(" ", 1)[1] for line in found] == [
        "isinstance(..., (MemoryTier, int))", "getattr(p.backend, ...)", "type: ignore[attr-defined]"]
