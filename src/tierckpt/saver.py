"""Saving: synchronous :func:`save` and asynchronous :func:`async_save`.

Lifecycle (every rank of the group unless noted):

1. *Prepare* (caller's thread): flatten the state into tensor entries and objects; encode the
   objects. Ranks exchange a digest of their offers: when it matches the cached plan's, the plan is
   reused; otherwise offers are all-gathered and every rank computes the same
   :class:`~tierckpt.planner.SavePlan`. Rank 0 reads ``COMMIT`` (the *base*, read on the I/O loop
   while the state is flattened) and names a fresh generation with the next commit sequence.
2. *Snapshot and write*: each rank streams its assigned pieces into its data file
   (:class:`~tierckpt.io.staging.FileStream`, CRC-32C computed on the I/O loop). A synchronous save
   streams straight from tensor memory. An asynchronous save first copies the pieces into the reusable
   staging buffer (pinned for CUDA) and returns to training once every byte is copied.
3. *Finish* (caller's thread for ``save``, a background thread for ``async_save``): close the files,
   write the objects, gather piece and object records on rank 0. A background save coordinates
   through the group's key-value store (:class:`~tierckpt.comm.StoreCoordinator`), never through
   collectives, so training's collectives are untouched. Any failure on any rank: every rank raises,
   no commit is written, and the last committed checkpoint is untouched.
4. *Commit* (rank 0): write the metadata documents, then ``COMMIT`` as one compare-and-swap against
   the base: if another job committed meanwhile, this save raises
   :class:`~tierckpt.errors.CheckpointBusyError` and removes its generation. Share the outcome;
   unless ``keep_previous``, rank 0 then hands the removal of the superseded generations (the one the
   base named, and leftovers) to the I/O loop and returns (:mod:`tierckpt.cleanup`).

5. *Replicate* (a store with a node memory tier, torch.distributed initialised): after the commit every
   rank starts copying its node's files of the generation to the peer nodes' memory tiers
   (:mod:`tierckpt.tiers.replication`; the replicator is built in step 1 of the first save, never in
   the background). Neither ``save`` nor ``async_save`` waits for it unless asked:
   ``handle.wait("replicated")``, ``save(..., replicated=True)``.

A background failure is raised by the handle's ``wait()``, and — if nobody waited — by the next save.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import crc32c
import torch

from . import cleanup, layout
from .backends import Backend
from .call_args import checked_uri
from .comm import Comm, Group, StoreCoordinator, describe_error
from .gc_pause import gc_paused
from .bounded import MAX_RECORD_BYTES
from .errors import CheckpointBusyError, CheckpointError, CheckpointNotFoundError, StorageError, TransientStorageError
from .io.scheduler import get_scheduler
from .io.staging import Chunk, FileStream, StagingBuffer, stage_into
from .metadata import (
    CheckpointMeta, FileMeta, ObjectMeta, PieceMeta, dtype_name, encode_header, encode_pieces, encode_tensors,
)
from .monitor import Monitor, ranks_from_timings
from .progress import attached
from .objects import encode_object
from .planner import LocalPiece, SavePlan, plan_save
from .planner.save_planner import offers_digest
from .regions import Box, FlatRange, Region
from .state import FlatState, TensorEntry, flatten_state
from .deadline import bounded, operation, process_left
from .deadline import current as current_deadline
from .store import (
    drain_write_back, durability_of, exit_wait_s, identity_of, memory_tier_of, open_store, revocable_of,
)
from .tiers.replication import Replication, replicator_for, stop_replicators
from .tiers.replication import exit_wait_s as replication_exit_wait_s

# -- process-wide save state -----------------------------------------------------------------------
@dataclass
class _Process:
    """What outlives one save in this process: plan cache, staging buffer, background saves."""

    plans: dict[Any, tuple[list[str], SavePlan]] = field(default_factory=dict)
    staging: StagingBuffer = field(default_factory=StagingBuffer)
    staging_lock: threading.Lock = field(default_factory=threading.Lock)
    background: concurrent.futures.ThreadPoolExecutor | None = None
    in_flight: dict[str, SaveHandle] = field(default_factory=dict)
    unreported: list[SaveHandle] = field(default_factory=list)

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self.background is None:
            self.background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-save")
        return self.background


_PROCESS = _Process()


def _drain_at_exit() -> None:
    """The exit drain: let background saves commit, superseded generations be removed (up to
    :data:`tierckpt.cleanup.EXIT_WAIT_S`), peer replication in flight finish (its threads are then
    stopped, before the interpreter and the process groups are torn down), then write-back uploads,
    within the stores' exit wait; print on stderr what is left (with the command that finishes an
    upload or a removal; a replication cut short keeps the level ``memory``).

    It runs from :mod:`threading`'s exit hooks, i.e. when the main thread is done and *before* the
    ``atexit`` handlers: thread pools still accept work (``concurrent.futures`` stops them in an
    earlier-registered hook of the same list, which runs after this one) and the I/O loop still runs.
    """
    handles = [h for h in _PROCESS.in_flight.values() if not h.done()]
    deadline = time.monotonic() + process_left(exit_wait_s())  # a CLI command's --timeout bounds the drain too
    for handle in handles:
        try:
            handle.wait(timeout_s=max(0.0, deadline - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - reported, exit goes on
            sys.stderr.write(f"tierckpt: the async save to {handle.uri} did not commit before exit: {describe_error(exc)}\n")
    for uri in cleanup.wait_pending(process_left(cleanup.EXIT_WAIT_S), exiting=True):
        sys.stderr.write(f"tierckpt: removing superseded generations of {uri} was cut short by the exit; the next "
                         f"save to it or `tierckpt gc {uri} --keep-last 1` removes them\n")
    # Replication started with each commit above: its wait counts from there, within its own limit.
    replication_deadline = max(deadline, time.monotonic() + process_left(replication_exit_wait_s()))
    for line in stop_replicators(max(0.0, replication_deadline - time.monotonic()), "the process exited"):
        sys.stderr.write(line + "\n")
    for line in drain_write_back(max(0.0, deadline - time.monotonic())):
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


threading._register_atexit(_drain_at_exit)  # type: ignore[attr-defined]  # see _drain_at_exit


def _group_key(group: Group) -> Any:
    return "WORLD" if group is None else group if isinstance(group, str) else id(group)


IF_BUSY = ("wait", "error")
"""What :func:`async_save` does when a save to the same URI is in flight (``if_busy``)."""
from .writeback.levels import WAITABLE as LEVELS  # noqa: E402
"""The durability levels :meth:`SaveHandle.wait` waits for."""


class SaveHandle:
    """An asynchronous save in flight. ``wait()`` returns the committed checkpoint's metadata once it
    is committed (on a write-back store: in the node cache or memory tier); ``wait("replicated")``
    also waits until the peer nodes hold this node's files; ``wait("remote")`` (= ``wait_durable()``)
    until the store holds it where its URI points (every object uploaded, ``COMMIT`` last)."""

    def __init__(
        self, uri: str, future: concurrent.futures.Future[CheckpointMeta], monitor: Monitor, store: Backend,
        replication: Replication | None = None,
    ) -> None:
        self.uri = uri
        self.store = store
        self.monitor = monitor
        self._future = future
        self._replication = replication if replication is not None else Replication(uri, None, None, None)
        self._reported = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self, level: str | float = "memory", timeout_s: float | None = None) -> CheckpointMeta:
        """Block until the checkpoint reached ``level``; return its metadata. Raise the save's error if it failed.

        A number as the first argument is the timeout, as before levels existed: ``wait(30)`` is
        ``wait("memory", timeout_s=30)``.

        * ``"memory"`` (default): committed — in the node memory tier (or node cache) when the store
          has one, else where the URI points.
        * ``"replicated"``: and this node's files are acknowledged, CRC-checked, by its peer nodes'
          memory tiers. Raises :class:`~tierckpt.tiers.replication.ReplicationError` naming the reason
          when the level stayed ``memory`` (a peer died or refused, one node, ``TIERCKPT_REPLICAS=0``,
          the memory tier off). Each rank waits for its own node's files.
        * ``"remote"``: durable where the URI points (:meth:`wait_durable`).
        """
        if isinstance(level, (int, float)) and not isinstance(level, bool):
            if timeout_s is not None:
                raise CheckpointError(
                    f"SaveHandle.wait({level!r}, timeout_s={timeout_s!r}): a number as the first argument is the "
                    "timeout; pass the level by name, e.g. wait('replicated', timeout_s=30)"
                )
            level, timeout_s = "memory", float(level)
        if level not in LEVELS:
            raise CheckpointError(
                f"SaveHandle.wait(level={level!r}): use 'memory' (committed), 'replicated' (and copied to peer "
                "nodes' memory) or 'remote' (uploaded where the URI points); a timeout goes in timeout_s="
            )
        if level == "remote":
            return self.wait_durable(timeout_s)
        meta = self._committed(timeout_s)
        if level == "replicated":
            self._replication.wait(meta.generation, timeout_s)
        return meta

    def _committed(self, timeout_s: float | None) -> CheckpointMeta:
        bound = current_deadline()  # an operation's deadline (wait_durable's) ends this wait too
        if bound is not None and (timeout_s is None or bound.remaining() < timeout_s):
            timeout_s = max(0.0, bound.remaining())
        else:
            bound = None
        try:
            return self._future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            if bound is not None:
                raise bound.exceeded(f"the async save to {self.uri} to commit") from None
            raise CheckpointBusyError(f"async save to {self.uri!r} is still running after {timeout_s}s") from None
        except BaseException:
            self._reported = True
            raise

    def result(self, timeout_s: float | None = None) -> CheckpointMeta:
        """The committed checkpoint's metadata (``wait("memory", timeout_s)``)."""
        return self._committed(timeout_s)

    def wait_durable(self, timeout_s: float | None = None) -> CheckpointMeta:
        """Block until committed and durable where the URI points: on a write-back store (the node
        cache in front of a remote) until every object of the checkpoint is uploaded, ``COMMIT`` last.
        Raises :class:`~tierckpt.errors.StorageError` when an upload failed (the message names the
        ``tierckpt sync`` command that retries it). Without ``timeout_s`` it waits as long as the uploads
        take (``TIERCKPT_TIMEOUT_S`` bounds it), saying on stderr what it waits for once it has waited a
        few seconds, then at growing intervals."""
        with operation("wait_durable", self.uri):
            meta = self._committed(timeout_s)
            durable = durability_of(self.store)
            if durable is not None:
                get_scheduler().run(durable.wait_durable(meta.generation, timeout_s))
                self._record_uploads(meta.generation)
        return meta

    def _record_uploads(self, generation: str) -> None:
        """Add this process's uploads of the generation's files to the monitor (``upload``, ``bytes_uploaded``)."""
        uploads = [
            r for r in get_scheduler().metrics.records()
            if r.op == "upload" and r.ok and r.key.startswith(f"{generation}/")
        ]
        self.monitor.add_seconds("upload", sum(r.seconds for r in uploads))
        self.monitor.count("bytes_uploaded", sum(r.nbytes for r in uploads))

    def unreported_error(self) -> BaseException | None:
        if self._reported or not self._future.done():
            return None
        return self._future.exception()


