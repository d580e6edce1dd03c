"""Regions: flat ranges split into boxes, contiguous runs of boxes, box intersection.

Every property is checked against brute force over explicit element indices, using
``torch.arange(numel).reshape(shape)`` as the map from global coordinates to flat indices.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.native.regions import Box, FlatRange, flat_range_boxes, stored_boxes, box_runs

FAST = settings(max_examples=150, deadline=None)

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


def flat_indices(shape: tuple[int, ...], box: Box) -> list[int]:
    """Row-major flat indices (in the global tensor) of the elements of ``box``, in box order."""
    return torch.arange(math.prod(shape)).reshape(shape)[box.slices()].reshape(-1).tolist()


@st.composite
def shape_and_range(draw):
    shape = draw(shapes)
    total = math.prod(shape)
    start = draw(st.integers(0, total))
    stop = draw(st.integers(start, total))
    return shape, start, stop


@st.composite
def box_in(draw, shape):
    offsets, lengths = [], []
    for d in shape:
        o = draw(st.integers(0, d - 1))
        offsets.append(o)
        lengths.append(draw(st.integers(1, d - o)))
    return Box(tuple(offsets), tuple(lengths))


@st.composite
def outer_and_inner(draw):
    shape = draw(shapes)
    outer = draw(box_in(shape))
    rel = draw(box_in(outer.lengths))
    inner = Box(tuple(o + r for o, r in zip(outer.offsets, rel.offsets)), rel.lengths)
    return outer, inner


# -- flat_range_boxes --------------------------------------------------------------------------------
@FAST
@given(shape_and_range())
def test_flat_range_boxes_tile_the_range_in_order(case):
    """The boxes, concatenated in order, hold exactly the flat indices [start, stop), each contiguous,
    with element offsets that are their positions relative to ``start``; at most 2*ndim-1 boxes."""
    shape, start, stop = case
    boxes = flat_range_boxes(shape, start, stop)
    assert len(boxes) <= 2 * len(shape) - 1
    flat = []
    for sb in boxes:
        idx = flat_indices(shape, sb.box)
        assert sb.box.numel > 0
        assert idx == list(range(idx[0], idx[0] + len(idx))), "box is not contiguous in the flattening"
        assert sb.element_offset == len(flat) == idx[0] - start
        flat.extend(idx)
    assert flat == list(range(start, stop))


@FAST
@given(shape_and_range())
def test_flat_range_boxes_are_pairwise_disjoint(case):
    """No two boxes of one flat range share an element."""
    shape, start, stop = case
    boxes = [sb.box for sb in flat_range_boxes(shape, start, stop)]
    for a, b in itertools.combinations(boxes, 2):
        assert a.intersect(b) is None


def test_flat_range_boxes_worst_case_count():
    """A range that starts and ends mid-row in a 3-d tensor needs the full 2*3-1 = 5 boxes."""
    shape = (4, 4, 4)
    boxes = flat_range_boxes(shape, 1, 63)
    assert len(boxes) == 5
    assert sum(sb.box.numel for sb in boxes) == 62


def test_flat_range_whole_tensor_is_one_box():
    """The full range of a tensor is the full box."""
    assert [sb.box for sb in flat_range_boxes((3, 4, 5), 0, 60)] == [Box.full((3, 4, 5))]


def test_flat_range_boxes_zero_dim_and_empty():
    """A 0-d tensor's only element is the empty-shaped box; an empty range has no boxes."""
    (sb,) = flat_range_boxes((), 0, 1)
    assert sb.box == Box((), ()) and sb.box.numel == 1 and sb.element_offset == 0
    assert flat_range_boxes((), 0, 0) == []
    assert flat_range_boxes((3, 4), 5, 5) == []
    assert flat_range_boxes((0, 4), 0, 0) == []


@pytest.mark.parametrize("start, stop", [(-1, 2), (3, 2), (0, 13)])
def test_flat_range_boxes_rejects_out_of_bounds(start, stop):
    """A range outside the tensor (or reversed) raises ValueError."""
    with pytest.raises(ValueError):
        flat_range_boxes((3, 4), start, stop)


