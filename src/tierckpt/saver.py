"""Synchronous save.

Lifecycle (every rank of the group unless noted):

1. Flatten the state into tensor entries (with regions) and objects; encode the objects.
2. Rank 0 names a fresh generation and broadcasts it; ranks all-gather their offers (or their
   errors) and each computes the same :class:`~tierckpt.planner.SavePlan`.
3. Each rank streams its assigned pieces into its data file and its objects into its objects file,
   computing CRC-32C on the way. Nothing is visible until each file's writer closes.
4. Ranks all-gather their piece and object records (or errors). Any failure: every rank raises, no
   commit is written, and the previously committed checkpoint is untouched.
5. Rank 0 writes the metadata documents, then the ``COMMIT`` record (atomic), then broadcasts the
   outcome; by default it then deletes the generation the old ``COMMIT`` named.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import crc32c
import torch
import torch.distributed as dist

from . import layout
from .backends import Backend, open_backend
from .comm import Comm
from .errors import CheckpointError, CheckpointNotFoundError
from .io.scheduler import get_scheduler
from .metadata import (
    CheckpointMeta, FileMeta, ObjectMeta, PieceMeta, dtype_name, encode_header, encode_pieces, encode_tensors,
)
from .monitor import Monitor
from .objects import encode_object
from .planner import LocalPiece, SavePlan, WriteAssignment, plan_save
from .regions import Box, FlatRange, Region
from .state import FlatState, TensorEntry, flatten_state

T = TypeVar("T")


def save(
    uri: str,
    state: Mapping[str, Any],
    *,
    group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
    keep_previous: bool = False,
    align_bytes: int = 64,
    monitor: Monitor | None = None,
) -> CheckpointMeta:
    """Save ``state`` to ``uri``; returns once the checkpoint is committed (on every rank).

    ``keep_previous=True`` keeps the generation that the previous commit named (it is otherwise
    deleted after the new commit). ``tags`` are stored in the header.
    """
    comm = Comm(group)
    monitor = monitor or Monitor()
    backend = open_backend(uri, **dict(storage_options or {}))
    started = time.time()
    with monitor.phase("plan"):
        (offers, digests), flat, encoded = run_agreed(comm, lambda: _prepare(state), "preparing the state to save")
        generation = comm.broadcast_object(layout.new_generation() if comm.rank == 0 else None)
        gathered = comm.all_gather_object((offers, digests))
        plan = plan_save([o for o, _ in gathered], align_bytes=align_bytes)
        owners = _place_objects([d for _, d in gathered], plan)
    with monitor.phase("write"):
        mine = run_agreed(
            comm,
            lambda: _write_rank(backend, generation, comm.rank, plan, flat, encoded, owners, monitor),
            f"writing checkpoint {uri!r}",
        )
        records = comm.all_gather_object(mine)
    meta = CheckpointMeta(
        generation=generation,
        world_size=comm.world_size,
        created_unix=started,
        frameworks=tuple(sorted(flat.frameworks)),
        files=tuple(f for r in records for f in r[2]),
        objects=tuple(o for r in records for o in r[1]),
        num_tensors=len(plan.tensors),
        num_pieces=sum(len(r[0]) for r in records),
        tensor_bytes=sum(t.nbytes for t in plan.tensors),
        timings={**{f"rank{r}.{k}": v for r, rec in enumerate(records) for k, v in rec[3].items()}},
        tags=dict(tags or {}),
    )
    error: BaseException | None = None
    if comm.rank == 0:
        try:
            previous = _committed_generation(backend)
            _commit(backend, meta, plan, [p for r in records for p in r[0]])
            if previous and previous != generation and not keep_previous:
                get_scheduler().run(backend.delete_prefix(f"{previous}/"))
        except Exception as exc:  # noqa: BLE001 - shared with every rank below
            error = exc
    outcome = comm.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if outcome is not None:
        raise CheckpointError(f"committing checkpoint {uri!r} failed on rank 0: {outcome}")
    return meta


def run_agreed(comm: Comm, fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on every rank; if it failed on any rank, raise on all of them (none is left waiting)."""
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - shared with every rank by agree()
        error = exc
    comm.agree(error, what)
    return result  # type: ignore[return-value]


def _prepare(state: Mapping[str, Any]) -> tuple[tuple[list[LocalPiece], dict[str, tuple[int, int]]], FlatState, dict]:
    flat = flatten_state(state, for_load=False)
    offers = [
        LocalPiece(fqn=e.fqn, dtype=dtype_name(e.tensor.dtype), shape=e.shape, region=e.region)
        for e in flat.tensors.values()
    ]
    encoded = {key: encode_object(entry.value) for key, entry in flat.objects.items()}
    digests = {key: (crc32c.crc32c(data), len(data)) for key, (data, _) in encoded.items()}
    return (offers, digests), flat, encoded


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