# -- the steps -------------------------------------------------------------------------------------
@dataclass
class _Prepared:
    uri: str
    comm: Comm
    backend: Backend
    flat: FlatState
    encoded: dict[str, tuple[bytes, str]]
    plan: SavePlan
    owners: dict[str, int | None]
    generation: str
    started: float
    base: concurrent.futures.Future[bytes | None] | None
    """``COMMIT`` as it was when the save began (rank 0 only; ``None`` inside: no commit yet), the
    expected value of the compare-and-swap commit."""
    monitor: Monitor
    tags: dict[str, str]
    keep_previous: bool
    write_back: bool
    """Return at node commit and upload behind (``async_save``); else wait until the store is durable."""
    replication: Replication
    """Peer replication of the generation once committed (a no-op without a memory tier or torch.distributed)."""
    persist: bool
    """Written down where the URI points; ``False``: held in the node memory tier (and on the peers) only."""


def _prepare(
    uri: str, state: Mapping[str, Any], group: Group, storage_options: Mapping[str, Any] | None,
    tags: Mapping[str, str] | None, keep_previous: bool, align_bytes: int, monitor: Monitor,
    collective_timeout_s: float | None, write_back: bool, persist: bool,
) -> _Prepared:
    _raise_unreported()
    comm = Comm(group)
    comm.check_in(f"save to {uri!r}", collective_timeout_s)
    backend = open_store(uri, dict(storage_options or {}))
    started = time.time()
    # Rank 0 reads COMMIT on the I/O loop while the state is flattened (a remote round trip then adds
    # nothing to the stall); its commit sequence names the new generation. A write-back save reads the
    # node's view (its pending COMMIT first) and may start while the remote is unreachable.
    offline_ok = write_back and durability_of(backend) is not None
    base = get_scheduler().submit(_read_commit(backend, offline_ok)) if comm.rank == 0 else None
    with monitor.phase("plan"):
        # One collective agrees that every rank could prepare its state and carries each rank's
        # plan-cache digest and object digests, and rank 0's name for the new generation.
        (flat, offers, encoded), agreement = comm.exchange_agreed(
            lambda: _offer(state, base, memory_tier_of(backend) is not None, persist), "preparing the state to save",
            same=("URI", identity_of(uri, backend)),
        )
        _check_tiers_agree(uri, [a[3] for a in agreement])
        _check_persist(uri, [a[4] for a in agreement], memory_tier_of(backend) is not None)
        generation = agreement[0][2]
        if not persist:
            backend.keep_in_memory(generation)  # type: ignore[attr-defined]  # a MemoryLink (_check_persist)
        digests = [a[0] for a in agreement]
        plan_key = (_group_key(group), align_bytes)
        cached = _PROCESS.plans.get(plan_key)
        if cached is not None and cached[0] == digests:
            plan = cached[1]
            monitor.count("plan_cache_hits")
        else:
            gathered = comm.all_gather_object(offers)
            plan = comm.run_agreed(lambda: plan_save(gathered, align_bytes=align_bytes), "planning the save")
            _PROCESS.plans[plan_key] = (digests, plan)
        owners = _place_objects([a[1] for a in agreement], plan)
    # The replicator is built here, in the foreground every rank reaches together (first save only).
    tier = memory_tier_of(backend)
    replicator, not_replicated = replicator_for(tier, group, _group_key(group))
    return _Prepared(
        uri=uri, comm=comm, backend=backend, flat=flat, encoded=encoded, plan=plan, owners=owners,
        generation=generation, started=started, monitor=monitor, tags=dict(tags or {}), keep_previous=keep_previous,
        base=base, write_back=write_back, replication=Replication(uri, tier, replicator, not_replicated),
        persist=persist,
    )


