"""The journal protocol of the write-back engine: what a link records of the writes it still owes below.

Each link keeps its journal where every process of the node (and a restart) reads it: the node disk
cache in its LMDB catalogue (:class:`tierckpt.node.disk.catalog.Catalog`, one record per pending key of a
root), the memory tier in one append-only log per generation (:class:`tierckpt.node.memory.downlog.DownLog`).
Both answer :meth:`Journal.outstanding`, which the exit drain and ``status`` read: the keys of a scope
(a root's hash, a generation) not yet below, who is copying each, and why its last attempt failed. A
key whose owner process is gone (:func:`pid_alive`) is nobody's: the next ``sync`` takes it over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Outstanding:
    """One key a link still owes the link below."""

    key: str
    owner: int | None
    """The pid of the live process copying it (``None``: nobody; ``sync`` takes it over)."""
    error: str | None = None
    """Why its last attempt failed (``None``: none failed)."""
    final: bool = False
    """That failure is for good: no attempt follows before a ``sync`` (``False``: it is retried, or the
    journal does not tell)."""


class Journal(Protocol):
    """A link's record of its write-behind (see the module docstring)."""

    def outstanding(self, scope: str) -> list[Outstanding]:
        """The keys of ``scope`` not yet below, sorted by key."""


def pid_alive(pid: int) -> bool:
    """Whether the process ``pid`` (the owner of a journal entry) still runs on this node."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
