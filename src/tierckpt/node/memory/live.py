"""Replicators whose threads run in this process: the exit hook stops those nobody closed.

The saver's exit drain, which runs before this hook, closes its own after waiting for them; this one
stops the rest so that the interpreter's exit does not wait for their threads (registered before the
threads are joined). A forked child has none of its parent's threads.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Protocol


class Closable(Protocol):
    def close(self, timeout_s: float | None = None, why: str = "") -> list[str]:
        """Stop the threads; one line per replication cut short."""


_LIVE: set[Closable] = set()
_LOCK = threading.Lock()


def add(replicator: Closable) -> None:
    with _LOCK:
        _LIVE.add(replicator)


def discard(replicator: Closable) -> None:
    with _LOCK:
        _LIVE.discard(replicator)


def _close_at_exit() -> None:
    with _LOCK:
        running = list(_LIVE)
    for replicator in running:
        for line in replicator.close(0.0, "the process exited"):
            sys.stderr.write(line + "\n")


threading._register_atexit(_close_at_exit)  # type: ignore[attr-defined]  # before the threads are joined
os.register_at_fork(after_in_child=_LIVE.clear)
