"""Load planning: which bytes each rank reads, and who gets which elements.

Inputs are the saved pieces of each tensor, what every rank of the loading group needs
(:class:`TargetPiece`: the region its local tensor holds) and the :class:`~.routes.Topology` the
routes are costed with (the store, the exchange, each rank's node). :func:`plan_load` runs
identically on every rank (the needs and node ids are all-gathered first) and returns a :class:`LoadPlan`:

1. Every saved piece and every target becomes *stored boxes* (a flat range is a few boxes), so all
   meetings are box ∩ box. For each tensor the saved boxes are indexed (:class:`~.box_index.BoxIndex`)
   and each target visits only those that meet it along its most selective dimension, so a rank's
   targets cost the pieces they touch, not every piece of the tensor.
2. Each saved box is cut into row slabs of about ``chunk_bytes``; a slab is contiguous in its file.
   Within a slab :func:`~.routes.choose_route` picks a route from what each costs:
   ``direct`` — every rank reads its own parts (one unit per rank and part, no exchange), or
   ``exchange`` — the union of the needs becomes *read units* (one box read into one packed buffer
   when the needs tile it or overlap, else one per need), each read once.
3. Units are ordered by file and offset. An exchanged unit has one reader: the rank that needs most
   of it, ties to the least-loaded rank — or to the reader of the unit it continues in its file (up to
   :data:`COALESCE_GAP_BYTES` of padding between them) while
   that rank is at most ``chunk_bytes`` ahead, so a reader's units lie back to back and the loader can
   fetch them in one request (:mod:`tierckpt.io.coalesce`). Its :class:`Delivery` parts for the
   others are sent by an all-to-all. Exchanged bytes are read exactly once (read amplification 1.00 whenever the needs tile each slab); direct units read a byte
   once per rank that needs it, which the cost model allows only where the repeats are cheap (the
   same node's page cache).
4. Units are grouped into rounds so that no rank holds more than about ``round_bytes`` of read,
   sent and received buffers at once; memory stays bounded whatever the checkpoint's size.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import CheckpointError, CorruptCheckpointError
from ..metadata import PieceMeta, TensorMeta, itemsize
from ..regions import Box, Region, StoredBox, box_runs, stored_boxes
from .box_index import BoxIndex
from .routes import DIRECT, EXCHANGE, RankRead, Route, Topology, choose_route, default_topology


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

    @property
    def route(self) -> Route:
        """``exchange`` when some of its elements go to another rank, else ``direct``."""
        return EXCHANGE if any(d.rank != self.reader for d in self.deliveries) else DIRECT


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

    def bytes_by_route(self) -> dict[Route, int]:
        """Bytes read by the units of each route."""
        out: dict[Route, int] = {DIRECT: 0, EXCHANGE: 0}
        for u in self.units:
            out[u.route] += u.nbytes
        return out


def plan_load(
    tensors: dict[str, TensorMeta],
    pieces: dict[str, list[PieceMeta]],
    needs: Sequence[Sequence[TargetPiece]],
    *,
    chunk_bytes: int,
    round_bytes: int,
    topology: Topology | None = None,
) -> LoadPlan:
    """Plan a load for a group whose rank ``r`` needs ``needs[r]``. Pure and deterministic.

    ``chunk_bytes`` and ``round_bytes`` (steps 2 and 4 above) have no default here: the entry point
    passes its own (:data:`tierckpt.loader.DEFAULT_CHUNK_BYTES`, :data:`tierckpt.loader.DEFAULT_ROUND_BYTES`).

    ``topology``: the costs the route of each slab is chosen by (see :mod:`.routes`); default
    :func:`~.routes.default_topology`, which reads each byte once per group.
    """
    world = len(needs)
    topo = topology if topology is not None else default_topology(world)
    if len(topo.nodes) != world:
        raise CheckpointError(
            f"the load topology names the nodes of {len(topo.nodes)} ranks but {world} ranks load: "
            "give one node id per rank of the loading group"
        )
    targets: dict[str, list[tuple[int, int, StoredBox]]] = defaultdict(list)
    for rank, rank_needs in enumerate(needs):
        for index, need in enumerate(rank_needs):
            shape = tensors[need.fqn].shape
            for sb in stored_boxes(need.region, shape):
                targets[need.fqn].append((rank, index, sb))

    drafts: list[dict] = []
    for fqn in sorted(targets):
        meta = tensors[fqn]
        _plan_tensor(meta, pieces.get(fqn, []), targets[fqn], chunk_bytes, topo, drafts)
    # In file order, so that one reader's units lie back to back and a round reads files sequentially.
    drafts.sort(key=lambda d: (d["file"], int(d["run_offsets"][0]) if len(d["run_offsets"]) else 0))
    _choose_readers(drafts, world, chunk_bytes)

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
    topo: Topology,
    drafts: list[dict],
) -> None:
    item = itemsize(meta.torch_dtype)
    saved: list[tuple[Box, str, int]] = []
    for p in pieces:
        for sb in stored_boxes(p.region, meta.shape):
            saved.append((sb.box, p.file, p.byte_offset + sb.element_offset * item))
    if meta.shape:
        saved.sort(key=lambda s: s[0].offsets[0])
    lookup = BoxIndex([s[0] for s in saved])

    needs_of: dict[int, list[tuple[int, int, StoredBox, Box]]] = defaultdict(list)
    for rank, index, target in wanted:
        covered = 0
        for si, inter in lookup.overlapping(target.box):
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
        if len(needs) == 1 and needs[0][3] == box and box.numel * item <= chunk_bytes:
            drafts.append(_whole_box_unit(meta, box, file, base, needs[0], item))
        else:
            drafts.extend(_box_units(meta, box, file, base, needs, item, chunk_bytes, topo))


def _whole_box_unit(meta: TensorMeta, box: Box, file: str, base: int, need: tuple[int, int, StoredBox, Box],
                    item: int) -> dict:
    """The draft of a saved box (at most ``chunk_bytes``) that one target takes whole: what
    :func:`_box_units` gives for it — one slab, one run, read by the rank that needs it — without cutting
    slabs and costing routes for each of a model's hundreds of small tensors (an unchanged layout)."""
    rank, index, target, _ = need
    return dict(
        fqn=meta.fqn, dtype=meta.dtype, box=box, file=file,
        run_offsets=np.array([base], dtype=np.int64), run_bytes=box.numel * item,
        reader=-1, deliveries=(Delivery(rank=rank, target=index, target_box=target, box=box),), item=item,
    )


