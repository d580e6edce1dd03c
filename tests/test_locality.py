"""Locality-aware readers: units go to ranks whose node holds the file, each byte read once, plans still exact.

Each rank plans its own units (:func:`tierckpt.planner.rank_plan.plan_rank` with what the nodes' memory tiers
hold, as :class:`tierckpt.loading.locality.LocalReads` gives it); the union of the rank plans is executed with the
pure-torch executor of ``test_load_planner``, each unit's bytes taken only from the files its reader's node
holds (or the remote, for units no node holds), and compared bit-exactly — including loads onto another world
size (4 ranks on 2 nodes -> 2 ranks on 1 node).
"""

from __future__ import annotations

import crc32c
import pytest

from test_load_planner import SIZES, check_exact, reference, save_fake
from test_rank_plan import P2P, check_union, rank_plans
from tierckpt.loading.locality import HeldFile, LocalReads
from tierckpt.planner import LoadPlan, TargetPiece, plan_load, topology
from tierckpt.planner.rank_plan import agree_rounds, local_reader, plan_rank
from tierckpt.native.regions import Box

MiB = 1 << 20


def held(files: dict[str, bytes], names: list[str]) -> tuple[HeldFile, ...]:
    return tuple(HeldFile(n, len(files[n]), crc32c.crc32c(files[n])) for n in names)


def local_reads(nodes: list[str], node_files: dict[str, dict[str, bytes]]) -> LocalReads:
    """What every rank sees after the load's first collective: each rank's node and what its tier holds."""
    return LocalReads.of(0, None, [(n, held(node_files[n], sorted(node_files[n]))) for n in nodes])


def planned(tensors, pieces, needs, nodes, reads: LocalReads, round_bytes: int = SIZES["round_bytes"]):
    """The group plan (the reference), and the union of the rank plans with the nodes' holdings."""
    topo = topology("object_store", "gloo", nodes)
    chunk = SIZES["chunk_bytes"]
    group = plan_load(tensors, pieces, needs, chunk_bytes=chunk, round_bytes=round_bytes, topology=topo)
    drafts = [plan_rank(tensors, pieces, needs, r, chunk_bytes=chunk, round_bytes=round_bytes, p2p_min_bytes=P2P,
                        topology=topo, held=reads.holders()) for r in range(len(needs))]
    plans = [agree_rounds(d, [x.share for x in drafts], tensors) for d in drafts]
    return group, plans, check_union(plans, group, tensors, round_bytes)


# -- the pure choice of one unit's reader ---------------------------------------------------------------------
def test_a_reader_on_a_holding_node_keeps_its_unit() -> None:
    assert local_reader(2, ((1, 2), 100), 0, 0, 100, 64) == 2


def test_a_unit_moves_to_a_holder_by_the_stripe_rule() -> None:
    readers = [local_reader(3, ((0, 1, 2), 1000), 0, at, at + 10, 64) for at in (0, 64, 128, 192)]
    assert readers == [0, 1, 2, 0]  # successive stripes rotate over the holding node's ranks


def test_units_no_node_holds_or_a_copy_too_short_keep_their_reader() -> None:
    assert local_reader(1, None, 0, 0, 10, 64) == 1
    assert local_reader(1, ((), 0), 0, 0, 10, 64) == 1
    assert local_reader(1, ((0,), 98), 0, 0, 100, 64) == 1  # the copy ends before the unit does


def test_copies_that_disagree_are_never_read() -> None:
    reads = LocalReads.of(0, None, [("a", ()), ("b", (HeldFile("f", 10, 1),)), ("c", (HeldFile("f", 10, 2),)),
                                    ("d", (HeldFile("g", 10, 3),))])
    assert reads.holders() == {"g": ((3,), 10)}


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
                       remote: dict[str, bytes], refs, tensors, needs) -> int:
    """Each unit is read from its reader's node files when they hold it, else from the remote; results exact.
    Returns the bytes read from the nodes' tiers."""
    per_unit_files, local = {}, 0
    for unit in plan.units:
        here = node_files[nodes[unit.reader]]
        source = here if unit.file in here else remote
        assert unit.file in source, (unit.file, nodes[unit.reader])
        per_unit_files[unit.file] = source[unit.file]  # the same bytes wherever they come from
        local += unit.nbytes if source is here else 0
    check_exact(refs, plan, tensors, per_unit_files, needs)
    return local


