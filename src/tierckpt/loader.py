"""Synchronous load with resharding.

Lifecycle (every rank of the loading group unless noted):

1. Rank 0 reads ``COMMIT``, the header and the tensor table, checks them against the sizes and
   CRC-32Cs that ``COMMIT`` records, and broadcasts them (a missing commit raises
   :class:`~tierckpt.errors.IncompleteCheckpointError` when data exists without one).
2. Each rank flattens its target state and checks it against the checkpoint: missing and unexpected
   keys, shape and dtype mismatches. Ranks all-gather their needs and findings; in strict mode any
   finding on any rank raises on every rank, before anything is read.
3. Each rank reads the rows of the pieces table for the tensors the group needs and computes the
   same :class:`~tierckpt.planner.LoadPlan`. Each rank checks the sizes of the data files it will read,
   so a truncated or missing file fails before any tensor is modified.
4. Round by round: readers fetch their units (straight into the target's memory when a unit is
   exactly one contiguous part of one local target), copy local deliveries, and exchange the rest with
   one all-to-all per round.
5. Objects are decoded (weights-only unless ``allow_pickle``) and put in place; optimizers and
   stateful objects get their ``load_state_dict`` calls.

Racing a save. A save that commits a newer generation deletes the one this load follows. When a
step fails and ``COMMIT`` has moved since the load read it, the load starts again on the newer
generation (at most :data:`RACE_RETRIES` times), filling every target again, so it returns one
committed checkpoint exactly — never an error caused by the race, never a mix of two generations.
"""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import crc32c
import torch
import torch.distributed as dist

from . import layout
from .backends import Backend, open_backend
from .comm import Comm
from .errors import (
    CheckpointBusyError, CheckpointError, CheckpointNotFoundError, CollectiveError, CorruptCheckpointError,
    IncompleteCheckpointError, StateMismatchError,
)
from .io.rangefile import RangeFile
from .io.scheduler import ReadRequest, get_scheduler
from .metadata import (
    CheckpointMeta, ObjectMeta, PieceMeta, TensorMeta, decode_header, decode_pieces, decode_tensors, dtype_name,
    itemsize,
)
from .monitor import Monitor
from .objects import decode_object
from .planner import LoadPlan, ReadUnit, TargetPiece, plan_load
from .regions import FlatRange, StoredBox
from .state import FlatState, TensorEntry, flatten_state

logger = logging.getLogger("tierckpt")

LOCAL_MIN_RUN_BYTES = 512
"""On local files a rank reads its own parts when they come in runs of at least this many bytes."""
REMOTE_MIN_RUN_BYTES = 1 << 20
"""On object stores each run is a request: shorter runs are read in large ranges and exchanged."""
RACE_RETRIES = 8
"""How many times a load that lost its generation to a newer commit starts again on the newer one (each
attempt fails only if a whole save cycle completes during it)."""
WHOLE_PIECES_BYTES = 8 << 20
"""A pieces table up to this size is read whole and checked against its CRC-32C in ``COMMIT``; a larger
one is read by row groups (only those a load needs), and ``verify`` checks its CRC."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A committed checkpoint's header and tensor table, as read by rank 0."""

    meta: CheckpointMeta
    tensors: dict[str, TensorMeta]
    record: layout.CommitRecord | None = None
    """The ``COMMIT`` record that named it (its checksums check the other metadata documents)."""


