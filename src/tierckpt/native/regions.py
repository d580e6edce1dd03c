"""Regions of a tensor: which elements of a global tensor a piece holds.

Two kinds cover every framework:

* :class:`Box` — offsets and lengths per dimension (DTensor ``Shard``, TP, PP, uneven shards).
* :class:`FlatRange` — ``[start, stop)`` of the row-major flattening of the global tensor (FSDP1 /
  ZeRO flat buffers that cut tensors at arbitrary elements).

Everything else reduces to boxes: a flat range is a short ordered list of boxes
(:func:`flat_range_boxes`), each contiguous in the flattening and in the piece's storage. So any
(saved piece, target piece) pair meets as box ∩ box, and copies are strided tensor views — never loops
over elements. All functions here are pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Box:
    """An N-d box of a global tensor: ``offsets[d] <= i_d < offsets[d] + lengths[d]``."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.lengths)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def intersect(self, other: Box) -> Box | None:
        """The common box, or ``None`` when the two share no element (comparisons, not ``max``/``min`` calls:
        a rank's plan tests every target of a layout against the saved boxes it touches)."""
        offsets = []
        lengths = []
        for a0, an, b0, bn in zip(self.offsets, self.lengths, other.offsets, other.lengths):
            lo = a0 if a0 > b0 else b0
            hi = a0 + an
            end = b0 + bn
            if end < hi:
                hi = end
            if hi <= lo:
                return None
            offsets.append(lo)
            lengths.append(hi - lo)
        return Box(tuple(offsets), tuple(lengths))

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.lengths)

    def slices(self) -> tuple[slice, ...]:
        """Index expression selecting this box from a tensor whose origin is the global origin."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths))

    def contains(self, other: Box) -> bool:
        return all(
            a0 <= b0 and b0 + bn <= a0 + an
            for a0, an, b0, bn in zip(self.offsets, self.lengths, other.offsets, other.lengths)
        )

    @staticmethod
    def full(shape: tuple[int, ...]) -> Box:
        return Box((0,) * len(shape), tuple(shape))


@dataclass(frozen=True, slots=True)
class FlatRange:
    """Elements ``[start, stop)`` of the row-major flattening of the global tensor."""

    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


Region = Box | FlatRange


def region_numel(region: Region) -> int:
    return region.numel


@dataclass(frozen=True, slots=True)
class StoredBox:
    """A box whose elements sit contiguously, row-major, at ``element_offset`` of a piece's storage."""

    box: Box
    element_offset: int


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[StoredBox]:
    """Split a flat range of a tensor of ``shape`` into boxes, in flattening order.

    Each box fixes a prefix of indices, spans a range of one dimension and the full extent of all
    later dimensions, so its row-major elements are consecutive in the flattening; ``element_offset``
    is its position relative to ``start``. At most ``2 * ndim - 1`` boxes.
    """
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of {total} elements")
    if start == stop:
        return []
    if len(shape) == 0:
        return [StoredBox(Box((), ()), 0)]
    out: list[StoredBox] = []

    def split(dim: int, prefix: tuple[int, ...], lo: int, hi: int) -> None:
        inner = math.prod(shape[dim + 1 :])
        rest = tuple(shape[dim + 1 :])
        pad = len(shape) - dim - 1
        ones = (1,) * len(prefix)
        if lo % inner == 0 and hi % inner == 0:
            box = Box(prefix + (lo // inner,) + (0,) * pad, ones + (hi // inner - lo // inner,) + rest)
            out.append(StoredBox(box, 0))
            return
        first, last = lo // inner, (hi - 1) // inner
        if first == last:
            split(dim + 1, prefix + (first,), lo - first * inner, hi - first * inner)
            return
        full_lo = -(-lo // inner)
        full_hi = hi // inner
        if lo % inner:
            split(dim + 1, prefix + (first,), lo - first * inner, inner)
        if full_hi > full_lo:
            out.append(StoredBox(Box(prefix + (full_lo,) + (0,) * pad, ones + (full_hi - full_lo,) + rest), 0))
        if hi % inner:
            split(dim + 1, prefix + (full_hi,), 0, hi - full_hi * inner)

    split(0, (), start, stop)
    placed: list[StoredBox] = []
    offset = 0
    for stored in out:
        placed.append(StoredBox(stored.box, offset))
        offset += stored.box.numel
    return placed


def stored_boxes(region: Region, shape: tuple[int, ...]) -> list[StoredBox]:
    """The boxes of a piece's storage: one for a box region, a few for a flat range."""
    if isinstance(region, Box):
        return [StoredBox(region, 0)] if region.numel else []
    return flat_range_boxes(shape, region.start, region.stop)


def _run_dim(rel: Box, outer: Box) -> int:
    """The dimension where runs of ``rel`` (relative to ``outer``) start: later ones are spanned fully."""
    split = outer.ndim - 1
    while split > 0 and rel.lengths[split] == outer.lengths[split] and rel.offsets[split] == 0:
        split -= 1
    return split


def run_length(inner: Box, outer: Box) -> int:
    """Elements in each contiguous run of ``inner`` inside ``outer``'s storage (see :func:`box_runs`)."""
    if outer.ndim == 0:
        return 1
    rel = inner.relative_to(outer)
    split = _run_dim(rel, outer)
    return rel.lengths[split] * math.prod(outer.lengths[split + 1 :])


def box_runs(inner: Box, outer: Box) -> tuple[np.ndarray, int]:
    """Contiguous runs of ``inner`` inside ``outer``'s row-major storage.

    Returns ``(starts, run_length)`` in elements relative to ``outer``'s first element. Trailing
    dimensions that ``inner`` spans fully are collapsed first, so a row slab of a row-major tensor
    is one run, and a column block is one run per row — never one per element.
    """
    rel = inner.relative_to(outer)
    ndim = outer.ndim
    if ndim == 0:
        return np.zeros(1, dtype=np.int64), 1
    strides = [math.prod(outer.lengths[d + 1 :]) for d in range(ndim)]
    split = _run_dim(rel, outer)  # the run covers dims split..ndim-1
    length = rel.lengths[split] * strides[split]
    base = sum(o * s for o, s in zip(rel.offsets, strides))
    if split == 1 and strides[0]:  # one run per index of dimension 0 (a column block of a matrix): one arange
        return np.arange(base, base + rel.lengths[0] * strides[0], strides[0], dtype=np.int64), length
    starts = np.zeros(1, dtype=np.int64) + base
    for d in range(split):
        steps = np.arange(rel.lengths[d], dtype=np.int64) * strides[d]
        starts = (starts[:, None] + steps[None, :]).reshape(-1)
    return starts, length