def _offer(
    state: Mapping[str, Any], base: concurrent.futures.Future[bytes | None] | None, memory_tier: bool, persist: bool,
) -> tuple[tuple[FlatState, list[LocalPiece], dict[str, tuple[bytes, str]]],
           tuple[str, dict[str, tuple[int, int]], str | None, bool, bool]]:
    """Flatten and encode this rank's state: ``(kept, shared)``, shared being the plan-cache digest of
    the offered pieces, ``(crc, size)`` of each encoded object, rank 0's generation proposal (named
    after the base ``COMMIT``'s sequence), whether this rank's chain has the node memory tier and its
    ``persist``."""
    flat = flatten_state(state, for_load=False)
    offers = [
        LocalPiece(fqn=e.fqn, dtype=dtype_name(e.tensor.dtype), shape=e.shape, region=e.region)
        for e in flat.tensors.values()
    ]
    encoded = {key: encode_object(entry.value) for key, entry in flat.objects.items()}
    digests = {key: (crc32c.crc32c(data), len(data)) for key, (data, _) in encoded.items()}
    proposal = None if base is None else layout.new_generation(layout.next_seq(base.result()))
    return (flat, offers, encoded), (offers_digest([offers]), digests, proposal, memory_tier, persist)


def _check_tiers_agree(uri: str, memory_tier: list[bool]) -> None:
    """Every rank saves through the node memory tier or none does: a checkpoint half in memory would be
    reported ``memory``/``replicated`` while some of its files are in no node's memory. Raised on every
    rank (the flags came with the agreement), before anything is written."""
    if len(set(memory_tier)) > 1:
        on = [r for r, flag in enumerate(memory_tier) if flag]
        off = [r for r, flag in enumerate(memory_tier) if not flag]
        raise CheckpointError(
            f"ranks disagree on the node memory tier for {uri!r}: on for ranks {on}, off for ranks {off}; "
            "set TIERCKPT_MEMORY (or storage_options memory=) the same on every rank"
        )


