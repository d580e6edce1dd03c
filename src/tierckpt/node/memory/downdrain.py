"""The memory tier's part of the engine's exit drain: this process's write-downs, and what it left in memory only.

Every :class:`~.writedown.WriteDown` registers in :data:`ACTIVE`; a ``persist=False`` commit in
:data:`MEMORY_ONLY`. :func:`drain` waits for the write-downs and names what is left (registered with
:mod:`tierckpt.node.drain` at the top of the chain: drained before the node cache's uploads).
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from typing import Protocol

from tierckpt.errors import CheckpointError
from tierckpt.node import drain as exit_drain, lifecycle
from tierckpt.node.runner import TaskRunner
from tierckpt.node.memory.config import DIR_ENV
from tierckpt.node.memory.downlog import DownLog
from tierckpt.node.memory.memory import MemoryTier


class Writing(Protocol):
    """What the drain sees of a write-down."""

    tier: MemoryTier
    """The URI's files in the node memory tier it copies from."""
    down: DownLog
    """The tier's write-down log."""
    runner: TaskRunner
    """Its tasks: what it still runs (:meth:`~tierckpt.node.runner.TaskRunner.outstanding`) is the drain's view."""

    def pending(self) -> list[concurrent.futures.Future[None]]:
        """Its tasks not done yet, and the deletes waiting for them."""


ACTIVE: weakref.WeakSet[Writing] = weakref.WeakSet()
"""This process's write-downs (one per store opened on a URI with the memory tier)."""
ACTIVE_LOCK = threading.Lock()
MEMORY_ONLY: dict[str, tuple[Writing, str]] = {}
"""Tier home -> (write-down, generation) of this process's newest memory-only commit there (``persist=False``):
the exit drain says when it is still the newest checkpoint of its URI and still in memory only."""


def sync_command(tier: MemoryTier) -> str:
    """The command that finishes the write-down of ``tier``'s URI from any later process on the node."""
    return f"{DIR_ENV}={tier.config.directory} tierckpt sync {tier.uri}"


def exit_wait_s() -> float:
    """How long the exit drain may wait for write-downs: the longest ``exit_wait_s`` of the memory
    configurations of this process's links with write-downs running (0: none running)."""
    with ACTIVE_LOCK:
        return max((w.tier.config.exit_wait_s for w in ACTIVE if w.pending()), default=0.0)


def drain(timeout_s: float) -> list[str]:
    """Wait up to ``timeout_s`` for this process's write-downs; one line per URI left with some, and one
    per URI whose newest checkpoint this process committed in memory only (``persist=False``)."""
    with ACTIVE_LOCK:
        active = list(ACTIVE)
    jobs = [j for w in active for j in w.pending()]
    if jobs:
        concurrent.futures.wait(jobs, timeout=timeout_s)
    lines = []
    for w in active:
        left = w.pending()
        if not left:
            continue
        errors = [o.error for o in w.runner.outstanding() if o.error]
        why = f"failing: {errors[0]}" if errors else "not finished"
        lines.append(
            f"tierckpt: {len(left)} write-down(s) of {w.tier.uri} from the node memory tier did not "
            f"finish before exit ({why}); what they hold is committed in this node's memory only. Finish them: "
            f"{sync_command(w.tier)}"
        )
    return lines + _still_memory_only()


def _still_memory_only() -> list[str]:
    """One line per URI whose newest checkpoint this process committed with ``persist=False`` and nobody
    has written down since: at exit it is only as durable as this node's memory (and its peers')."""
    with ACTIVE_LOCK:
        held = list(MEMORY_ONLY.values())
    lines = []
    for writing, generation in held:
        try:
            record = writing.tier.committed()
            if record is None or record.generation != generation or not writing.down.state(generation).memory_only:
                continue
        except (CheckpointError, OSError, ValueError):
            continue
        lines.append(
            f"tierckpt: the newest checkpoint of {writing.tier.uri} ({generation}) is held in node memory only "
            f"(saved with persist=False), not where its URI points. To write it down: {sync_command(writing.tier)}"
        )
    return lines


class _Drainer:
    """This process's write-downs in the engine's exit drain (the top of the chain: drained first)."""

    depth = 0

    def exit_wait_s(self) -> float:
        return exit_wait_s()

    def drain(self, timeout_s: float) -> list[str]:
        return drain(timeout_s)


exit_drain.register(_Drainer())


def _forget_after_fork() -> None:
    """A forked child has none of its parent's write-down tasks."""
    ACTIVE.clear()
    MEMORY_ONLY.clear()


lifecycle.after_fork_in_child(_forget_after_fork)
