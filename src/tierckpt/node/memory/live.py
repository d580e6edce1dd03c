"""The one registry of this process's live replicators: :data:`REPLICATORS`.

Every :class:`~.replica.Replicator` whose threads run is in it (it adds itself when it starts them and
leaves when it is closed), and so is the saver's replicator of each (group, memory tier configuration),
which :func:`~.replication.replicator_for` builds and reuses through it. Three ends stop them:

* the saver's exit drain and the default group's destruction stop the saver's replicators
  (:meth:`LiveReplicators.stop`, through :func:`~.replication.stop_replicators`), waiting for replication
  in flight within the exit wait;
* then, before the interpreter joins threads, the rest, without waiting (:meth:`LiveReplicators.close_all`,
  registered with :mod:`tierckpt.node.lifecycle`), so that the exit never waits for their threads;
* a forked child has none of its parent's threads or groups: it forgets them all.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

from tierckpt.node import lifecycle
from tierckpt.node.memory.nodememory import NodeMemory


class LiveReplicator(Protocol):
    """What the registry needs of a replicator."""

    memory: NodeMemory

    def busy(self) -> bool:
        """Whether a queued generation is still being sent or received."""

    def close(self, timeout_s: float | None = None, why: str = "") -> list[str]:
        """Stop the threads; one line per replication cut short."""


R = TypeVar("R", bound=LiveReplicator)


class LiveReplicators:
    """This process's live replicators, each with the key the saver built it for (``None``: built by
    someone else). One lock guards them; a build of the saver's replicator (collectives) holds it, so
    two saves never build the same one."""

    def __init__(self) -> None:
        self._keys: dict[LiveReplicator, Hashable | None] = {}
        self._lock = threading.RLock()

    def add(self, replicator: LiveReplicator) -> None:
        """``replicator`` started its threads (kept with its key when the saver already registered it)."""
        with self._lock:
            self._keys.setdefault(replicator, None)

    def discard(self, replicator: LiveReplicator) -> None:
        """``replicator`` was closed."""
        with self._lock:
            self._keys.pop(replicator, None)

    def built_for(self, key: Hashable, build: Callable[[], R]) -> R:
        """The saver's replicator of ``key``: the live one, else the one ``build()`` makes (under the lock)."""
        with self._lock:
            for replicator, its_key in self._keys.items():
                if its_key == key:
                    return replicator  # type: ignore[return-value]  # the saver's keys hold what build() made
            replicator = build()
            self._keys[replicator] = key
            return replicator

    def exit_wait_s(self) -> float:
        """How long the exit drain may wait for replication: the longest ``exit_wait_s`` of the memory tier
        configurations of the saver's busy replicators (0: none busy)."""
        with self._lock:
            saver = [r for r, key in self._keys.items() if key is not None]
        return max((r.memory.config.exit_wait_s for r in saver if r.busy()), default=0.0)

    def stop(self, timeout_s: float, why: str) -> list[str]:
        """Stop the saver's replicators: wait up to ``timeout_s`` in all for replication in flight, then end
        their threads; a later save builds new ones. One line per generation cut short."""
        with self._lock:
            saver = [r for r, key in self._keys.items() if key is not None]
            for replicator in saver:
                del self._keys[replicator]
        deadline = time.monotonic() + timeout_s
        lines: list[str] = []
        for replicator in saver:
            lines += replicator.close(max(0.0, deadline - time.monotonic()), why)
        return lines

    def close_all(self, why: str) -> list[str]:
        """Stop every live replicator without waiting; one line per replication cut short."""
        with self._lock:
            running = list(self._keys)
        lines: list[str] = []
        for replicator in running:
            lines += replicator.close(0.0, why)
        return lines

    def forget(self) -> None:
        """In a forked child: none of the parent's replicators runs here (a fresh lock: a parent thread
        may have held this one)."""
        self._keys = {}
        self._lock = threading.RLock()


REPLICATORS = LiveReplicators()
"""This process's live replicators."""


def _close_at_exit() -> None:
    for line in REPLICATORS.close_all("the process exited"):
        sys.stderr.write(line + "\n")


lifecycle.before_threads_joined(_close_at_exit)
lifecycle.after_fork_in_child(REPLICATORS.forget)