def _check_persist(uri: str, persist: list[bool], memory_tier: bool) -> None:
    """``persist=False`` needs the node memory tier, and every rank must pass the same ``persist``: a
    checkpoint half written down would be committed below with files missing there. Raised on every rank
    (the flags came with the agreement), before anything is written."""
    if all(persist):
        return
    if not memory_tier:
        raise CheckpointError(
            f"save to {uri!r} with persist=False keeps the checkpoint in the node memory tier only, and {uri!r} "
            "has none: turn it on (TIERCKPT_MEMORY=on or storage_options memory=True) or save with persist=True"
        )
    if any(persist):
        raise CheckpointError(
            f"ranks disagree on persist for {uri!r}: True for ranks {[r for r, f in enumerate(persist) if f]}, "
            f"False for ranks {[r for r, f in enumerate(persist) if not f]}; pass the same value on every rank"
        )


def _place_objects(digests: list[dict[str, tuple[int, int]]], plan: SavePlan) -> dict[str, int | None]:
    """Which rank writes each object: one writer for values equal on every rank, else each rank its own."""
    world = len(digests)
    load = list(plan.file_sizes)
    owners: dict[str, int | None] = {}
    for key in sorted(set().union(*digests)):
        values = {d.get(key) for d in digests}
        if len(values) == 1 and None not in values:
            writer = min(range(world), key=lambda r: (load[r], r))
            load[writer] += next(iter(values))[1]
            owners[key] = writer
        else:
            owners[key] = None
    return owners


def _pieces(p: _Prepared) -> list[tuple[int, int, torch.Tensor]]:
    """``(index, byte_offset, tensor)`` of every piece this rank writes, in file order."""
    return [
        (i, w.byte_offset, _piece_tensor(p.flat.tensors[w.fqn], w.region))
        for i, w in enumerate(p.plan.writes[p.comm.rank])
    ]


def _on_written(p: _Prepared) -> Any:
    """What a file stream tells the bytes it wrote: the save's progress bar, if it has one."""
    return p.monitor.progress.add if p.monitor.progress is not None else None


