"""The write-down of a :class:`~.link.MemoryLink`: this process's copies from the memory tier to the chain below.

Both run on the engine's task runner (:mod:`tierckpt.node.runner`), as jobs whose journal is the
tier's write-down log. Every file the link puts into the tier is copied down by a background task on
the I/O scheduler's loop (:meth:`WriteDown.file`, :class:`_FileCopy`), retried through outages. A
``COMMIT`` committed in the tier is committed below by one task per commit (:meth:`WriteDown.commit`,
:class:`_CommitDown`), in the order of the commits: it seals the
generation's manifest, waits until every file the commit depends on is below (this process's copies;
copies of the node's other processes, taken over when their process is gone; other nodes' files,
asked of the chain below), then commits there as a compare-and-swap against the base the saver gave.
A chain below that lags behind the tier (an earlier write-down was dropped with its superseded
generation) is caught up: the commit then swaps against what it holds, if that is older. Events go to
the tier's write-down log (:mod:`.downlog`), shared by the node's processes.

Its part of the engine's exit drain is :mod:`.downdrain`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping

from tierckpt.backends.base import Backend, Unconditional
from tierckpt.comm import describe_error
from tierckpt.backends.bounded import MAX_RECORD_BYTES
from tierckpt.errors import (
    CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError,
    TransientStorageError,
)
from tierckpt.native.layout import COMMIT, CommitRecord, seq_of
from tierckpt.node.memory.commitbelow import commit_below
from tierckpt.node.memory.copydown import copy_down
from tierckpt.node import lifecycle
from tierckpt.node.durability import durability_of, wait_owed
from tierckpt.node.journal import Outstanding
from tierckpt.backends.retry import WRITE_DOWN, RetryPolicy
from tierckpt.node.runner import Blocked, Entry, TaskRunner
from tierckpt.node.memory.downlog import DownLog, DownState, generation_of
from tierckpt.node.memory.downdrain import ACTIVE as _ACTIVE, ACTIVE_LOCK as _ACTIVE_LOCK, MEMORY_ONLY as _MEMORY_ONLY, sync_command
from tierckpt.node.memory.memory import MemoryTier


log = logging.getLogger(__name__)

_POLL_S = 0.05
_REMOTE_POLL_MAX_S = 1.0
"""A wait that is left with another node's ``COMMIT`` to find below asks the chain below (a remote GET
each time) at intervals doubling from ``_POLL_S`` up to this."""
_ENSURE_POLL_MAX_S = 0.4
"""The longest interval between two checks of what the chain below holds while a COMMIT waits for it."""
REPLICA_TAKEOVER_S = 30.0
"""How long the write-down of a ``COMMIT`` waits for another node's files it holds replicas of to appear
below before it copies them itself."""

_LAST_COMMIT: dict[str, Entry] = {}
"""Tier home -> this process's newest COMMIT write-down of it, whichever link made it: commits go down in
the order they were made, even when each save opened its own store."""


class _Down:
    """What a file's copy and a commit's share as jobs on the engine's runner: the tier's log is their
    journal (``start`` once, ``error``/``failed`` per failure, ``done``), retried by ``WRITE_DOWN``."""

    retry = WRITE_DOWN
    poll = RetryPolicy(first_s=_POLL_S / 2, max_s=_ENSURE_POLL_MAX_S)
    """While a commit waits for what the chain below must hold first: other nodes' files take a while."""

    def __init__(self, writedown: WriteDown, key: str, generation: str) -> None:
        self.writedown, self.key, self.generation = writedown, key, generation

    async def take(self, attempt: int) -> str | None:
        """The key, unless a retry finds it below already (another process, a sync, got it down)."""
        if attempt and self.key in self.writedown.down.state(self.generation).done:
            self._forget_failure()
            return None
        return self.key

    async def failed(self, op: str, exc: Exception, retrying: bool, attempt: int) -> bool:
        """Log it (one ``O_APPEND`` write to tmpfs, made on the loop: cheaper than a thread hop)."""
        why = describe_error(exc) or ""
        self.writedown.failures[self.key] = (why, not retrying)
        if isinstance(exc, CorruptCheckpointError):
            self.writedown.corrupt[self.key] = exc
        self.writedown.down.append(self.generation, "error" if retrying else "failed", self.key, why)
        return True

    async def done(self, op: str) -> bool:
        self.writedown.down.append(self.generation, "done", self.key)
        self._forget_failure()
        return False

    def _forget_failure(self) -> None:
        self.writedown.failures.pop(self.key, None)
        self.writedown.corrupt.pop(self.key, None)


