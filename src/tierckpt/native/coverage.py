"""Exact coverage of each tensor by its pieces, checked on every load: every element in exactly one piece.

A checkpoint's metadata is untrusted input. A table (native, or a foreign format's) that lists the same
half of a tensor twice has element counts that add up to the whole, 50 + 50 = 100, while the other half
is in no piece: a load that trusted the sum would return with that half never written. Pieces that are
pairwise disjoint and whose element counts add up to the tensor's cover it exactly (their union is the
tensor), so a load checks both, per tensor, before it plans a read:

* overlapping pieces raise :class:`~tierckpt.errors.CorruptCheckpointError` naming the tensor and both
  pieces' ranges;
* elements no piece holds raise it too, naming the tensor and how many are missing.

A save checks the same of the regions its ranks offer (:func:`check_offered_coverage`, on the
save's plan, before anything is written): a tensor the ranks hold only in part
(a shard no rank listed, a global shape larger than what the shards make up) is refused with a
:class:`~tierckpt.errors.StateMismatchError`, instead of a committed checkpoint that no load accepts.

The cost stays in the noise of a load: a tensor saved whole (one piece holding all of it) is one
comparison; flat ranges (ZeRO buffers) are sorted by start; boxes are swept along the dimension that
splits them most, so row- or column-sharded tensors compare each piece with its neighbours only.
``tierckpt verify`` reports the same overlaps one by one (:mod:`tierckpt.formats.verify`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

from tierckpt.errors import CorruptCheckpointError, StateMismatchError
from tierckpt.native.metadata import PieceMeta, TensorMeta
from tierckpt.native.regions import Box, FlatRange, Region, stored_boxes


def check_exact_coverage(tensors: Mapping[str, TensorMeta], pieces: Mapping[str, Sequence[PieceMeta]], uri: str) -> None:
    """Raise :class:`~tierckpt.errors.CorruptCheckpointError` unless the pieces of each tensor in ``pieces``
    hold each of its elements exactly once."""
    for fqn, listed in pieces.items():
        shape = tensors[fqn].shape
        if len(listed) == 1:
            # A tensor saved whole, one box holding all of it: the common case, tested inline (on every load,
            # once per tensor: a call per tensor was a third of the check on 100,000 small tensors).
            region = listed[0].region
            if type(region) is Box and region.lengths == shape and not any(region.offsets) or _whole(region, shape):
                continue
        _check_tensor(fqn, shape, listed, uri)


def check_offered_coverage(tensors: Mapping[str, TensorMeta], regions: Mapping[str, Sequence[Region]]) -> None:
    """Raise :class:`~tierckpt.errors.StateMismatchError` unless the regions a save writes of each tensor in
    ``tensors`` (each replica once) hold each of its elements exactly once: what :func:`check_exact_coverage`
    requires of the checkpoint."""
    for fqn, tensor in tensors.items():
        offered = regions.get(fqn, ())
        shape = tensor.shape
        if len(offered) == 1 and _whole(offered[0], shape):
            continue
        overlap, missing = coverage_fault(shape, offered)
        if overlap is not None:
            a, b = (offered[i] for i in overlap)
            raise StateMismatchError(
                f"tensor {fqn!r} of shape {list(shape)}: two ranks hold different pieces with the same elements, "
                f"{describe(a)} and {describe(b)}; every element must be in one piece (a replica is the same "
                "region on each rank)"
            )
        if missing:
            total = math.prod(shape)
            raise StateMismatchError(
                f"tensor {fqn!r} of shape {list(shape)}: the ranks' {len(offered)} piece(s) hold {total - missing} of "
                f"its {total} elements, {missing} are on no rank; every rank holding a shard must list it, and "
                "the global shape must be what the shards make up (a tensor saved under one name per layer "
                "has the shape of one layer)"
            )


def _whole(region: Region, shape: tuple[int, ...]) -> bool:
    """Whether ``region`` is the whole of a tensor of ``shape``."""
    if isinstance(region, FlatRange):
        return region.start == 0 and region.stop == math.prod(shape)
    return region.lengths == shape and not any(region.offsets)


def _check_tensor(fqn: str, shape: tuple[int, ...], pieces: Sequence[PieceMeta], uri: str) -> None:
    overlap, missing = coverage_fault(shape, [p.region for p in pieces])
    if overlap is not None:
        a, b = (pieces[i] for i in overlap)
        raise CorruptCheckpointError(
            f"checkpoint {uri!r} is corrupt: two pieces of tensor {fqn!r} hold the same elements, "
            f"{describe(a.region)} (in {a.file!r}) and {describe(b.region)} (in {b.file!r}); "
            "its metadata was rewritten or damaged (`tierckpt verify` lists every such piece)"
        )
    if missing:
        total = math.prod(shape)
        raise CorruptCheckpointError(
            f"checkpoint {uri!r} is corrupt: the {len(pieces)} piece(s) of tensor {fqn!r} hold {total - missing} of "
            f"its {total} elements; {missing} are in no piece (`tierckpt verify` lists what is missing)"
        )


def coverage_fault(shape: tuple[int, ...], regions: Sequence[Region]) -> tuple[tuple[int, int] | None, int]:
    """What keeps ``regions`` from holding each element of a tensor of ``shape`` exactly once: the positions
    of two regions that share an element (or ``None``) and, when none do, how many elements no region holds
    (disjoint regions whose counts add up to the tensor's cover it). ``(None, 0)``: exact coverage. The save's
    check and the load's phrase the same fault each in their own words."""
    overlap = _first_overlap(shape, regions)
    if overlap is not None:
        return overlap, 0
    return None, math.prod(shape) - sum(r.numel for r in regions)


def _first_overlap(shape: tuple[int, ...], regions: Sequence[Region]) -> tuple[int, int] | None:
    """The positions of two regions that share an element, or ``None``."""
    if all(isinstance(r, FlatRange) for r in regions):
        ordered = sorted((i for i, r in enumerate(regions) if r.numel), key=lambda i: regions[i].start)  # type: ignore[union-attr]
        for before, after in zip(ordered, ordered[1:]):
            if regions[after].start < regions[before].stop:  # type: ignore[union-attr]
                return before, after
        return None
    boxes = [(stored.box, i) for i, region in enumerate(regions) for stored in stored_boxes(region, shape)]
    for i, j in overlapping_boxes([box for box, _ in boxes]):
        if boxes[i][1] != boxes[j][1]:
            return boxes[i][1], boxes[j][1]
    return None


def overlapping_boxes(boxes: Sequence[Box]) -> Iterator[tuple[int, int]]:
    """Index pairs ``(i, j)`` of boxes that share an element: a sweep along the dimension where the boxes
    start at the most distinct offsets (each box meets only those still open at its start there)."""
    if not boxes:
        return
    ndim = boxes[0].ndim
    if ndim == 0:  # every box of a 0-d tensor is the whole of it
        yield from ((0, i) for i in range(1, len(boxes)))
        return
    dim = max(range(ndim), key=lambda d: len({b.offsets[d] for b in boxes}))
    order = sorted(range(len(boxes)), key=lambda i: boxes[i].offsets[dim])
    open_boxes: list[int] = []
    for i in order:
        start = boxes[i].offsets[dim]
        open_boxes = [j for j in open_boxes if boxes[j].offsets[dim] + boxes[j].lengths[dim] > start]
        for j in open_boxes:
            if boxes[i].intersect(boxes[j]) is not None:
                yield j, i
        open_boxes.append(i)


def describe(region: Region) -> str:
    """A piece's range as an index expression: ``[0:32, 0:64]`` for a box, ``flat [0:50]`` for a flat range."""
    if isinstance(region, FlatRange):
        return f"flat [{region.start}:{region.stop}]"
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(region.offsets, region.lengths)) + "]"
