"""The engine's one task runner: this process's task per key that moves a link's pending op down.

Both node tiers hand their write-behind to a :class:`TaskRunner`: the node disk cache one task per key
of its catalogue (:mod:`tierckpt.node.disk.uploads`: put, commit, delete), the memory tier one per file and
one per ``COMMIT`` (:mod:`tierckpt.node.memory.writedown`: copy down, commit below). What is the link's own is
a :class:`Job`: its journal (the LMDB catalogue, the append log) and its op's action. The runner owns
the rest, on the I/O scheduler's loop:

* *One task per key*: :meth:`TaskRunner.ensure` starts one, or tells the running one that a newer op
  arrived (it takes the key's op once more after the one in hand: the newer op supersedes it).
* *Order*: before an op is performed, :meth:`Job.ready` says what it still waits for (a commit: every
  key it depends on, and the commit made before it). What has a task in this process is awaited (woken
  the moment it finishes); the rest (another process's, another node's) is asked again at pauses
  growing by ``job.poll``. A dependency that failed for good ends the op (:class:`Blocked`).
* *Retry*: a :class:`~tierckpt.errors.TransientStorageError` (the link below is out) is recorded in the
  journal (:meth:`Job.failed`) and retried after ``job.retry``'s pause (:mod:`tierckpt.backends.retry`), so write-back
  covers an outage; any other failure is recorded and ends the task with it.
* *The exit drain's view*: :meth:`TaskRunner.outstanding` (what this process still runs, and why its
  last attempt failed) and :meth:`TaskRunner.wait`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Collection, Hashable
from typing import Generic, Protocol, TypeVar

from tierckpt.comm import describe_error
from tierckpt.errors import TransientStorageError
from tierckpt.io.scheduled import set_background
from tierckpt.io.scheduler import get_scheduler
from tierckpt.node.journal import Outstanding
from tierckpt.backends.retry import RetryPolicy

Op = TypeVar("Op")


class Job(Protocol[Op]):
    """A link's journal and action for one key (see the module docstring)."""

    retry: RetryPolicy
    """The pause after a transient failure."""
    poll: RetryPolicy
    """The pause between two asks of :meth:`ready` while what the op waits for is elsewhere (read after
    each ask: a job may pace asking its node and asking a remote differently)."""

    async def take(self, attempt: int) -> Op | None:
        """The key's op to perform now, claimed in the journal for this process; ``None``: nothing left
        here (none pending, another live process has it, or it got below meanwhile). ``attempt``: the
        failed attempts so far of the op in hand."""

    async def ready(self, op: Op) -> Collection[Hashable] | None:
        """What ``op`` still waits for: keys of this runner not below yet, or tasks (:class:`Entry`) of
        another runner to go first (empty: perform it now; ``None``: it was superseded, take again).
        Raising :class:`Blocked` ends the task; any other failure counts as a failed attempt."""

    async def perform(self, op: Op) -> bool:
        """Apply ``op`` below; ``False``: it was superseded meanwhile (take again)."""

    async def failed(self, op: Op, exc: Exception, retrying: bool, attempt: int) -> bool:
        """Record why ``op`` failed (``retrying``: transiently, retried after ``retry.pause_s(attempt)``);
        ``False``: a newer op superseded it (not recorded; the newer one is taken at once)."""

    async def done(self, op: Op) -> bool:
        """Record that ``op`` is below; ``True``: a newer op of the key is pending (take it)."""


class Entry(Generic[Op]):
    """One key's task (its future completes when the task ends)."""

    def __init__(self, key: Hashable, job: Job[Op]) -> None:
        self.key = key
        self.job = job
        """The newest job ensured for the key: each round of the task takes from it."""
        self.future: concurrent.futures.Future[None]
        """Completes when the task ends (the coroutine's own future: cancelling it cancels the task)."""
        self.again = False
        """A newer op arrived while the task ran: take the key's op once more before ending."""
        self.stopped = False
        """Stop before the next attempt (the key was deleted, the store dropped)."""
        self.finished = False
        self.error: str | None = None
        """Why the last attempt failed (``None``: none failed, or it succeeded since)."""
        self.task: asyncio.Task[None] | None = None

    def running(self) -> bool:
        return not self.future.done()

    async def settled(self) -> None:
        """Wait (on any loop) until the task ends; what it ended with stays in :attr:`failure`."""
        await asyncio.wait([_awaitable(self)])

    @property
    def failure(self) -> BaseException | None:
        """The failure that ended the task for good (``None``: running, succeeded, stopped or cancelled)."""
        if not self.future.done() or self.future.cancelled():
            return None
        return self.future.exception()