def test_stored_boxes_box_and_flat():
    """stored_boxes: a box region is itself (none when empty); a flat range goes through flat_range_boxes."""
    box = Box((1, 0), (2, 4))
    assert [sb.box for sb in stored_boxes(box, (3, 4))] == [box]
    assert stored_boxes(Box((1, 0), (0, 4)), (3, 4)) == []
    assert stored_boxes(FlatRange(2, 9), (3, 4)) == flat_range_boxes((3, 4), 2, 9)


# -- box_runs ----------------------------------------------------------------------------------------
def brute_runs(inner: Box, outer: Box) -> list[tuple[int, int]]:
    """Maximal contiguous runs (start, length) of inner's elements in outer's row-major storage."""
    local = torch.arange(outer.numel).reshape(outer.lengths)
    idx = local[inner.relative_to(outer).slices()].reshape(-1).tolist()
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return [tuple(r) for r in runs]


@FAST
@given(outer_and_inner())
def test_box_runs_equal_brute_force(case):
    """box_runs returns exactly the maximal contiguous runs, in order (so trailing full dims collapse)."""
    outer, inner = case
    starts, length = box_runs(inner, outer)
    assert isinstance(starts, np.ndarray)
    assert [(int(s), length) for s in starts] == brute_runs(inner, outer)


def test_box_runs_row_slab_is_one_run():
    """Rows 3..7 (all columns) of a (10, 6) box are one run of 4*6 elements at element 18."""
    outer = Box((0, 0), (10, 6))
    starts, length = box_runs(Box((3, 0), (4, 6)), outer)
    assert starts.tolist() == [18] and length == 24


def test_box_runs_column_block_is_one_run_per_row():
    """Columns 2..4 of an (R, C) box give R runs of 3 elements, one per row."""
    outer = Box((5, 10), (7, 6))
    starts, length = box_runs(Box((5, 12), (7, 3)), outer)
    assert starts.tolist() == [r * 6 + 2 for r in range(7)] and length == 3


def test_box_runs_collapses_trailing_full_dims_in_3d():
    """A (2, 4, 5) sub-box spanning dims 1 and 2 fully of a (6, 4, 5) box is one run of 40."""
    starts, length = box_runs(Box((1, 0, 0), (2, 4, 5)), Box((0, 0, 0), (6, 4, 5)))
    assert starts.tolist() == [20] and length == 40


def test_box_runs_zero_dim():
    """A 0-d box is one run of one element."""
    starts, length = box_runs(Box((), ()), Box((), ()))
    assert starts.tolist() == [0] and length == 1


# -- intersect ---------------------------------------------------------------------------------------
@st.composite
def two_boxes(draw):
    shape = draw(shapes)
    return shape, draw(box_in(shape)), draw(box_in(shape))


def element_set(shape: tuple[int, ...], box: Box) -> set[int]:
    return set(flat_indices(shape, box))


@FAST
@given(two_boxes())
def test_intersect_equals_brute_force(case):
    """a ∩ b holds exactly the common elements; None iff there are none; it is symmetric and contained."""
    shape, a, b = case
    common = element_set(shape, a) & element_set(shape, b)
    inter = a.intersect(b)
    assert inter == b.intersect(a)
    if not common:
        assert inter is None
    else:
        assert inter is not None
        assert element_set(shape, inter) == common
        assert a.contains(inter) and b.contains(inter)


def test_intersect_touching_boxes_share_nothing():
    """Boxes that only touch at a boundary (end == offset) do not intersect."""
    assert Box((0, 0), (2, 3)).intersect(Box((2, 0), (2, 3))) is None
    assert Box((0, 0), (2, 3)).intersect(Box((1, 3), (2, 3))) is None


def test_relative_to_and_slices():
    """relative_to shifts offsets into the outer box's coordinates; slices selects the box."""
    inner = Box((3, 4), (2, 2))
    assert inner.relative_to(Box((2, 1), (5, 5))) == Box((1, 3), (2, 2))
    t = torch.arange(64).reshape(8, 8)
    assert t[inner.slices()].tolist() == [[28, 29], [36, 37]]