def _write_rank(
    backend: Backend,
    generation: str,
    rank: int,
    plan: SavePlan,
    flat: FlatState,
    encoded: dict[str, tuple[bytes, str]],
    owners: dict[str, int | None],
    monitor: Monitor,
) -> tuple[list[PieceMeta], list[ObjectMeta], list[FileMeta], dict[str, float]]:
    sched = get_scheduler()
    pieces: list[PieceMeta] = []
    files: list[FileMeta] = []
    writes = plan.writes[rank]
    if writes:
        chunks = _piece_chunks(flat, writes, pieces)
        key = layout.in_generation(generation, writes[0].file)
        sched.run(_stream(backend, key, chunks))
        files.append(FileMeta(key=writes[0].file, size=plan.file_sizes[rank]))
        monitor.count("bytes_written", plan.file_sizes[rank])
    objects: list[ObjectMeta] = []
    blobs = []
    offset = 0
    for key in sorted(encoded):
        owner = owners.get(key)
        if owner is not None and owner != rank:
            continue
        data, codec = encoded[key]
        objects.append(
            ObjectMeta(
                key=key, rank=None if owner is not None else rank, file=layout.objects_file(rank),
                byte_offset=offset, byte_length=len(data), crc32c=crc32c.crc32c(data), codec=codec,
            )
        )
        blobs.append(data)
        offset += len(data)
    if blobs:
        sched.run(backend.put(layout.in_generation(generation, layout.objects_file(rank)), b"".join(blobs)))
        files.append(FileMeta(key=layout.objects_file(rank), size=offset))
    return pieces, objects, files, dict(monitor.seconds)


def _piece_chunks(flat: FlatState, writes: tuple[WriteAssignment, ...], out: list[PieceMeta]) -> Iterator[memoryview | bytes]:
    """The bytes of a data file, piece by piece (with alignment padding); records each piece in ``out``."""
    position = 0
    for w in writes:
        if w.byte_offset > position:
            yield bytes(w.byte_offset - position)
        data = tensor_bytes(_piece_tensor(flat.tensors[w.fqn], w.region))
        if len(data) != w.byte_length:
            raise CheckpointError(f"piece of {w.fqn!r} has {len(data)} bytes, the plan expected {w.byte_length}")
        out.append(
            PieceMeta(fqn=w.fqn, region=w.region, file=w.file, byte_offset=w.byte_offset,
                      byte_length=w.byte_length, crc32c=crc32c.crc32c(data))
        )
        yield data
        position = w.byte_offset + w.byte_length


def _piece_tensor(entry: TensorEntry, region: Region) -> torch.Tensor:
    """The part of an entry's local tensor that holds ``region``."""
    if isinstance(region, FlatRange) and isinstance(entry.region, FlatRange):
        return entry.tensor.reshape(-1)[region.start - entry.region.start : region.stop - entry.region.start]
    if isinstance(region, Box) and isinstance(entry.region, Box):
        return entry.tensor[region.relative_to(entry.region).slices()]
    raise CheckpointError(f"piece of {entry.fqn!r}: a {type(region).__name__} cannot be cut from a {type(entry.region).__name__}")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's elements as raw bytes, row-major (copying only if not contiguous or not on the CPU)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


async def _stream(backend: Backend, key: str, chunks: Iterator[memoryview | bytes]) -> None:
    writer = await backend.open_writer(key)
    try:
        for chunk in chunks:
            await writer.write(chunk)
    except BaseException:
        await writer.abort()
        raise
    await writer.close()


def _committed_generation(backend: Backend) -> str | None:
    try:
        data = get_scheduler().run(backend.get(layout.COMMIT))
    except CheckpointNotFoundError:
        return None
    return layout.CommitRecord.decode(data).generation


def _commit(backend: Backend, meta: CheckpointMeta, plan: SavePlan, pieces: list[PieceMeta]) -> None:
    sched = get_scheduler()
    gen = meta.generation
    sched.run(backend.put(layout.tensors_key(gen), encode_tensors(plan.tensors)))
    sched.run(backend.put(layout.pieces_key(gen), encode_pieces(pieces)))
    sched.run(backend.put(layout.header_key(gen), encode_header(meta)))
    sched.run(backend.commit(layout.COMMIT, layout.CommitRecord(gen, time.time()).encode()))
