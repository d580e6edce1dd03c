"""The load planner's box index: the same answers, and so the same plans, as meeting every pair.

The reference is brute force: every saved box is tested against every target box. The index must
return exactly the boxes that brute force finds (with the same intersections, in index order), and
a plan made through it must equal, unit by unit, the plan made by brute force — on random
shardings: box grids of 1-3 dimensions (DTensor 1-D and 2-D meshes, uneven), FSDP1 flat ranges cut
at arbitrary elements, and replicated targets.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_load_planner import partition, save_fake, scenario, tiles

from tierckpt.errors import CorruptCheckpointError
from tierckpt.native.metadata import PieceMeta, TensorMeta
from tierckpt.planner import LoadPlan, TargetPiece, plan_load, slab_units, topology
from tierckpt.planner import box_index
from tierckpt.planner.box_index import BoxIndex
from tierckpt.native.regions import Box, FlatRange, stored_boxes


class BruteIndex:
    """The reference: every box is a candidate."""

    def __init__(self, boxes: list[Box]) -> None:
        self.boxes = list(boxes)

    def overlapping(self, box: Box) -> list[tuple[int, Box]]:
        return [(i, inter) for i, b in enumerate(self.boxes) if (inter := b.intersect(box)) is not None]


def normal(plan: LoadPlan) -> tuple:
    """Everything a plan says, comparable with ``==``."""
    units = tuple(
        (u.fqn, u.dtype, u.box, u.file, tuple(u.run_offsets.tolist()), u.run_bytes, u.reader, u.deliveries, u.round)
        for u in plan.units
    )
    return (units, plan.rounds, plan.exchanges, plan.world_size, plan.bytes_read, plan.bytes_delivered,
            plan.bytes_read_per_rank)


@st.composite
def mesh_layout(draw, shape: tuple[int, ...], ranks: int) -> list[Box]:
    """A DTensor-like layout: a mesh of up to 2 dimensions, each sharding one tensor dimension at uneven cuts."""
    dims = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=2, unique=True))
    cuts = [[] for _ in shape]
    for d in dims:
        if shape[d] > 1:
            k = draw(st.integers(1, min(ranks, shape[d] - 1)))
            cuts[d] = sorted(draw(st.sets(st.integers(1, shape[d] - 1), min_size=k, max_size=k)))
    return tiles(shape, cuts)


@st.composite
def shapes(draw) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(1, 24), min_size=1, max_size=3)))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_index_finds_exactly_the_boxes_brute_force_finds(data):
    """Saved boxes of a grid or a flat-range tiling (FSDP1), queried with boxes of another tiling and
    with arbitrary boxes: the same indices and intersections as testing every box, built as an index or
    scanned (few boxes, or few queries told: each box's first and last extents compared first)."""
    shape = data.draw(shapes())
    if data.draw(st.booleans()):
        saved = data.draw(mesh_layout(shape, 8))
    else:
        saved = [s.box for r in data.draw(partition(shape, max_parts=12)) for s in stored_boxes(r, shape)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(box_index, "SCAN_BELOW", data.draw(st.sampled_from([0, box_index.SCAN_BELOW])))
        index = BoxIndex(saved, queries=data.draw(st.sampled_from([None, 1, box_index.SCAN_QUERIES])))
    brute = BruteIndex(saved)
    queries = [s.box for r in data.draw(partition(shape, max_parts=12)) for s in stored_boxes(r, shape)]
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    queries.append(Box(offsets, tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets))))
    for q in queries:
        assert index.overlapping(q) == brute.overlapping(q), q


def test_index_on_overlapping_and_zero_dim_boxes(monkeypatch):
    """Saved boxes may overlap (the planner then reports a corrupt checkpoint): the index still finds
    every one; a 0-d tensor's single box meets the 0-d query."""
    monkeypatch.setattr(box_index, "SCAN_BELOW", 0)
    boxes = [Box((0, 0), (10, 10)), Box((2, 3), (1, 1)), Box((5, 0), (5, 10)), Box((9, 9), (1, 1))]
    assert BoxIndex(boxes).overlapping(Box((4, 4), (6, 6))) == BruteIndex(boxes).overlapping(Box((4, 4), (6, 6)))
    assert [i for i, _ in BoxIndex(boxes).overlapping(Box((4, 4), (6, 6)))] == [0, 2, 3]
    scanned = BoxIndex(boxes, queries=1)  # few queries told: scanned, extents compared first
    for q in (Box((4, 4), (6, 6)), Box((2, 3), (1, 1)), Box((2, 3), (0, 4)), Box((0, 9), (10, 1))):
        assert scanned.overlapping(q) == BruteIndex(boxes).overlapping(q), q
    assert BoxIndex([Box((), ())]).overlapping(Box((), ())) == [(0, Box((), ()))]
    assert BoxIndex([]).overlapping(Box((0,), (3,))) == []