def test_a_replacement_node_reads_its_peers_replicas_through_the_exchange() -> None:
    refs, tensors, pieces, files = saved_by_four_ranks()
    nodes = ["a", "a", "b", "b"]
    needs = needs_of(4)
    node_files = {"a": dict(files), "b": {}}  # node b was replaced: its memory is empty; a holds b's replicas
    group, plans, union = planned(tensors, pieces, needs, nodes, local_reads(nodes, node_files))
    assert {u.reader for u in union.units} == {0, 1}
    assert sum(p.bytes_read for p in plans) == group.bytes_read  # each byte read once per group
    per_rank = [p.bytes_read for p in plans]
    assert abs(per_rank[0] - per_rank[1]) <= 2 * max(u.nbytes for u in group.units)  # the stripes spread them
    assert execute_from_nodes(union, nodes, node_files, {}, refs, tensors, needs) == group.bytes_read


def test_each_node_holding_its_own_files_changes_nothing() -> None:
    refs, tensors, pieces, files = saved_by_four_ranks()
    nodes = ["a", "a", "b", "b"]
    own = {"a": {n: files[n] for n in sorted(files)[:2]}, "b": {n: files[n] for n in sorted(files)[2:]}}
    group, _, union = planned(tensors, pieces, needs_of(4), nodes, local_reads(nodes, own))
    plain = rank_plans(tensors, pieces, needs_of(4), SIZES["chunk_bytes"], SIZES["round_bytes"],
                       topology("object_store", "gloo", nodes))  # as if no node held anything
    assert sorted((u.file, int(u.run_offsets[0]), u.reader) for u in union.units) == sorted(
        (u.file, int(u.run_offsets[0]), u.reader) for r, p in enumerate(plain) for u in p.units if u.reader == r)
    assert execute_from_nodes(union, nodes, own, {}, refs, tensors, needs_of(4)) == group.bytes_read


@pytest.mark.parametrize("split_cols", [False, True], ids=["rows", "columns"])
def test_four_ranks_on_two_nodes_to_two_ranks_on_the_surviving_node(split_cols: bool) -> None:
    refs, tensors, pieces, files = saved_by_four_ranks()
    nodes = ["b", "b"]  # node a is lost; b holds its own files and a's replicas
    needs = needs_of(2, split_cols)
    _, plans, union = planned(tensors, pieces, needs, nodes, local_reads(nodes, {"b": files}), round_bytes=64 << 10)
    assert sum(p.bytes_read for p in plans) == sum(t.nbytes for t in tensors.values())  # each byte read once
    assert execute_from_nodes(union, nodes, {"b": files}, {}, refs, tensors, needs) == sum(p.bytes_read for p in plans)


def test_a_replacement_nodes_needs_are_read_by_the_survivor_in_bounded_rounds() -> None:
    """A replacement node's needs read by the surviving node's rank (read straight into the send buffer):
    each unit costs its reader and its receiver its bytes once, so a round holds round_bytes of them."""
    ref = reference((64, 1024), "float32")  # 256 KiB, saved as 4 row pieces by rank 0
    refs = {"w": ref}
    tensors, pieces, files = save_fake(refs, {"w": [(0, Box((16 * i, 0), (16, 1024))) for i in range(4)]})
    needs = [[], [TargetPiece(fqn="w", region=Box.full((64, 1024)))]]  # rank 1, on the fresh node, needs it all
    nodes = ["survivor", "fresh"]
    node_files = {"survivor": files, "fresh": {}}
    topo = topology("object_store", "gloo", nodes)
    drafts = [plan_rank(tensors, pieces, needs, r, chunk_bytes=64 << 10, round_bytes=128 << 10, p2p_min_bytes=P2P,
                        topology=topo, held=local_reads(nodes, node_files).holders()) for r in range(2)]
    plans = [agree_rounds(d, [x.share for x in drafts], tensors) for d in drafts]
    assert [u.reader for u in plans[0].units] == [0] * 4
    assert [len(r) for r in plans[0].rounds] == [2, 2]  # 64 KiB units, two per 128 KiB round
    group = plan_load(tensors, pieces, needs, chunk_bytes=64 << 10, round_bytes=128 << 10, topology=topo)
    union = check_union(plans, group, tensors, 128 << 10)
    execute_from_nodes(union, nodes, node_files, {}, refs, tensors, needs)


def test_partly_held_checkpoint_mixes_local_and_remote_reads() -> None:
    refs, tensors, pieces, files = saved_by_four_ranks()
    nodes = ["a", "a", "b", "b"]
    needs = needs_of(4, split_cols=True)
    node_files = {"a": {"data/rank-00003.bin": files["data/rank-00003.bin"]}, "b": {}}
    group, _, union = planned(tensors, pieces, needs, nodes, local_reads(nodes, node_files))
    assert all(u.reader in (0, 1) for u in union.units if u.file == "data/rank-00003.bin")
    local = execute_from_nodes(union, nodes, node_files, files, refs, tensors, needs)
    assert local == sum(u.nbytes for u in group.units if u.file == "data/rank-00003.bin")