class _FileCopy(_Down):
    """A tier file copied down (:func:`.copydown.copy_down`); it waits for nothing.

    Its ``start`` is logged when the job is made, in the thread that asks for the copy (:meth:`WriteDown.file`),
    not when its task first runs: background tasks queue behind the I/O loop's foreground calls, and until
    the log names a live process copying the file, a commit of the node's other processes takes it for a file
    whose process is gone and copies it too (:meth:`_CommitDown._check_below`: twice the upload traffic)."""

    def __init__(self, writedown: WriteDown, key: str) -> None:
        super().__init__(writedown, key, generation_of(key) or "")
        writedown.down.append(self.generation, "start", key)

    async def ready(self, op: str) -> tuple[()]:
        return ()

    async def perform(self, op: str) -> bool:
        await self.writedown._copy(self.key)
        return True


class _CommitDown(_Down):
    """A ``COMMIT`` committed below, after the commit made before it and every file it depends on."""

    def __init__(self, writedown: WriteDown, data: bytes, record: CommitRecord,
                 expected: bytes | None | Unconditional | object, after: Mapping[str, int | None] | None,
                 previous: Entry | None) -> None:
        super().__init__(writedown, COMMIT, record.generation)
        self.data, self.record, self.expected, self.after, self.previous = data, record, expected, after, previous
        self.need: dict[str, int | None] = {}
        """The keys the chain below must hold first (key -> size, ``None``: unknown)."""
        self.pending: set[str] | None = None
        """Those not known to be below yet (``None``: not sealed yet); empty once it may go."""
        self.takeover_at = 0.0

    async def ready(self, op: str) -> set[Hashable] | None:
        if self.previous is not None and self.previous.running():
            return {self.previous}  # in the order they were made
        if self.pending is None:
            tier = self.writedown.tier
            await self.writedown.seal(self.generation)
            self.need = dict.fromkeys(tier.keys_of(self.generation))
            self.need.update(self.after or {})
            self.pending = set(self.need)
            self.takeover_at = time.monotonic() + REPLICA_TAKEOVER_S
        if self.pending:
            await self._check_below()
            if not self.pending:  # its attempts begin
                self.writedown.down.append(self.generation, "start", COMMIT)
        return set(self.pending)

    async def _check_below(self) -> None:
        """One look at what the chain below holds of :attr:`pending`.

        A file of this node that no live process copies is copied here (its process is gone). A replica
        another node sent is that node's to write down: it is copied here only if it is still not below
        :data:`REPLICA_TAKEOVER_S` after the wait began (its node is likely lost)."""
        assert self.pending is not None
        wd = self.writedown
        below, tier, down, generation = wd.below, wd.tier, wd.down, self.generation
        write_back = durability_of(below) is not None  # its own commit waits for what other nodes write
        state = down.state(generation)
        replicas = () if time.monotonic() > self.takeover_at else down.replicas(generation, wd.origin)
        for key in sorted(self.pending):
            entry = wd.runner.entry(key)
            if key in state.done:
                self.pending.discard(key)
            elif entry is not None and entry.failure is not None:
                raise Blocked(entry.failure)
            elif entry is not None or key in state.busy:
                continue
            elif key not in replicas and os.path.isfile(tier.path_of(key)):
                wd.file(key)  # the node's process that wrote it is gone (or its node): copy it here
            elif write_back:
                self.pending.discard(key)
            else:
                try:
                    size = await below.size(key)
                except CheckpointNotFoundError:
                    continue
                if self.need[key] is None or size == self.need[key]:
                    self.pending.discard(key)

    async def perform(self, op: str) -> bool:
        await self.writedown.commit_below(self.data, self.record, self.expected, self.after)
        return True


