"""The scheduler's bookkeeping: priorities, the priority-aware slots of a store, and I/O metrics.

Kept apart from :mod:`tierckpt.io.scheduler` (which re-exports them) so that module holds the loop
and the calls only.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import threading
from dataclasses import dataclass


class Priority(enum.IntEnum):
    """Who gets a backend slot first; lower values win."""

    FOREGROUND = 0
    """Loads and synchronous saves: someone is waiting."""
    BACKGROUND = 1
    """Asynchronous uploads: throughput matters, latency does not."""


# -- metrics ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OpRecord:
    """One finished (or failed) backend call."""

    op: str
    backend: str
    key: str
    nbytes: int
    seconds: float
    attempts: int
    priority: Priority
    ok: bool


@dataclass(frozen=True, slots=True)
class OpTotals:
    """Totals of one op name since the last reset."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0
    retries: int = 0
    errors: int = 0


class IOMetrics:
    """Thread-safe accumulation of :class:`OpRecord`; keeps totals and the most recent records."""

    def __init__(self, keep_records: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, OpTotals] = {}
        self._records: collections.deque[OpRecord] = collections.deque(maxlen=keep_records)

    def record(self, rec: OpRecord) -> None:
        with self._lock:
            t = self._totals.get(rec.op, OpTotals())
            self._totals[rec.op] = OpTotals(
                count=t.count + 1,
                bytes=t.bytes + (rec.nbytes if rec.ok else 0),
                seconds=t.seconds + rec.seconds,
                retries=t.retries + rec.attempts - 1,
                errors=t.errors + (not rec.ok),
            )
            self._records.append(rec)

    def snapshot(self) -> dict[str, OpTotals]:
        """Totals per op name."""
        with self._lock:
            return dict(self._totals)

    def records(self) -> list[OpRecord]:
        """The most recent records, oldest first."""
        with self._lock:
            return list(self._records)

    def reset(self) -> None:
        with self._lock:
            self._totals.clear()
            self._records.clear()


# -- priority-aware slots --------------------------------------------------------------------------
class PrioritySemaphore:
    """An asyncio semaphore that hands a freed slot to the highest-priority waiter (FIFO within one).

    A released slot goes straight to the chosen waiter, so a newcomer cannot barge past the queue.
    Use it from one event loop only.
    """

    def __init__(self, value: int) -> None:
        self._free = value
        self._waiters: dict[Priority, collections.deque[asyncio.Future[None]]] = {
            p: collections.deque() for p in sorted(Priority)
        }

    def _queued(self) -> bool:
        return any(self._waiters.values())

    async def acquire(self, priority: Priority) -> None:
        if self._free > 0 and not self._queued():
            self._free -= 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[priority].append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted the slot just as we were cancelled: pass it on
            else:
                self._waiters[priority].remove(waiter)
            raise

    def release(self) -> None:
        for queue in self._waiters.values():
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    return
        self._free += 1
