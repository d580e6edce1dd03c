"""Load planning: which bytes each rank reads, and who gets which elements.

Inputs are the saved pieces of each tensor and what every rank of the loading group needs
(:class:`TargetPiece`: the region its local tensor holds). :func:`plan_load` runs identically on every
rank (the needs are all-gathered first) and returns a :class:`LoadPlan`:

1. Every saved piece and every target becomes *stored boxes* (a flat range is a few boxes), so all
   meetings are box ∩ box. For each tensor the saved boxes are sorted by their first offset and each
   target finds its candidates by bisection (a sweep, not all pairs).
2. Each saved box is cut into row slabs of about ``chunk_bytes``; a slab is contiguous in its file.
   Within a slab, the union of what the group needs becomes one *read unit* (a box read into one
   packed buffer) — or one unit per need when the needs are disjoint and do not tile a box. Bytes are
   read exactly: read amplification is 1.00 whenever the group's needs tile each slab, which every
   complete load does (row -> column, flat -> box, replicated targets alike).
3. Each unit has one reader: the rank that needs most of it, ties to the least-loaded rank. A unit
   needed by several ranks (replicated targets, cross-cutting reshards) is therefore read once and its
   :class:`Delivery` parts are sent to the others by an all-to-all — few large reads, zero redundancy.
4. Units are grouped into rounds so that no rank holds more than about ``round_bytes`` of read,
   sent and received buffers at once; memory stays bounded whatever the checkpoint's size.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import CorruptCheckpointError
from ..metadata import PieceMeta, TensorMeta, itemsize
from ..regions import Box, Region, StoredBox, box_runs, run_length, stored_boxes


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetPiece:
    """What one rank needs of tensor ``fqn``: the region its local tensor holds."""

    fqn: str
    region: Region


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """Elements ``box`` of a unit go to ``rank``'s target number ``target``."""

    rank: int
    target: int
    target_box: StoredBox
    """The target's stored box that receives them (global coordinates, offset in local storage)."""
    box: Box

    @property
    def numel(self) -> int:
        return self.box.numel


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ReadUnit:
    """A box of one saved piece, read by one rank into a packed row-major buffer."""

    fqn: str
    dtype: str
    box: Box
    file: str
    run_offsets: np.ndarray
    """Byte offset in ``file`` of each contiguous run, in order."""
    run_bytes: int
    reader: int
    deliveries: tuple[Delivery, ...]
    round: int

    @property
    def nbytes(self) -> int:
        return len(self.run_offsets) * self.run_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadPlan:
    units: tuple[ReadUnit, ...]
    rounds: tuple[tuple[int, ...], ...]
    """Unit indices of each round, in plan order."""
    exchanges: tuple[bool, ...]
    """Whether a round moves bytes between ranks (else its all-to-all is skipped)."""
    world_size: int
    bytes_read: int
    bytes_delivered: int
    """Bytes that reach targets, summed over ranks (replicated needs count once per rank)."""
    bytes_read_per_rank: tuple[int, ...] = field(default=())

    @property
    def requests(self) -> int:
        return sum(len(u.run_offsets) for u in self.units)