def _open_stream(p: _Prepared) -> FileStream | None:
    writes = p.plan.writes[p.comm.rank]
    if not writes:
        return None
    return FileStream(p.backend, layout.in_generation(p.generation, writes[0].file), len(writes), on_written=_on_written(p))


def _stream_direct(p: _Prepared) -> FileStream | None:
    """Synchronous path: stream pieces straight from tensor memory (no snapshot copy)."""
    stream = _open_stream(p)
    if stream is None:
        return None
    with stream.abort_on_error():
        position = 0
        for index, offset, tensor in _pieces(p):
            if offset > position:
                stream.put(Chunk(memoryview(bytes(offset - position))))
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            stream.put(Chunk(memoryview(data.numpy()), [(index, 0, data.numel())]))
            position = offset + data.numel()
    return stream


def _stream_staged(p: _Prepared, staging_bytes: int | None) -> FileStream | None:
    """Asynchronous path: copy pieces through the reusable staging buffer — or, through the node memory
    tier, straight into the tier's file (``mapped_writer``) — and return when all are copied."""
    writes = p.plan.writes[p.comm.rank]
    if not writes:
        return None
    size = p.plan.file_sizes[p.comm.rank]
    pin = any(e.tensor.is_cuda for e in p.flat.tensors.values()) and torch.cuda.is_available()
    key = layout.in_generation(p.generation, writes[0].file)
    mapped = getattr(p.backend, "mapped_writer", None)
    mapped = mapped(key, size) if mapped is not None and not pin else None
    stream = FileStream(p.backend, key, len(writes), writer=mapped, on_written=_on_written(p))
    with stream.abort_on_error():
        if mapped is not None:
            stage_into(stream, _pieces(p), mapped.buffer)
        else:
            capacity = min(size, staging_bytes) if staging_bytes else size
            stage_into(stream, _pieces(p), _PROCESS.staging.acquire(capacity, pin=pin)[:capacity])
    p.monitor.count("bytes_staged", size)
    return stream


def _finish(
    p: _Prepared, stream: FileStream | None, coord: Comm | StoreCoordinator, failure: BaseException | None = None,
) -> CheckpointMeta:
    """Close the data file, write objects, gather records on rank 0, commit, share the outcome.

    ``failure``: this rank could not stage its data; it only reports that, so no rank commits.
    """
    records, error = None, failure
    if failure is None:
        try:
            records = _finish_rank(p, stream)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, raised below
            error = exc
    with p.monitor.phase("gather"):
        gathered = coord.gather((records, describe_error(error)))
    commit_error: BaseException | None = None
    outcome: tuple[str, Any] | None = None
    if coord.rank == 0:
        with p.monitor.phase("commit"):
            outcome, commit_error = _commit_gathered(p, gathered, coord.world_size)
    outcome = coord.broadcast(outcome)
    if error is not None:
        raise error
    if commit_error is not None:
        raise commit_error
    status, value = outcome
    if status != "ok":
        raise CheckpointError(f"saving checkpoint {p.uri!r} failed: {value}")
    # Every rank, after the commit; no collective. Before the save reports committed, so that the node's
    # files are sealed (restart-recoverable from memory) whenever wait("memory") has returned.
    p.replication.start(value.generation)
    if coord.rank == 0 and not p.keep_previous:
        _sweep_superseded(p)
    p.monitor.finish("save", p.uri, coord.rank, ranks_from_timings(value.timings))
    return value


def _sweep_superseded(p: _Prepared) -> None:
    """Rank 0, once every rank knows the outcome: remove the superseded generations in the background
    (:mod:`tierckpt.cleanup`), so the call does not wait for the deletion."""
    base = p.base.result() if p.base is not None else None
    previous = layout.CommitRecord.decode(base).generation if base else None
    committed = layout.CommitRecord(p.generation, 0.0, seq=layout.next_seq(base))
    cleanup.sweep_after_commit(p.backend, p.uri, committed, previous,
                               find_leftovers=durability_of(p.backend) is None)


def _commit_gathered(p: _Prepared, gathered: Any, world_size: int) -> tuple[tuple[str, Any], BaseException | None]:
    """Rank 0: build the header from every rank's records and commit; ``("ok", meta)`` or ``("error", why)``."""
    failures = [f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e is not None]
    if failures:
        _discard_generation(p)
        return ("error", "; ".join(failures)), None
    records = [r for r, _ in gathered]
    meta = CheckpointMeta(
        generation=p.generation,
        world_size=world_size,
        created_unix=p.started,
        frameworks=tuple(sorted(p.flat.frameworks)),
        files=tuple(f for r in records for f in r[2]),
        objects=tuple(o for r in records for o in r[1]),
        num_tensors=len(p.plan.tensors),
        num_pieces=sum(len(r[0]) for r in records),
        tensor_bytes=sum(t.nbytes for t in p.plan.tensors),
        timings={f"rank{r}.{k}": v for r, rec in enumerate(records) for k, v in rec[3].items()},
        tags=p.tags,
        structure=p.flat.structure,
    )
    try:
        _commit(p, meta, [piece for r in records for piece in r[0]])
    except Exception as exc:  # noqa: BLE001 - rank 0 raises it; the others get its description
        _discard_uncommitted(p)
        return ("error", f"rank 0: {describe_error(exc)}"), exc
    return ("ok", meta), None


