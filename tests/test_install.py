"""Install truth: every import of src/ is declared in pyproject.toml, and CI runs the README's command.

A package installed by hand on a developer's machine or on CI must never hide a missing dependency:
a fresh ``pip install`` then fails at ``import tierckpt``. These tests read the source with ``ast``.
"""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tierckpt"
# Import names that differ from their distribution's name.
DISTRIBUTION_OF = {"yaml": "pyyaml", "google": "protobuf"}


def _requirement_name(spec: str) -> str:
    return re.split(r"[\s\[<>=!~;]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_requirement_name(d) for d in project["dependencies"]}
    extras = {_requirement_name(d) for deps in project.get("optional-dependencies", {}).values() for d in deps}
    return core, extras


def _guarded_ids(tree: ast.AST) -> set[int]:
    """Nodes inside ``try: ... except ImportError`` blocks (optional imports)."""
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        names = set()
        for handler in node.handlers:
            kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            names |= {getattr(k, "id", "") for k in kinds}
        if names & {"ImportError", "ModuleNotFoundError"}:
            for inner in node.body:
                guarded.update(id(n) for n in ast.walk(inner))
    return guarded


def _third_party_imports() -> list[tuple[str, str, bool]]:
    """(top-level module, where, guarded) for each absolute import of src/ outside the stdlib."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        guarded = _guarded_ids(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "tierckpt":
                    continue
                found.append((top, f"{path.relative_to(ROOT)}:{node.lineno}", id(node) in guarded))
    return found


def test_every_import_of_src_is_declared():
    core, extras = _declared()
    problems = []
    for module, where, guarded in _third_party_imports():
        dist = DISTRIBUTION_OF.get(module, module).lower().replace("_", "-")
        if dist in core:
            continue
        if dist in extras and guarded:
            continue  # optional feature: guarded import, declared in an extra
        if dist in extras:
            problems.append(f"{where}: {module!r} is only in an extra; guard it with try/except ImportError "
                            f"and raise an error naming the extra")
        else:
            problems.append(f"{where}: {module!r} is not declared in pyproject.toml")
    assert not problems, "\n".join(problems)


def test_ci_runs_the_readme_test_command_in_a_fresh_venv():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    test_commands = [c for c in commands if "pytest" in c]
    assert len(test_commands) == 1, test_commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_commands[0] in ci.splitlines()
    assert "python3 -m venv" in ci
    assert "apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd" in ci  # the real S3 server
    assert ci.index("apt-get install") < ci.index("python3 -m venv")