def read_commit(backend: Backend) -> layout.CommitRecord:
    """The decoded ``COMMIT`` record; a root with data but no ``COMMIT`` is incomplete."""
    sched = get_scheduler()
    try:
        return layout.CommitRecord.decode(sched.do(backend, "get", layout.COMMIT))
    except CheckpointNotFoundError:
        if sched.do(backend, "list", ""):
            raise IncompleteCheckpointError(
                f"{backend.root_uri!r} holds checkpoint data but no COMMIT record: a save was interrupted or is "
                "still running. Load an earlier checkpoint, or wait for the save to finish"
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {backend.root_uri!r} (no COMMIT record)") from None


def _newer_commit(backend: Backend, generation: str) -> layout.CommitRecord | None:
    """The ``COMMIT`` record if it now names another generation than ``generation`` (else ``None``)."""
    try:
        record = read_commit(backend)
    except CheckpointError:
        return None
    return record if record.generation != generation else None


def _document(backend: Backend, record: layout.CommitRecord, key: str) -> bytes:
    """One metadata document of the committed generation, checked against ``COMMIT``'s checksum."""
    data = get_scheduler().do(backend, "get", layout.in_generation(record.generation, key))
    record.check_document(key, data, backend.root_uri)
    return data


def read_checkpoint(backend: Backend) -> Checkpoint:
    """Follow ``COMMIT`` to the committed generation and read its header and tensor table (following a
    newer ``COMMIT`` when a save deleted the generation meanwhile)."""
    record = read_commit(backend)
    attempt = 0
    while True:
        gen = record.generation
        try:
            meta = decode_header(_document(backend, record, layout.HEADER))
            tensors = decode_tensors(_document(backend, record, layout.TENSORS))
        except CheckpointNotFoundError as exc:
            newer = _newer_commit(backend, gen)
            if newer is not None and attempt < RACE_RETRIES:
                record, attempt = newer, attempt + 1
                continue
            raise CorruptCheckpointError(
                f"checkpoint {backend.root_uri!r} is committed as {gen!r} but its metadata is missing: {exc}"
            ) from exc
        if meta.generation != gen:
            raise CorruptCheckpointError(f"header of {gen!r} names generation {meta.generation!r}")
        return Checkpoint(meta=meta, tensors=tensors, record=record)


def load(
    uri: str,
    state: dict[str, Any],
    *,
    group: dist.ProcessGroup | None = None,
    strict: bool = True,
    allow_pickle: bool = False,
    verify: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    chunk_bytes: int = 32 << 20,
    round_bytes: int = 256 << 20,
    direct_min_run_bytes: int | None = None,
    monitor: Monitor | None = None,
    collective_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Load the checkpoint at ``uri`` into ``state`` in place (resharding as needed) and return it.

    Tensors, modules and optimizers are filled in place; other values are replaced in their dicts.
    ``strict=False`` loads what matches and warns about the rest. ``verify=True`` checks the CRC-32C of
    every piece the load touches before modifying anything. ``allow_pickle=True`` permits objects that
    need full unpickling (only for checkpoints you trust). Every rank of the group must call it; a rank
    that does not arrive within ``collective_timeout_s`` (default: the group's timeout) is named in a :class:`CollectiveError`.
    """
    comm = Comm(group)
    comm.check_in(f"load from {uri!r}", collective_timeout_s)
    monitor = monitor or Monitor()
    backend = open_backend(uri, **dict(storage_options or {}))
    options = _Options(strict, allow_pickle, verify, chunk_bytes, round_bytes, direct_min_run_bytes)
    attempt = 0
    while True:
        with monitor.phase("metadata"):
            ckpt = _broadcast_checkpoint(comm, backend)
        try:
            _load_generation(uri, state, comm, backend, ckpt, options, monitor)
        except (CollectiveError, StateMismatchError):
            raise
        except CheckpointError:
            # Every rank raised (failures are agreed); rank 0 tells whether a newer commit explains it.
            moved = comm.broadcast_object(_newer_commit(backend, ckpt.meta.generation) is not None if comm.rank == 0 else None)
            if not moved:
                raise
            if attempt == RACE_RETRIES:
                raise CheckpointBusyError(
                    f"loading {uri!r}: newer saves replaced the checkpoint {attempt + 1} times while it was being "
                    f"loaded (last: {exc}); saves to this URI outpace the load. Load a checkpoint that is not being "
                    "re-saved, or save with keep_previous=True"
                ) from exc
            attempt += 1
            logger.info("load of %s: generation %s was replaced while loading; loading the newer commit",
                        uri, ckpt.meta.generation)
            continue
        monitor.finish("load", uri, comm.rank, comm.all_gather_object(monitor.summary()))
        return state


@dataclass(frozen=True, slots=True)
class _Options:
    """The tuning and checking arguments of :func:`load`."""

    strict: bool
    allow_pickle: bool
    verify: bool
    chunk_bytes: int
    round_bytes: int
    direct_min_run_bytes: int | None


def _load_generation(
    uri: str, state: dict[str, Any], comm: Comm, backend: Backend, ckpt: Checkpoint, opts: _Options, monitor: Monitor,
) -> None:
    """Steps 2-5 of the lifecycle for the generation ``ckpt`` names; fills every target."""
    with monitor.phase("metadata"):
        saved_keys = set(ckpt.tensors) | {o.key for o in ckpt.meta.objects}
        # One collective agrees that every rank could prepare its state and carries what each needs.
        (flat, needs), gathered = comm.exchange_agreed(lambda: _prepare(state, ckpt, saved_keys), "preparing the state to load")
        _report(gathered, ckpt, opts.strict, uri)
        all_needs = [g[0] for g in gathered]
        fqns = {n.fqn for rank_needs in all_needs for n in rank_needs}
        pieces = comm.run_agreed(lambda: read_pieces(backend, ckpt, fqns), "reading the pieces table")
    with monitor.phase("plan"):
        direct_min_run_bytes = opts.direct_min_run_bytes
        if direct_min_run_bytes is None:
            direct_min_run_bytes = LOCAL_MIN_RUN_BYTES if backend.capabilities.local_path else REMOTE_MIN_RUN_BYTES
        plan = plan_load(
            ckpt.tensors, pieces, all_needs,
            chunk_bytes=opts.chunk_bytes, round_bytes=opts.round_bytes, direct_min_run_bytes=direct_min_run_bytes,
        )
    gen = ckpt.meta.generation
    comm.run_agreed(lambda: _check_files(backend, ckpt, plan, comm.rank), "checking the data files")
    if opts.verify:
        with monitor.phase("verify"):
            comm.run_agreed(lambda: _verify_pieces(backend, gen, pieces, comm), "verifying checksums")
    with monitor.phase("objects"):
        # Objects are small: fetch, check and decode them before any tensor is modified.
        values = comm.run_agreed(lambda: _fetch_objects(backend, ckpt, flat, comm, opts.allow_pickle), "loading objects")
    targets = [flat.tensors[n.fqn] for n in needs]
    with monitor.phase("read"):
        comm.run_agreed(lambda: _Executor(backend, gen, plan, targets, comm, monitor).run(), f"loading {uri!r}")
    with monitor.phase("apply"):
        for key, value in values.items():
            flat.objects[key].assign(value)
        comm.run_agreed(lambda: [fn() for fn in flat.after_load], "applying loaded state")


def _broadcast_checkpoint(comm: Comm, backend: Backend) -> Checkpoint:
    result: Checkpoint | None = None
    error: str | None = None
    exc_type: type[CheckpointError] = CheckpointError
    if comm.rank == 0:
        try:
            result = read_checkpoint(backend)
        except CheckpointError as exc:
            if comm.world_size == 1:
                raise
            error, exc_type = str(exc), type(exc)
    result, error, exc_type = comm.broadcast_object((result, error, exc_type))
    if error is not None:
        raise exc_type(error)
    assert result is not None
    return result


def _prepare(
    state: Mapping[str, Any], ckpt: Checkpoint, saved_keys: set[str],
) -> tuple[tuple[FlatState, list[TargetPiece]], tuple[list[TargetPiece], list[tuple[str, str]], list[str], list[str]]]:
    """Flatten this rank's state for loading: ``(kept, shared)``, shared being what :func:`_report` reads."""
    flat = flatten_state(state, for_load=True, saved_keys=lambda p: any(k.startswith(p) for k in saved_keys))
    needs, findings = _match(flat, ckpt)
    return (flat, needs), (needs, findings, sorted(flat.tensors), sorted(flat.objects))


def _match(flat: FlatState, ckpt: Checkpoint) -> tuple[list[TargetPiece], list[tuple[str, str]]]:
    """This rank's needs, and findings ``(kind, message)`` about keys, shapes and dtypes."""
    needs: list[TargetPiece] = []
    findings: list[tuple[str, str]] = []
    for fqn, entry in flat.tensors.items():
        saved = ckpt.tensors.get(fqn)
        if saved is None:
            kind = "object" if any(o.key == fqn for o in ckpt.meta.objects) else "missing"
            findings.append((kind, fqn))
            continue
        dtype = dtype_name(entry.tensor.dtype)
        if saved.shape != entry.shape:
            findings.append(("shape", f"{fqn!r}: checkpoint has shape {list(saved.shape)}, the state has {list(entry.shape)}"))
        elif saved.dtype != dtype:
            findings.append(("dtype", f"{fqn!r}: checkpoint has dtype {saved.dtype}, the state has {dtype}"))
        else:
            needs.append(TargetPiece(fqn=fqn, region=entry.region))
    saved_objects = {o.key for o in ckpt.meta.objects}
    findings.extend(("missing", key) for key in flat.objects if key not in saved_objects)
    return needs, findings


def _report(gathered: list[Any], ckpt: Checkpoint, strict: bool, uri: str) -> None:
    findings = sorted({f for g in gathered for f in g[1]})
    wanted = {k for g in gathered for k in g[2]} | {k for g in gathered for k in g[3]}
    saved = set(ckpt.tensors) | {o.key for o in ckpt.meta.objects}
    unexpected = sorted(saved - wanted)
    lines = []
    missing = [m for kind, m in findings if kind == "missing"]
    if missing:
        lines.append(f"missing from the checkpoint: {_few(missing)}")
    if unexpected:
        lines.append(f"in the checkpoint but not in the state (unexpected): {_few(unexpected)}")
    lines.extend(f"shape mismatch {m}" for kind, m in findings if kind == "shape")
    lines.extend(f"dtype mismatch {m}" for kind, m in findings if kind == "dtype")
    lines.extend(f"{m!r} is a tensor in the state but an object in the checkpoint" for kind, m in findings if kind == "object")
    if not lines:
        return
    message = f"state does not match checkpoint {uri!r}: " + "; ".join(lines)
    if strict:
        raise StateMismatchError(message + ". Fix the state, or pass strict=False to load what matches")
    warnings.warn(message + " (strict=False: loading what matches)", stacklevel=3)


def _few(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def read_pieces(backend: Backend, ckpt: Checkpoint, fqns: set[str] | None = None) -> dict[str, list[PieceMeta]]:
    """The validated pieces of the tensors in ``fqns`` (all when ``None``).

    The table is read whole and checked against its CRC-32C in ``COMMIT`` when all of it is wanted or
    it is at most :data:`WHOLE_PIECES_BYTES`; otherwise only the table's footer and the row groups that
    can hold ``fqns`` are fetched.
    """
    key = layout.pieces_key(ckpt.meta.generation)
    recorded = ckpt.record.checksum(layout.PIECES) if ckpt.record is not None else None
    try:
        if fqns is None or (recorded is not None and recorded.size <= WHOLE_PIECES_BYTES):
            data = get_scheduler().do(backend, "get", key)
            if ckpt.record is not None:
                ckpt.record.check_document(layout.PIECES, data, backend.root_uri)
            return decode_pieces(data, ckpt.tensors, fqns)
        return decode_pieces(RangeFile(backend, key), ckpt.tensors, fqns)
    except CheckpointNotFoundError as exc:
        raise CorruptCheckpointError(f"checkpoint {backend.root_uri!r} has no pieces table: {exc}") from exc


def _check_files(backend: Backend, ckpt: Checkpoint, plan: LoadPlan, rank: int) -> None:
    sizes = {f.key: f.size for f in ckpt.meta.files}
    gen = ckpt.meta.generation
    sched = get_scheduler()
    for file in sorted({u.file for u in plan.units if u.reader == rank}):
        key = layout.in_generation(gen, file)
        try:
            actual = sched.do(backend, "size", key)
        except CheckpointNotFoundError:
            raise CorruptCheckpointError(f"data file {key!r} of checkpoint {backend.root_uri!r} is missing") from None
        if file not in sizes or actual != sizes[file]:
            raise CorruptCheckpointError(
                f"data file {key!r} of checkpoint {backend.root_uri!r} has {actual} bytes, the metadata says "
                f"{sizes.get(file, 'nothing')}: it is truncated or was replaced"
            )


def _verify_pieces(backend: Backend, gen: str, pieces: dict[str, list[PieceMeta]], comm: Comm) -> None:
    sched = get_scheduler()
    everything = [p for fqn in sorted(pieces) for p in pieces[fqn]]
    for i, piece in enumerate(everything):
        if i % comm.world_size != comm.rank:
            continue
        data = sched.do(backend, "get_range", layout.in_generation(gen, piece.file), piece.byte_offset, piece.byte_offset + piece.byte_length)
        if crc32c.crc32c(data) != piece.crc32c:
            raise CorruptCheckpointError(
                f"checksum mismatch in {piece.file!r} at bytes {piece.byte_offset}..{piece.byte_offset + piece.byte_length} "
                f"(tensor {piece.fqn!r}, region {piece.region}): the data file is corrupt"
            )


def _target_view(entry: TensorEntry, stored: StoredBox) -> torch.Tensor:
    """The target's storage for one stored box, shaped like the box (global-offset coordinates)."""
    if isinstance(entry.region, FlatRange):
        flat = entry.tensor.reshape(-1)
        return flat[stored.element_offset : stored.element_offset + stored.box.numel].view(stored.box.lengths)
    return entry.tensor


def _direct_buffer(unit: ReadUnit, targets: list[TensorEntry], rank: int) -> torch.Tensor | None:
    """The target memory to read ``unit`` into when it is exactly one contiguous CPU part of one target."""
    if len(unit.deliveries) != 1:
        return None
    d = unit.deliveries[0]
    if d.rank != rank or d.box != unit.box:
        return None
    view = _target_view(targets[d.target], d.target_box)[d.box.relative_to(d.target_box.box).slices()]
    if view.device.type != "cpu" or not view.is_contiguous():
        return None
    return view.reshape(-1).view(torch.uint8)


def _dtype(unit: ReadUnit) -> torch.dtype:
    return TensorMeta(fqn=unit.fqn, dtype=unit.dtype, shape=()).torch_dtype


EXCHANGE_ALIGN = 16
"""Each delivery starts at a multiple of this many bytes in the exchange stream, so any dtype can view it."""


def _padded(nbytes: int) -> int:
    return -(-nbytes // EXCHANGE_ALIGN) * EXCHANGE_ALIGN


@dataclass
class _Round:
    """One round's units, the buffers they are read into, and the reads in flight."""

    indices: tuple[int, ...]
    buffers: dict[int, torch.Tensor]
    direct: set[int]
    reads: Any


class _Executor:
    """Runs a :class:`LoadPlan` on one rank: reads, local copies and one all-to-all per round.

    Round *k + 1*'s reads are in flight on the I/O loop while round *k* is delivered and exchanged,
    so storage and the network overlap; at most two rounds' buffers are alive at once.
    """

    def __init__(self, backend: Backend, gen: str, plan: LoadPlan, targets: list[TensorEntry], comm: Comm, monitor: Monitor) -> None:
        self.backend, self.gen, self.plan, self.targets, self.comm, self.monitor = backend, gen, plan, targets, comm, monitor
        self.sched = get_scheduler()

    def run(self) -> None:
        rounds = list(zip(self.plan.rounds, self.plan.exchanges))
        pending = self._start(rounds[0][0]) if rounds else None
        for k, (_, exchange) in enumerate(rounds):
            current = pending
            current.reads.result()
            pending = self._start(rounds[k + 1][0]) if k + 1 < len(rounds) else None
            with torch.no_grad():
                self._deliver_round(current, exchange)

    def _start(self, indices: tuple[int, ...]) -> _Round:
        """Allocate this rank's buffers for a round and start reading into them."""
        buffers: dict[int, torch.Tensor] = {}
        direct: set[int] = set()
        singles: list[ReadRequest] = []
        multi: list[tuple[ReadUnit, memoryview]] = []
        for i in indices:
            unit = self.plan.units[i]
            if unit.reader != self.comm.rank:
                continue
            buf = _direct_buffer(unit, self.targets, self.comm.rank)
            if buf is None:
                buf = torch.empty(unit.nbytes, dtype=torch.uint8)
            else:
                direct.add(i)
            buffers[i] = buf
            view = memoryview(buf.numpy())
            key = layout.in_generation(self.gen, unit.file)
            if len(unit.run_offsets) == 1:
                singles.append(ReadRequest(key=key, start=int(unit.run_offsets[0]), out=view))
            else:
                multi.append((unit, view))
            self.monitor.count("requests", len(unit.run_offsets))
            self.monitor.count("bytes_read", unit.nbytes)
        return _Round(indices, buffers, direct, self.sched.submit(self._read(singles, multi)))

    async def _read(self, singles: list[ReadRequest], multi: list[tuple[ReadUnit, memoryview]]) -> None:
        backend, sched = self.backend, self.sched
        jobs = [sched.read(backend, singles)] if singles else []
        jobs += [
            sched.call(backend, "read_runs", backend.read_runs, layout.in_generation(self.gen, unit.file),
                       unit.run_offsets.tolist(), unit.run_bytes, view, nbytes=unit.nbytes)
            for unit, view in multi
        ]
        await asyncio.gather(*jobs)

    def _deliver_round(self, rnd: _Round, exchange: bool) -> None:
        me = self.comm.rank
        units = [(i, self.plan.units[i]) for i in rnd.indices]
        send_sizes = [0] * self.comm.world_size
        for i, unit in units:
            if unit.reader == me:
                for d in unit.deliveries:
                    if d.rank != me:
                        send_sizes[d.rank] += _padded(d.numel * itemsize(_dtype(unit)))
        send = torch.empty(sum(send_sizes), dtype=torch.uint8)
        cursors = [sum(send_sizes[:r]) for r in range(self.comm.world_size)]
        for i, unit in units:
            if unit.reader != me or i in rnd.direct:
                continue
            source = rnd.buffers.pop(i).view(_dtype(unit)).view(unit.box.lengths)
            for d in unit.deliveries:
                part = source[d.box.relative_to(unit.box).slices()]
                if d.rank == me:
                    _deliver(self.targets[d.target], d, part)
                else:
                    nbytes = d.numel * part.element_size()
                    at = cursors[d.rank]
                    send[at : at + nbytes].view(part.dtype).view(d.box.lengths).copy_(part)
                    cursors[d.rank] += _padded(nbytes)
        if exchange:
            self._exchange(units, send, send_sizes)

    def _exchange(self, units: list[tuple[int, ReadUnit]], send: torch.Tensor, send_sizes: list[int]) -> None:
        me = self.comm.rank
        recv_sizes = [0] * self.comm.world_size
        incoming = []
        for _, unit in units:
            if unit.reader == me:
                continue
            for d in unit.deliveries:
                if d.rank == me:
                    nbytes = d.numel * itemsize(_dtype(unit))
                    recv_sizes[unit.reader] += _padded(nbytes)
                    incoming.append((unit, d, nbytes))
        received = self.comm.all_to_all_bytes(send, send_sizes, recv_sizes)
        self.monitor.count("bytes_exchanged", sum(recv_sizes))
        cursors = [0] * self.comm.world_size
        for unit, d, nbytes in incoming:
            at = cursors[unit.reader]
            cursors[unit.reader] += _padded(nbytes)
            _deliver(self.targets[d.target], d, received[unit.reader][at : at + nbytes].view(_dtype(unit)))


def _deliver(entry: TensorEntry, delivery: Any, part: torch.Tensor) -> None:
    target = _target_view(entry, delivery.target_box)[delivery.box.relative_to(delivery.target_box.box).slices()]
    target.copy_(part.reshape(delivery.box.lengths))


def _fetch_objects(backend: Backend, ckpt: Checkpoint, flat: FlatState, comm: Comm, allow_pickle: bool) -> dict[str, Any]:
    """The decoded value of every object entry this rank loads (nothing is assigned yet)."""
    gen = ckpt.meta.generation
    values: dict[str, Any] = {}
    by_key: dict[str, list[ObjectMeta]] = {}
    for o in ckpt.meta.objects:
        by_key.setdefault(o.key, []).append(o)
    saved_world = ckpt.meta.world_size
    for key, entry in flat.objects.items():
        options = by_key.get(key)
        if not options:
            continue
        if entry.all_ranks:
            ordered = sorted(options, key=lambda o: -1 if o.rank is None else o.rank)
            values[key] = [_read_object(backend, gen, o, allow_pickle) for o in ordered]
        else:
            values[key] = _read_object(backend, gen, _object_for_rank(options, comm.rank, saved_world, key), allow_pickle)
    return values


def _read_object(backend: Backend, gen: str, meta: ObjectMeta, allow_pickle: bool) -> Any:
    data = get_scheduler().do(backend, "get_range", layout.in_generation(gen, meta.file), meta.byte_offset, meta.byte_offset + meta.byte_length)
    if crc32c.crc32c(data) != meta.crc32c:
        raise CorruptCheckpointError(f"checksum mismatch for object {meta.key!r} in {meta.file!r} at byte {meta.byte_offset}")
    return decode_object(data, meta.codec, meta.key, allow_pickle=allow_pickle)


def _object_for_rank(options: list[ObjectMeta], rank: int, saved_world: int, key: str) -> ObjectMeta:
    shared = [o for o in options if o.rank is None]
    if shared:
        return shared[0]
    per_rank = {o.rank: o for o in options}
    if rank in per_rank:
        return per_rank[rank]
    source = rank % saved_world
    logger.warning("object %r was saved per rank by %d ranks; rank %d loads rank %d's value", key, saved_world, rank, source)
    if source not in per_rank:
        raise CorruptCheckpointError(f"object {key!r} has no value for saved rank {source}")
    return per_rank[source]