def _discard_uncommitted(p: _Prepared) -> None:
    """After a failed commit step (a full disk, an outage): remove the generation unless COMMIT names it."""
    try:
        current = get_scheduler().run(_read_commit(p.backend))
        committed = None if current is None else layout.CommitRecord.decode(current).generation
    except CheckpointError:
        return  # cannot tell: leave it to `tierckpt gc`, which never removes what COMMIT names
    if committed != p.generation:
        _discard_generation(p)


def _finish_rank(p: _Prepared, stream: FileStream | None) -> tuple[list[PieceMeta], list[ObjectMeta], list[FileMeta], dict[str, float]]:
    with p.monitor.phase("write"):
        pieces, objects, files = _drain_rank(p, stream)
    return pieces, objects, files, p.monitor.summary()


def _drain_rank(p: _Prepared, stream: FileStream | None) -> tuple[list[PieceMeta], list[ObjectMeta], list[FileMeta]]:
    """Wait for this rank's data file to be written and write its objects file."""
    rank = p.comm.rank
    pieces: list[PieceMeta] = []
    files: list[FileMeta] = []
    objects, blob = _objects_of_rank(p)
    # The objects file is written while the data file is finished: on an object store, a round trip less.
    put = _put_all(p.backend, {layout.in_generation(p.generation, layout.objects_file(rank)): blob}) if blob else None
    if stream is not None:
        try:
            checksums = stream.finish()
        except BaseException:
            if put is not None:  # nothing of this save may land after the failure is reported
                concurrent.futures.wait([put])
            raise
        writes = p.plan.writes[rank]
        pieces = [
            PieceMeta(
                fqn=w.fqn, region=w.region, file=w.file, byte_offset=w.byte_offset, byte_length=w.byte_length,
                crc32c=c.crc32c, block_bytes=c.block_bytes, block_crc32c=c.block_crc32c,
            )
            for w, c in zip(writes, checksums)
        ]
        files.append(FileMeta(key=writes[0].file, size=p.plan.file_sizes[rank]))
        p.monitor.count("bytes_written", p.plan.file_sizes[rank])
        p.monitor.add_seconds("checksum", stream.checksum_s)
        p.monitor.add_seconds("file_write", stream.write_s)
    if put is not None:
        put.result()
        files.append(FileMeta(key=layout.objects_file(rank), size=len(blob)))
    return pieces, objects, files


