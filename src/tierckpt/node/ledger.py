"""What the node tiers cost the node, per process: bytes each tier lands and bytes it reads back to send down.

Every link of the engine counts here where bytes land on the node (:class:`~.written.WrittenCrc`, which
every writer of a tier feeds) and where it reads them back on their way down (the engine's one copy,
:mod:`.copy`, for the memory tier's write-down and the node disk cache's uploads; the cache's upload
that follows a file while it is written). ``benchmarks/bench_memory.py
--parts bytes`` reports them per checkpoint; :func:`snapshot` is cheap (a dict copy under a lock).
"""

from __future__ import annotations

import collections
import enum
import threading


class Tier(enum.StrEnum):
    """A node tier whose bytes are counted."""

    MEMORY = "memory"
    """The node memory tier (tmpfs), the node's own files and the replicas its peers send."""
    NODE_DISK = "node-disk"
    """The node disk cache."""


_COUNTS: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()


def landed(tier: Tier, nbytes: int) -> None:
    """``nbytes`` were written into ``tier`` on this node."""
    with _LOCK:
        _COUNTS[f"{tier}.landed"] += nbytes


def read_back(tier: Tier, nbytes: int) -> None:
    """``nbytes`` were read back out of ``tier`` to be sent to the link below."""
    with _LOCK:
        _COUNTS[f"{tier}.read_back"] += nbytes


def snapshot() -> dict[str, int]:
    """``{"<tier>.landed": bytes, "<tier>.read_back": bytes}`` counted by this process so far."""
    with _LOCK:
        return {f"{t}.{what}": _COUNTS[f"{t}.{what}"] for t in Tier for what in ("landed", "read_back")}
