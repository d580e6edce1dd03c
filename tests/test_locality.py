"""Locality-aware readers: units go to ranks whose node holds the file, each byte read once, plans still exact.

Plans are executed with the pure-torch executor of ``test_load_planner``, with each unit's bytes taken
only from the files its reader's node holds (or the remote, for units no node holds), and compared
bit-exactly — including loads onto another world size (4 ranks on 2 nodes -> 2 ranks on 1 node).
"""

from __future__ import annotations

import crc32c
import pytest

from test_load_planner import SIZES, check_exact, check_rounds, reference, save_fake
from tierckpt.errors import CheckpointError
from tierckpt.planner import LoadPlan, TargetPiece, plan_load, topology
from tierckpt.planner.locality import HeldFile, RankHoldings, UnitSpan, assign_local_readers, relocate, spans_of
from tierckpt.regions import Box

MiB = 1 << 20


def held(files: dict[str, bytes], names: list[str]) -> tuple[HeldFile, ...]:
    return tuple(HeldFile(n, len(files[n]), crc32c.crc32c(files[n])) for n in names)


# -- the pure choice on byte spans ----------------------------------------------------------------------------
def test_a_reader_on_a_holding_node_keeps_its_units() -> None:
    units = [UnitSpan("a", 0, 100, reader=1), UnitSpan("b", 0, 50, reader=0)]
    holdings = [RankHoldings("n0", (HeldFile("b", 50, 1),)), RankHoldings("n0", (HeldFile("b", 50, 1),)),
                RankHoldings("n1", (HeldFile("a", 100, 2),))]
    result = assign_local_readers(units, holdings)
    assert result.readers == (2, 0) and result.local == (True, True)  # "a" moves to n1's only rank
    assert result.bytes_local == 150 and result.bytes_per_rank == (50, 0, 100)


def test_moved_units_are_balanced_by_bytes_over_the_holding_nodes_ranks() -> None:
    units = [UnitSpan("f", i * 10, i * 10 + size, reader=3) for i, size in enumerate([40, 10, 30, 20, 10])]
    files = (HeldFile("f", 1000, 7),)
    holdings = [RankHoldings("a", files), RankHoldings("a", files), RankHoldings("a", files), RankHoldings("b")]
    result = assign_local_readers(units, holdings)
    assert sorted(result.bytes_per_rank[:3]) == [30, 40, 40] and result.bytes_per_rank[3] == 0
    assert result.readers == (0, 2, 1, 2, 1)  # largest first, to the least-loaded rank, ties to the lowest


def test_units_no_node_holds_keep_the_remote_assignment() -> None:
    units = [UnitSpan("x", 0, 10, reader=1), UnitSpan("y", 0, 99, reader=0)]
    holdings = [RankHoldings("a", (HeldFile("y", 98, 5),)), RankHoldings("b")]  # y's copy is too short
    result = assign_local_readers(units, holdings)
    assert result.readers == (1, 0) and result.local == (False, False) and result.bytes_local == 0


def test_copies_that_disagree_are_never_read() -> None:
    units = [UnitSpan("f", 0, 10, reader=0)]
    holdings = [RankHoldings("a"), RankHoldings("b", (HeldFile("f", 10, 1),)), RankHoldings("c", (HeldFile("f", 10, 2),))]
    result = assign_local_readers(units, holdings)
    assert result.conflicts == ("f",) and result.readers == (0,) and result.local == (False,)


def test_a_reader_outside_the_group_is_an_error() -> None:
    with pytest.raises(CheckpointError, match="reader 2, outside the 2 loading ranks"):
        assign_local_readers([UnitSpan("f", 0, 1, reader=2)], [RankHoldings("a"), RankHoldings("a")])


# -- real plans -------------------------------------------------------------------------------------------------
def rows(start: int, stop: int, cols: int) -> Box:
    return Box((start, 0), (stop - start, cols))


def saved_by_four_ranks():
    refs = {"w": reference((64, 48), "float32", seed=1), "b": reference((64,), "int64", seed=2)}
    layout = {
        "w": [(r, rows(16 * r, 16 * (r + 1), 48)) for r in range(4)],
        "b": [(r, Box((16 * r,), (16,))) for r in range(4)],
    }
    tensors, pieces, files = save_fake(refs, layout)
    return refs, tensors, pieces, files


def needs_of(world: int, split_cols: bool = False) -> list[list[TargetPiece]]:
    """Row blocks per rank (the saved layout when world is 4), or column halves (a layout change)."""
    if split_cols:
        width = 48 // world
        return [[TargetPiece(fqn="w", region=Box((0, width * r), (64, width))), TargetPiece(fqn="b", region=Box((0,), (64,)))]
                for r in range(world)]
    step = 64 // world
    return [[TargetPiece(fqn="w", region=rows(step * r, step * (r + 1), 48)),
             TargetPiece(fqn="b", region=Box((step * r,), (step,)))] for r in range(world)]


def execute_from_nodes(plan: LoadPlan, nodes: list[str], node_files: dict[str, dict[str, bytes]],
                       remote: dict[str, bytes], locality, refs, tensors, needs) -> None:
    """Each unit is read from its reader's node files when local, else from the remote; results exact."""
    per_unit_files = {}
    for i, unit in enumerate(plan.units):
        source = node_files[nodes[unit.reader]] if locality.local[i] else remote
        assert unit.file in source, (i, unit.file, nodes[unit.reader])
        per_unit_files[unit.file] = source[unit.file]  # the same bytes wherever they come from
    check_exact(refs, plan, tensors, per_unit_files, needs)


