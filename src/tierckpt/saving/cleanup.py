"""Removing superseded generations after a commit, off the save's critical path.

Once a save's commit outcome is shared, rank 0 hands the removal of the generations that the new
``COMMIT`` superseded to the process's I/O loop and the save returns: on a local disk mounted with
``discard`` unlinking a rank's fsynced file of hundreds of MiB takes longer than writing the metadata,
and nothing of it is needed for the checkpoint just committed.

What a sweep deletes (:func:`sweep_after_commit`): the generation the previous ``COMMIT`` named, and
every generation under the URI that :func:`tierckpt.native.layout.superseded_generations` says can never be
committed over the new record (leftovers of crashed, failed or losing saves, of earlier sweeps cut
short by an exit, and generations kept by earlier ``keep_previous=True`` saves) — the same set
``tierckpt gc`` removes. Never the committed generation, never one whose commit sequence is higher
(a save that started from the new record and may be in flight); and nothing when the ``COMMIT`` found
when the sweep runs is gone or older than the new record (the URI was deleted and may be saved afresh,
its commit sequences starting over), nor the generation that ``COMMIT`` names. A save with ``keep_previous=True``
starts no sweep. Every other rank, once it knows the commit, retires the same generations from its own
node's memory tier after the same grace (:func:`sweep_node_after_commit`), so every node reuses their
pages. Through a node cache (a write-back store) only the previous generation is deleted
(the cache defers the remote deletion until the new ``COMMIT`` is uploaded); listing the remote after
every save is left to ``tierckpt gc``.

Guarantees kept:

* A load racing the save finishes on a committed generation. A superseded generation stays readable
  for :data:`GRACE_S` after the commit that superseded it, so a load that began on it just before
  finishes on it; a load that was still reading it later fails a step, sees that ``COMMIT`` moved and
  starts again on the newer one (the loader's rule). The grace is a delay of the deletion only: what
  is deleted is decided by commit sequences, never by a clock.
* Sweeps of one URI in a process run one after the other (each waits for the one before), at
  background priority on the store's slots.
* A sweep that fails (an unreachable store) is logged as a warning naming ``tierckpt gc``; the save
  that started it has committed and stays committed.
* At exit the saver's drain waits up to :data:`EXIT_WAIT_S` for pending sweeps
  (:func:`wait_pending`); a process that exits or dies earlier leaves only superseded generations,
  which the next save to the URI and ``tierckpt gc`` remove.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time

from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.backends.bounded import MAX_RECORD_BYTES
from tierckpt.comm import describe_error
from tierckpt.io.scheduled import set_background
from tierckpt.io.scheduler import get_scheduler
from tierckpt.node.face import NodeFace

logger = logging.getLogger("tierckpt")

GRACE_S = 1.0
"""Seconds a superseded generation stays readable after the commit that superseded it (sweeps of one URI
run in commit order, each no earlier than its commit + ``GRACE_S``, so a fast save loop does not queue)."""

EXIT_WAIT_S = 10.0
"""How long the exit drain waits for this process's pending sweeps."""

_exiting = threading.Event()
"""Set by the exit drain: pending sweeps skip the rest of their grace (this process's loads are over)."""

_lock = threading.Lock()
_pending: dict[str, concurrent.futures.Future[list[str]]] = {}
"""The latest sweep of each URI in this process (a new one waits for it)."""
_graces: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()
"""The sweeps waiting out their grace, each woken by the exit drain through its loop."""


def _forget_after_fork() -> None:
    """A forked child has no I/O loop of its parent's: its sweeps are not the child's to wait for."""
    global _lock
    _lock = threading.Lock()
    _pending.clear()
    _graces.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def sweep_after_commit(
    backend: Backend, uri: str, committed: layout.CommitRecord, previous: str | None, *, find_leftovers: bool = True,
) -> concurrent.futures.Future[list[str]]:
    """Start removing, in the background, the generations superseded by ``committed`` under ``uri``.

    ``previous``: the generation the replaced ``COMMIT`` named, deleted first (even if the listing
    fails). ``find_leftovers``: then list ``uri`` and delete every other superseded generation.
    Returns a future of the generation names deleted; it never raises (failures are logged).
    """
    due = time.monotonic() + GRACE_S
    with _lock:
        before = _pending.get(uri)
        sweep = _sweep(backend, uri, committed, previous, before, find_leftovers, due)
        try:
            future = get_scheduler().submit(sweep, background=True)
        except Exception as exc:  # noqa: BLE001 - the commit stands; a leftover is only space
            sweep.close()
            logger.warning("could not start removing superseded generations of %s (%s); the next save to it or "
                           "`tierckpt gc` removes them", uri, describe_error(exc))
            future = concurrent.futures.Future()
            future.set_result([])
            return future
        _pending[uri] = future
    future.add_done_callback(lambda f: _forget(uri, f))
    return future


def _forget(uri: str, future: concurrent.futures.Future[list[str]]) -> None:
    with _lock:
        if _pending.get(uri) is future:
            del _pending[uri]