def _put_all(backend: Backend, documents: Mapping[str, bytes]) -> concurrent.futures.Future[None]:
    """Start writing every document at once; the future is done when all are written (or failed:
    it raises the first error, after every write has ended)."""
    sched = get_scheduler()

    async def put_all() -> None:
        results = await asyncio.gather(
            *(backend.put(key, data) for key, data in documents.items()), return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    return sched.submit(put_all())


def _objects_of_rank(p: _Prepared) -> tuple[list[ObjectMeta], bytes]:
    rank = p.comm.rank
    objects: list[ObjectMeta] = []
    blobs: list[bytes] = []
    offset = 0
    for key in sorted(p.encoded):
        owner = p.owners.get(key)
        if owner is not None and owner != rank:
            continue
        data, codec = p.encoded[key]
        objects.append(
            ObjectMeta(
                key=key, rank=None if owner is not None else rank, file=layout.objects_file(rank),
                byte_offset=offset, byte_length=len(data), crc32c=crc32c.crc32c(data), codec=codec,
            )
        )
        blobs.append(data)
        offset += len(data)
    return objects, b"".join(blobs)


def _piece_tensor(entry: TensorEntry, region: Region) -> torch.Tensor:
    """The part of an entry's local tensor that holds ``region``."""
    if isinstance(region, FlatRange) and isinstance(entry.region, FlatRange):
        return entry.tensor.reshape(-1)[region.start - entry.region.start : region.stop - entry.region.start]
    if isinstance(region, Box) and isinstance(entry.region, Box):
        return entry.tensor[region.relative_to(entry.region).slices()]
    raise CheckpointError(f"piece of {entry.fqn!r}: a {type(region).__name__} cannot be cut from a {type(entry.region).__name__}")


def _discard_generation(p: _Prepared) -> None:
    """Rank 0, after a failed save: remove what the ranks wrote (every rank has reported, none still writes)."""
    try:
        get_scheduler().run(p.backend.delete_prefix(f"{p.generation}/"))
    except CheckpointError:
        pass  # an uncommitted generation is invisible to loads, and `tierckpt gc` removes leftovers


async def _read_commit(backend: Backend, offline_ok: bool = False) -> bytes | None:
    """The bytes of ``COMMIT`` (``None``: nothing committed yet). ``offline_ok`` (a write-back store):
    an unreachable remote that this node knows nothing of counts as none; the store's upload is a
    compare-and-swap against that, so a remote that does hold a commit refuses it later, loudly."""
    try:
        return await backend.get_capped(layout.COMMIT, MAX_RECORD_BYTES)
    except CheckpointNotFoundError:
        return None
    except TransientStorageError:
        if offline_ok:
            return None
        raise


def _commit(p: _Prepared, meta: CheckpointMeta, pieces: list[PieceMeta]) -> None:
    """Rank 0: metadata, then COMMIT — one compare-and-swap against the base, so of two jobs saving to
    one URI from the same base exactly one commits; the other removes its generation and raises."""
    sched = get_scheduler()
    backend, gen = p.backend, p.generation
    base = p.base.result() if p.base is not None else None
    documents = {  # the header last: it lists every file
        layout.TENSORS: encode_tensors(p.plan.tensors),
        layout.PIECES: encode_pieces(pieces),
        layout.HEADER: encode_header(meta),
    }
    # The two tables at once (a round trip less on an object store), then the header.
    _put_all(backend, {layout.in_generation(gen, k): documents[k] for k in (layout.TENSORS, layout.PIECES)}).result()
    sched.run(backend.put(layout.in_generation(gen, layout.HEADER), documents[layout.HEADER]))
    record = layout.CommitRecord(
        gen, time.time(), seq=layout.next_seq(base),
        checksums=tuple(sorted((key, layout.FileChecksum.of(data)) for key, data in documents.items())),
    ).encode()
    try:
        # The commit depends on every file of the generation (a write-back store uploads it after them).
        after = {layout.in_generation(gen, f.key): f.size for f in meta.files}
        after.update({layout.in_generation(gen, key): len(data) for key, data in documents.items()})
        sched.run(backend.commit(layout.COMMIT, record, expected=base, after=after))
    except CheckpointBusyError as exc:
        current = sched.run(_read_commit(backend))
        if current != record:  # not a retried request whose first attempt landed: another job won
            sched.run(backend.delete_prefix(f"{gen}/"))
            winner = layout.CommitRecord.decode(current).generation if current else None
            started = layout.CommitRecord.decode(base).generation if base else None
            raise CheckpointBusyError(
                f"another job committed {winner!r} to {p.uri!r} while this save was running (it started from "
                f"{started!r}); this save was not committed and its generation {gen!r} was removed; the other "
                "job's checkpoint is intact. Give concurrent jobs different URIs"
            ) from exc
    durable = durability_of(backend)
    if durable is not None and not p.write_back and p.persist:  # a synchronous save commits where the URI points
        try:
            sched.run(durable.wait_durable(gen, None, through_outage=False))
        except StorageError as exc:
            _withdraw(p, record, base, exc)


def _withdraw(p: _Prepared, record: bytes, base: bytes | None, failure: StorageError) -> None:
    """Rank 0, a synchronous save whose commit did not reach where the URI points: take it back from the
    node cache too (a failed save is loadable nowhere), then raise; return if the commit landed after all."""
    revocable = revocable_of(p.backend)
    if revocable is None:
        raise failure
    errors = get_scheduler().run(revocable.withdraw(p.generation, record, base))
    if errors is None:
        return
    previous = layout.CommitRecord.decode(base).generation if base else None
    raise StorageError(
        f"saving {p.uri!r} failed: its upload did not complete ({'; '.join(errors[:2]) or failure}). The save was "
        f"not committed anywhere (this node's cache and memory tier included); the last committed checkpoint "
        f"({previous or 'none'}) is unchanged. Fix the store and save again"
    ) from failure


def _raise_unreported() -> None:
    """Raise the failure of an earlier background save that nobody waited for."""
    for handle in list(_PROCESS.unreported):
        error = handle.unreported_error()
        if handle.done():
            _PROCESS.unreported.remove(handle)
        if error is not None:
            raise CheckpointError(f"an earlier async save to {handle.uri!r} failed: {error}") from error


# -- public API ------------------------------------------------------------------------------------
@gc_paused  # outermost: no collection during any of the call, its deadline's set-up included
@bounded("save")
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
) -> CheckpointMeta:
    """Save ``state`` to ``uri``; return once the checkpoint is committed (on every rank).

    With the node memory tier on in a multi-node job, peer replication starts after the commit and runs
    in the background; ``replicated=True`` also waits for it and raises
    :class:`~tierckpt.tiers.replication.ReplicationError` naming the reason when this node's files did
    not reach the level ``replicated``.

    ``persist=False`` (node memory tier on) keeps the checkpoint in the node memory tier and on the peers
    only: nothing is written where the URI points until ``tierckpt sync URI`` (or :func:`tierckpt.sync`),
    eviction may drop it once newer checkpoints need the room, and ``wait("remote")`` raises. For saving
    to memory often and persisting every N-th checkpoint (:class:`CheckpointManager` ``persist_every``).

    ``keep_previous=True`` keeps the generation that the previous commit named (otherwise it and any
    other superseded generation under ``uri`` are deleted in the background once the new commit is
    shared: see :mod:`tierckpt.cleanup`). ``tags`` are stored in the header. Pass a :class:`Monitor` to
    read per-phase timings and byte counts afterwards. Every rank of the group must call it; a rank
    that does not arrive within ``collective_timeout_s`` (default: the group's timeout) is named in a :class:`CollectiveError`.

    ``group="self"`` saves this process's state alone, with no collective and no wait on other ranks,
    as a one-rank checkpoint (for a trainer that saves from rank 0 only, e.g. Lightning under DDP; its
    plain tensors are taken to be the whole of each tensor). Peer replication does not apply to it.

    ``progress=True`` draws a progress bar of the bytes staged on stderr, on rank 0 only (``None``: only
    when stderr is a terminal; :mod:`tierckpt.progress`).
    """
    uri = checked_uri("save", uri, state)
    monitor = monitor or Monitor()
    previous = _PROCESS.in_flight.get(uri)
    if previous is not None and not previous.done():
        previous.wait()
    p = _prepare(uri, state, group, storage_options, tags, keep_previous, align_bytes, monitor, collective_timeout_s,
                 write_back=False, persist=persist)
    rank = p.comm.rank
    with attached(monitor, f"save {uri}", progress, rank, total=p.plan.file_sizes[rank] if rank < len(p.plan.file_sizes) else None):
        with monitor.phase("stage"):
            stream = p.comm.run_agreed(lambda: _stream_direct(p), f"writing checkpoint {uri!r}")
        meta = _finish(p, stream, p.comm)
    if replicated:
        p.replication.wait(meta.generation)
    return meta