def test_a_replacement_node_reads_its_peers_replicas_through_the_exchange() -> None:
    refs, tensors, pieces, files = saved_by_four_ranks()
    nodes = ["a", "a", "b", "b"]
    needs = needs_of(4)
    plan = plan_load(tensors, pieces, needs, **SIZES, topology=topology("object_store", "gloo", nodes))
    assert {u.file for u in plan.units if u.reader >= 2} == {"data/rank-00002.bin", "data/rank-00003.bin"}
    node_files = {"a": dict(files), "b": {}}  # node b was replaced: its memory is empty; a holds b's replicas
    everything = held(files, sorted(files))
    holdings = [RankHoldings(n, everything if n == "a" else ()) for n in nodes]
    locality = assign_local_readers(spans_of(plan), holdings)
    assert all(locality.local) and locality.bytes_local == plan.bytes_read
    moved = relocate(plan, locality.readers, round_bytes=512 * MiB)
    assert {u.reader for u in moved.units} == {0, 1} and moved.bytes_read == plan.bytes_read
    assert abs(moved.bytes_read_per_rank[0] - moved.bytes_read_per_rank[1]) <= max(u.nbytes for u in plan.units)
    assert [u.deliveries for u in moved.units] == [u.deliveries for u in plan.units]
    check_rounds(moved, 512 * MiB)
    execute_from_nodes(moved, nodes, node_files, {}, locality, refs, tensors, needs)


def test_each_node_holding_its_own_files_changes_nothing() -> None:
    refs, tensors, pieces, files = saved_by_four_ranks()
    nodes = ["a", "a", "b", "b"]
    plan = plan_load(tensors, pieces, needs_of(4), **SIZES, topology=topology("object_store", "gloo", nodes))
    own = {"a": sorted(files)[:2], "b": sorted(files)[2:]}
    holdings = [RankHoldings(n, held(files, own[n])) for n in nodes]
    locality = assign_local_readers(spans_of(plan), holdings)
    assert locality.readers == tuple(u.reader for u in plan.units) and all(locality.local)


@pytest.mark.parametrize("split_cols", [False, True], ids=["rows", "columns"])
def test_four_ranks_on_two_nodes_to_two_ranks_on_the_surviving_node(split_cols: bool) -> None:
    refs, tensors, pieces, files = saved_by_four_ranks()
    nodes = ["b", "b"]  # node a is lost; b holds its own files and a's replicas
    needs = needs_of(2, split_cols)
    plan = plan_load(tensors, pieces, needs, **SIZES, topology=topology("object_store", "gloo", nodes))
    holdings = [RankHoldings("b", held(files, sorted(files)))] * 2
    locality = assign_local_readers(spans_of(plan), holdings)
    assert all(locality.local) and locality.conflicts == ()
    moved = relocate(plan, locality.readers, round_bytes=64 << 10)
    assert moved.bytes_read == sum(t.nbytes for t in tensors.values())  # each byte read once per group
    check_rounds(moved, 64 << 10)
    execute_from_nodes(moved, nodes, {"b": files}, {}, locality, refs, tensors, needs)


def test_units_going_whole_to_another_rank_count_once_in_their_rounds() -> None:
    """A replacement node's needs read by the surviving node's rank (read straight into the send buffer):
    each unit costs its reader and its receiver its bytes once, so a round holds round_bytes of them."""
    ref = reference((64, 1024), "float32")  # 256 KiB, saved as 4 row pieces by rank 0
    refs = {"w": ref}
    tensors, pieces, files = save_fake(refs, {"w": [(0, Box((16 * i, 0), (16, 1024))) for i in range(4)]})
    needs = [[], [TargetPiece(fqn="w", region=Box.full((64, 1024)))]]  # rank 1, on the fresh node, needs it all
    nodes = ["survivor", "fresh"]
    plan = plan_load(tensors, pieces, needs, chunk_bytes=64 << 10, round_bytes=512 * MiB,
                     topology=topology("object_store", "gloo", nodes))
    holdings = [RankHoldings("survivor", held(files, sorted(files))), RankHoldings("fresh")]
    locality = assign_local_readers(spans_of(plan), holdings)
    assert locality.readers == (0,) * len(plan.units) and len(plan.units) == 4
    moved = relocate(plan, locality.readers, round_bytes=128 << 10)
    assert [len(r) for r in moved.rounds] == [2, 2]  # 64 KiB units, two per 128 KiB round (one each before)
    check_rounds(moved, 128 << 10)
    execute_from_nodes(moved, nodes, {"survivor": files, "fresh": {}}, {}, locality, refs, tensors, needs)


def test_partly_held_checkpoint_mixes_local_and_remote_reads() -> None:
    refs, tensors, pieces, files = saved_by_four_ranks()
    nodes = ["a", "a", "b", "b"]
    needs = needs_of(4, split_cols=True)
    plan = plan_load(tensors, pieces, needs, **SIZES, topology=topology("object_store", "gloo", nodes))
    node_files = {"a": {"data/rank-00003.bin": files["data/rank-00003.bin"]}, "b": {}}
    holdings = [RankHoldings(n, held(node_files[n], sorted(node_files[n]))) for n in nodes]
    locality = assign_local_readers(spans_of(plan), holdings)
    for unit, reader, is_local in zip(plan.units, locality.readers, locality.local):
        assert is_local == (unit.file == "data/rank-00003.bin")
        assert reader in ((0, 1) if is_local else (unit.reader,))
    moved = relocate(plan, locality.readers, round_bytes=512 * MiB)
    execute_from_nodes(moved, nodes, node_files, files, locality, refs, tensors, needs)
    assert moved.bytes_read == plan.bytes_read and locality.bytes_local == sum(
        u.nbytes for u in plan.units if u.file == "data/rank-00003.bin")
