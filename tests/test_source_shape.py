"""The shape the storage floor keeps, read from the sources with ``ast``: small modules, and no mutable
state at module level in the node cache (what a process holds per cache directory lives in its
:class:`~tierckpt.cache.uploader.Uploader`, which :func:`tierckpt.store.uploader_of` keeps)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tierckpt"
"""This checkout's sources (not whichever copy of the package is installed)."""

MAX_LINES = 420
"""About 400 lines: the most a module of the storage floor may grow to before it is split."""

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
    found = [line for path in sorted((SRC / "cache").glob("*.py")) for line in _mutable_module_state(path)]
    assert not found, "module-level mutable state in tierckpt/cache:\n" + "\n".join(found)


def test_the_check_finds_module_state() -> None:
    """Guards the check itself: it sees the registries that do exist at module level elsewhere."""
    assert any("_UPLOADERS" in line for line in _mutable_module_state(SRC / "store.py"))
    assert any("global _instance" in line for line in _mutable_module_state(SRC / "io" / "scheduler.py"))


def test_modules_of_the_storage_floor_stay_small() -> None:
    sizes = {f"{p.relative_to(SRC)}": len(p.read_text().splitlines())
             for sub in ("backends", "cache", "io", "tiers", "writeback") for p in sorted((SRC / sub).glob("*.py"))}
    sizes.update({p.name: len(p.read_text().splitlines()) for p in (SRC / "store.py", SRC / "cache_api.py", SRC / "manager.py")})
    assert len(sizes) > 60 and "tiers/link.py" in sizes and "writeback/drain.py" in sizes  # the walk sees the packages
    big = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by job): {big}"
