"""The asyncio I/O scheduler: one event loop per process on a daemon thread.

Training code is synchronous; storage backends are async. :func:`get_scheduler` returns the
process's :class:`IOScheduler`, whose loop runs on a background thread, and
:meth:`IOScheduler.run` is the synchronous bridge (block until a coroutine finishes there) while
:meth:`IOScheduler.submit` starts background work (uploads) and returns a
``concurrent.futures.Future``.

Inside the loop, every call to a store's backend goes through :meth:`IOScheduler.call` — for stores
from :func:`tierckpt.store.open_store`, once, in their scheduling link
(:class:`~tierckpt.io.scheduled.ScheduledBackend`), so callers just ``await store.get(key)``. It

* holds one of the backend's slots (``max_concurrency`` per backend instance, default 16). When
  both priorities wait for a slot, :attr:`Priority.FOREGROUND` (loads, synchronous saves) gets it
  before :attr:`Priority.BACKGROUND` (uploads), so an upload queue never stalls a load;
* retries :class:`~tierckpt.errors.TransientStorageError` with exponential backoff and full
  jitter (the backoff sleeps outside the slot), and nothing else — once while the store's service is
  marked down (:mod:`.outages`: a whole retry sequence failed and nothing answered since);
* records a metric (:class:`IOMetrics`).

:meth:`IOScheduler.read` fills caller-owned buffers from many ranges in parallel, splitting large
ranges into parts so one big tensor uses several connections.

Cancellation: cancelling a task cancels the backend calls it is waiting on (a call already running
in a worker thread finishes in that thread, but its result is dropped). Writers are not tracked
here: whoever opened an :class:`~tierckpt.backends.base.ObjectWriter` aborts it when cancelled
(``try: ... except BaseException: await writer.abort(); raise``).

Fork safety: a forked child does not inherit a running loop thread, so the inherited scheduler is
dropped in the child and the next :func:`get_scheduler` call there starts a fresh one.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tierckpt import deadline
from tierckpt.backends.base import Backend
from tierckpt.errors import CheckpointError, StorageUnreachableError, TransientStorageError
from tierckpt.backends.retry import retry_transient
from tierckpt.io.calls import CallsInFlight
from tierckpt.io.outages import Outages
from tierckpt.io.slots import IOMetrics, OpRecord, OpTotals, Priority, PrioritySemaphore

__all__ = [
    "IOMetrics", "IOScheduler", "OpRecord", "OpTotals", "Priority", "PrioritySemaphore", "ReadRequest", "get_scheduler",
    "retry_transient",
]

_T = TypeVar("_T")

DEFAULT_MAX_CONCURRENCY = 16
DEFAULT_PART_BYTES = 32 * 2**20
MIN_BYTES_PER_S = 2**20
"""The slowest transfer rate an attempt of a call to a store with a request timeout may have: an attempt
that moves ``n`` bytes must end within the store's ``request_timeout_s + n / MIN_BYTES_PER_S`` (an
endpoint that answers a few bytes at a time passes every per-read timeout, never this)."""


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """Fill ``out`` with the bytes ``[start, start + len(out))`` of ``key``."""

    key: str
    start: int
    out: memoryview


# -- the scheduler ---------------------------------------------------------------------------------
class IOScheduler:
    """An event loop on a daemon thread, with per-backend slots, retries and metrics."""

    def __init__(
        self, *, max_concurrency: int = DEFAULT_MAX_CONCURRENCY, name: str = "tierckpt-io"
    ) -> None:
        if max_concurrency < 1:
            raise CheckpointError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        self.metrics = IOMetrics()
        self.outages = Outages()
        self.calls = CallsInFlight()
        self._slots: weakref.WeakKeyDictionary[Any, PrioritySemaphore] = weakref.WeakKeyDictionary()
        self._named_slots: dict[str, PrioritySemaphore] = {}
        self._loop = asyncio.new_event_loop()
        # Local-file backends block in worker threads; give them more than the default few.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(32, 4 * max_concurrency), thread_name_prefix=f"{name}-worker"
        )
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    # -- bridges from synchronous code -------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        """Run ``coro`` on the I/O loop and block until it finishes; re-raise what it raises.

        With ``timeout_s`` the coroutine is cancelled when the time is up (its cleanup runs before
        this returns) and :class:`~tierckpt.errors.TransientStorageError` is raised.
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise CheckpointError(
                "IOScheduler.run() was called from the I/O loop thread, which would deadlock; "
                "await the coroutine instead"
            )
        bound = deadline.current()  # the operation's overall deadline ends the wait too, when it comes first
        if bound is not None and (timeout_s is None or bound.remaining() < timeout_s):
            timeout_s = max(0.0, bound.remaining())
        else:
            bound = None
        future = asyncio.run_coroutine_threadsafe(self._with_timeout(coro, timeout_s, bound), self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt in the caller: stop the work too
            raise

    async def _with_timeout(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None,
                            bound: deadline.Deadline | None) -> _T:
        limit = asyncio.timeout(timeout_s)
        try:
            async with limit:
                return await coro
        except TimeoutError as exc:
            if not limit.expired():
                raise
            if bound is not None:
                raise bound.exceeded(self.calls.oldest()) from exc
            name = getattr(coro, "__qualname__", repr(coro))
            raise TransientStorageError(
                f"I/O operation {name} did not finish within {timeout_s} s and was cancelled; "
                "raise the timeout or check the storage endpoint"
            ) from exc

    def submit(self, coro: Coroutine[Any, Any, _T], *, background: bool = False) -> concurrent.futures.Future[_T]:
        """Start ``coro`` on the I/O loop; cancelling the returned future cancels the coroutine.

        Started inside an operation with a deadline (:mod:`tierckpt.deadline`), it is part of that operation:
        cancelled at the deadline, its future then raising :class:`~tierckpt.errors.DeadlineExceededError`
        — unless ``background`` (a write-down, a sweep: work that outlives the operation)."""
        bound = None if background else deadline.current()
        if bound is None:
            return asyncio.run_coroutine_threadsafe(coro, self._loop)
        return asyncio.run_coroutine_threadsafe(self._with_timeout(coro, max(0.0, bound.remaining()), bound), self._loop)

    def close(self) -> None:
        """Stop the loop and its thread (pending work is cancelled). For tests and shutdown."""
        if self._loop.is_closed():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_cancel_all(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()
        self._executor.shutdown(wait=True, cancel_futures=True)

    # -- inside the loop ---------------------------------------------------------------------------
    def _check_loop(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise CheckpointError(
                "IOScheduler.slotted()/read() must run on the scheduler's own loop; "
                "wrap the coroutine in scheduler.run() or scheduler.submit()"
            )

    def _slot(self, owner: Any) -> PrioritySemaphore:
        """The slots of ``owner``: a backend instance, or a name (e.g. a remote's root URI) that every
        scheduling link of one remote shares, so its reads and uploads wait in one priority queue."""
        table: Any = self._named_slots if isinstance(owner, str) else self._slots
        slots = table.get(owner)
        if slots is None:
            slots = table[owner] = PrioritySemaphore(self.max_concurrency)
        return slots

    async def slotted(
        self,
        slot_owner: object,
        label: str,
        op_name: str,
        fn: Callable[..., Awaitable[_T]],
        *args: Any,
        priority: Priority = Priority.FOREGROUND,
        nbytes: int = 0,
        retries: int = 5,
        service: str | None = None,
        request_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> _T:
        """``await fn(*args, **kwargs)`` under one of ``slot_owner``'s slots (one priority queue per owner),
        retrying transient errors, with a metric labelled ``label`` (the store's URI).

        ``retries`` is the most attempts in all (1: no retry); one while ``service`` (what answers the
        store, :attr:`~tierckpt.backends.base.Backend.service`) is marked down in :attr:`outages`. The
        metric's key is ``args[0]`` when it is a string (backend methods take the key first).
        :class:`~tierckpt.io.scheduled.ScheduledBackend`, the scheduling link of every chain, calls it for
        each operation of the store it wraps.

        ``request_timeout_s`` (the store's, e.g. S3's ``timeout_s``) bounds each attempt as a whole: it must
        end within ``request_timeout_s + nbytes / MIN_BYTES_PER_S`` or it fails as
        :class:`~tierckpt.errors.StorageUnreachableError` (and is retried). A call still unanswered after a
        few seconds says so on stderr (:mod:`.calls`)."""
        self._check_loop()
        if retries < 1:
            raise CheckpointError(f"retries must be at least 1 for {op_name} on {label}, got {retries}")
        slots = self._slot(slot_owner)
        key = args[0] if args and isinstance(args[0], str) else ""
        started = time.perf_counter()
        attempt = 0
        ok = False

        attempts = self.outages.attempts(service, retries)
        what = f"{op_name} {label.rstrip('/')}/{key}" if key else f"{op_name} {label}"
        limit = None if request_timeout_s is None else request_timeout_s + nbytes / MIN_BYTES_PER_S

        async def once() -> _T:
            nonlocal attempt
            attempt += 1
            call.attempt = attempt
            await slots.acquire(priority)
            try:
                if limit is None:
                    return await fn(*args, **kwargs)
                timer = asyncio.timeout(limit)
                try:
                    async with timer:
                        return await fn(*args, **kwargs)
                except TimeoutError as exc:
                    if not timer.expired():
                        raise
                    raise StorageUnreachableError(
                        f"{what}: {service or label} gave no complete answer within {limit:.0f} s (the request "
                        f"timeout, {request_timeout_s:g} s, plus {nbytes} bytes at {MIN_BYTES_PER_S // 2**20} MiB/s); "
                        "check the endpoint and the network, or raise the storage option timeout_s"
                    ) from exc
            except TransientStorageError as exc:
                call.last_error = str(exc)
                raise
            finally:
                slots.release()

        call = self.calls.start(what, service or label, attempts, noted=priority is Priority.FOREGROUND)
        cancelled = False
        try:
            result = await retry_transient(once, attempts=attempts)
            ok = True
            self.outages.answered(service)
            return result
        except TransientStorageError as exc:
            self.outages.exhausted(service, attempt, str(exc))
            raise
        except CheckpointError:
            self.outages.answered(service)  # a definite answer (not found, denied, refused): it is up
            raise
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self.calls.end(call, cancelled=cancelled)
            self.metrics.record(
                OpRecord(
                    op=op_name,
                    backend=label,
                    key=key,
                    nbytes=nbytes,
                    seconds=time.perf_counter() - started,
                    attempts=attempt,
                    priority=priority,
                    ok=ok,
                )
            )

    async def read(
        self,
        backend: Backend,
        requests: Sequence[ReadRequest],
        *,
        part_bytes: int = DEFAULT_PART_BYTES,
    ) -> None:
        """Fill every request's ``out`` in parallel, in parts of at most ``part_bytes``, through
        ``backend.read_into`` (a store's scheduling link slots and retries each part).

        The first failure cancels the remaining parts and is raised as is. Zero-length requests do
        no I/O.
        """
        self._check_loop()
        if part_bytes < 1:
            raise CheckpointError(f"part_bytes must be at least 1, got {part_bytes}")
        parts = []
        for req in requests:
            out = memoryview(req.out).cast("B")
            for offset in range(0, len(out), part_bytes):
                parts.append(backend.read_into(req.key, req.start + offset, out[offset : offset + part_bytes]))
        await _all_or_cancel(parts)


async def _all_or_cancel(coros: Sequence[Coroutine[Any, Any, Any]]) -> None:
    """Run ``coros`` concurrently; on the first error (or cancellation) cancel the rest and raise."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        for finished in asyncio.as_completed(tasks):
            await finished
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# -- the per-process instance ----------------------------------------------------------------------
_instance: IOScheduler | None = None
_instance_lock = threading.Lock()


def get_scheduler() -> IOScheduler:
    """The process's scheduler, started on first use (and again in a forked child)."""
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = IOScheduler()
            atexit.register(_close_at_exit, _instance)
        return _instance


def _close_at_exit(scheduler: IOScheduler) -> None:
    """Stop the loop thread before the interpreter tears down the libraries it may be running in.

    A daemon thread still inside native code (pyarrow, aiohttp, botocore) while the interpreter
    finalizes can abort the whole process at exit; joining it first makes exit clean.
    """
    if scheduler is _instance and scheduler._thread.is_alive():
        try:
            scheduler.close()
        except Exception:  # noqa: BLE001 - exit must not fail
            pass


def _forget_after_fork() -> None:
    """In a forked child the loop thread is gone: drop the instance (and a possibly held lock)."""
    global _instance, _instance_lock
    _instance = None
    _instance_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
