"""The node package's one place for a fork's child and the exit (``node/lifecycle.py``), and its one registry
of live replicators (``node/memory/live.py``), which the saver's replicators and every running one share."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tierckpt"

_PROCESS_HOOKS = {("os", "register_at_fork"), ("atexit", "register"), ("threading", "_register_atexit")}


def _process_hooks(path: Path) -> list[str]:
    """``file:line what`` for each registration with the interpreter (fork, exit) and each rebinding of
    ``destroy_process_group`` in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            if (node.func.value.id, node.func.attr) in _PROCESS_HOOKS:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.func.value.id}.{node.func.attr}")
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "destroy_process_group":
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {ast.unparse(target)} =")
    return found


def test_only_the_lifecycle_registers_the_node_package_with_the_process() -> None:
    """Every module of the node package (and ``store.py``, which keeps the node cache's uploaders) registers
    its fork and exit handling with ``node/lifecycle.py``; only that module registers with the interpreter
    and wraps ``destroy_process_group``."""
    paths = sorted((SRC / "node").rglob("*.py")) + [SRC / "store.py"]
    found = [line for path in paths for line in _process_hooks(path)]
    lifecycle = [line for line in found if line.startswith("node/lifecycle.py:")]
    # The check sees registrations where they are: the lifecycle's own four.
    assert sorted(line.split(" ", 1)[1] for line in lifecycle) == [
        "atexit.register", "c10d.destroy_process_group =", "dist.destroy_process_group =", "os.register_at_fork",
        "threading._register_atexit"]
    assert found == lifecycle, "register with tierckpt.node.lifecycle instead:\n" + "\n".join(
        line for line in found if line not in lifecycle)


def _run_child(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=120)


def test_fork_and_exit_handlers_run_in_their_order_and_a_failing_one_does_not_stop_the_rest() -> None:
    """A forked child runs the fork handlers in the order registered (each once, however often it was
    registered); at exit the handlers before the threads are joined run first, each kind last registered
    first; one that raises is reported with its name, and the others still run."""
    child = _run_child("""
        import os, sys
        from tierckpt.node import lifecycle

        def first(): print("fork first", flush=True)
        def failing(): raise RuntimeError("a handler failed")
        def second(): print("fork second", flush=True)
        for handler in (first, failing, second, first):
            lifecycle.after_fork_in_child(handler)
        lifecycle.before_threads_joined(lambda: print("join 1", flush=True))
        lifecycle.before_threads_joined(lambda: print("join 2", flush=True))
        lifecycle.at_exit(lambda: print("exit 1", flush=True))
        lifecycle.at_exit(lambda: print("exit 2", flush=True))
        pid = os.fork()
        if pid == 0:
            os._exit(0)  # no exit handlers in the child
        assert os.waitpid(pid, 0)[1] == 0
        print("main done", flush=True)
    """)
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == ["fork first", "fork second", "main done", "join 2", "join 1", "exit 2",
                                         "exit 1"], (child.stdout, child.stderr)
    assert "failing (in a forked child) failed" in child.stderr and "RuntimeError: a handler failed" in child.stderr


def test_a_forked_child_never_frees_its_parents_side_group() -> None:
    """The parent's side group, held by nothing but the side-group table, survives the child's fork handler
    and its garbage collection: freeing it there ran gloo's destructor, which waits for I/O threads the
    child does not have (the child hung, or died before it could answer)."""
    child = _run_child("""
        import gc, os, select, tempfile
        import torch.distributed as dist
        from tierckpt.node.memory.sidegroup import side_group_of

        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        assert side_group_of(None, "test") is not None  # kept only by the table
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            gc.collect()
            os.write(write, b"answered")
            os._exit(0)
        os.close(write)
        ready, _, _ = select.select([read], [], [], 30)
        print(os.read(read, 16).decode() if ready else "no answer in 30 s", flush=True)
        if not ready:
            os.kill(pid, 9)
        print("child status", os.waitpid(pid, 0)[1], flush=True)
        os._exit(0)  # this parent's own exit is not what is tested
    """)
    assert child.stdout.splitlines() == ["answered", "child status 0"], (child.stdout, child.stderr)


