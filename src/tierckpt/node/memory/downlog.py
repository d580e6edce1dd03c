"""What the chain below the node memory tier holds: the write-down log of each generation.

The memory link (:mod:`.link`) copies every file it puts into the tier down to the chain below it
("write-down"), ``COMMIT`` last. Which copies are down decides eviction (a copy no lower tier holds is
never evicted), ``status`` and ``sync`` — for every process of the node and for a restart — so it is
kept in the tier, one append-only log per generation::

    <tier home>/down/<generation>.log      one JSON line per event: {"pid", "op", "key", "error"}

``op`` is ``start`` (a process began copying ``key`` down), ``done`` (the chain below acknowledged it),
``error`` (an attempt failed transiently and the process retries; ``error`` says why) or ``failed`` (it
failed for good). Two ops name the whole generation (``key`` is the generation): ``memory-only`` (saved
with ``persist=False``: kept in the node memory tier, and on the peers, and not written down until a
``sync``) and ``persist`` (a ``sync`` took it down after all). Each line is one ``write`` on an ``O_APPEND`` file,
so lines of concurrent processes never interleave. A key started by a process that is gone and never
done is nobody's: ``sync`` (or the commit's write-down) copies it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from tierckpt.backends.bounded import MAX_TIER_RECORD_BYTES, read_capped
from tierckpt.node.journal import Outstanding, pid_alive
from tierckpt.native.layout import COMMIT, is_generation
from tierckpt.node.memory.eviction import copy_id
from tierckpt.node.memory.memory import SPARE_PREFIX, MemoryTier
from tierckpt.node.memory.nodememory import NodeMemory


MEMORY_ONLY = "memory-only"
PERSIST = "persist"


def generation_of(key: str) -> str | None:
    """The generation a key of the checkpoint root lies in (its first part), else ``None``."""
    first = key.split("/", 1)[0]
    return first if "/" in key and is_generation(first) else None


@dataclass(slots=True)
class DownState:
    """The write-down of one generation as the log tells it."""

    done: set[str] = field(default_factory=set)
    """Keys the chain below acknowledged (``COMMIT`` included once its commit landed there)."""
    busy: dict[str, int] = field(default_factory=dict)
    """Keys a live process is copying right now -> its pid."""
    errors: dict[str, str] = field(default_factory=dict)
    """Keys whose last copy failed (and are not done) -> why."""
    memory_only: bool = False
    """Saved with ``persist=False`` and not synced since: nobody writes it down, eviction may drop it."""


MAX_ERROR_CHARS = 2000
"""An error recorded in the log is cut to this many characters (the log must stay under its read cap)."""


class DownLog:
    """The write-down logs of one URI's tier (see the module docstring)."""

    def __init__(self, tier: MemoryTier) -> None:
        self.tier = tier

    def path(self, generation: str) -> str:
        return os.path.join(self.tier.home, "down", f"{generation}.log")

    def append(self, generation: str, op: str, key: str, error: str | None = None) -> None:
        """Record one event (one ``O_APPEND`` write, so concurrent processes' lines stay whole)."""
        path = self.path(generation)
        error = error if error is None else error[:MAX_ERROR_CHARS]  # lines stay short: the log is read whole
        line = json.dumps({"pid": os.getpid(), "op": op, "key": key, "error": error}) + "\n"
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o666)
        except FileNotFoundError:  # the first event of the tier: its log directory first
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, flags, 0o666)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def state(self, generation: str) -> DownState:
        """Replay the log of ``generation``; a torn last line (a process killed mid-write) is skipped."""
        out = DownState()
        started: dict[str, int] = {}
        try:
            lines = read_capped(self.path(generation), MAX_TIER_RECORD_BYTES).splitlines()
        except FileNotFoundError:
            return out
        for raw in lines:
            try:
                event = json.loads(raw)
                pid, op, key = int(event["pid"]), str(event["op"]), str(event["key"])
            except (ValueError, KeyError, TypeError):
                continue
            if op == "start":
                started[key] = pid
            elif op == "done":
                out.done.add(key)
                out.errors.pop(key, None)
                started.pop(key, None)
            elif op == "error":  # a transient failure: its process retries (it stays busy while alive)
                out.errors[key] = str(event.get("error"))
            elif op == "failed":  # for good: nobody copies it until a sync
                out.errors[key] = str(event.get("error"))
                started.pop(key, None)
            elif op in (MEMORY_ONLY, PERSIST):
                out.memory_only = op == MEMORY_ONLY
        out.busy = {k: p for k, p in started.items() if k not in out.done and pid_alive(p)}
        return out

    def newest_is_memory_only(self) -> bool:
        """Whether the tier's ``COMMIT`` names a generation saved with ``persist=False``: the chain below
        then still holds an older commit, so a superseded generation is dropped from the tier only (deleting
        it below could take the files of the commit the chain below names), and one the chain below is still
        owed stays (:func:`owed_copies`)."""
        record = self.tier.committed()
        return record is not None and self.state(record.generation).memory_only

    def forget(self, generation: str) -> None:
        """Drop the log of a generation that left the tier."""
        try:
            os.unlink(self.path(generation))
        except FileNotFoundError:
            pass

    def pending(self, generation: str, state: DownState | None = None, *, origin: str | None = None) -> list[str]:
        """The tier's files of ``generation`` (and its ``COMMIT``, when the tier's names it) not yet down.
        With ``origin`` (this node), the replicas other nodes sent are left out: their own node writes
        them down."""
        state = state if state is not None else self.state(generation)
        keys = [k for k in self.tier.keys_of(generation) if k not in state.done]
        if origin is not None:
            replicas = self.replicas(generation, origin)
            keys = [k for k in keys if k not in replicas]
        record = self.tier.committed()
        if record is not None and record.generation == generation and COMMIT not in state.done:
            keys.append(COMMIT)
        return keys

    def outstanding(self, scope: str) -> list[Outstanding]:
        """The journal protocol (:class:`~tierckpt.node.journal.Journal`): generation ``scope``'s files
        (and COMMIT) not yet below, each with its live copier and its last failure."""
        state = self.state(scope)
        return [Outstanding(key, state.busy.get(key), state.errors.get(key))
                for key in sorted(self.pending(scope, state))]

    def replicas(self, generation: str, origin: str) -> set[str]:
        """Keys of ``generation`` in the tier that other nodes sent (their manifests list them, or declare them
        arriving): not files of ``origin`` (this node), which is not the one to write them down."""
        return self.tier.listed(generation, besides=(origin, f"{origin}-recovered"))

    def held_below(self, generation: str, state: DownState | None = None) -> bool:
        """Whether the chain below holds every file of ``generation`` that the tier holds (and its COMMIT)."""
        return not self.pending(generation, state)


