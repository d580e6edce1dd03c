"""An index of a tensor's saved boxes: which of them share an element with a query box.

The load planner meets every target box of every rank with the saved boxes of its tensor. Testing
each pair costs the product of their numbers (N^2 at N ranks) although a target usually meets a few
saved boxes: a column shard meets one of N column shards, a row window a few flat-range boxes.

Per dimension the index keeps the boxes' extents twice sorted (by start and by end), so the number
of boxes that overlap a query along that dimension is two bisections; a query enumerates the boxes
of its most selective dimension only. Enumeration goes through *length classes* (extents of
``[2^k, 2^(k+1))`` elements, each sorted by start): a box of class ``k`` that overlaps ``[a, b)``
starts in ``(a - 2^(k+1), b)``, and the ones of that window that end before ``a`` start within
``2^k`` of each other — a few per class where boxes do not pile up along the dimension. So a query
costs ``O(ndim log P + boxes overlapping in the chosen dimension)``, not ``O(P)``. Pure, no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from tierckpt.native.regions import Box


class _Axis:
    """The extents of every box along one dimension."""

    __slots__ = ("starts", "ends", "classes")

    def __init__(self, extents: Sequence[tuple[int, int]]) -> None:
        self.starts = sorted(lo for lo, _ in extents)
        self.ends = sorted(hi for _, hi in extents)
        by_class: dict[int, list[tuple[int, int]]] = {}
        for i, (lo, hi) in enumerate(extents):
            by_class.setdefault((hi - lo).bit_length(), []).append((lo, i))
        self.classes = []
        """``(widest extent of the class, starts sorted, box indices in that order)`` per length class."""
        for k, members in sorted(by_class.items()):
            members.sort()
            self.classes.append(((1 << k) - 1, [lo for lo, _ in members], [i for _, i in members]))

    def count(self, lo: int, hi: int) -> int:
        """Boxes whose extent meets ``[lo, hi)`` (``lo < hi``): those starting before ``hi`` less those
        ending at or before ``lo`` (which all start before ``hi`` too)."""
        return bisect.bisect_left(self.starts, hi) - bisect.bisect_right(self.ends, lo)

    def candidates(self, lo: int, hi: int) -> list[int]:
        """Indices of the boxes that may meet ``[lo, hi)`` along this dimension: every one that does,
        and a few per length class that end just before ``lo``."""
        out: list[int] = []
        for widest, starts, indices in self.classes:
            first = bisect.bisect_right(starts, lo - widest)
            last = bisect.bisect_left(starts, hi)
            out.extend(indices[first:last])
        return out


SCAN_BELOW = 8
"""Fewer boxes than this are scanned, not indexed: sorting them costs more than testing each (a tensor
saved whole, or by a few ranks)."""

SCAN_QUERIES = 16
"""An index told its number of queries scans when they are fewer than this. A scan first compares each box's
extents along its first and last dimensions with the query's (four comparisons, about 60 ns; the whole test in
2-D), intersecting only the boxes that pass; building the index costs about a microsecond more per box than
listing those extents, and each query a few microseconds: below 16 queries the scan costs less whatever the
number of boxes (a rank's one target meets its layout's saved boxes; the few saved boxes it touches meet every
rank's targets)."""


class BoxIndex:
    """The saved boxes of one tensor (all of one number of dimensions), queried by :meth:`overlapping`.

    ``queries``: how many queries it will answer, if known (:data:`SCAN_QUERIES`)."""

    __slots__ = ("boxes", "axes", "bounds")

    def __init__(self, boxes: Sequence[Box], queries: int | None = None) -> None:
        self.boxes = list(boxes)
        scan = len(self.boxes) < SCAN_BELOW or (queries is not None and queries < SCAN_QUERIES)
        ndim = self.boxes[0].ndim if self.boxes else 0
        self.axes = [
            _Axis([(b.offsets[d], b.offsets[d] + b.lengths[d]) for b in self.boxes]) for d in range(0 if scan else ndim)
        ]
        self.bounds: list[tuple[int, int, int, int]] | None = None
        """Scanned: each box's extent along its first and last dimensions, compared before any intersection
        (four comparisons where a miss by :meth:`Box.intersect` costs half a microsecond; the whole test in 2-D)."""
        if scan and ndim:
            self.bounds = [(b.offsets[0], b.offsets[0] + b.lengths[0], b.offsets[-1], b.offsets[-1] + b.lengths[-1])
                           for b in self.boxes]

    def overlapping(self, box: Box) -> list[tuple[int, Box]]:
        """``(index, intersection)`` of every indexed box that shares an element with ``box``, by index."""
        if not self.axes:  # few boxes or queries, or a 0-d tensor's one: test each
            if self.bounds is None:
                return [(i, inter) for i, b in enumerate(self.boxes) if (inter := b.intersect(box)) is not None]
            lo, n = box.offsets, box.lengths
            a, c = lo[0], lo[-1]
            b, d = a + n[0], c + n[-1]
            boxes = self.boxes
            return [(i, inter) for i, (a0, b0, c0, d0) in enumerate(self.bounds)
                    if a0 < b and a < b0 and c0 < d and c < d0 and (inter := boxes[i].intersect(box)) is not None]
        if box.numel == 0:
            return []
        ends = box.ends
        meeting, best = min((axis.count(box.offsets[d], ends[d]), d) for d, axis in enumerate(self.axes))
        if not meeting:
            return []
        candidates = sorted(self.axes[best].candidates(box.offsets[best], ends[best]))
        return [(i, inter) for i in candidates if (inter := self.boxes[i].intersect(box)) is not None]