def test_destroying_the_default_group_runs_the_handlers_first_and_only_for_it() -> None:
    """``destroy_process_group()`` of the default group runs the handlers while the group still exists; a
    subgroup's destruction does not; a handler registered twice runs once."""
    child = _run_child("""
        import os, tempfile
        import torch.distributed as dist
        from tierckpt.node import lifecycle

        seen = []
        def handler(): seen.append(dist.is_initialized())
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        lifecycle.before_default_group_destroyed(handler)
        lifecycle.before_default_group_destroyed(handler)
        sub = dist.new_group([0])
        dist.destroy_process_group(sub)
        assert seen == [], seen
        from torch.distributed import destroy_process_group  # taken after the wrapping: wrapped too
        destroy_process_group()
        assert seen == [True] and not dist.is_initialized(), seen
        print("ok")
    """)
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr


def _registry_scenario(workdir: str) -> dict:
    """Two nodes of two ranks: the saver's replicator and one built directly are both in the one registry;
    stopping the saver's leaves the other running; a forked child has none; closing all ends the rest."""
    import torch.distributed as dist

    from tierckpt.node.memory import MemoryConfig, NodeMemory
    from tierckpt.node.memory.live import REPLICATORS
    from tierckpt.node.memory.replica import Replicator
    from tierckpt.node.memory.replication import replicator_for, stop_replicators

    rank = dist.get_rank()
    saved = os.environ.get("TIERCKPT_NODE_ID")
    os.environ["TIERCKPT_NODE_ID"] = f"node-{rank // 2}"
    try:
        memory = NodeMemory(MemoryConfig(directory=os.path.join(workdir, f"node-{rank // 2}")))
        tier = memory.tier("s3://bucket/run")
        saver, why_not = replicator_for(tier, None, "WORLD")
        assert why_not is None and saver is not None
        again, _ = replicator_for(tier, None, "WORLD")
        direct = Replicator(memory, timeout_s=30)
        keys = dict(REPLICATORS._keys)
        out = {"same": again is saver, "leader": saver.is_leader,
               "saver_keyed": keys.get(saver) is not None, "saver_in": saver in keys, "direct_in": direct in keys}
        # A forked child has none of its parent's replicators (nor their threads).
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, str(len(REPLICATORS._keys)).encode())
            os._exit(0)
        os.close(write)
        out["in_child"] = int(os.read(read, 16))
        os.close(read)
        os.waitpid(pid, 0)
        out["stop_lines"] = stop_replicators(10.0, "the test stopped them")
        out["after_stop"] = {"saver_in": saver in REPLICATORS._keys, "direct_in": direct in REPLICATORS._keys,
                             "direct_threads": sum(t.is_alive() for t in direct._threads)}
        dist.barrier()
        rebuilt, _ = replicator_for(tier, None, "WORLD")  # a later save builds a new one (every rank)
        out["rebuilt_new"] = rebuilt is not saver
        out["stop_again"] = stop_replicators(10.0, "the test stopped them")
        out["close_all"] = REPLICATORS.close_all("the test closed them")
        out["left"] = sum(r in REPLICATORS._keys for r in (saver, rebuilt, direct))
        dist.barrier()
        return out
    finally:
        if saved is None:
            os.environ.pop("TIERCKPT_NODE_ID", None)
        else:
            os.environ["TIERCKPT_NODE_ID"] = saved


def test_the_savers_replicators_and_the_running_ones_are_one_registry(dist_pool, tmp_path: Path) -> None:
    results = dist_pool.run(_registry_scenario, str(tmp_path))
    assert [r["leader"] for r in results] == [True, False, True, False]
    for r in results:
        assert r["same"] and r["saver_in"] and r["saver_keyed"], r
        assert r["direct_in"] is r["leader"], r  # a replicator with threads (a leader's) is registered
        assert r["in_child"] == 0, r
        assert r["stop_lines"] == [] and r["after_stop"]["saver_in"] is False, r
        assert r["after_stop"]["direct_in"] is r["leader"], r  # not the saver's: it runs on
        assert r["after_stop"]["direct_threads"] == (2 if r["leader"] else 0), r
        assert r["rebuilt_new"] and r["stop_again"] == [] and r["close_all"] == [] and r["left"] == 0, r
