"""The scheduling link: a remote store whose every call goes through the I/O scheduler.

:class:`ScheduledBackend` wraps the backend of a URI (the last link of every chain that
:func:`tierckpt.store.open_store` builds). Each call holds one of the remote's slots, is retried on
:class:`~tierckpt.errors.TransientStorageError` and leaves a metric, so callers simply
``await store.get(key)``. All links of one remote (keyed by its root URI) share one priority queue:
cache-miss reads (:attr:`Priority.FOREGROUND`, the default) get a freed slot before uploads, which run
inside :func:`background`.

Writers are not slotted per write: ``open_writer`` is, and the writer streams on its own (a data file's
stream is one long sequential transfer, like today's uploads).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from tierckpt import deadline
from tierckpt.backends.base import UNCONDITIONAL, Backend, ObjectWriter, Segment, Unconditional
from tierckpt.io.scheduler import Priority, get_scheduler, retry_transient

_T = TypeVar("_T")

_PRIORITY: contextvars.ContextVar[Priority] = contextvars.ContextVar("tierckpt_io_priority", default=Priority.FOREGROUND)


@contextlib.contextmanager
def background() -> Iterator[None]:
    """Calls made inside (in this task, and tasks it starts) wait behind foreground ones for a slot."""
    token = _PRIORITY.set(Priority.BACKGROUND)
    try:
        yield
    finally:
        _PRIORITY.reset(token)


def set_background() -> None:
    """Make the rest of the current task background work (an upload task's first statement): it queues
    behind foreground calls, and it has no deadline (it outlives the operation that started it;
    :mod:`tierckpt.deadline`)."""
    _PRIORITY.set(Priority.BACKGROUND)
    deadline.drop()


class ScheduledBackend(Backend):
    """``inner`` with every call under the scheduler's slots, retries and metrics (see the module docstring)."""

    schedules_itself = True
    """:meth:`IOScheduler.call` calls such a store as it is (no second slot, no second retry loop)."""

    def __init__(self, inner: Backend, queue: str | None = None) -> None:
        super().__init__(inner.root_uri)
        self.inner = inner
        self.capabilities = inner.capabilities
        self.queue = queue or inner.root_uri.rstrip("/")

    def __repr__(self) -> str:
        return f"ScheduledBackend({self.inner!r})"

    def uri_of(self, key: str) -> str:
        return self.inner.uri_of(key)

    def next_link(self) -> Backend:
        return self.inner

    async def call(self, op: str, fn: Callable[..., Awaitable[_T]], *args: Any, nbytes: int = 0,
                   retries: int = 5, **kwargs: Any) -> _T:
        """``await fn(*args, **kwargs)`` as one scheduled call named ``op`` (e.g. an upload that streams
        a file through :attr:`inner`) at the current task's priority. On another event loop than the
        scheduler's (a test driving a store with ``asyncio.run``) it is only retried."""
        scheduler = get_scheduler()
        try:
            foreign = asyncio.get_running_loop() is not scheduler.loop
        except RuntimeError:
            foreign = True
        if foreign:
            return await retry_transient(lambda: fn(*args, **kwargs), attempts=retries)
        return await scheduler.slotted(self.queue, self.root_uri, op, fn, *args, priority=_PRIORITY.get(),
                                       nbytes=nbytes, retries=retries, service=self.inner.service,
                                       request_timeout_s=self.inner.request_timeout_s, **kwargs)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self.call("put", self.inner.put, key, data, nbytes=memoryview(data).nbytes)

    async def open_writer(self, key: str) -> ObjectWriter:
        return await self.call("open_writer", self.inner.open_writer, key)

    async def get(self, key: str) -> bytes:
        return await self.call("get", self.inner.get, key)

    async def get_capped(self, key: str, cap: int) -> bytes:
        return await self.call("get", self.inner.get_capped, key, cap)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        return await self.call("get_range", self.inner.get_range, key, start, end, nbytes=max(end - start, 0))

    async def read_into(self, key: str, start: int, out: memoryview) -> None:
        await self.call("read_into", self.inner.read_into, key, start, out, nbytes=memoryview(out).nbytes)

    async def read_runs(
        self, key: str, offsets: Sequence[int], run_bytes: int, out: memoryview,
        digest: Callable[[memoryview], int] | None = None,
    ) -> list[int] | None:
        return await self.call(
            "read_runs", self.inner.read_runs, key, offsets, run_bytes, out, digest, nbytes=len(offsets) * run_bytes,
        )

    async def read_segments(
        self, key: str, segments: Sequence[Segment], digest: Callable[[memoryview], int] | None = None,
    ) -> list[list[int] | None]:
        return await self.call(
            "read_segments", self.inner.read_segments, key, segments, digest,
            nbytes=sum(len(offsets) * run_bytes for offsets, run_bytes, _ in segments),
        )

    async def exists(self, key: str) -> bool:
        return await self.call("exists", self.inner.exists, key)

    def size_at_once(self, key: str) -> int | None:
        return self.inner.size_at_once(key)

    async def size(self, key: str) -> int:
        return await self.call("size", self.inner.size, key)

    async def list(self, prefix: str = "") -> list[str]:
        return await self.call("list", self.inner.list, prefix)

    async def delete(self, key: str) -> None:
        await self.call("delete", self.inner.delete, key)

    async def delete_prefix(self, prefix: str) -> None:
        await self.call("delete_prefix", self.inner.delete_prefix, prefix)

    async def commit(self, key: str, data: bytes, *, expected: bytes | None | Unconditional = UNCONDITIONAL,
                     after: Mapping[str, int | None] | None = None) -> None:
        await self.call("commit", self.inner.commit, key, data, expected=expected, after=after, nbytes=len(data))

    async def close(self) -> None:
        await self.inner.close()