def plan_load(
    tensors: dict[str, TensorMeta],
    pieces: dict[str, list[PieceMeta]],
    needs: Sequence[Sequence[TargetPiece]],
    *,
    chunk_bytes: int = 32 << 20,
    round_bytes: int = 512 << 20,
    direct_min_run_bytes: int | None = 512,
) -> LoadPlan:
    """Plan a load for a group whose rank ``r`` needs ``needs[r]``. Pure and deterministic.

    ``direct_min_run_bytes``: when the needs within a slab are disjoint and each is made of contiguous
    runs of at least this many bytes, every rank reads its own part directly (no exchange). Small for
    local files, where a short positional read is cheap; about 1 MiB for object stores, where each run
    is a request; ``None`` always reads through one reader per slab.
    """
    world = len(needs)
    targets: dict[str, list[tuple[int, int, StoredBox]]] = defaultdict(list)
    for rank, rank_needs in enumerate(needs):
        for index, need in enumerate(rank_needs):
            shape = tensors[need.fqn].shape
            for sb in stored_boxes(need.region, shape):
                targets[need.fqn].append((rank, index, sb))

    load = [0] * world
    drafts: list[dict] = []
    for fqn in sorted(targets):
        meta = tensors[fqn]
        _plan_tensor(meta, pieces.get(fqn, []), targets[fqn], chunk_bytes, direct_min_run_bytes, load, drafts)

    units, rounds, exchanges = _assign_rounds(drafts, world, round_bytes)
    per_rank = [0] * world
    for u in units:
        per_rank[u.reader] += u.nbytes
    return LoadPlan(
        units=units,
        rounds=rounds,
        exchanges=exchanges,
        world_size=world,
        bytes_read=sum(per_rank),
        bytes_delivered=sum(d.numel * itemsize(tensors[u.fqn].torch_dtype) for u in units for d in u.deliveries),
        bytes_read_per_rank=tuple(per_rank),
    )


def _plan_tensor(
    meta: TensorMeta,
    pieces: list[PieceMeta],
    wanted: list[tuple[int, int, StoredBox]],
    chunk_bytes: int,
    direct_min_run_bytes: int | None,
    load: list[int],
    drafts: list[dict],
) -> None:
    item = itemsize(meta.torch_dtype)
    saved: list[tuple[Box, str, int]] = []
    for p in pieces:
        for sb in stored_boxes(p.region, meta.shape):
            saved.append((sb.box, p.file, p.byte_offset + sb.element_offset * item))
    ndim = len(meta.shape)
    saved.sort(key=lambda s: s[0].offsets[0] if ndim else 0)
    starts = [s[0].offsets[0] for s in saved] if ndim else []
    # A saved box starting at or before (target start - longest saved extent) ends before the target.
    longest = max((s[0].lengths[0] for s in saved), default=0) if ndim else 0

    needs_of: dict[int, list[tuple[int, int, StoredBox, Box]]] = defaultdict(list)
    for rank, index, target in wanted:
        covered = 0
        if ndim:
            hi = bisect.bisect_left(starts, target.box.offsets[0] + target.box.lengths[0])
            lo = bisect.bisect_right(starts, target.box.offsets[0] - longest)
            candidates = range(lo, hi)
        else:
            candidates = range(len(saved))
        for si in candidates:
            inter = saved[si][0].intersect(target.box)
            if inter is not None:
                needs_of[si].append((rank, index, target, inter))
                covered += inter.numel
        if covered != target.box.numel:
            raise CorruptCheckpointError(
                f"the checkpoint's pieces of {meta.fqn!r} cover {covered} of the {target.box.numel} elements "
                f"rank {rank} needs in box {target.box}; the checkpoint is incomplete or its pieces overlap"
            )

    for si in sorted(needs_of):
        box, file, base = saved[si]
        needs = needs_of[si]
        for slab in _slabs(box, _bounding([n[3] for n in needs]), item, chunk_bytes):
            parts = [(r, i, t, b) for r, i, t, inter in needs if (b := inter.intersect(slab)) is not None]
            if not parts:  # a slab between disjoint needs (e.g. rows 0 and 2 of a piece): nothing to read
                continue
            for unit_box in _unit_boxes([p[3] for p in parts], box, item, direct_min_run_bytes):
                starts_el, run = box_runs(unit_box, box)
                deliveries = tuple(
                    Delivery(rank=r, target=i, target_box=t, box=b)
                    for r, i, t, inter in parts
                    if (b := inter.intersect(unit_box)) is not None
                )
                reader = _choose_reader(deliveries, load)
                nbytes = unit_box.numel * item
                load[reader] += nbytes
                drafts.append(
                    dict(
                        fqn=meta.fqn, dtype=meta.dtype, box=unit_box, file=file,
                        run_offsets=base + starts_el * item, run_bytes=run * item,
                        reader=reader, deliveries=deliveries, item=item,
                    )
                )


