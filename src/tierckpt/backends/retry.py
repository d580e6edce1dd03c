"""Retrying transient storage errors: exponential backoff with full jitter.

Below both the backends and the I/O scheduler, so a backend that retries its own requests (the S3
writer's parts) and the scheduler's slotted calls share one rule without importing each other.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tierckpt import deadline
from tierckpt.errors import CheckpointError, TransientStorageError

_T = TypeVar("_T")

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0


def backoff_s(attempt: int) -> float:
    """Full-jitter exponential backoff before attempt ``attempt + 1``."""
    return random.uniform(0.0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (attempt - 1)))


async def retry_transient(fn: Callable[[], Awaitable[_T]], *, attempts: int = 5) -> _T:
    """``await fn()``, retrying :class:`TransientStorageError` with exponential backoff and full jitter.

    Usable on any event loop; :meth:`tierckpt.io.scheduler.IOScheduler.call` adds slots and metrics on top.
    A retry whose backoff would end past the operation's deadline (:mod:`tierckpt.deadline`) is not made:
    :class:`~tierckpt.errors.DeadlineExceededError` is raised instead, from the last error.
    """
    for attempt in range(1, attempts + 1):
        try:
            return await fn()
        except TransientStorageError as exc:
            if attempt >= attempts:
                raise
            pause = backoff_s(attempt)
            bound = deadline.current()
            if bound is not None and bound.remaining() <= pause:
                raise bound.exceeded(str(exc)) from exc  # no backoff that ends past the operation's deadline
        await asyncio.sleep(pause)
    raise CheckpointError(f"attempts must be at least 1, got {attempts}")
