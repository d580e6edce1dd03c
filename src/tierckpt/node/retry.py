"""The engine's one retry rule: how long a copy down waits before it tries again after a transient failure.

A copy that failed because the link below is out (:class:`~tierckpt.errors.TransientStorageError`, after
the I/O scheduler's own quick retries) is retried until it lands, so write-back covers an outage; any
other failure ends it. Both node tiers pause between attempts by a :class:`RetryPolicy`: growing from
``first_s`` to ``max_s``, and never past the deadline of the operation that waits (:mod:`tierckpt.deadline`),
so a bounded ``wait``/``sync`` gets its answer at its deadline rather than a pause later.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from tierckpt import deadline


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Pauses between attempts of one copy down (see the module docstring)."""

    first_s: float
    """The pause after the first failed attempt."""
    max_s: float
    """The longest pause."""
    jitter: bool = False
    """Draw each pause from its upper half, so the node's processes do not retry in lockstep."""

    def pause_s(self, attempt: int) -> float:
        """The pause after failed attempt ``attempt`` (1-based), clipped to the current deadline."""
        pause = min(self.first_s * 2 ** min(attempt - 1, 30), self.max_s)
        if self.jitter:
            pause = random.uniform(pause / 2, pause)
        left = deadline.remaining()
        return pause if left is None else max(min(pause, left), 0.0)

    async def wait(self, attempt: int) -> None:
        await asyncio.sleep(self.pause_s(attempt))


WRITE_DOWN = RetryPolicy(first_s=0.05, max_s=2.0, jitter=True)
"""The memory tier's write-down: the chain below is usually the node disk cache or a nearby store."""
UPLOAD = RetryPolicy(first_s=1.0, max_s=30.0)
"""The node disk cache's uploads to the URI's (remote) store."""