class WriteDown:
    """This process's write-down for one link (see the module docstring)."""

    def __init__(self, tier: MemoryTier, down: DownLog, below: Backend, origin: str,
                 seal: Callable[[str], Awaitable[None]]) -> None:
        self.tier = tier
        """The URI's files in the node memory tier, copied from."""
        self.down = down
        """The tier's write-down log (this write-down's journal)."""
        self.below = below
        """The chain below the tier, copied to."""
        self.origin = origin
        """This node (the manifests' origin; the replicas other nodes sent are theirs to write down)."""
        self.seal = seal
        """Records the manifest of the node's files of a generation (before its ``COMMIT`` goes down)."""
        self.runner = TaskRunner()
        """One task per file (keyed by the file's key) and per commit (``(COMMIT, generation)``)."""
        self.deferred: list[concurrent.futures.Future[None]] = []
        self.failures: dict[str, tuple[str, bool]] = {}
        """key -> (why its copy failed, whether for good); cleared when it succeeds."""
        self.corrupt: dict[str, CorruptCheckpointError] = {}
        """key -> why its copy was refused for good: its bytes differ from what the save recorded."""
        with _ACTIVE_LOCK:
            _ACTIVE.add(self)

    # -- starting --------------------------------------------------------------------------------------
    def file(self, key: str) -> Entry:
        return self.runner.ensure(key, _FileCopy(self, key))

    def commit(self, data: bytes, record: CommitRecord, expected: bytes | None | Unconditional | object,
               after: Mapping[str, int | None] | None) -> None:
        home, key = self.tier.home, (COMMIT, record.generation)
        with _ACTIVE_LOCK:
            previous = _LAST_COMMIT.get(home)
            if previous is not None and previous is self.runner.entry(key):
                previous = None  # the same generation's commit again: it supersedes that one
            _LAST_COMMIT[home] = self.runner.ensure(key, _CommitDown(self, data, record, expected, after, previous))

    def last_commit(self) -> Entry | None:
        """This process's newest ``COMMIT`` write-down of the tier, whichever link made it (running, done or
        failed for good): what a delete below follows (the link core's rule)."""
        with _ACTIVE_LOCK:
            return _LAST_COMMIT.get(self.tier.home)

    def held_in_memory(self, generation: str) -> None:
        """``generation`` was committed in the tier to stay there only (``persist=False``)."""
        with _ACTIVE_LOCK:
            _MEMORY_ONLY[self.tier.home] = (self, generation)

    def _same_tier(self) -> list[WriteDown]:
        """This process's write-downs of the same tier (one per store opened on the URI)."""
        return _writedowns(self.tier.home)

    def pending(self) -> list[concurrent.futures.Future[None]]:
        return [e.future for e in self.runner.running()] + [f for f in self.deferred if not f.done()]

    async def _copy(self, key: str) -> None:
        """Copy the tier's ``key`` below (:func:`.copydown.copy_down`): the action of a file's job."""
        await copy_down(self.tier, self.below, key)

    async def commit_below(self, data: bytes, record: CommitRecord, expected: bytes | None | Unconditional | object,
                            after: Mapping[str, int | None] | None) -> None:
        """Commit ``data`` below against ``expected`` (:func:`.commitbelow.commit_below`)."""
        await commit_below(self.below, data, record, expected, after)

    # -- waiting ---------------------------------------------------------------------------------------
    async def wait(self, generation: str | None, timeout_s: float | None, *, through_outage: bool,
                   commit: bool = True) -> None:
        """Wait for this process's write-downs (of ``generation``) and until the tier's log shows the
        node's files of it below: the engine's one wait (:func:`~tierckpt.node.durability.wait_owed`) over
        them (:class:`_WriteDowns`). It raises a failure for good at once, a transient one at once unless
        ``through_outage``, and :class:`TransientStorageError` at ``timeout_s``."""
        name = None if generation is None else generation.rstrip("/").rpartition("/")[2]
        if name is not None and self.down.state(name).memory_only:
            raise CheckpointError(
                f"{self.tier.uri} {name} was saved with persist=False: it is held in node memory (and on the "
                f"peers) only and is not written down where its URI points. To write it down, run: {sync_command(self.tier)}"
            )
        await wait_owed(_WriteDowns(self, name, through_outage, commit), timeout_s, through_outage=through_outage)

    async def _node_files_below(self, generation: str, state: DownState | None = None) -> bool:
        """Whether ``generation`` is where its URI points, as far as this node owes it: the chain below holds
        this node's files of it (the tier's log says so; the replicas other nodes sent are theirs to write
        down) and a ``COMMIT`` at least as new — this generation's (logged as written down from this node,
        or found below), or a newer one that superseded it there. A generation that only the tier's
        ``COMMIT`` superseded is not below until the chain below's ``COMMIT`` says so: its own commit down
        may still be under way, or have been stopped by the sweep of the newer one."""
        if state is None:
            state = self.down.state(generation)
        pending = self.down.pending(generation, state, origin=self.origin)
        if [key for key in pending if key != COMMIT]:
            return False
        if COMMIT in state.done:
            return True
        try:
            below = CommitRecord.decode(await self.below.get_capped(COMMIT, MAX_RECORD_BYTES))
        except (CheckpointNotFoundError, TransientStorageError):
            return False
        seq = seq_of(generation)
        return below.generation == generation or (seq is not None and below.seq >= seq)

    async def owed_below(self, generation: str) -> bool:
        """Whether ``generation`` was saved to be written down and is not yet where its URI points as far as
        this node owes it (:meth:`_node_files_below`)."""
        state = self.down.state(generation)
        return not state.memory_only and not await self._node_files_below(generation, state)

    # -- deletes ---------------------------------------------------------------------------------------
    async def cancel(self, what: str, *, exact: bool) -> None:
        """Stop this process's write-downs of a key (``exact``) or of everything under a prefix, through any
        store of the URI: no new attempt starts, and the one in flight is waited for (so nothing lands
        below after a delete)."""

        def hit(key: Hashable) -> bool:
            if isinstance(key, tuple):  # a commit's: (COMMIT, generation)
                return not exact and f"{key[1]}/".startswith(what)
            return key == what if exact else str(key).startswith(what)

        peers = self._same_tier()
        await asyncio.gather(*(w.runner.stop(hit) for w in peers))
        for w in peers:
            for key in [k for k in w.failures if hit(k)]:
                w.failures.pop(key, None)
                w.corrupt.pop(key, None)


