"""A child program for the tests of a node shared by two users (tests/test_shared_node.py).

``python tests/shared_node_child.py scenario NAME BASE USER_A USER_B PYTHON`` runs as root inside a mount
namespace of its own (``unshare -m``), where it mounts a private tmpfs on ``/dev/shm``; it runs each step of
scenario NAME as one of the two real users (``runuser -u``, the interpreter ``PYTHON``) and prints one JSON
object: what each step printed. Steps, run as a user (each prints one JSON object)::

    dirs                      the user's default memory tier directory
    save URI VALUE            tierckpt.save of a state whose tensors depend on VALUE
    load URI                  tierckpt.load of that state: {"value", "exact"}
    sync                      tierckpt.sync() (opens the node cache)
    mkdir-open PATH           make PATH writable by everyone (what an attacker prepares)
    probe PATH                try to list and read every file under PATH: {"listed", "read"}
    mode PATH                 {"mode", "uid"} of PATH

A step that raises prints ``{"error": <type name>, "message": ...}``.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from typing import Any

CHILD = os.path.abspath(__file__)


def _state(value: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(value)
    return {"w": torch.randn(64, 32, generator=g), "value": value}


def step(argv: list[str]) -> dict[str, Any]:
    command = argv[0]
    if command == "mkdir-open":
        os.makedirs(argv[1], exist_ok=True)
        os.chmod(argv[1], 0o777)
        return {"made": argv[1]}
    if command == "mode":
        st = os.stat(argv[1])
        return {"mode": st.st_mode & 0o7777, "uid": st.st_uid}
    if command == "probe":
        listed, read = False, []
        try:
            for root, _dirs, files in os.walk(argv[1], onerror=_raise):
                listed = True
                for name in files:
                    try:
                        with open(os.path.join(root, name), "rb") as f:
                            f.read(1)
                        read.append(os.path.join(root, name))
                    except OSError:
                        pass
        except OSError:
            pass
        return {"listed": listed, "read": read}
    import tierckpt
    from tierckpt.node.memory.config import MemoryConfig

    if command == "dirs":
        return {"memory_dir": MemoryConfig.from_env().directory}
    if command == "save":
        return {"generation": tierckpt.save(argv[1], _state(int(argv[2]))).generation}
    if command == "load":
        import torch

        loaded = tierckpt.load(argv[1], {"w": torch.zeros(64, 32), "value": -1})
        return {"value": loaded["value"], "exact": bool(torch.equal(loaded["w"], _state(loaded["value"])["w"]))}
    if command == "sync":
        return {"synced": tierckpt.sync()}
    raise SystemExit(f"unknown step {command!r}")


def _raise(exc: OSError) -> None:
    raise exc


class Users:
    """Runs steps as the two users, with the environment each step asks for."""

    def __init__(self, python: str, names: dict[str, str], env: dict[str, str]) -> None:
        self.python, self.names, self.env = python, names, env
        self.uids = {role: pwd.getpwnam(name).pw_uid for role, name in names.items()}

    def run(self, role: str, *args: str, **env: str) -> dict[str, Any]:
        full = {**self.env, **env}
        cmd = ["runuser", "-u", self.names[role], "--", "env", "-i", *(f"{k}={v}" for k, v in full.items()),
               self.python, CHILD, "step", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd="/")
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            return {"crashed": done.returncode, "stderr": done.stderr[-2000:]}
        return json.loads(lines[-1])


def fresh_shm() -> None:
    """A new, empty tmpfs on /dev/shm (this namespace's own), world-writable and sticky like the real one."""
    subprocess.run(["umount", "/dev/shm"], capture_output=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777,size=256m", "tmpfs", "/dev/shm"], check=True)


def home_of(base: str, users: Users, role: str) -> str:
    """A directory of the user's own under ``base`` (its HOME and its checkpoints)."""
    path = os.path.join(base, role)
    os.makedirs(path, exist_ok=True)
    os.chown(path, users.uids[role], users.uids[role])
    os.chmod(path, 0o700)
    return path


def memory_scenario(base: str, users: Users) -> dict[str, Any]:
    out: dict[str, Any] = {}
    home = home_of(base, users, "a")
    mem = {"TIERCKPT_MEMORY": "on", "TIERCKPT_CACHE": "off", "HOME": home}
    # 1. A saves with the memory tier on; B tries to read what the tier holds.
    fresh_shm()
    out["dirs"] = users.run("a", "dirs", **mem)
    if "memory_dir" not in out["dirs"]:
        raise SystemExit(f"the user's memory tier directory is unknown: {out['dirs']}")
    memory_dir = out["dirs"]["memory_dir"]
    out["save"] = users.run("a", "save", os.path.join(home, "ckpt"), "1", **mem)
    out["probe"] = users.run("b", "probe", memory_dir, HOME=base)
    out["mode"] = users.run("a", "mode", memory_dir, **mem)
    out["load"] = users.run("a", "load", os.path.join(home, "ckpt"), **mem)
    # 2. B made A's memory tier directory first (writable by all); A saves, then loads.
    fresh_shm()
    users.run("b", "mkdir-open", memory_dir, HOME=base)
    out["planted_save"] = users.run("a", "save", os.path.join(home, "ckpt2"), "2", **mem)
    out["planted_load"] = users.run("a", "load", os.path.join(home, "ckpt"), **mem)
    return out


def cache_scenario(base: str, users: Users) -> dict[str, Any]:
    """The node cache's default directory when ~/.cache is not on this node's disk (here: on tmpfs):
    ``tierckpt-cache-<uid>`` under $TMPDIR, a directory every user may create entries in."""
    out: dict[str, Any] = {}
    home = home_of(base, users, "a")
    fresh_shm()
    for scratch in (os.path.join(base, "scratch1"), os.path.join(base, "scratch2")):
        os.makedirs(scratch, exist_ok=True)
        os.chmod(scratch, 0o1777)
    env = {"HOME": home, "XDG_CACHE_HOME": "/dev/shm/xdg-a", "TMPDIR": os.path.join(base, "scratch1")}
    guessed = os.path.join(base, "scratch1", f"tierckpt-cache-{users.uids['a']}")
    users.run("b", "mkdir-open", guessed, HOME=base)
    out["planted_sync"] = users.run("a", "sync", **env)
    env["TMPDIR"] = os.path.join(base, "scratch2")
    out["sync"] = users.run("a", "sync", **env)
    mine = os.path.join(base, "scratch2", f"tierckpt-cache-{users.uids['a']}")
    out["mode"] = users.run("a", "mode", mine, **env)
    out["probe"] = users.run("b", "probe", mine, HOME=base)
    return out


def main(argv: list[str]) -> None:
    if argv[0] == "step":
        try:
            result = step(argv[1:])
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result = {"error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(result), flush=True)
        return
    name, base, user_a, user_b, python = argv[1:6]
    env = {k: os.environ[k] for k in ("PYTHONPATH", "PATH") if k in os.environ}
    env["OMP_NUM_THREADS"] = "1"
    users = Users(python, {"a": user_a, "b": user_b}, env)
    scenario = {"memory": memory_scenario, "cache": cache_scenario}[name]
    print(json.dumps(scenario(base, users)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
