"""What outlives one save in this process, and the exit drain that finishes it.

The plan cache, the reusable staging buffer, the background saves in flight (and those whose failure
nobody has heard yet), and :func:`_drain_at_exit`, the one hook that lets background saves commit,
superseded generations be removed, peer replication finish and write-back uploads drain before the
process exits (see :mod:`tierckpt.saving.api` for the save's steps).
"""

from __future__ import annotations

import concurrent.futures
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tierckpt.saving import cleanup
from tierckpt.comm import Comm, Group, describe_error
from tierckpt.deadline import process_left
from tierckpt.errors import CheckpointError
from tierckpt.io.staging import StagingBuffer
from tierckpt.planner import SavePlan
from tierckpt.saving.handle import SaveHandle
from tierckpt.store import drain_write_back, exit_wait_s
from tierckpt.node.memory.replication import exit_wait_s as replication_exit_wait_s
from tierckpt.node.memory.replication import stop_replicators


T = TypeVar("T")


class _DaemonWorker:
    """One daemon thread that runs the calls submitted to it in order, each answered by a future.

    For the agreement thread: a ``ThreadPoolExecutor``'s workers are joined at interpreter exit, so an
    agreement left waiting in a collective by an exception in the caller (a ``KeyboardInterrupt`` during
    the copy, while another rank never arrives) would hold the process's exit until the group's timeout.
    A daemon thread does not: the process exits with the caller's error."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._thread is None or not self._thread.is_alive():  # not alive: a fork's child
            self._calls = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._calls.put((fn, future))
        return future

    def _run(self) -> None:
        calls = self._calls
        while True:
            fn, future = calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller's future raises it
                future.set_exception(exc)
            del fn, future  # nothing of a finished call outlives it here (its state, its result)


@dataclass
class _Process:
    """What outlives one save in this process: plan cache, staging buffer, background saves."""

    plans: dict[Any, tuple[list[str], SavePlan]] = field(default_factory=dict)
    staging: StagingBuffer = field(default_factory=StagingBuffer)
    staging_lock: threading.Lock = field(default_factory=threading.Lock)
    background: concurrent.futures.ThreadPoolExecutor | None = None
    in_flight: dict[str, SaveHandle] = field(default_factory=dict)
    unreported: list[SaveHandle] = field(default_factory=list)

    agreement: _DaemonWorker = field(default_factory=lambda: _DaemonWorker("tierckpt-agree"))

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self.background is None:
            self.background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-save")
        return self.background

    def agree_aside(self, agree: Callable[[], T], comm: Comm) -> concurrent.futures.Future[T]:
        """Run a save's agreement (its collectives) in the agreement thread while the caller copies its
        snapshot; on an NCCL group the thread uses the caller's CUDA device."""
        device = torch.cuda.current_device() if comm.backend == "nccl" else None

        def run() -> T:
            if device is not None:
                torch.cuda.set_device(device)
            return agree()

        return self.agreement.submit(run)


_PROCESS = _Process()


def _drain_at_exit() -> None:
    """The exit drain: let background saves commit, superseded generations be removed (up to
    :data:`tierckpt.saving.cleanup.EXIT_WAIT_S`), peer replication in flight finish (its threads are then
    stopped, before the interpreter and the process groups are torn down), then write-back uploads,
    within the stores' exit wait; print on stderr what is left (with the command that finishes an
    upload or a removal; a replication cut short keeps the level ``memory``).

    It runs from :mod:`threading`'s exit hooks, i.e. when the main thread is done and *before* the
    ``atexit`` handlers: thread pools still accept work (``concurrent.futures`` stops them in an
    earlier-registered hook of the same list, which runs after this one) and the I/O loop still runs.
    """
    handles = [h for h in _PROCESS.in_flight.values() if not h.done()]
    deadline = time.monotonic() + process_left(exit_wait_s())  # a CLI command's --timeout bounds the drain too
    for handle in handles:
        try:
            handle.wait(timeout_s=max(0.0, deadline - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - reported, exit goes on
            sys.stderr.write(f"tierckpt: the async save to {handle.uri} did not commit before exit: {describe_error(exc)}\n")
    for uri in cleanup.wait_pending(process_left(cleanup.EXIT_WAIT_S), exiting=True):
        sys.stderr.write(f"tierckpt: removing superseded generations of {uri} was cut short by the exit; the next "
                         f"save to it or `tierckpt gc {uri} --keep-last 1` removes them\n")
    # Replication started with each commit above: its wait counts from there, within its own limit.
    replication_deadline = max(deadline, time.monotonic() + process_left(replication_exit_wait_s()))
    for line in stop_replicators(max(0.0, replication_deadline - time.monotonic()), "the process exited"):
        sys.stderr.write(line + "\n")
    for line in drain_write_back(max(0.0, deadline - time.monotonic())):
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


threading._register_atexit(_drain_at_exit)  # type: ignore[attr-defined]  # see _drain_at_exit


def _group_key(group: Group) -> Any:
    return "WORLD" if group is None else group if isinstance(group, str) else id(group)



def _raise_unreported() -> None:
    """Raise the failure of an earlier background save that nobody waited for."""
    for handle in list(_PROCESS.unreported):
        error = handle.unreported_error()
        if handle.done():
            _PROCESS.unreported.remove(handle)
        if error is not None:
            raise CheckpointError(f"an earlier async save to {handle.uri!r} failed: {error}") from error