class _WriteDowns:
    """A durability wait's view of a write-down (:class:`~tierckpt.node.durability.Owed`): this process's
    copies down of ``name`` (``None``: of everything) and their failures; once none runs, with ``commit``,
    the node's files of ``name`` and its ``COMMIT`` as the tier's log shows them below."""

    def __init__(self, writedown: WriteDown, name: str | None, through_outage: bool, commit: bool) -> None:
        self.writedown, self.name, self.through_outage, self.commit = writedown, name, through_outage, commit
        self.pause = _POLL_S
        self.only_commit_below = False
        """The last look found only the ``COMMIT`` below awaited (a remote GET each look: ask less often)."""

    async def outstanding(self) -> list[Outstanding]:
        wd, name = self.writedown, self.name
        jobs = wd.runner.entries(lambda k: _of(k, name, commits=self.commit))
        failed = {k: Outstanding(k, None, why, final) for k, (why, final) in wd.failures.items()
                  if (name is None or generation_of(k) == name or k == COMMIT) and (final or not self.through_outage)}
        for job in jobs:
            if job.failure is not None:
                failed.setdefault(name or COMMIT, Outstanding(name or COMMIT, None, describe_error(job.failure) or "", True))
        if failed:
            return sorted(failed.values(), key=lambda o: o.key)
        me = os.getpid()
        left = [Outstanding(str(job.key), me) for job in jobs if job.running()]
        self.only_commit_below = not left and self.commit and name is not None
        if left or not self.commit or name is None:
            return left
        return [] if await wd._node_files_below(name) else [Outstanding(COMMIT, None)]

    def waiting_for(self, left: list[Outstanding]) -> str:
        failures = self.writedown.failures
        return (f"the write-down of {self.writedown.tier.uri} from the node memory tier"
                + (f" (failing, retried: {min(failures.values())[0]})" if failures else ""))

    def failed(self, failed: list[Outstanding], left: list[Outstanding]) -> Exception:
        wd, name = self.writedown, self.name
        corrupt = sorted((k, e) for k, e in self.writedown.corrupt.items() if name is None or generation_of(k) == name)
        if corrupt:  # a tier file that differs from its save: no fix of the storage helps
            error: Exception = CorruptCheckpointError(
                f"the write-down of {wd.tier.uri} from the node memory tier stopped: {corrupt[0][1]}")
            error.__cause__ = corrupt[0][1]
            return error
        return StorageError(
            f"writing {wd.below.uri_of(failed[0].key)} down from the node memory tier failed ({failed[0].error}); the "
            f"checkpoint is committed in this node's memory only. Fix the storage, then run: {sync_command(wd.tier)}"
        )

    def resume(self, left: list[Outstanding]) -> None:
        """Nothing: a wait resumes no write-down (``sync`` does)."""

    def overdue(self, left: list[Outstanding], timeout_s: float) -> Exception:
        tier = self.writedown.tier
        return TransientStorageError(
            f"the write-down of {tier.uri} from the node memory tier did not finish within "
            f"{timeout_s} s; it goes on in the background ({sync_command(tier)} finishes it)"
        )

    def pause_s(self, left: list[Outstanding]) -> float:
        pause = self.pause
        if self.only_commit_below:
            self.pause = min(pause * 2, _REMOTE_POLL_MAX_S)
        return pause


async def drop_tier(home: str) -> None:
    """Stop every write-down of this process from the tier at ``home`` (its URI is being deleted) and
    wait for the attempts in flight."""
    peers = _writedowns(home)
    await asyncio.gather(*(w.runner.stop(lambda _key: True) for w in peers))
    for w in peers:
        w.failures.clear()
        w.corrupt.clear()


def _writedowns(home: str) -> list[WriteDown]:
    """This process's write-downs from the tier at ``home``."""
    with _ACTIVE_LOCK:
        return [w for w in _ACTIVE if isinstance(w, WriteDown) and w.tier.home == home]


def _of(key: Hashable, generation: str | None, *, commits: bool) -> bool:
    """Whether the runner key ``key`` is a file of ``generation`` (``None``: any) or, with ``commits``,
    its commit."""
    if isinstance(key, tuple):
        return commits and (generation is None or key[1] == generation)
    return generation is None or generation_of(str(key)) == generation


def _forget_after_fork() -> None:
    """A forked child has none of its parent's write-down tasks."""
    _LAST_COMMIT.clear()


lifecycle.after_fork_in_child(_forget_after_fork)