def _box_units(meta: TensorMeta, box: Box, file: str, base: int, needs: list[tuple[int, int, StoredBox, Box]],
               item: int, chunk_bytes: int, topo: Topology) -> list[dict]:
    """The drafts of the units that read what ``needs`` take of saved box ``box`` (at byte ``base`` of ``file``)."""
    drafts = []
    for slab in _slabs(box, _bounding([n[3] for n in needs]), item, chunk_bytes):
        parts = [(r, i, t, b) for r, i, t, inter in needs if (b := inter.intersect(slab)) is not None]
        if not parts:  # a slab between disjoint needs (e.g. rows 0 and 2 of a piece): nothing to read
            continue
        for unit_box, deliveries in _slab_units(parts, box, item, topo):
            starts_el, run = box_runs(unit_box, box)
            drafts.append(
                dict(
                    fqn=meta.fqn, dtype=meta.dtype, box=unit_box, file=file,
                    run_offsets=base + starts_el * item, run_bytes=run * item,
                    reader=-1, deliveries=deliveries, item=item,
                )
            )
    return drafts


def _slab_units(
    parts: list[tuple[int, int, StoredBox, Box]], saved: Box, item: int, topo: Topology,
) -> list[tuple[Box, tuple[Delivery, ...]]]:
    """The units of one slab of ``saved`` and their deliveries, by the route the cost model picks.

    ``parts``: ``(rank, target, target box, needed box)``. Direct: one unit per rank and distinct
    needed box, delivered to that rank only. Exchange: the boxes of :func:`_union_boxes`, each
    delivering every part that meets it.
    """
    union = _union_boxes([p[3] for p in parts])
    # Each rank's distinct needed boxes and the parts they deliver, in one pass (not ranks x parts).
    own: dict[tuple[int, Box], list[Delivery]] = {}
    for r, i, t, b in parts:
        own.setdefault((r, b), []).append(Delivery(rank=r, target=i, target_box=t, box=b))
    reads: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    for rank, b in own:
        numel, requests, span = _walk(b, saved)
        totals = reads[rank]
        totals[0] += numel * item
        totals[1] += requests
        totals[2] += span * item
    walks = [_walk(b, saved) for b in union]
    route = choose_route(
        [RankRead(rank, n, q, w) for rank, (n, q, w) in sorted(reads.items())],
        sum(w[0] for w in walks) * item, sum(w[1] for w in walks), topo, sum(w[2] - w[0] for w in walks) * item,
    )
    if route == DIRECT:
        return [(b, tuple(deliveries)) for (_, b), deliveries in own.items()]
    if len(union) == 1:  # the needs tile or overlap: every part meets the one union box
        ub = union[0]
        return [(ub, tuple(Delivery(rank=r, target=i, target_box=t, box=pb) for r, i, t, pb in parts))]
    return [
        (ub, tuple(Delivery(rank=r, target=i, target_box=t, box=b) for r, i, t, pb in parts if (b := pb.intersect(ub)) is not None))
        for ub in union
    ]


