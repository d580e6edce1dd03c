"""Save planning: drop duplicate replicas, balance the bytes written, place pieces in files.

Every rank offers the pieces it holds (:class:`LocalPiece`). :func:`plan_save` runs on the gathered
offers — identically on every rank, so no scatter is needed — and returns who writes what, where:

1. Check that every rank agrees on each tensor's dtype and global shape.
2. Group identical ``(fqn, region)`` offers: a region held by several ranks (DDP, ``Replicate()``) is
   a replica and is written once.
3. Pieces held by one rank are pinned to it. Replicated pieces larger than ``split_bytes`` are cut
   into row slabs (boxes) or sub-ranges (flat), then all replicated parts are assigned greedily,
   largest first, to the least-loaded holder — so a DDP job writes ~1/N of the model per rank.
4. Each rank's pieces are laid out back to back in its own data file, aligned to ``align_bytes``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tierckpt.errors import StateMismatchError
from tierckpt.native.metadata import TensorMeta, dtype_from_name, itemsize
from tierckpt.native.regions import Box, FlatRange, Region


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalPiece:
    """A piece of a tensor that one rank holds and can write."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    region: Region


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteAssignment:
    """Write ``region`` of tensor ``fqn`` (taken from the writer's local piece) at ``file[byte_offset:]``."""

    fqn: str
    region: Region
    file: str
    byte_offset: int
    byte_length: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SavePlan:
    tensors: tuple[TensorMeta, ...]
    writes: tuple[tuple[WriteAssignment, ...], ...]
    """``writes[rank]``: what that rank writes, in file order."""
    file_sizes: tuple[int, ...]
    """Bytes of each rank's data file."""

    @property
    def bytes_per_rank(self) -> tuple[int, ...]:
        return tuple(sum(w.byte_length for w in ws) for ws in self.writes)


def data_file(rank: int) -> str:
    return f"data/rank-{rank:05d}.bin"


def offers_digest(offers: Sequence[Sequence[LocalPiece]]) -> str:
    """A hash of offers: each rank hashes its own, and equal digests on every rank mean the cached plan holds."""
    h = hashlib.sha256()
    for rank, pieces in enumerate(offers):
        h.update(f"#{rank}".encode())
        for p in pieces:
            h.update(repr((p.fqn, p.dtype, p.shape, p.region)).encode())
    return h.hexdigest()


def plan_save(
    offers: Sequence[Sequence[LocalPiece]],
    *,
    align_bytes: int = 64,
    min_split_bytes: int = 4 << 20,
) -> SavePlan:
    """Plan a save from every rank's offers (``offers[rank]``). Pure and deterministic."""
    world = len(offers)
    tensors = _agree_on_tensors(offers)
    holders: dict[tuple[str, Region], list[int]] = {}
    for rank, pieces in enumerate(offers):
        for p in pieces:
            if p.region.numel:
                holders.setdefault((p.fqn, p.region), []).append(rank)

    sizes = {fqn: itemsize(dtype_from_name(t.dtype)) for fqn, t in tensors.items()}
    load = [0] * world
    assigned: list[list[tuple[str, Region]]] = [[] for _ in range(world)]
    replicated: list[tuple[int, str, Region, list[int]]] = []
    total = sum(r.numel * sizes[f] for f, r in holders)
    split_bytes = max(min_split_bytes, math.ceil(total / (4 * world)))
    for (fqn, region), ranks in holders.items():
        nbytes = region.numel * sizes[fqn]
        if len(ranks) == 1:
            assigned[ranks[0]].append((fqn, region))
            load[ranks[0]] += nbytes
            continue
        for part in _split(region, tensors[fqn].shape, sizes[fqn], split_bytes):
            replicated.append((part.numel * sizes[fqn], fqn, part, ranks))
    replicated.sort(key=lambda x: (-x[0], x[1], _region_key(x[2])))
    for nbytes, fqn, region, ranks in replicated:
        rank = min(ranks, key=lambda r: (load[r], r))
        assigned[rank].append((fqn, region))
        load[rank] += nbytes

    writes: list[tuple[WriteAssignment, ...]] = []
    file_sizes: list[int] = []
    for rank, pieces in enumerate(assigned):
        pieces.sort(key=lambda x: (x[0], _region_key(x[1])))
        offset = 0
        ws = []
        for fqn, region in pieces:
            offset = -(-offset // align_bytes) * align_bytes
            length = region.numel * sizes[fqn]
            ws.append(WriteAssignment(fqn=fqn, region=region, file=data_file(rank), byte_offset=offset, byte_length=length))
            offset += length
        writes.append(tuple(ws))
        file_sizes.append(offset)
    return SavePlan(
        tensors=tuple(tensors[f] for f in sorted(tensors)),
        writes=tuple(writes),
        file_sizes=tuple(file_sizes),
    )


def _agree_on_tensors(offers: Sequence[Sequence[LocalPiece]]) -> dict[str, TensorMeta]:
    seen: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for rank, pieces in enumerate(offers):
        for p in pieces:
            dtype, shape, first = seen.setdefault(p.fqn, (p.dtype, tuple(p.shape), rank))
            if dtype != p.dtype or shape != tuple(p.shape):
                raise StateMismatchError(
                    f"ranks disagree on tensor {p.fqn!r}: rank {first} has {dtype}{list(shape)}, "
                    f"rank {rank} has {p.dtype}{list(p.shape)}; every rank must describe the same global tensor"
                )
    return {fqn: TensorMeta(fqn=fqn, dtype=dtype, shape=shape) for fqn, (dtype, shape, _) in seen.items()}


def _region_key(region: Region) -> tuple:
    if isinstance(region, Box):
        return (0, region.offsets, region.lengths)
    return (1, (region.start,), (region.stop,))


def _split(region: Region, shape: tuple[int, ...], item: int, split_bytes: int) -> list[Region]:
    """Cut a region into parts of at most ~``split_bytes``: row slabs of a box, sub-ranges of a flat range."""
    if region.numel * item <= split_bytes:
        return [region]
    if isinstance(region, FlatRange):
        step = max(1, split_bytes // item)
        return [FlatRange(s, min(s + step, region.stop)) for s in range(region.start, region.stop, step)]
    dim = next((d for d, n in enumerate(region.lengths) if n > 1), None)
    if dim is None:
        return [region]
    row = math.prod(region.lengths[dim + 1 :]) * item
    rows = max(1, split_bytes // row)
    parts = []
    for s in range(0, region.lengths[dim], rows):
        n = min(rows, region.lengths[dim] - s)
        offsets = list(region.offsets)
        lengths = list(region.lengths)
        offsets[dim] += s
        lengths[dim] = n
        parts.append(Box(tuple(offsets), tuple(lengths)))
    return parts