def _bounding(boxes: Sequence[Box]) -> Box:
    lo = [min(b.offsets[d] for b in boxes) for d in range(boxes[0].ndim)]
    hi = [max(b.offsets[d] + b.lengths[d] for b in boxes) for d in range(boxes[0].ndim)]
    return Box(tuple(lo), tuple(h - l for l, h in zip(lo, hi)))


def _slabs(box: Box, needed: Box, item: int, chunk_bytes: int) -> list[Box]:
    """Row slabs of ``box`` (full in later dims, so contiguous in storage) that touch ``needed``."""
    dim = next((d for d, n in enumerate(box.lengths) if n > 1), None)
    if dim is None:
        return [box]
    row = math.prod(box.lengths[dim + 1 :]) * item
    rows = max(1, chunk_bytes // max(row, 1))
    lo, hi = needed.offsets[dim], needed.offsets[dim] + needed.lengths[dim]
    slabs = []
    for start in range(lo, hi, rows):
        offsets = list(box.offsets)
        lengths = list(box.lengths)
        offsets[dim] = start
        lengths[dim] = min(rows, hi - start)
        slabs.append(Box(tuple(offsets), tuple(lengths)))
    return slabs


def _unit_boxes(needed: list[Box], saved: Box, item: int, direct_min_run_bytes: int | None) -> list[Box]:
    """What to read of one slab of ``saved``, as boxes each read by one rank.

    Disjoint needs made of long enough runs are read by their own ranks (no exchange). Otherwise the
    needs' bounding box is read once when they tile it (one reader, parts exchanged); needs that are
    disjoint but do not tile it are read separately, so no byte outside them is read.
    """
    distinct = list(dict.fromkeys(needed))
    if len(distinct) == 1:
        return distinct
    disjoint = all(
        distinct[i].intersect(distinct[j]) is None for i in range(len(distinct)) for j in range(i + 1, len(distinct))
    )
    if disjoint and direct_min_run_bytes is not None:
        if min(run_length(b, saved) for b in distinct) * item >= direct_min_run_bytes:
            return distinct
    bound = _bounding(distinct)
    if disjoint and sum(b.numel for b in distinct) != bound.numel:
        return distinct
    return [bound]


READER_SHARE = 0.75
"""A rank that needs at least this share of what the top needer needs of a unit may read it."""


def _choose_reader(deliveries: Sequence[Delivery], load: list[int]) -> int:
    """The least-loaded rank among those that need (nearly) the most of a unit."""
    wanted: dict[int, int] = defaultdict(int)
    for d in deliveries:
        wanted[d.rank] += d.numel
    most = max(wanted.values())
    return min((r for r, n in wanted.items() if n >= READER_SHARE * most), key=lambda r: (load[r], r))


def _assign_rounds(
    drafts: list[dict], world: int, round_bytes: int
) -> tuple[tuple[ReadUnit, ...], tuple[tuple[int, ...], ...], tuple[bool, ...]]:
    units: list[ReadUnit] = []
    rounds: list[list[int]] = []
    exchanges: list[bool] = []
    usage = [0] * world
    for draft in drafts:
        item = draft.pop("item")
        reader = draft["reader"]
        add = defaultdict(int)
        add[reader] += draft["box"].numel * item
        crosses = False
        for d in draft["deliveries"]:
            if d.rank != reader:
                crosses = True
                add[d.rank] += d.numel * item
                add[reader] += d.numel * item
        if not rounds or (rounds[-1] and any(usage[r] + a > round_bytes for r, a in add.items())):
            rounds.append([])
            exchanges.append(False)
            usage = [0] * world
        for r, a in add.items():
            usage[r] += a
        exchanges[-1] = exchanges[-1] or crosses
        rounds[-1].append(len(units))
        units.append(ReadUnit(round=len(rounds) - 1, **draft))
    return tuple(units), tuple(tuple(r) for r in rounds), tuple(exchanges)