@settings(max_examples=150, deadline=None)
@given(scenario(), st.sampled_from(["node_local", "shared_fs", "object_store"]), st.booleans(), st.sampled_from([0, 8]))
def test_indexed_plan_equals_brute_force_plan(case, store, two_nodes, scan_below):
    """The planner's random reshards (grids, flat ranges, partial and replicated targets): the plan
    through the index is the plan through brute force, unit by unit."""
    refs, layout, needs, kinds, chunk, round_bytes = case
    tensors, pieces, _ = save_fake(refs, layout)
    topo = topology(store, "gloo", [f"n{r % 2 if two_nodes else 0}" for r in range(len(needs))])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(box_index, "SCAN_BELOW", scan_below)
        indexed = plan_load(tensors, pieces, needs, chunk_bytes=chunk, round_bytes=round_bytes, topology=topo)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slab_units, "BoxIndex", BruteIndex)
        brute = plan_load(tensors, pieces, needs, chunk_bytes=chunk, round_bytes=round_bytes, topology=topo)
    assert normal(indexed) == normal(brute)


def mesh_or_flat_case(data, spacing: int) -> tuple[int, dict, dict, list[list[TargetPiece]]]:
    """A random load of up to 16 ranks, ``(world, tensors, pieces, needs)``: a DTensor 1-D/2-D mesh or FSDP1
    flat ranges saved (pieces ``spacing`` bytes apart in their files), another mesh or flat tiling loaded."""
    shape = data.draw(shapes())
    world = data.draw(st.integers(2, 16))
    tensors = {"w": TensorMeta(fqn="w", dtype="float32", shape=shape)}

    def layout():
        if data.draw(st.booleans()):
            return data.draw(mesh_layout(shape, world))
        numel = math.prod(shape)
        k = min(world, numel)
        points = sorted(data.draw(st.sets(st.integers(1, numel - 1), min_size=k - 1, max_size=k - 1))) if numel > 1 else []
        edges = [0, *points, numel]
        return [FlatRange(a, b) for a, b in zip(edges, edges[1:])]

    saved = layout()
    pieces = {"w": [PieceMeta(fqn="w", region=r, file=f"f{i % world}", byte_offset=spacing * i, byte_length=0, crc32c=0)
                    for i, r in enumerate(saved)]}
    needs: list[list[TargetPiece]] = [[] for _ in range(world)]
    for i, region in enumerate(layout()):
        needs[i % world].append(TargetPiece(fqn="w", region=region))
    return world, tensors, pieces, needs


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_indexed_plan_equals_brute_force_on_meshes_and_flat_ranges(data):
    """Up to 16 ranks: a DTensor 1-D/2-D mesh or FSDP1 flat ranges saved, another mesh or flat tiling
    loaded (each rank one part): the same plan both ways."""
    world, tensors, pieces, needs = mesh_or_flat_case(data, 64)
    chunk = data.draw(st.sampled_from([16, 256, 32 << 20]))
    topo = topology(data.draw(st.sampled_from(["node_local", "object_store"])), "gloo", ["n"] * world)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(box_index, "SCAN_BELOW", data.draw(st.sampled_from([0, box_index.SCAN_BELOW])))
        indexed = plan_load(tensors, pieces, needs, chunk_bytes=chunk, round_bytes=1 << 20, topology=topo)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slab_units, "BoxIndex", BruteIndex)
        brute = plan_load(tensors, pieces, needs, chunk_bytes=chunk, round_bytes=1 << 20, topology=topo)
    assert normal(indexed) == normal(brute)


def test_a_gap_between_indexed_pieces_is_still_reported():
    """Column shards with one missing: the target over the gap is reported with what covers it."""
    tensors = {"w": TensorMeta(fqn="w", dtype="float32", shape=(4, 8))}
    pieces = {"w": [PieceMeta(fqn="w", region=Box((0, c), (4, 2)), file="f", byte_offset=32 * c, byte_length=32, crc32c=0)
                    for c in (0, 2, 6)]}
    needs = [[TargetPiece(fqn="w", region=Box((0, 0), (4, 4)))], [TargetPiece(fqn="w", region=Box((0, 4), (4, 4)))]]
    with pytest.raises(CorruptCheckpointError, match=r"cover 8 of the 16 elements rank 1 needs"):
        plan_load(tensors, pieces, needs, chunk_bytes=1 << 20, round_bytes=1 << 20)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_walk_counts_the_runs_and_span_box_runs_gives(data):
    """The route costs' one-pass walk: elements, requests and span equal those of the box's actual runs
    (:func:`~tierckpt.native.regions.box_runs`): one request per run, the span from the first run's start to the
    last run's end."""
    from tierckpt.native.regions import box_runs

    shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=0, max_size=4)))
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    saved = Box(offsets, tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets)))
    inner_off = tuple(data.draw(st.integers(o, o + n - 1)) for o, n in zip(saved.offsets, saved.lengths))
    box = Box(inner_off, tuple(data.draw(st.integers(1, o + n - i)) for o, n, i in zip(saved.offsets, saved.lengths, inner_off)))
    starts, run = box_runs(box, saved)
    assert slab_units.walk(box, saved) == (box.numel, len(starts), int(starts[-1]) + run - int(starts[0]))
