"""Saving: synchronous :func:`save` and asynchronous :func:`async_save`, both one :func:`_save`.

Lifecycle (every rank of the group unless noted):

1. *Prepare* (caller's thread; :mod:`tierckpt.saving.plan`): flatten the state into tensor entries and
   objects; encode the objects, while rank 0 reads ``COMMIT`` (the *base*) on the I/O loop. Then the
   group agrees: a check-in, and one collective of each rank's digest of its offers: when they match the
   cached plan's, the plan is reused; otherwise offers are all-gathered and every rank computes the same
   :class:`~tierckpt.planner.SavePlan`. Rank 0 names a fresh generation with the base's next commit
   sequence.
2. *Snapshot and write* (:mod:`tierckpt.saving.stream`): each rank streams its assigned pieces into its
   data file (:class:`~tierckpt.io.staging.FileStream`, CRC-32C computed on the I/O loop). A synchronous
   save streams straight from tensor memory. An asynchronous save first copies the pieces into the
   node memory tier's spare file or the reusable staging buffer (pinned for CUDA) and returns to training
   once every byte is copied; a rank whose offers match its previous save's copies under that save's
   plan while the group agrees, in the agreement thread (:mod:`tierckpt.saving.snapshot`).
3. *Finish* (caller's thread for ``save``, a background thread for ``async_save``;
   :mod:`tierckpt.saving.commit`): close the files, write the objects, gather piece and object records on
   rank 0. A background save coordinates through the group's key-value store
   (:class:`~tierckpt.comm.StoreCoordinator`), never through collectives, so training's collectives are
   untouched. Any failure on any rank: every rank raises, no commit is written, and the last committed
   checkpoint is untouched.
4. *Commit* (rank 0; :mod:`tierckpt.saving.commit`): write the metadata documents, then ``COMMIT`` as one
   compare-and-swap against the base: if another job committed meanwhile, this save raises
   :class:`~tierckpt.errors.CheckpointBusyError` and removes its generation. Share the outcome;
   unless ``keep_previous``, rank 0 then hands the removal of the superseded generations (the one the
   base named, and leftovers) to the I/O loop and returns (:mod:`tierckpt.saving.cleanup`).

5. *Replicate* (a store with a node memory tier, torch.distributed initialised): after the commit every
   rank starts copying its node's files of the generation to the peer nodes' memory tiers
   (:mod:`tierckpt.node.memory.replication`; the replicator is built in step 1 of the first save, never in
   the background). Neither ``save`` nor ``async_save`` waits for it unless asked:
   ``handle.wait("replicated")``, ``save(..., replicated=True)``.

A background failure is raised by the handle's ``wait()`` (:mod:`tierckpt.saving.handle`), and — if nobody
waited — by the next save. What outlives one save, and the exit drain, are :mod:`tierckpt.saving.process`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, cast

from tierckpt.call_args import checked_uri
from tierckpt.comm import Group, StoreCoordinator, attempt
from tierckpt.deadline import bounded
from tierckpt.errors import CheckpointBusyError, CheckpointError
from tierckpt.gc_pause import gc_paused
from tierckpt.native.metadata import CheckpointMeta
from tierckpt.monitor import Monitor
from tierckpt.formats.objects import AllowPickle
from tierckpt.progress import attached
from tierckpt.saving.commit import _finish
from tierckpt.saving.handle import LEVELS, SaveHandle
from tierckpt.saving.plan import _agree, _Local, _prepare, _prepare_local, cached_plan
from tierckpt.saving.prepared import _Prepared
from tierckpt.saving.snapshot import OpenStream, Snapshot, take_snapshot
from tierckpt.saving.process import _PROCESS
from tierckpt.io.staging import FileStream
from tierckpt.saving.stream import _stream_direct, _stream_staged

log = logging.getLogger("tierckpt")

__all__ = ["IF_BUSY", "LEVELS", "SaveHandle", "async_save", "save"]

_F = TypeVar("_F", bound=Callable[..., Any])

IF_BUSY = ("wait", "error")
"""What :func:`async_save` does when a save to the same URI is in flight (``if_busy``)."""

_SHARED_DOC = """
    ``persist=False`` (node memory tier on) keeps the checkpoint in the node memory tier and on the peers
    only: nothing is written where the URI points until ``tierckpt sync URI`` (or :func:`tierckpt.sync`),
    eviction may drop it once newer checkpoints need the room, and ``wait("remote")`` raises. For saving
    to memory often and persisting every N-th checkpoint (:class:`CheckpointManager` ``persist_every``).

    ``keep_previous=True`` keeps the generation that the previous commit named (otherwise it and any
    other superseded generation under ``uri`` are deleted in the background once the new commit is
    shared: see :mod:`tierckpt.saving.cleanup`). ``tags`` are stored in the header. ``align_bytes`` aligns each
    piece in its data file. Pass a :class:`Monitor` to read per-phase timings and byte counts afterwards.
    Every rank of the group must call it; a rank that does not arrive within ``collective_timeout_s``
    (default: the group's timeout) is named in a :class:`CollectiveError`.

    ``group="self"`` saves this process's state alone, with no collective and no wait on other ranks,
    as a one-rank checkpoint (for a trainer that saves from rank 0 only, e.g. Lightning under DDP; its
    plain tensors are taken to be the whole of each tensor). Peer replication does not apply to it.

    Non-tensor values are stored so that a weights-only load reads them (numbers, strings, containers,
    tensors). A value that only unpickling reads back (an instance of your own class, an
    ``argparse.Namespace``) raises :class:`CheckpointError` naming its key and type, before anything is
    written: store it as plain data, or pass ``allow_pickle=True`` (``"warn"``: with a warning) to store it
    as a pickle, which a load then reads only with ``allow_pickle=True``.
"""


def _shared_doc(fn: _F) -> _F:
    """Append the parameters :func:`save` and :func:`async_save` share to ``fn``'s own docstring."""
    fn.__doc__ = (fn.__doc__ or "").rstrip() + "\n" + _SHARED_DOC
    return fn


def _save(
    call: str, uri: str, state: Mapping[str, Any], *, group: Group, storage_options: Mapping[str, Any] | None,
    tags: Mapping[str, str] | None, keep_previous: bool, align_bytes: int, monitor: Monitor | None,
    collective_timeout_s: float | None, persist: bool, background: bool, staging_bytes: int | None = None,
    if_busy: str = "wait", replicated: bool = False, progress: bool | None = False, allow_pickle: AllowPickle = False,
) -> CheckpointMeta | SaveHandle:
    """The one save behind :func:`save` (``background=False``: stream from tensor memory, finish and commit
    in the caller's thread) and :func:`async_save` (``background=True``: stage, then finish and commit on the
    save thread, coordinating through the group's key-value store)."""
    uri = checked_uri(call, uri, state)
    if if_busy not in IF_BUSY:
        raise CheckpointError(
            f"{call}({uri!r}, if_busy={if_busy!r}): use {' or '.join(map(repr, IF_BUSY))} (wait for the save in "
            "flight to the URI, or raise CheckpointBusyError)"
        )
    monitor = monitor or Monitor()
    previous = _PROCESS.in_flight.get(uri)
    if previous is not None and not previous.done():
        if if_busy == "error":
            raise CheckpointBusyError(f"an async save to {uri!r} is still in flight; wait() for it or pass if_busy='wait'")
        previous.wait()
    if not background:
        p = _prepare(uri, state, group, storage_options, tags, keep_previous, align_bytes, monitor,
                     collective_timeout_s, write_back=False, persist=persist, allow_pickle=allow_pickle)
        rank = p.comm.rank
        total = p.plan.file_sizes[rank] if rank < len(p.plan.file_sizes) else None
        # Through a write-back link (node cache, memory tier) the data file lands there first; the save then waits
        # for its upload, whose pending bytes join the bar (tierckpt.progress).
        where = " (node tiers, then upload)" if p.node.durable is not None and persist else ""
        with attached(monitor, f"save {uri}{where}", progress, rank, total=total):
            with monitor.phase("stage"):
                stream = p.comm.run_agreed(lambda: _stream_direct(p), f"writing checkpoint {uri!r}")
            meta = _finish(p, stream, p.comm)
        if replicated:
            p.replication.wait(meta.generation)
        return meta
    local = _prepare_local(uri, state, group, storage_options, True, persist, monitor, allow_pickle)
    p, open_stream = _snapshot_while_agreeing(
        local, align_bytes, staging_bytes, lambda: _agree(local, tags, keep_previous, align_bytes, collective_timeout_s),
    )

    def finish() -> CheckpointMeta:
        stream: FileStream | None = None
        failure: BaseException | None = None
        try:
            stream = open_stream()  # a snapshot becomes the data file here, off the training thread
            if stream is not None:
                stream.finish()
        except BaseException as exc:  # noqa: BLE001 - reported to the group by _finish
            if stream is None:
                failure = exc  # the file could not be named: no rank commits
            # else: the stream's error is raised again by _finish on this rank and shared with the others
        finally:
            _PROCESS.staging_lock.release()
        return _finish(p, stream, StoreCoordinator(p.comm, p.generation), failure)

    handle = SaveHandle(uri, _PROCESS.executor().submit(finish), monitor, p.node.durable, p.replication)
    _PROCESS.in_flight[uri] = handle
    _PROCESS.unreported.append(handle)
    return handle


def _snapshot_while_agreeing(
    local: _Local, align_bytes: int, staging_bytes: int | None, agree: Callable[[], _Prepared],
) -> tuple[_Prepared, OpenStream]:
    """An async save's snapshot and the group's agreement on its plan and generation (``agree``); returns
    with every byte copied and the staging lock held (the save's ``finish`` opens the file's stream and
    releases the lock).

    Where this rank offers the pieces of its previous save, the snapshot is copied under that save's plan
    while the group agrees in the agreement thread (:mod:`tierckpt.saving.snapshot`), so training waits for
    the longer of the two; it is taken again in the rare case the group agreed on another plan. Else the
    group agrees first. No collective follows the copy: each rank returns to training as soon as its own
    copy is done.
    """
    plan = cached_plan(local, align_bytes)
    agreeing = _PROCESS.agree_aside(agree, local.comm) if plan is not None else None
    _PROCESS.staging_lock.acquire()  # the staging buffer serves one save at a time
    snapshot: Snapshot | None = None
    copy_error: Exception | None = None
    try:
        if agreeing is not None and plan is not None and local.kept is not None:
            flat = local.kept[0]
            snapshot, copy_error = attempt(
                lambda: take_snapshot(flat, plan, local.comm.rank, local.node, staging_bytes, local.monitor)
            )
            if snapshot is not None:
                local.monitor.count("snapshots_while_agreeing")
            p = agreeing.result()
        else:
            p = agree()
    except BaseException:
        try:
            if snapshot is not None:
                snapshot.release()  # a failure to give it up is logged: the save's own error is what is raised
        except Exception as exc:  # noqa: BLE001 - see the comment
            log.warning("rank %d: the snapshot of the failed save to %s was not given up: %s",
                        local.comm.rank, local.uri, exc)
        finally:
            _PROCESS.staging_lock.release()  # the next save must not wait for a lock nobody holds
        raise
    try:
        if copy_error is not None:
            raise copy_error
        if snapshot is not None and p.plan is snapshot.plan:
            return p, snapshot.deferred(p)
        if snapshot is not None:
            snapshot.release()  # another rank's offers changed: the group planned anew
            p.monitor.count("snapshots_taken_again")
        return p, _stream_staged(p, staging_bytes)
    except BaseException as exc:
        _PROCESS.staging_lock.release()
        # The other ranks may be back in training already: the background coordination tells them
        # (their handles' wait() raises and nothing is committed); this rank raises now.
        _PROCESS.executor().submit(_finish, p, None, StoreCoordinator(p.comm, p.generation), exc)
        raise


# -- public API ------------------------------------------------------------------------------------
@gc_paused  # outermost: no collection during any of the call, its deadline's set-up included
@bounded("save")
@_shared_doc
def save(
    uri: str,
    state: Mapping[str, Any],
    *,
    group: Group = None,
    storage_options: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
    keep_previous: bool = False,
    align_bytes: int = 64,
    monitor: Monitor | None = None,
    collective_timeout_s: float | None = None,
    replicated: bool = False,
    persist: bool = True,
    progress: bool | None = False,
    allow_pickle: AllowPickle = False,
) -> CheckpointMeta:
    """Save ``state`` to ``uri``; return once the checkpoint is committed (on every rank).

    With the node memory tier on in a multi-node job, peer replication starts after the commit and runs
    in the background; ``replicated=True`` also waits for it and raises
    :class:`~tierckpt.node.memory.replication.ReplicationError` naming the reason when this node's files did
    not reach the level ``replicated``.

    ``progress=True`` draws a progress bar of the bytes staged on stderr, on rank 0 only (``None``: only
    when stderr is a terminal; :mod:`tierckpt.progress`).
    """
    return cast(CheckpointMeta, _save(
        "save", uri, state, group=group, storage_options=storage_options, tags=tags, keep_previous=keep_previous,
        align_bytes=align_bytes, monitor=monitor, collective_timeout_s=collective_timeout_s, persist=persist,
        background=False, replicated=replicated, progress=progress, allow_pickle=allow_pickle,
    ))


@gc_paused
@_shared_doc
def async_save(
    uri: str,
    state: Mapping[str, Any],
    *,
    group: Group = None,
    storage_options: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
    keep_previous: bool = False,
    align_bytes: int = 64,
    staging_bytes: int | None = None,
    if_busy: Literal["wait", "error"] = "wait",
    monitor: Monitor | None = None,
    collective_timeout_s: float | None = None,
    persist: bool = True,
    allow_pickle: AllowPickle = False,
) -> SaveHandle:
    """Snapshot ``state`` and save it in the background; training may mutate it once this returns.

    The snapshot goes through a reusable staging buffer of at most ``staging_bytes`` per rank
    (default: the rank's share of the checkpoint); a larger state streams through it, and the call
    returns once the last bytes are copied. One save per ``uri`` is in flight: with
    ``if_busy="wait"`` (default) a new one waits for the previous, with ``"error"`` it raises
    :class:`CheckpointBusyError`. The returned :class:`SaveHandle` waits for the levels the checkpoint
    reaches (``wait()``: committed, ``wait("replicated")``, ``wait("remote")``).
    """
    return cast(SaveHandle, _save(
        "async_save", uri, state, group=group, storage_options=storage_options, tags=tags,
        keep_previous=keep_previous, align_bytes=align_bytes, monitor=monitor,
        collective_timeout_s=collective_timeout_s, persist=persist, background=True, staging_bytes=staging_bytes,
        if_busy=if_busy, allow_pickle=allow_pickle,
    ))
