"""The read units of one tensor: its saved boxes met by the targets, cut into row slabs, each slab's
route chosen by :func:`~.routes.choose_route` (step 2 of :mod:`.load_planner`). Units come out as
*drafts* (dicts) whose reader is chosen afterwards (:mod:`.load_order`)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from tierckpt.errors import CorruptCheckpointError
from tierckpt.native.metadata import PieceMeta, TensorMeta, itemsize
from tierckpt.native.regions import Box, StoredBox, box_runs, stored_boxes
from tierckpt.planner.box_index import BoxIndex
from tierckpt.planner.plan_types import Delivery
from tierckpt.planner.routes import DIRECT, NODE, RankRead, Topology, choose_route


Need = tuple[int, int, StoredBox, Box]
"""``(rank, target number, target's stored box, the part of a saved box it needs)``."""
Saved = tuple[Box, str, int]
"""A saved box, its file and the byte offset of its first element there."""


def saved_boxes(meta: TensorMeta, pieces: list[PieceMeta], near: list[tuple[int, int]] | None = None,
                files: frozenset[str] = frozenset()) -> tuple[list[Saved], list[int]]:
    """The saved boxes of a tensor in the planner's order (by first row) and the number (in ``pieces``) of
    the piece each lies in: a tensor whose pieces have the same regions has the same boxes in the same
    order, each at its own piece's file and offset (:mod:`.rank_plan` plans such tensors once).

    ``near``: the flat spans (:func:`flat_span`) of the only targets that will query the boxes (one rank's):
    a flat-range piece whose range meets none of them, and in none of ``files``, is left out unsplit (none
    of its boxes meets them; splitting every rank's flat range was a rank's plan's largest cost that grows
    with the ranks). Leaving pieces out keeps the others' order."""
    item = itemsize(meta.torch_dtype)
    placed: list[tuple[Saved, int]] = []
    for pi, p in enumerate(pieces):
        region = p.region
        if type(region) is Box:  # its one stored box, at the piece's first byte (no StoredBox built)
            if region.numel:
                placed.append(((region, p.file, p.byte_offset), pi))
            continue
        if near is not None and p.file not in files and not any(
                first < region.stop and region.start < end for first, end in near):
            continue
        for sb in stored_boxes(region, meta.shape):
            placed.append(((sb.box, p.file, p.byte_offset + sb.element_offset * item), pi))
    if meta.shape:
        placed.sort(key=lambda s: s[0][0].offsets[0])
    saved = [s for s, _ in placed]
    return saved, [pi for _, pi in placed]


def flat_span(box: Box, shape: tuple[int, ...]) -> tuple[int, int]:
    """``[first, end)``: the flat indices (row-major, in a tensor of ``shape``) from ``box``'s first element
    to one past its last; a box with no element is not asked."""
    first = last = 0
    stride = 1
    for d in reversed(range(len(shape))):
        first += box.offsets[d] * stride
        last += (box.offsets[d] + box.lengths[d] - 1) * stride
        stride *= shape[d]
    return first, last + 1


def check_covered(meta: TensorMeta, rank: int, target: StoredBox, covered: int) -> None:
    """Raise when the saved boxes cover only ``covered`` elements of a target box."""
    if covered != target.box.numel:
        raise CorruptCheckpointError(
            f"the checkpoint's pieces of {meta.fqn!r} cover {covered} of the {target.box.numel} elements "
            f"rank {rank} needs in box {target.box}; the checkpoint is incomplete or its pieces overlap"
        )


def saved_box_units(meta: TensorMeta, saved: Saved, needs: list[Need], chunk_bytes: int, topo: Topology,
                    only: int | None = None) -> list[dict]:
    """The drafts of the units that read what ``needs`` (in the group's rank order) take of one saved box.

    ``only``: the rank planning for itself (:mod:`.rank_plan`): a unit another rank reads for itself
    alone (direct) keeps its box, reader and deliveries but not its runs (``run_offsets`` ``None``)."""
    item = itemsize(meta.torch_dtype)
    box, file, base = saved
    if len(needs) == 1 and needs[0][3] == box and box.numel * item <= chunk_bytes:
        return [whole_box_unit(meta, box, file, base, needs[0], item)]
    return box_units(meta, box, file, base, needs, item, chunk_bytes, topo, only)


def plan_tensor(
    meta: TensorMeta,
    pieces: list[PieceMeta],
    wanted: list[tuple[int, int, StoredBox]],
    chunk_bytes: int,
    topo: Topology,
    drafts: list[dict],
) -> None:
    """Append to ``drafts`` the units of every saved box of ``meta`` that the group's targets ``wanted`` meet."""
    saved, _ = saved_boxes(meta, pieces)
    lookup = BoxIndex([s[0] for s in saved])
    needs_of: dict[int, list[Need]] = defaultdict(list)
    for rank, index, target in wanted:
        covered = 0
        for si, inter in lookup.overlapping(target.box):
            needs_of[si].append((rank, index, target, inter))
            covered += inter.numel
        check_covered(meta, rank, target, covered)
    for si in sorted(needs_of):
        drafts.extend(saved_box_units(meta, saved[si], needs_of[si], chunk_bytes, topo))


def whole_box_unit(meta: TensorMeta, box: Box, file: str, base: int, need: tuple[int, int, StoredBox, Box],
                    item: int) -> dict:
    """The draft of a saved box (at most ``chunk_bytes``) that one target takes whole: what
    :func:`box_units` gives for it — one slab, one run, read by the rank that needs it — without cutting
    slabs and costing routes for each of a model's hundreds of small tensors (an unchanged layout)."""
    rank, index, target, _ = need
    return dict(
        fqn=meta.fqn, dtype=meta.dtype, box=box, file=file,
        run_offsets=np.array([base], dtype=np.int64), run_bytes=box.numel * item,
        reader=-1, deliveries=(Delivery(rank=rank, target=index, target_box=target, box=box),), item=item,
    )


def box_units(meta: TensorMeta, box: Box, file: str, base: int, needs: list[tuple[int, int, StoredBox, Box]],
               item: int, chunk_bytes: int, topo: Topology, only: int | None = None) -> list[dict]:
    """The drafts of the units that read what ``needs`` take of saved box ``box`` (at byte ``base`` of
    ``file``); ``only``: see :func:`saved_box_units`."""
    drafts = []
    for slab in _slabs(box, _bounding([n[3] for n in needs]), item, chunk_bytes):
        parts = [(r, i, t, b) for r, i, t, inter in needs if (b := inter.intersect(slab)) is not None]
        if not parts:  # a slab between disjoint needs (e.g. rows 0 and 2 of a piece): nothing to read
            continue
        for unit_box, deliveries in slab_units(parts, box, item, topo):
            alone = deliveries[0].rank
            if only is not None and alone != only and all(d.rank == alone for d in deliveries):
                drafts.append(dict(fqn=meta.fqn, dtype=meta.dtype, box=unit_box, file=file, run_offsets=None,
                                   run_bytes=0, reader=alone, deliveries=deliveries, item=item))
                continue
            starts_el, run = box_runs(unit_box, box)
            drafts.append(
                dict(
                    fqn=meta.fqn, dtype=meta.dtype, box=unit_box, file=file,
                    run_offsets=base + starts_el * item, run_bytes=run * item,
                    reader=-1, deliveries=deliveries, item=item,
                )
            )
    return drafts


def slab_units(
    parts: list[tuple[int, int, StoredBox, Box]], saved: Box, item: int, topo: Topology,
) -> list[tuple[Box, tuple[Delivery, ...]]]:
    """The units of one slab of ``saved`` and their deliveries, by the route the cost model picks.

    ``parts``: ``(rank, target, target box, needed box)``. Direct: one unit per rank and distinct
    needed box, delivered to that rank only. Exchange: the boxes of :func:`_union_boxes`, each
    delivering every part that meets it. Node: the exchange's units of each node's parts, delivering to
    that node's ranks only (one set per node, in the order of the nodes' first ranks).
    """
    union = _union_boxes([p[3] for p in parts])
    # Each rank's distinct needed boxes and the parts they deliver, in one pass (not ranks x parts).
    own: dict[tuple[int, Box], list[Delivery]] = {}
    for r, i, t, b in parts:
        own.setdefault((r, b), []).append(Delivery(rank=r, target=i, target_box=t, box=b))
    reads: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    for rank, b in own:
        numel, requests, span = walk(b, saved)
        totals = reads[rank]
        totals[0] += numel * item
        totals[1] += requests
        totals[2] += span * item
    walks = [walk(b, saved) for b in union]
    route = choose_route(
        [RankRead(rank, n, q, w) for rank, (n, q, w) in sorted(reads.items())],
        sum(w[0] for w in walks) * item, sum(w[1] for w in walks), topo, sum(w[2] - w[0] for w in walks) * item,
    )
    if route == DIRECT:
        return [(b, tuple(deliveries)) for (_, b), deliveries in own.items()]
    if route == NODE:
        by_node: dict[str, list[tuple[int, int, StoredBox, Box]]] = {}
        for part in parts:
            by_node.setdefault(topo.nodes[part[0]], []).append(part)
        return [unit for node_parts in by_node.values()
                for unit in _shared_units(node_parts, _union_boxes([p[3] for p in node_parts]))]
    return _shared_units(parts, union)


def _shared_units(parts: list[tuple[int, int, StoredBox, Box]], union: list[Box]) -> list[tuple[Box, tuple[Delivery, ...]]]:
    """The units reading ``union`` (:func:`_union_boxes` of ``parts``' needed boxes), each delivering every
    part that meets it."""
    if len(union) == 1:  # the needs tile or overlap: every part meets the one union box
        ub = union[0]
        return [(ub, tuple(Delivery(rank=r, target=i, target_box=t, box=pb) for r, i, t, pb in parts))]
    return [
        (ub, tuple(Delivery(rank=r, target=i, target_box=t, box=b) for r, i, t, pb in parts if (b := pb.intersect(ub)) is not None))
        for ub in union
    ]


def walk(box: Box, saved: Box) -> tuple[int, int, int]:
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