def sweep_node_after_commit(node: NodeFace, uri: str, committed: layout.CommitRecord) -> None:
    """Every rank but rank 0, once it knows ``committed``: after the same grace, in turn with this process's
    other sweeps of ``uri``, the generations it superseded leave this rank's node memory tier, their pages
    to the node's pool (:meth:`~tierckpt.node.face.NodeFace.drop_superseded`). Rank 0's sweep does that on
    its own node along with the chain below; without this the other nodes would keep superseded
    generations until an admission evicted them, and allocate fresh pages for every save and replica."""
    if node.memory_tier is None:
        return
    due = time.monotonic() + GRACE_S
    with _lock:
        sweep = _sweep_node(node, uri, committed, _pending.get(uri), due)
        try:
            future = get_scheduler().submit(sweep, background=True)
        except Exception as exc:  # noqa: BLE001 - the commit stands; an admission evicts what is left
            sweep.close()
            logger.debug("not retiring superseded generations of %s on this node: %s", uri, describe_error(exc))
            return
        _pending[uri] = future
    future.add_done_callback(lambda f: _forget(uri, f))


async def _sweep_node(node: NodeFace, uri: str, committed: layout.CommitRecord,
                      before: concurrent.futures.Future[list[str]] | None, due: float) -> list[str]:
    await _after(before, due)
    try:
        await node.drop_superseded(committed)
    except Exception as exc:  # noqa: BLE001 - committed is committed; an admission evicts what is left
        logger.warning("retiring generations of %s that %s superseded from this node's memory tier failed (%s); "
                       "they stay until the tier needs the room", uri, committed.generation, describe_error(exc))
    return []


async def _after(before: concurrent.futures.Future[list[str]] | None, due: float) -> None:
    """Wait for the sweep ``before`` this one, then until ``due`` (the grace of loads on the old generation),
    which the exit drain cuts short; at background priority."""
    set_background()
    if before is not None:
        await asyncio.wait([asyncio.wrap_future(before)])
    left = due - time.monotonic()
    if left <= 0 or _exiting.is_set():
        return
    loop = asyncio.get_running_loop()
    woken = loop.create_future()
    waiter = (loop, woken)
    with _lock:
        _graces.add(waiter)
    try:
        if not _exiting.is_set():  # set before this sweep was listed: nobody will wake it
            await asyncio.wait([woken], timeout=left)
    finally:
        with _lock:
            _graces.discard(waiter)


def _end_graces() -> None:
    """The exit drain: every sweep waiting out its grace goes on now (this process's loads are over)."""
    _exiting.set()
    with _lock:
        waiters = list(_graces)
    for loop, woken in waiters:
        try:
            loop.call_soon_threadsafe(lambda f=woken: f.done() or f.set_result(None))
        except RuntimeError:
            pass  # its loop is closed: the sweep ended with it


async def _sweep(
    backend: Backend, uri: str, committed: layout.CommitRecord, previous: str | None,
    before: concurrent.futures.Future[list[str]] | None, find_leftovers: bool, due: float,
) -> list[str]:
    await _after(before, due)
    started = time.perf_counter()
    deleted: list[str] = []
    current = await _current_commit(backend, uri)
    if current is None or current.seq < committed.seq:
        return deleted  # COMMIT gone or older: the URI was wiped (a new history may be starting): keep all
    if previous and previous != current.generation:
        await _delete(backend, uri, previous, deleted)
    if find_leftovers:
        try:
            keys = await backend.list("")
            leftovers = [g for g in layout.superseded_generations(keys, committed) if g != current.generation]
        except Exception as exc:  # noqa: BLE001 - a leftover is only space; gc finds it later
            logger.warning("listing %s for superseded generations failed (%s); the next save to it or "
                           "`tierckpt gc` removes any left", uri, describe_error(exc))
            leftovers = []
        for generation in leftovers:
            await _delete(backend, uri, generation, deleted)
    logger.debug("removed %d superseded generation(s) of %s in %.3fs", len(deleted), uri,
                 time.perf_counter() - started)
    return deleted


async def _current_commit(backend: Backend, uri: str) -> layout.CommitRecord | None:
    """The ``COMMIT`` record under ``uri`` now (``None``: none, or unreadable). What is superseded is decided
    against it, not against the record the sweep was started for: between the commit and the sweep the URI
    may have been deleted and saved afresh, restarting the commit sequences."""
    try:
        return layout.CommitRecord.decode(await backend.get_capped(layout.COMMIT, MAX_RECORD_BYTES))
    except Exception as exc:  # noqa: BLE001 - nothing is deleted without a readable COMMIT
        logger.debug("not removing superseded generations of %s: its COMMIT cannot be read (%s)", uri,
                     describe_error(exc))
        return None


async def _delete(backend: Backend, uri: str, generation: str, deleted: list[str]) -> None:
    try:
        await backend.delete_prefix(f"{generation}/")
        deleted.append(generation)
    except Exception as exc:  # noqa: BLE001 - committed is committed; a leftover is only space
        logger.warning("removing superseded generation %s of %s failed (%s); the next save to it or "
                       "`tierckpt gc` removes it", generation, uri, describe_error(exc))


def pending() -> list[str]:
    """URIs with a sweep still running in this process."""
    with _lock:
        return sorted(uri for uri, future in _pending.items() if not future.done())


def wait_pending(timeout_s: float | None = None, *, exiting: bool = False) -> list[str]:
    """Wait up to ``timeout_s`` (``None``: no limit) for this process's sweeps; return the URIs still pending.
    ``exiting`` (the exit drain): the sweeps skip the rest of their grace."""
    if exiting:
        _end_graces()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        with _lock:
            futures = [f for f in _pending.values() if not f.done()]
        if not futures:
            return []
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        concurrent.futures.wait(futures, timeout=left)
        if deadline is not None and time.monotonic() >= deadline:
            return pending()
