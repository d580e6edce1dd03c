"""Reading the saved objects of a checkpoint (everything that is not a tensor: step counters, RNG
states, optimizer hyperparameters, user objects).

Objects are small and many: :func:`read_objects` fetches nearby objects of one file in one ranged
read and checks each object's CRC-32C; :func:`wanted_objects` decides which saved values each object
entry of a rank's state loads (a per-rank value saved by fewer ranks comes from ``rank % saved_world``);
:func:`fetch_objects` reads and decodes them for a load, from a peer's share, the node's memory tier
or the store's chain. Used by :mod:`tierckpt.loading.api` and :mod:`tierckpt.convert.api`.
"""

from __future__ import annotations

import logging
from typing import Any

import crc32c

from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.formats.reader import Checkpoint
from tierckpt.errors import ChecksumMismatchError, CheckpointNotFoundError, CorruptCheckpointError, MissingFileError
from tierckpt.io.scheduler import ReadRequest, get_scheduler
from tierckpt.loading.locality import LocalReads
from tierckpt.native.metadata import ObjectMeta
from tierckpt.formats.objects import decode_object
from tierckpt.state.adapters import FlatState

log = logging.getLogger("tierckpt")

OBJECT_GAP_BYTES = 1 << 20
"""Objects of one file at most this far apart are fetched in one ranged read (they are many and small)."""


def fetch_objects(
    backend: Backend, ckpt: Checkpoint, flat: FlatState, wanted: dict[str, list[ObjectMeta]], allow_pickle: bool,
    local: LocalReads, shared: dict[str, bytes],
) -> dict[str, Any]:
    """The decoded value of every object entry this rank loads (``wanted``: :func:`wanted_objects`;
    nothing is assigned yet). Each objects file is read from a peer's share, this node's memory tier or
    the chain."""
    metas = {o for ms in wanted.values() for o in ms}
    data = object_bytes(shared, {o for o in metas if o.file in shared})
    for here in (True, False):
        group = {o for o in metas if o.file not in shared and local.here(o.file) == here}
        data.update(read_objects(local.store(here, backend), ckpt.meta.generation, group))
    values: dict[str, Any] = {}
    for key, ms in wanted.items():
        decoded = [decode_object(data[o], o.codec, o.key, allow_pickle=allow_pickle) for o in ms]
        values[key] = decoded if flat.objects[key].all_ranks else decoded[0]
        flat.objects[key].check(values[key])
    return values


def wanted_objects(ckpt: Checkpoint, flat: FlatState, rank: int) -> dict[str, list[ObjectMeta]]:
    """The saved objects each object entry of this rank's state loads from (all ranks' for ``all_ranks`` entries)."""
    by_key: dict[str, list[ObjectMeta]] = {}
    for o in ckpt.meta.objects:
        by_key.setdefault(o.key, []).append(o)
    saved_world = ckpt.meta.world_size
    wanted: dict[str, list[ObjectMeta]] = {}
    for key, entry in flat.objects.items():
        options = by_key.get(key)
        if not options:
            continue
        if entry.all_ranks:
            wanted[key] = sorted(options, key=lambda o: -1 if o.rank is None else o.rank)
        else:
            wanted[key] = [_object_for_rank(options, rank, saved_world, key)]
    return wanted


def object_bytes(files: dict[str, bytes], metas: set[ObjectMeta]) -> dict[ObjectMeta, bytes]:
    """The checksummed bytes of each object, cut from whole objects files already read."""
    out: dict[ObjectMeta, bytes] = {}
    for meta in metas:
        data = files[meta.file][meta.byte_offset : meta.byte_offset + meta.byte_length]
        if len(data) != meta.byte_length or crc32c.crc32c(data) != meta.crc32c:
            raise CorruptCheckpointError(f"checksum mismatch for object {meta.key!r} in {meta.file!r} at byte {meta.byte_offset}")
        out[meta] = data
    return out


def read_objects(backend: Backend, gen: str, metas: set[ObjectMeta]) -> dict[ObjectMeta, bytes]:
    """The checksummed bytes of each object; nearby objects of one file come in one ranged read."""
    spans: list[tuple[str, int, list[ObjectMeta]]] = []
    ends: list[int] = []
    for meta in sorted(metas, key=lambda o: (o.file, o.byte_offset)):
        end = meta.byte_offset + meta.byte_length
        if spans and spans[-1][0] == meta.file and meta.byte_offset - ends[-1] <= OBJECT_GAP_BYTES:
            spans[-1][2].append(meta)
            ends[-1] = max(ends[-1], end)
        else:
            spans.append((meta.file, meta.byte_offset, [meta]))
            ends.append(end)
    sched = get_scheduler()
    sizes = {file: _size(backend, gen, file) for file, _, _ in spans}
    for (file, _, group), end in zip(spans, ends):
        if end > sizes[file]:  # checked before allocating: the header is untrusted input
            last = max(group, key=lambda o: o.byte_offset + o.byte_length)
            raise CorruptCheckpointError(
                f"object {last.key!r} runs past the end of {file!r} ({sizes[file]} bytes): the checkpoint "
                "metadata and the stored data disagree"
            )
    buffers = [bytearray(end - start) for (_, start, _), end in zip(spans, ends)]
    requests = [
        ReadRequest(key=layout.in_generation(gen, file), start=start, out=memoryview(buf))
        for (file, start, _), buf in zip(spans, buffers)
    ]
    if requests:
        sched.run(sched.read(backend, requests))
    out: dict[ObjectMeta, bytes] = {}
    checked: dict[tuple[str, int, int], tuple[bytes, int]] = {}  # objects sharing bytes are copied and checked once
    for (_, start, group), buf in zip(spans, buffers):
        for meta in group:
            span = (meta.file, meta.byte_offset, meta.byte_length)
            if span not in checked:
                data = bytes(buf[meta.byte_offset - start : meta.byte_offset - start + meta.byte_length])
                checked[span] = (data, crc32c.crc32c(data))
            data, crc = checked[span]
            if crc != meta.crc32c:
                raise ChecksumMismatchError(
                    f"checksum mismatch for object {meta.key!r} in {meta.file!r} at byte {meta.byte_offset}",
                    layout.in_generation(gen, meta.file), meta.byte_offset, meta.byte_offset + meta.byte_length,
                )
            out[meta] = data
    return out


def _size(backend: Backend, gen: str, file: str) -> int:
    """The size of an objects file the metadata lists: one that is not there is a :class:`MissingFileError`."""
    key = layout.in_generation(gen, file)
    try:
        return get_scheduler().run(backend.size(key))
    except CheckpointNotFoundError:
        raise MissingFileError(f"file {key!r} of checkpoint {backend.root_uri!r} is missing") from None


def _object_for_rank(options: list[ObjectMeta], rank: int, saved_world: int, key: str) -> ObjectMeta:
    shared = [o for o in options if o.rank is None]
    if shared:
        return shared[0]
    per_rank = {o.rank: o for o in options}
    if rank in per_rank:
        return per_rank[rank]
    source = rank % saved_world
    log.warning("object %r was saved per rank by %d ranks; rank %d loads rank %d's value", key, saved_world, rank, source)
    if source not in per_rank:
        raise CorruptCheckpointError(f"object {key!r} has no value for saved rank {source}")
    return per_rank[source]
