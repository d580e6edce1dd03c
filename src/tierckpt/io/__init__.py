"""Asynchronous I/O: the per-process scheduler that runs every backend call.

May import: ``errors``, ``deadline``, ``native``, ``backends``, the ``_copycrc`` extension.
"""

from __future__ import annotations

from tierckpt.io.scheduler import (
    IOMetrics,
    IOScheduler,
    OpRecord,
    OpTotals,
    Priority,
    PrioritySemaphore,
    ReadRequest,
    get_scheduler,
)

__all__ = [
    "IOMetrics",
    "IOScheduler",
    "OpRecord",
    "OpTotals",
    "Priority",
    "PrioritySemaphore",
    "ReadRequest",
    "get_scheduler",
]