class Blocked(Exception):
    """Raised by :meth:`Job.ready`: a dependency failed for good, so the op is not attempted. Its task ends
    with the dependency's failure, recorded nowhere for this key (the dependency's own record says why)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class TaskRunner:
    """This process's write-behind tasks of one link (see the module docstring); thread-safe."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, Entry] = {}
        """Key -> its running task, or the one that failed for good (kept until the key is ensured again)."""
        self._lock = threading.Lock()

    # -- starting --------------------------------------------------------------------------------------
    def ensure(self, key: Hashable, job: Job) -> Entry:
        """Make sure a task of this process handles ``key``'s op (from any thread): start one, or tell the
        running one to take once more, from ``job``, after the op in hand (the newer op supersedes it)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not entry.finished:
                entry.job, entry.again = job, True
                return entry
            entry = self._entries[key] = Entry(key, job)
            entry.future = get_scheduler().submit(self._run(entry), background=True)
        return entry

    def entry(self, key: Hashable) -> Entry | None:
        """``key``'s running task, or the one that failed for good."""
        with self._lock:
            return self._entries.get(key)

    def entries(self, where: Callable[[Hashable], bool] = lambda _key: True) -> list[Entry]:
        """The tasks (running, or failed for good) of the keys ``where`` picks."""
        with self._lock:
            return [e for k, e in self._entries.items() if where(k)]

    def running(self) -> list[Entry]:
        return [e for e in self.entries() if e.running()]

    # -- the task --------------------------------------------------------------------------------------
    async def _run(self, entry: Entry) -> None:
        set_background()  # its calls queue behind foreground ones; it outlives the operation that started it
        entry.task = asyncio.current_task()
        attempt = 0
        try:
            while True:
                job = entry.job
                op = None if entry.stopped else await job.take(attempt)
                if op is None:
                    if self._settle(entry):
                        return
                    attempt = 0
                    continue
                try:
                    performed = await self._ready(entry, job, op) and await job.perform(op)
                except Blocked as dep:
                    if self._settle(entry, failed=True):
                        raise dep.cause from None
                    continue
                except Exception as exc:  # noqa: BLE001 - recorded in the journal; the link's waits report it
                    retrying = isinstance(exc, TransientStorageError)
                    if not await job.failed(op, exc, retrying, attempt + 1):
                        continue  # superseded while it ran: the newer op goes at once
                    entry.error = describe_error(exc)
                    if not retrying:
                        if self._settle(entry, failed=True):
                            raise
                        continue
                    attempt += 1
                    await job.retry.wait(attempt)
                    continue
                if not performed:
                    continue
                entry.error = None
                attempt = 0
                if not await job.done(op) and self._settle(entry):
                    return
        except asyncio.CancelledError:
            self._settle(entry, failed=False, force=True)
            raise

    def _settle(self, entry: Entry, *, failed: bool = False, force: bool = False) -> bool:
        """End ``entry``'s task, unless a newer op arrived meanwhile (``False``: take it). A task that
        failed for good is kept (its failure is what a wait or a commit that depends on it reports)."""
        with self._lock:
            if entry.again and not entry.stopped and not force:
                entry.again = False
                return False
            entry.finished = True
            if not failed and self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            return True

    async def _ready(self, entry: Entry, job: Job, op: object) -> bool:
        """Wait until ``job.ready(op)`` has nothing left (``False``: superseded, or the task was stopped)."""
        polls = 0
        while not entry.stopped:
            waiting = await job.ready(op)
            if waiting is None:
                return False
            if not waiting:
                return True
            here = [w if isinstance(w, Entry) else self.entry(w) for w in waiting]
            polls += 1
            pause = job.poll.pause_s(polls)
            running = [_awaitable(e) for e in here if e is not None and e.running()]
            if running:  # woken the moment one of them finishes here
                await asyncio.wait(running, timeout=pause)
            else:
                await asyncio.sleep(pause)
        return False

    # -- stopping and waiting --------------------------------------------------------------------------
    async def stop(self, where: Callable[[Hashable], bool], *, cancel: bool = False) -> None:
        """Stop the tasks of the keys ``where`` picks before their next attempt (``cancel``: at once, the
        attempt in flight cancelled), wait for them, and forget their failures."""
        entries = self.entries(where)
        for entry in entries:
            entry.stopped = True
            if cancel:
                entry.future.cancel()
        await self._wait_all(entries)
        with self._lock:
            for entry in entries:
                if self._entries.get(entry.key) is entry:
                    del self._entries[entry.key]

    async def settle(self, where: Callable[[Hashable], bool]) -> None:
        """Wait for the running tasks of the keys ``where`` picks (not the calling task's own)."""
        current = asyncio.current_task()
        await self._wait_all([e for e in self.entries(where) if e.task is None or e.task is not current])

    @staticmethod
    async def _wait_all(entries: list[Entry]) -> None:
        futures = [_awaitable(e) for e in entries if e.running()]
        if futures:
            await asyncio.wait(futures)

    def wait(self, timeout_s: float, *, stall_s: float | None = None) -> None:
        """Block (off the I/O loop) up to ``timeout_s`` for this runner's tasks. ``stall_s``: stop early
        once some are failing and none has finished for that long (the drain then reports them)."""
        deadline = time.monotonic() + timeout_s
        last, since = -1, time.monotonic()
        while (running := self.running()) and (left := deadline - time.monotonic()) > 0:
            concurrent.futures.wait([e.future for e in running], timeout=min(left, 0.5))
            now = len(self.running())
            if now != last:
                last, since = now, time.monotonic()
            elif stall_s is not None and any(e.error for e in running) and time.monotonic() - since > stall_s:
                return

    def outstanding(self) -> list[Outstanding]:
        """The keys this process still runs (the exit drain's view), each with its last failure."""
        me = os.getpid()
        return sorted((Outstanding(str(e.key), me, e.error) for e in self.running()), key=lambda o: o.key)


def _awaitable(entry: Entry) -> asyncio.Future[None]:
    """``entry``'s future on the running loop, to wait on; its failure is read by whoever holds the entry,
    so this copy marks it retrieved (no "exception was never retrieved" log when it is collected)."""
    future = asyncio.wrap_future(entry.future)
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future
