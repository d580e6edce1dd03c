"""The one retry rule of tierckpt: how long to wait before trying again after a transient storage error.

Every retry paces itself by a :class:`RetryPolicy` (pauses growing from ``first_s`` to ``max_s``, part of each
drawn at random so processes do not retry in lockstep, never past the deadline of the operation that waits,
:mod:`tierckpt.deadline`). Three are named:

* :data:`REQUEST`: one request to a store, retried a few times by :func:`retry_transient` (a backend's own
  requests, such as the S3 writer's parts, and the I/O scheduler's slotted calls);
* :data:`WRITE_DOWN` and :data:`UPLOAD`: the node tiers' copies down (:mod:`tierckpt.node.runner`), retried
  until they land so that write-back covers an outage of the link below.

Below the backends, the I/O scheduler and the node tiers alike, so they share the rule without importing
each other.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from tierckpt import deadline
from tierckpt.errors import CheckpointError, TransientStorageError

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Pauses between attempts: ``first_s`` after the first failure, doubling up to ``max_s``."""

    first_s: float
    """The pause after the first failed attempt."""
    max_s: float
    """The longest pause."""
    jitter: float = 0.0
    """The fraction of each pause drawn at random: 0 none, 0.5 its upper half, 1 all of it (full jitter)."""

    def drawn_s(self, attempt: int) -> float:
        """The pause after failed attempt ``attempt`` (1-based), jittered, before any deadline."""
        pause = min(self.first_s * 2 ** min(attempt - 1, 30), self.max_s)
        return random.uniform(pause * (1.0 - self.jitter), pause) if self.jitter else pause

    def pause_s(self, attempt: int) -> float:
        """:meth:`drawn_s`, clipped to the current deadline (a bounded wait gets its answer at its deadline)."""
        pause = self.drawn_s(attempt)
        left = deadline.remaining()
        return pause if left is None else max(min(pause, left), 0.0)

    async def wait(self, attempt: int) -> None:
        await asyncio.sleep(self.pause_s(attempt))


REQUEST = RetryPolicy(first_s=0.05, max_s=2.0, jitter=1.0)
"""One request to a store, retried by :func:`retry_transient`."""
WRITE_DOWN = RetryPolicy(first_s=0.05, max_s=2.0, jitter=0.5)
"""The memory tier's write-down: the chain below is usually the node disk cache or a nearby store."""
UPLOAD = RetryPolicy(first_s=1.0, max_s=30.0)
"""The node disk cache's uploads to the URI's (remote) store."""


async def retry_transient(fn: Callable[[], Awaitable[_T]], *, attempts: int = 5,
                          policy: RetryPolicy = REQUEST) -> _T:
    """``await fn()``, retrying :class:`TransientStorageError` up to ``attempts`` times, paced by ``policy``.

    Usable on any event loop; :meth:`tierckpt.io.scheduler.IOScheduler.call` adds slots and metrics on top.
    A retry whose pause would end past the operation's deadline (:mod:`tierckpt.deadline`) is not made:
    :class:`~tierckpt.errors.DeadlineExceededError` is raised instead, from the last error.
    """
    for attempt in range(1, attempts + 1):
        try:
            return await fn()
        except TransientStorageError as exc:
            if attempt >= attempts:
                raise
            pause = policy.drawn_s(attempt)
            bound = deadline.current()
            if bound is not None and bound.remaining() <= pause:
                raise bound.exceeded(str(exc)) from exc  # no pause that ends past the operation's deadline
        await asyncio.sleep(pause)
    raise CheckpointError(f"attempts must be at least 1, got {attempts}")
