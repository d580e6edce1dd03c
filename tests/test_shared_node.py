"""A node shared by two users: node tiers are private. Each test runs its scenario as two real local users
(``useradd``, ``runuser``) with the memory tier on a private tmpfs (a mount namespace of its own: ``unshare
-m``, then ``mount -t tmpfs`` on ``/dev/shm``); see tests/shared_node_child.py. They need root (as the tests
run in CI) and are skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

CHILD = str(Path(__file__).parent / "shared_node_child.py")
SRC = str(Path(__file__).parents[1] / "src")
USERS = ("tierckpt-test-a", "tierckpt-test-b")


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (to add two local users and mount a private tmpfs)"
    for tool in ("useradd", "runuser", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True)
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.decode()[-200:]}"
    return None


def _user_python(user: str, env: dict[str, str]) -> str | None:
    """An interpreter of this Python version that ``user`` may run, with this environment's packages."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for exe in (sys.executable, shutil.which(version, path="/usr/local/bin:/usr/bin:/bin")):
        if exe and subprocess.run(["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                                   exe, "-c", "import torch, tierckpt"], capture_output=True, cwd="/").returncode == 0:
            return exe
    return None


@pytest.fixture(scope="module")
def two_users() -> Iterator[tuple[str, dict[str, str]]]:
    """Two real local users and the interpreter (with its PYTHONPATH) they run the steps with."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    for name in USERS:
        if subprocess.run(["id", name], capture_output=True).returncode != 0:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    packages = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    env = {"PYTHONPATH": os.pathsep.join([SRC, *sorted(packages)]), "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    python = _user_python(USERS[0], env)
    if python is None:
        pytest.skip("no interpreter of this Python version that another user may run with these packages")
    yield python, env


_RESULTS: dict[str, dict] = {}
"""Each scenario's outcome, run once per session (its steps start an interpreter per user and step)."""


def scenario(name: str, two_users: tuple[str, dict[str, str]]) -> dict:
    if name not in _RESULTS:
        _RESULTS[name] = _run_scenario(name, two_users)
    return _RESULTS[name]


def _run_scenario(name: str, two_users: tuple[str, dict[str, str]]) -> dict:
    python, env = two_users
    base = tempfile.mkdtemp(prefix="tierckpt-shared-node-", dir="/tmp")
    os.chmod(base, 0o755)
    try:
        done = subprocess.run(["unshare", "-m", sys.executable, CHILD, "scenario", name, base, *USERS, python],
                              capture_output=True, text=True, timeout=600, env={**os.environ, **env})
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_memory_tier_is_private_to_its_user(two_users: tuple[str, dict[str, str]]) -> None:
    out = scenario("memory", two_users)
    assert "generation" in out["save"], out["save"]
    assert out["load"] == {"value": 1, "exact": True}, out["load"]
    assert out["mode"]["mode"] == 0o700, out["mode"]  # before: /dev/shm/tierckpt, 0755, one for every user
    assert out["probe"]["read"] == [] and not out["probe"]["listed"], out["probe"]  # before: B read A's files


def test_a_memory_tier_directory_another_user_made_is_refused(two_users: tuple[str, dict[str, str]]) -> None:
    out = scenario("memory", two_users)
    for step in ("planted_save", "planted_load"):  # before: the save used B's directory, the load followed it
        assert out[step].get("error") == "NodeTierNotPrivateError", out[step]
        assert "TIERCKPT_MEMORY_DIR" in out[step]["message"] and "mode 0777" in out[step]["message"]


def test_the_node_cache_is_private_to_its_user(two_users: tuple[str, dict[str, str]]) -> None:
    out = scenario("cache", two_users)
    planted = out["planted_sync"]  # before: A's sync opened the directory B made, and used it
    assert planted.get("error") == "NodeTierNotPrivateError" and "TIERCKPT_CACHE_DIR" in planted["message"], planted
    assert out["sync"] == {"synced": []}, out["sync"]
    assert out["mode"]["mode"] == 0o700, out["mode"]  # before: created 0755
    assert out["probe"]["read"] == [] and not out["probe"]["listed"], out["probe"]


def test_a_directory_found_private_is_checked_again_when_it_changes(tmp_path: Path) -> None:
    """One process, no second user: a directory that passed is looked at again with one ``stat``, and any change
    of its mode or identity brings the whole check back (a directory opened to others is refused at once)."""
    from tierckpt.errors import NodeTierNotPrivateError
    from tierckpt.node import private

    path = str(tmp_path / "tier")
    assert private.private_directory(path, "node memory tier", "TIERCKPT_MEMORY_DIR") == path
    assert path in private._PASSED
    os.chmod(path, 0o777)
    with pytest.raises(NodeTierNotPrivateError, match="other users may write to it"):
        private.private_directory(path, "node memory tier", "TIERCKPT_MEMORY_DIR")
    os.chmod(path, 0o700)
    private.private_directory(path, "node memory tier", "TIERCKPT_MEMORY_DIR")
    os.rmdir(path)
    os.symlink(str(tmp_path), path)  # the same path, another directory now (a link of this user's: allowed)
    assert private.private_directory(path, "node memory tier", "TIERCKPT_MEMORY_DIR", create=False) == path
    assert private._PASSED[path][1] == os.stat(tmp_path).st_ino