@gc_paused
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
) -> SaveHandle:
    """Snapshot ``state`` and save it in the background; training may mutate it once this returns.

    The snapshot goes through a reusable staging buffer of at most ``staging_bytes`` per rank
    (default: the rank's share of the checkpoint); a larger state streams through it, and the call
    returns once the last bytes are copied. One save per ``uri`` is in flight: with
    ``if_busy="wait"`` (default) a new one waits for the previous, with ``"error"`` it raises
    :class:`CheckpointBusyError`. ``persist=False``: held in the node memory tier only (see :func:`save`).
    """
    uri = checked_uri("async_save", uri, state)
    if if_busy not in IF_BUSY:
        raise CheckpointError(
            f"async_save({uri!r}, if_busy={if_busy!r}): use {' or '.join(map(repr, IF_BUSY))} (wait for the save in "
            "flight to the URI, or raise CheckpointBusyError)"
        )
    monitor = monitor or Monitor()
    previous = _PROCESS.in_flight.get(uri)
    if previous is not None and not previous.done():
        if if_busy == "error":
            raise CheckpointBusyError(f"an async save to {uri!r} is still in flight; wait() for it or pass if_busy='wait'")
        previous.wait()
    p = _prepare(uri, state, group, storage_options, tags, keep_previous, align_bytes, monitor, collective_timeout_s,
                 write_back=True, persist=persist)
    _PROCESS.staging_lock.acquire()  # the staging buffer serves one save at a time
    try:
        # No collective after the copy: each rank returns to training as soon as its own copy is done.
        with monitor.phase("stage"):
            stream = _stream_staged(p, staging_bytes)
    except BaseException as exc:
        _PROCESS.staging_lock.release()
        # The other ranks may be back in training already: the background coordination tells them
        # (their handles' wait() raises and nothing is committed); this rank raises now.
        _PROCESS.executor().submit(_finish, p, None, StoreCoordinator(p.comm, p.generation), exc)
        raise

    def finish() -> CheckpointMeta:
        try:
            if stream is not None:
                stream.finish()
        except BaseException:
            pass  # the error is raised again by _finish on this rank and shared with the others
        finally:
            _PROCESS.staging_lock.release()
        return _finish(p, stream, StoreCoordinator(p.comm, p.generation))

    handle = SaveHandle(uri, _PROCESS.executor().submit(finish), monitor, p.backend, p.replication)
    _PROCESS.in_flight[uri] = handle
    _PROCESS.unreported.append(handle)
    return handle