def _walk(box: Box, saved: Box) -> tuple[int, int, int]:
    """What reading ``box`` out of ``saved``'s row-major storage takes, in one pass without allocating
    (it runs for every rank and slab): its elements, its read requests (contiguous runs: one per index
    of the dimensions before the first one, from the last, that it does not span fully) and its span
    (elements from its first to its last, both included: what a read of its runs passes over)."""
    lengths, offsets = box.lengths, box.offsets
    numel = math.prod(lengths)
    if not numel:
        return 0, 0, 0
    outer, base = saved.lengths, saved.offsets
    split = len(lengths) - 1
    while split > 0 and lengths[split] == outer[split] and offsets[split] == base[split]:
        split -= 1
    stride, first, last = 1, 0, 0
    for d in reversed(range(len(lengths))):
        first += (offsets[d] - base[d]) * stride
        last += (offsets[d] + lengths[d] - 1 - base[d]) * stride
        stride *= outer[d]
    return numel, math.prod(lengths[:split]) if lengths else 1, last - first + 1


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


def _union_boxes(needed: list[Box]) -> list[Box]:
    """What the exchange route reads of one slab: the needs' bounding box when they tile it or
    overlap (read once, parts exchanged); needs that are disjoint but do not tile it are read
    separately, so no byte outside them is read."""
    distinct = list(dict.fromkeys(needed))
    if len(distinct) == 1:
        return distinct
    bound = _bounding(distinct)
    if sum(b.numel for b in distinct) != bound.numel:
        disjoint = _disjoint(distinct)
        return distinct if disjoint else [bound]
    return [bound]  # disjoint boxes summing to their bound tile it; overlapping ones are read once all the same


def _disjoint(boxes: list[Box]) -> bool:
    """Whether no two of ``boxes`` share an element. Boxes that differ in one dimension only (a slab's
    column windows, row blocks) are a sort along it; others are compared pairwise."""
    ndim = boxes[0].ndim
    differing = [d for d in range(ndim) if len({(b.offsets[d], b.lengths[d]) for b in boxes}) > 1]
    if len(differing) <= 1:
        d = differing[0] if differing else 0
        spans = sorted((b.offsets[d], b.offsets[d] + b.lengths[d]) for b in boxes)
        return all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))
    return all(boxes[i].intersect(boxes[j]) is None for i in range(len(boxes)) for j in range(i + 1, len(boxes)))


COALESCE_GAP_BYTES = 64
"""The gap bound: a reader's units of one file at most this many bytes apart — the padding that aligns
saved pieces (64 bytes by default) — may be fetched in one request, where no other read covers the
gap: a few bytes cost an object store's link nanoseconds, a request milliseconds. Wider gaps (a torch
DCP file's record headers, pieces nobody loads) are not read through."""
READER_SHARE = 0.75
"""A rank that needs at least this share of what the top needer needs of a unit may read it."""


def _choose_readers(drafts: list[dict], world: int, chunk_bytes: int) -> None:
    """Set each draft's reader, in file order: the least-loaded rank among those that need (nearly)
    the most of it — unless the unit continues in its file, within :data:`COALESCE_GAP_BYTES`, one
    that an eligible rank reads and that rank is at most ``chunk_bytes`` ahead of the least loaded. One reader's adjacent
    units then become one request on stores that charge per request, at a bounded imbalance."""
    load = [0] * world
    previous: tuple[str, int, int] | None = None
    """File, end offset and reader of the last single-run unit."""
    for draft in drafts:
        wanted: dict[int, int] = defaultdict(int)
        for d in draft["deliveries"]:
            wanted[d.rank] += d.numel
        most = max(wanted.values())
        eligible = [r for r, n in wanted.items() if n >= READER_SHARE * most]
        reader = min(eligible, key=lambda r: (load[r], r))
        offsets = draft["run_offsets"]
        if (previous is not None and len(offsets) == 1 and draft["file"] == previous[0]
                and 0 <= int(offsets[0]) - previous[1] <= COALESCE_GAP_BYTES):
            if previous[2] in eligible and load[previous[2]] - load[reader] <= chunk_bytes:
                reader = previous[2]
        draft["reader"] = reader
        load[reader] += draft["box"].numel * draft["item"]
        previous = (draft["file"], int(offsets[0]) + draft["run_bytes"], reader) if len(offsets) == 1 else None


def whole_to_other(reader: int, box: Box, deliveries: Sequence[Delivery]) -> bool:
    """Whether a unit goes, as read, whole to one rank other than its reader: the read step then reads it
    straight into its place in the round's send buffer, so the reader holds its bytes once, not twice."""
    return len(deliveries) == 1 and deliveries[0].rank != reader and deliveries[0].box == box


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
        if not whole_to_other(reader, draft["box"], draft["deliveries"]):  # else read into the send buffer
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
