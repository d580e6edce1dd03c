"""The write-down of a :class:`~.link.MemoryLink`: this process's copies from the memory tier to the chain below.

Every file the link puts into the tier is copied down by a background task on the I/O scheduler's
loop (:meth:`WriteDown.file`), retried through outages. A ``COMMIT`` committed in the tier is committed
below by one task per commit (:meth:`WriteDown.commit`), in the order of the commits: it seals the
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
from collections.abc import Awaitable, Callable, Mapping

from ..backends.base import Unconditional
from ..comm import describe_error
from ..bounded import MAX_RECORD_BYTES, read_capped
from ..errors import (
    CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError,
    TransientStorageError,
)
from ..io.calls import Waiting
from ..io.scheduled import set_background
from ..io.scheduler import get_scheduler
from ..layout import COMMIT, CommitRecord
from .commitbelow import CATCH_UP, commit_below
from .copydown import copy_down
from ..writeback.durability import durability_of
from ..writeback.retry import WRITE_DOWN
from .downlog import PERSIST, generation_of
from .downdrain import ACTIVE as _ACTIVE, ACTIVE_LOCK as _ACTIVE_LOCK, MEMORY_ONLY as _MEMORY_ONLY, sync_command
from .linkview import LinkView


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

_LAST_COMMIT: dict[str, _Job] = {}
"""Tier home -> this process's newest COMMIT write-down of it, whichever link made it: commits go down in
the order they were made, even when each save opened its own store."""


class _Job:
    """One write-down task; ``dropped`` tells it to stop before its next attempt (its key was deleted)."""

    def __init__(self) -> None:
        self.dropped = False
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()

    def done(self) -> bool:
        return self.future.done()


class WriteDown:
    """This process's write-down for one link (see the module docstring)."""

    def __init__(self, link: LinkView) -> None:
        self.link = link
        self.files: dict[str, _Job] = {}
        self.commits: dict[str, _Job] = {}
        self.deferred: list[concurrent.futures.Future[None]] = []
        self.failures: dict[str, tuple[str, bool]] = {}
        """key -> (why its copy failed, whether for good); cleared when it succeeds."""
        self.corrupt: dict[str, CorruptCheckpointError] = {}
        """key -> why its copy was refused for good: its bytes differ from what the save recorded."""
        with _ACTIVE_LOCK:
            _ACTIVE.add(self)

    # -- starting --------------------------------------------------------------------------------------
    def file(self, key: str) -> _Job:
        job = self.files[key] = _Job()
        job.future = get_scheduler().submit(self._file(key, job), background=True)
        return job

    def commit(self, data: bytes, record: CommitRecord, expected: bytes | None | Unconditional | object,
               after: Mapping[str, int | None] | None) -> None:
        job = _Job()
        home = self.link.memory_tier.home
        with _ACTIVE_LOCK:
            previous = _LAST_COMMIT.get(home)
            _LAST_COMMIT[home] = job
        job.future = get_scheduler().submit(self._commit(data, record, expected, after, previous, job), background=True)
        self.commits[record.generation] = job

    def held_in_memory(self, generation: str) -> None:
        """``generation`` was committed in the tier to stay there only (``persist=False``)."""
        with _ACTIVE_LOCK:
            _MEMORY_ONLY[self.link.memory_tier.home] = (self.link, generation)

    def _same_tier(self) -> list[WriteDown]:
        """This process's write-downs of the same tier (one per store opened on the URI)."""
        return _writedowns(self.link.memory_tier.home)

    def pending(self) -> list[concurrent.futures.Future[None]]:
        jobs = [j.future for j in (*self.files.values(), *self.commits.values())]
        return [f for f in (*jobs, *self.deferred) if not f.done()]

    # -- files -----------------------------------------------------------------------------------------
    async def _retrying(self, key: str, generation: str, step: Callable[[], Awaitable[None]], job: _Job) -> None:
        """Run ``step`` until it succeeds (or the job is dropped), pausing by the engine's retry rule
        (:data:`~tierckpt.writeback.retry.WRITE_DOWN`) and logging the start, each failure and the end in
        the tier's log (one ``O_APPEND`` write to tmpfs each, made on the loop: cheaper than a thread hop)."""
        down = self.link.down
        down.append(generation, "start", key)
        attempt = 0
        while not job.dropped:
            attempt += 1
            try:
                await step()
            except TransientStorageError as exc:
                self.failures[key] = (describe_error(exc), False)
                down.append(generation, "error", key, describe_error(exc))
                await WRITE_DOWN.wait(attempt)
                if key in (await asyncio.to_thread(down.state, generation)).done:
                    break  # another process (a sync) got it down meanwhile
                continue
            except CheckpointError as exc:
                self.failures[key] = (describe_error(exc), True)
                if isinstance(exc, CorruptCheckpointError):
                    self.corrupt[key] = exc
                down.append(generation, "failed", key, describe_error(exc))
                raise
            down.append(generation, "done", key)
            break
        self.failures.pop(key, None)
        self.corrupt.pop(key, None)

    async def _file(self, key: str, job: _Job) -> None:
        set_background()
        await self._retrying(key, generation_of(key) or "", lambda: self._copy(key), job)

    async def _copy(self, key: str) -> None:
        await copy_down(self.link.memory_tier, self.link.below, key)

    # -- commits ---------------------------------------------------------------------------------------
    async def _commit(self, data: bytes, record: CommitRecord, expected: bytes | None | Unconditional | object,
                      after: Mapping[str, int | None] | None, previous: _Job | None, job: _Job) -> None:
        set_background()
        while previous is not None and not previous.done() and not job.dropped:  # in the order they were made
            await asyncio.wait([asyncio.wrap_future(previous.future)], timeout=_POLL_S)
        if job.dropped:
            return
        tier, generation = self.link.memory_tier, record.generation
        await self.link.seal(generation)
        need: dict[str, int | None] = dict.fromkeys(await asyncio.to_thread(tier.keys_of, generation))
        need.update(after or {})
        await self._ensure_below(generation, need, job)
        await self._retrying(COMMIT, generation, lambda: self.commit_below(data, record, expected, after), job)

    async def _ensure_below(self, generation: str, need: dict[str, int | None], job_of_commit: _Job) -> None:
        """Wait until the chain below holds every key of ``need`` (key -> size, ``None``: unknown).

        A file of this node that no live process copies is copied here (its process is gone). A replica
        another node sent is that node's to write down: it is copied here only if it is still not below
        :data:`REPLICA_TAKEOVER_S` after the wait began (its node is likely lost)."""
        below, tier, down = self.link.below, self.link.memory_tier, self.link.down
        write_back = durability_of(below) is not None  # its own commit waits for what other nodes write
        pending = set(need)
        takeover_at = time.monotonic() + REPLICA_TAKEOVER_S
        pause = _POLL_S / 2
        while pending and not job_of_commit.dropped:
            state = await asyncio.to_thread(down.state, generation)
            replicas = () if time.monotonic() > takeover_at else await asyncio.to_thread(
                down.replicas, generation, self.link.origin)
            for key in sorted(pending):
                job = self.files.get(key)
                if key in state.done:
                    pending.discard(key)
                elif job is not None and job.done():
                    job.future.result()  # raises its failure
                    pending.discard(key)
                elif job is not None or key in state.busy:
                    continue
                elif key not in replicas and os.path.isfile(tier.path_of(key)):
                    self.file(key)  # the node's process that wrote it is gone (or its node): copy it here
                elif write_back:
                    pending.discard(key)
                else:
                    try:
                        size = await below.size(key)
                    except CheckpointNotFoundError:
                        continue
                    if need[key] is None or size == need[key]:
                        pending.discard(key)
            if pending:  # other nodes' files may take a while: ask below less and less often
                await asyncio.sleep(pause)
                pause = min(pause * 2, _ENSURE_POLL_MAX_S)

    async def commit_below(self, data: bytes, record: CommitRecord, expected: bytes | None | Unconditional | object,
                            after: Mapping[str, int | None] | None) -> None:
        """Commit ``data`` below against ``expected`` (:func:`.commitbelow.commit_below`)."""
        await commit_below(self.link.below, data, record, expected, after)

    # -- waiting ---------------------------------------------------------------------------------------
    async def wait(self, generation: str | None, timeout_s: float | None, *, through_outage: bool,
                   commit: bool = True) -> None:
        """Wait for this process's write-downs (of ``generation``) and until the tier's log shows the
        node's files of it below; raise a failure for good at once, a transient one at once unless
        ``through_outage``, and :class:`TransientStorageError` at ``timeout_s``."""
        link = self.link
        name = None if generation is None else generation.rstrip("/").rpartition("/")[2]
        if name is not None and (await asyncio.to_thread(link.down.state, name)).memory_only:
            raise CheckpointError(
                f"{link.memory_tier.uri} {name} was saved with persist=False: it is held in node memory (and on the "
                f"peers) only and is not written down where its URI points. To write it down, run: {sync_command(link)}"
            )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = _POLL_S
        waiting = Waiting()  # a long wait says on stderr what it waits for
        while True:
            waiting.note(lambda: f"the write-down of {link.memory_tier.uri} from the node memory tier"
                         + (f" (failing, retried: {min(self.failures.values())[0]})" if self.failures else ""))
            mine = [k for k in self.files if name is None or generation_of(k) == name]
            jobs = [self.files[k].future for k in mine]
            if commit:
                jobs += [j.future for g, j in self.commits.items() if name is None or g == name]
            failed = {k: why for k, (why, final) in self.failures.items()
                      if (name is None or generation_of(k) == name or k == COMMIT) and (final or not through_outage)}
            for job in jobs:
                if job.done() and not job.cancelled() and job.exception() is not None:
                    failed.setdefault(name or COMMIT, describe_error(job.exception()))
            corrupt = sorted((k, e) for k, e in self.corrupt.items() if name is None or generation_of(k) == name)
            if corrupt:  # a tier file that differs from its save: no fix of the storage helps
                raise CorruptCheckpointError(
                    f"the write-down of {link.memory_tier.uri} from the node memory tier stopped: {corrupt[0][1]}"
                ) from corrupt[0][1]
            if failed:
                key, why = sorted(failed.items())[0]
                raise StorageError(
                    f"writing {link.uri_of(key)} down from the node memory tier failed ({why}); the checkpoint is "
                    f"committed in this node's memory only. Fix the storage, then run: {sync_command(link)}"
                )
            left = [j for j in jobs if not j.done()]
            if not left and (not commit or name is None or await self._node_files_below(name)):
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TransientStorageError(
                    f"the write-down of {link.memory_tier.uri} from the node memory tier did not finish within "
                    f"{timeout_s} s; it goes on in the background ({sync_command(link)} finishes it)"
                )
            await asyncio.sleep(pause)
            if not left and commit and name is not None:  # only the COMMIT below is awaited: ask less often
                pause = min(pause * 2, _REMOTE_POLL_MAX_S)

    async def _node_files_below(self, generation: str) -> bool:
        """Whether the chain below holds this node's files of ``generation`` (the tier's log says so;
        the replicas other nodes sent are theirs to write down) and, when the tier's ``COMMIT`` names it,
        that commit: logged as written down from this node, or else (another node, or another process
        of this one, commits it) found below."""
        link = self.link
        pending = await asyncio.to_thread(link.down.pending, generation, origin=link.origin)
        if pending != [COMMIT]:
            return not pending
        record = await asyncio.to_thread(link.memory_tier.committed)
        try:
            below = CommitRecord.decode(await link.below.get_capped(COMMIT, MAX_RECORD_BYTES))
        except (CheckpointNotFoundError, TransientStorageError):
            return False
        return record is not None and record.generation == generation and below.generation == generation

    async def sync(self, timeout_s: float | None) -> None:
        """Copy down the tier's committed generation wherever the chain below lacks it (files not being
        copied by a live process, then ``COMMIT``), and wait for it."""
        tier, down = self.link.memory_tier, self.link.down
        record = await asyncio.to_thread(tier.committed)
        if record is None:
            return
        generation = record.generation
        state = await asyncio.to_thread(down.state, generation)
        if state.memory_only:  # saved with persist=False: a sync takes it down after all
            await asyncio.to_thread(down.append, generation, PERSIST, generation)
            self.link.memory_only.discard(generation)
        for key in await asyncio.to_thread(down.pending, generation, state):
            if key != COMMIT and key not in state.busy and not _running(self.files.get(key)):
                self.file(key)
        if COMMIT not in state.done and COMMIT not in state.busy and not _running(self.commits.get(generation)):
            data = read_capped(tier.path_of(COMMIT), MAX_RECORD_BYTES)
            if CommitRecord.decode(data).generation == generation:
                self.commit(data, record, CATCH_UP, None)
        await self.wait(generation, timeout_s, through_outage=True)

    # -- deletes ---------------------------------------------------------------------------------------
    async def cancel(self, what: str, *, exact: bool) -> None:
        """Stop this process's write-downs of a key (``exact``) or of everything under a prefix, through any
        store of the URI: no new attempt starts, and the one in flight is waited for (so nothing lands
        below after a delete)."""

        def hit(key: str) -> bool:
            return key == what if exact else key.startswith(what)

        peers = self._same_tier()
        jobs = [j for w in peers for k, j in w.files.items() if hit(k)]
        jobs += [j for w in peers for g, j in w.commits.items() if not exact and hit(f"{g}/")]
        for job in jobs:
            job.dropped = True
        if jobs:
            await asyncio.wait([asyncio.wrap_future(j.future) for j in jobs])
        for w in peers:
            for key in [k for k in w.files if hit(k)]:
                del w.files[key]
                w.failures.pop(key, None)
                w.corrupt.pop(key, None)
            for gen in [g for g in w.commits if not exact and hit(f"{g}/")]:
                del w.commits[gen]

    async def after_commits(self, step: Callable[[], Awaitable[None]], *, superseded: str | None = None) -> None:
        """Run ``step`` (a delete below) now, or after the pending ``COMMIT`` write-down when there is one.

        ``superseded``: the step deletes that generation because a newer commit superseded it (the sweep).
        If the newest ``COMMIT`` write-down failed, the chain below may still name that generation, so
        it is kept there (a leftover for ``tierckpt gc``) rather than deleted under its commit."""
        with _ACTIVE_LOCK:
            previous = _LAST_COMMIT.get(self.link.memory_tier.home)

        async def run() -> None:
            failed = superseded is not None and previous is not None and not previous.future.cancelled() \
                and previous.future.exception()
            if failed:
                log.warning("%s: generation %s is kept below: the write-down of the newer COMMIT failed (%s)",
                            self.link.memory_tier.uri, superseded, describe_error(failed))
                return
            await step()

        if previous is None or previous.done():
            await run()
            return

        async def deferred() -> None:
            await asyncio.wait([asyncio.wrap_future(previous.future)])
            try:
                await run()
            except CheckpointError as exc:
                log.warning("a delete below %s after its write-down failed: %s", self.link.memory_tier.uri, exc)

        self.deferred.append(get_scheduler().submit(deferred(), background=True))


async def drop_tier(home: str) -> None:
    """Stop every write-down of this process from the tier at ``home`` (its URI is being deleted) and
    wait for the attempts in flight."""
    peers = _writedowns(home)
    jobs = [j for w in peers for j in (*w.files.values(), *w.commits.values())]
    for job in jobs:
        job.dropped = True
    if jobs:
        await asyncio.wait([asyncio.wrap_future(j.future) for j in jobs])
    for w in peers:
        w.files.clear()
        w.commits.clear()
        w.failures.clear()
        w.corrupt.clear()


def _writedowns(home: str) -> list[WriteDown]:
    """This process's write-downs from the tier at ``home``."""
    with _ACTIVE_LOCK:
        return [w for w in _ACTIVE if isinstance(w, WriteDown) and w.link.memory_tier.home == home]


def _running(job: _Job | None) -> bool:
    return job is not None and not job.done()


def _forget_after_fork() -> None:
    """A forked child has none of its parent's write-down tasks."""
    _LAST_COMMIT.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
