"""The one exit drain of the write-back engine: every link's write-behind registers here.

A link that writes behind (the node memory tier's write-down, the node disk cache's uploads) registers
a :class:`Drainer`; at exit the saver asks :func:`exit_wait_s` how long it may wait and calls
:func:`drain`, which waits for the drainers from the top of the chain down (a faster link feeds the one
below it) and returns one line per store left pending, naming the command that finishes it.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Drainer(Protocol):
    """One link kind's write-behind in this process."""

    depth: int
    """Its place in the chain (0: the top); the drain waits for the lower numbers first."""

    def exit_wait_s(self) -> float:
        """How long the exit drain may wait for it (0: nothing pending)."""

    def drain(self, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s``; one line per store left with writes pending."""


_DRAINERS: list[Drainer] = []
_LOCK = threading.Lock()


def register(drainer: Drainer) -> Drainer:
    """Add ``drainer`` to this process's exit drain (once; a link kind registers one drainer at import,
    which keeps its own per-process state and forgets it in a forked child)."""
    with _LOCK:
        if not any(d is drainer for d in _DRAINERS):
            _DRAINERS.append(drainer)
    return drainer


def _drainers() -> list[Drainer]:
    with _LOCK:
        return sorted(_DRAINERS, key=lambda d: d.depth)


def exit_wait_s() -> float:
    """The longest wait any registered link asks for (0: none)."""
    return max((d.exit_wait_s() for d in _drainers()), default=0.0)


def drain(timeout_s: float) -> list[str]:
    """Wait up to ``timeout_s`` in all for this process's write-behinds, top of the chain first; the lines
    of the stores left pending."""
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    for drainer in _drainers():
        lines += drainer.drain(max(0.0, deadline - time.monotonic()))
    return lines