def owed_copies(memory: NodeMemory, origin: str, tiers: Iterable[MemoryTier] | None = None) -> set[str]:
    """Copy ids of the generations the chain below is still owed by this node (``origin``): saved to be
    written down, this node's files of it not all below yet, in a tier whose newest commit is memory-only.
    Superseded as they are, eviction keeps them: the chain below gets no newer commit of this node's files
    until a persisted save or a ``sync`` (the sweeps keep them too, :meth:`.link.MemoryLink.drop_superseded`).
    A generation still being saved may be named too: eviction asks this of superseded copies only."""
    out: set[str] = set()
    for tier in tiers if tiers is not None else memory.tiers():
        log = DownLog(tier)
        if not log.newest_is_memory_only():
            continue
        for generation in tier.generations():
            if generation.startswith(SPARE_PREFIX):  # the committed one is memory-only: left out below
                continue
            state = log.state(generation)
            if not state.memory_only and log.pending(generation, state, origin=origin):
                out.add(copy_id(tier.uri, generation))
    return out


def durable_copies(memory: NodeMemory, tiers: Iterable[MemoryTier] | None = None) -> set[str]:
    """Copy ids (see :func:`~.eviction.copy_id`) of every generation in the node's tier that the chain
    below its link holds whole, or that was saved to be held in memory only: what eviction may drop."""
    out: set[str] = set()
    for tier in tiers if tiers is not None else memory.tiers():
        log = DownLog(tier)
        for generation in tier.generations():
            state = log.state(generation)
            if state.memory_only or log.held_below(generation, state):
                out.add(copy_id(tier.uri, generation))
    return out
