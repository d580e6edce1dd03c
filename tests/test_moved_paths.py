"""Modules that moved into packages still import by their old paths: the same module objects (so the same
classes and errors), with a DeprecationWarning naming the new path. Each check runs in a fresh interpreter, where
no earlier import has loaded the module yet."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tierckpt._moved import MOVED, new_path

SRC = Path(__file__).resolve().parents[1] / "src"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(SRC), "PATH": ""})


def test_documented_old_paths_give_the_moved_modules() -> None:
    done = _run("""
        from tierckpt.cache import CacheConfig
        from tierckpt.tiers import MemoryConfig
        from tierckpt.tiers.replication import ReplicationError
        import tierckpt.verify
        import tierckpt.node.disk, tierckpt.node.memory, tierckpt.node.memory.replication, tierckpt.formats.verify
        assert CacheConfig is tierckpt.node.disk.CacheConfig and MemoryConfig is tierckpt.node.memory.MemoryConfig
        assert ReplicationError is tierckpt.node.memory.replication.ReplicationError
        assert tierckpt.verify is tierckpt.formats.verify
        import sys
        assert sys.modules["tierckpt.tiers.replication"] is sys.modules["tierckpt.node.memory.replication"]
        print("same modules")
    """)
    assert done.returncode == 0, done.stderr
    assert "same modules" in done.stdout
    assert "tierckpt.cache moved to tierckpt.node.disk: import it from there" in done.stderr
    assert "tierckpt.tiers.replication moved to tierckpt.node.memory.replication" in done.stderr


def test_a_name_that_never_existed_is_still_not_found() -> None:
    done = _run("import tierckpt.cache.no_such_module")
    assert done.returncode == 1 and "No module named 'tierckpt.cache.no_such_module'" in done.stderr


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_moved_path_names_a_module_that_exists(old: str) -> None:
    new = new_path(old)
    assert new is not None and new.startswith("tierckpt.") and not new.startswith(old + ".")
    relative = Path(*new.split(".")[1:])
    package = SRC / "tierckpt" / relative
    assert (package / "__init__.py").exists() or package.with_suffix(".py").exists(), f"{old} -> {new}: no such module"
