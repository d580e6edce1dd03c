"""A pool of real torch.distributed (gloo) worker processes for multi-rank tests.

Starting Python + torch in a fresh process costs seconds, so the pool starts ``world_size`` workers
once per test session, joins them in one gloo group, and runs each scenario (a top-level, picklable
function) on every rank. Workers are forked from a ``forkserver`` that has imported torch once (a
fresh interpreter per worker paid that import on every rank, and again at every restart), and leave
with ``os._exit`` once their group is destroyed (tearing down torch's modules at exit took as long).
Scenarios that need fewer ranks use :func:`subgroup`. A scenario that fails on any rank raises in the
test with every rank's traceback; one that hangs is killed at its timeout and the pool is restarted for
the next test.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import Any

_GROUPS: dict[tuple[int, ...], Any] = {}

PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "tierckpt"]
"""Imported once by the forkserver the workers are forked from (no threads are started by these imports)."""


def _preload() -> list[str]:
    """:data:`PRELOAD` added to what other tests asked of the process's one forkserver (its preload list is
    process-wide: ``tests/test_memory_recovery.py`` forks its ranks from it too)."""
    from multiprocessing import forkserver

    asked = list(getattr(forkserver._forkserver, "_preload_modules", None) or [])
    return asked + [m for m in PRELOAD if m not in asked]


@contextlib.contextmanager
def _server_environment() -> Iterator[None]:
    """The environment a forkserver started now gets: ``OMP_NUM_THREADS=1`` (it imports torch), and this
    directory on ``PYTHONPATH`` so that test modules in the preload list import there (the forkserver
    starts as ``python -c``, without the test process's ``sys.path``)."""
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH")}
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved["PYTHONPATH"]) if p)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=90),
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, "ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - reported to the test
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()
    results.close()
    results.join_thread()  # every result is in the pipe before the process goes
    os._exit(0)


def subgroup(size: int) -> Any | None:
    """A process group of ranks ``0..size-1`` (every rank must call this); ``None`` on other ranks."""
    import torch.distributed as dist

    ranks = tuple(range(size))
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks)) if size < dist.get_world_size() else dist.group.WORLD
    return _GROUPS[ranks] if dist.get_rank() < size else None


class WorkerPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_preload())
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self._tasks[r], self._results), daemon=True)
            for r in range(self.world_size)
        ]
        with _server_environment():
            for p in self._procs:
                p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 180) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the per-rank results."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            while len(out) + len(errors) < self.world_size:
                # After a failure the other ranks may be stuck in a collective: wait briefly, not forever.
                rank, status, value = self._results.get(timeout=5 if errors else timeout_s)
                (out if status == "ok" else errors)[rank] = value
        except queue.Empty:
            if not errors:
                self.close()
                raise TimeoutError(f"scenario {fn.__name__} did not finish on every rank within {timeout_s}s") from None
        if errors:
            self.close()
            raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
