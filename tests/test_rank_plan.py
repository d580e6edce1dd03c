"""Per-rank load plans (planner/rank_plan.py): the union of every rank's plan is the group plan.

Each rank plans only the units it reads or receives from and the group agrees on the rounds from one
small share per rank. On random reshards (grids, FSDP1 flat ranges, partial and replicated targets,
1-D and 2-D meshes up to 16 ranks, one or two nodes, every store kind): the units read over all ranks
are the group plan's units (same boxes, runs and deliveries: each byte read once where the group plan
reads it once, every need covered exactly, checked by executing them against fake files); every rank
agrees on each unit it shares with another (reader, round; a receiver holds the reader's deliveries to it) and on the rounds, exchanges
and point-to-point decisions; a sender's deliveries to each receiver come in the order the receiver
takes them; each rank's buffers per round stay under ``round_bytes``.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_load_planner import check_exact, save_fake, scenario
from test_load_planner_index import mesh_or_flat_case

from tierckpt.errors import CorruptCheckpointError
from tierckpt.native.metadata import PieceMeta, TensorMeta
from tierckpt.planner import LoadPlan, TargetPiece, plan_load, topology
from tierckpt.planner.box_index import SCAN_QUERIES, BoxIndex
from tierckpt.planner.rank_plan import agree_rounds, plan_rank
from tierckpt.planner.plan_types import whole_to_other
from tierckpt.native.regions import Box, FlatRange

P2P = 64


def rank_plans(tensors, pieces, needs, chunk, round_bytes, topo) -> list[LoadPlan]:
    drafts = [plan_rank(tensors, pieces, needs, r, chunk_bytes=chunk, round_bytes=round_bytes, p2p_min_bytes=P2P,
                        topology=topo) for r in range(len(needs))]
    shares = [d.share for d in drafts]
    return [agree_rounds(d, shares, tensors) for d in drafts]


def shape_of(u) -> tuple:
    """A unit without its reader and round."""
    return (*ident(u), u.deliveries)


def ident(u) -> tuple:
    """A unit's bytes: the same in its reader's plan and in the plans of the ranks it delivers to."""
    return (u.fqn, u.box, u.file, tuple(u.run_offsets.tolist()), u.run_bytes)


def check_union(plans: list[LoadPlan], group: LoadPlan, tensors, round_bytes: int) -> LoadPlan:
    """The properties of the module docstring; returns the union as one plan (for execution)."""
    world = len(plans)
    read = [(r, u) for r, p in enumerate(plans) for u in p.units if u.reader == r]
    assert Counter(shape_of(u) for _, u in read) == Counter(shape_of(u) for u in group.units)
    assert sum(p.bytes_read for p in plans) == group.bytes_read
    assert sum(p.bytes_delivered for p in plans) == group.bytes_delivered
    # The same rounds and decisions everywhere.
    assert len({len(p.rounds) for p in plans}) == 1
    assert len({p.exchanges for p in plans}) == 1 and len({p.point_to_point for p in plans}) == 1
    # A unit a rank receives from is the reader's, in the same round, with the reader's deliveries to it.
    held = defaultdict(list)  # a reader may read the same bytes twice for two ranks (a holder reading for a peer)
    for r, u in read:
        held[(r, ident(u))].append(u)
    for r, p in enumerate(plans):
        assert all(p.units[i].round == k for k, idx in enumerate(p.rounds) for i in idx)
        for u in p.units:
            if u.reader != r:
                sources = [s for s in held[(u.reader, ident(u))]
                           if s.round == u.round and u.deliveries == tuple(d for d in s.deliveries if d.rank == r)]
                assert sources and u.deliveries != ()
        mine = {ident(u) for u in p.units if u.reader != r}
        for u in (u for _, u in read if u.reader != r and any(d.rank == r for d in u.deliveries)):
            assert ident(u) in mine, "a unit delivering here is missing"
    # Sender and receiver list the deliveries between them in the same order, round by round.
    for k in range(len(plans[0].rounds)):
        crosses, small = False, False
        for s in range(world):
            for r in range(world):
                if r == s:
                    continue
                sent = [(ident(u), d) for u in (plans[s].units[i] for i in plans[s].rounds[k]) if u.reader == s
                        for d in u.deliveries if d.rank == r]
                taken = [(ident(u), d) for u in (plans[r].units[i] for i in plans[r].rounds[k]) if u.reader == s
                         for d in u.deliveries if d.rank == r]
                assert sent == taken
                crosses = crosses or bool(sent)
                small = small or any(d.numel * tensors[i[0]].torch_dtype.itemsize < P2P for i, d in sent)
        assert plans[0].exchanges[k] == crosses
        assert plans[0].point_to_point[k] == (crosses and not small)
    # Each rank's buffers in each round stay under round_bytes, unless its share is one unit.
    for r, p in enumerate(plans):
        for idx in p.rounds:
            usage, count = 0, 0
            for u in (p.units[i] for i in idx):
                item = itemsize_of(tensors, u)
                if u.reader == r:
                    usage += 0 if whole_to_other(r, u.box, u.deliveries) else u.nbytes
                    usage += sum(d.numel for d in u.deliveries if d.rank != r) * item
                else:
                    usage += sum(d.numel for d in u.deliveries if d.rank == r) * item
                count += 1
            assert usage <= round_bytes or count == 1 or len({plans[r].units[i].run_offsets[0] for i in idx}) == 1
    units = tuple(u for _, u in sorted(read, key=lambda ru: (ru[1].round, ru[1].file, int(ru[1].run_offsets[0]))))
    return LoadPlan(units=units, rounds=(), exchanges=(), world_size=world, bytes_read=0, bytes_delivered=0)


def itemsize_of(tensors, u) -> int:
    return tensors[u.fqn].torch_dtype.itemsize


@settings(max_examples=200, deadline=None)
@given(scenario(), st.sampled_from(["node_local", "shared_fs", "object_store"]), st.booleans())
def test_union_of_rank_plans_is_the_group_plan(case, store, two_nodes):
    """Random reshards (grids, flat ranges, partial and replicated targets over 1-4 ranks): the union of
    the rank plans reads the group plan's units, delivers every element once with the reference bits,
    and the ranks agree on everything they share."""
    refs, layout, needs, kinds, chunk, round_bytes = case
    tensors, pieces, files = save_fake(refs, layout)
    topo = topology(store, "gloo", [f"n{r % 2 if two_nodes else 0}" for r in range(len(needs))])
    group = plan_load(tensors, pieces, needs, chunk_bytes=chunk, round_bytes=round_bytes, topology=topo)
    union = check_union(rank_plans(tensors, pieces, needs, chunk, round_bytes, topo), group, tensors, round_bytes)
    check_exact(refs, union, tensors, files, needs)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_union_of_rank_plans_on_meshes_and_flat_ranges(data):
    """Up to 16 ranks: a 1-D/2-D mesh or FSDP1 flat ranges saved, another loaded; the same properties."""
    world, tensors, pieces, needs = mesh_or_flat_case(data, 4096)
    chunk = data.draw(st.sampled_from([16, 256, 32 << 20]))
    round_bytes = data.draw(st.sampled_from([64, 1 << 20]))
    nodes = [f"n{r * data.draw(st.sampled_from([1, 2])) // world}" for r in range(world)]
    topo = topology(data.draw(st.sampled_from(["node_local", "object_store"])), "gloo", nodes)
    group = plan_load(tensors, pieces, needs, chunk_bytes=chunk, round_bytes=round_bytes, topology=topo)
    check_union(rank_plans(tensors, pieces, needs, chunk, round_bytes, topo), group, tensors, round_bytes)


def test_a_rank_plan_reports_its_own_uncovered_need():
    """Column shards with one missing: the rank whose target lies over the gap raises, naming it."""
    tensors = {"w": TensorMeta(fqn="w", dtype="float32", shape=(4, 8))}
    pieces = {"w": [PieceMeta(fqn="w", region=r, file="f", byte_offset=32 * c, byte_length=32, crc32c=0)
                    for c, r in ((0, FlatRange(0, 8)), (2, FlatRange(16, 24)))]}
    needs = [[TargetPiece(fqn="w", region=FlatRange(0, 8))], [TargetPiece(fqn="w", region=FlatRange(8, 24))]]
    plan_rank(tensors, pieces, needs, 0, chunk_bytes=1 << 20, round_bytes=1 << 20, p2p_min_bytes=P2P)
    with pytest.raises(CorruptCheckpointError, match=r"cover 8 of the 16 elements rank 1 needs"):
        plan_rank(tensors, pieces, needs, 1, chunk_bytes=1 << 20, round_bytes=1 << 20, p2p_min_bytes=P2P)


def test_a_replicated_load_spreads_readers_and_checks_by_stripe():
    """Every rank needs every tensor (object store: read once, exchanged): each unit has one reader,
    neighbouring small units of a chunk share it, and the stripes rotate over the ranks."""
    world, n = 4, 64
    tensors = {f"t{i}": TensorMeta(fqn=f"t{i}", dtype="float32", shape=(16,)) for i in range(n)}
    pieces = {f"t{i}": [PieceMeta(fqn=f"t{i}", region=FlatRange(0, 16), file="f", byte_offset=64 * i, byte_length=64,
                                  crc32c=0)] for i in range(n)}
    needs = [[TargetPiece(fqn=f"t{i}", region=FlatRange(0, 16)) for i in range(n)] for _ in range(world)]
    topo = topology("object_store", "gloo", ["n"] * world)
    plans = rank_plans(tensors, pieces, needs, 1024, 1 << 20, topo)
    readers = defaultdict(set)
    for r, p in enumerate(plans):
        for u in p.units:
            if u.reader == r:
                readers[int(u.run_offsets[0]) // 1024].add(r)
    assert all(len(rs) == 1 for rs in readers.values())
    assert [next(iter(readers[s])) for s in range(4)] == [0, 1, 2, 3]


@settings(max_examples=100, deadline=None)
@given(scenario(), st.sampled_from(["node_local", "object_store"]), st.booleans())
def test_tensors_laid_out_alike_are_planned_once_and_placed_right(case, store, two_nodes):
    """Each tensor copied under a second name with the same layout (planned once per rank, then moved to
    the copy's files, offsets and target numbers; a rank lists its copies in reverse order): the union
    of the rank plans is still the group plan and delivers the reference bits exactly."""
    refs, layout, needs, kinds, chunk, round_bytes = case
    refs = {**refs, **{f"{k}.copy": v.flip(0) if v.dim() else v + 1 for k, v in refs.items()}}
    layout = {**layout, **{f"{k}.copy": v for k, v in layout.items()}}
    needs = [[*n, *[TargetPiece(fqn=f"{x.fqn}.copy", region=x.region) for x in reversed(n)]] for n in needs]
    tensors, pieces, files = save_fake(refs, layout)
    topo = topology(store, "gloo", [f"n{r % 2 if two_nodes else 0}" for r in range(len(needs))])
    group = plan_load(tensors, pieces, needs, chunk_bytes=chunk, round_bytes=round_bytes, topology=topo)
    union = check_union(rank_plans(tensors, pieces, needs, chunk, round_bytes, topo), group, tensors, round_bytes)
    check_exact(refs, union, tensors, files, needs)


@settings(max_examples=150, deadline=None)
@given(scenario(), st.sampled_from(["node_local", "shared_fs", "object_store"]), st.booleans(), st.data())
def test_units_go_to_ranks_whose_node_memory_tier_holds_their_file(case, store, two_nodes, data):
    """Memory-tier loads plan per rank too: random files held by random nodes (some copies too short to
    cover every unit). The union of the rank plans still reads the group plan's units once each and delivers
    the reference bits exactly; a unit of a file some node holds in full is read by a rank of such a node,
    by its planned reader whenever that rank's node holds it; the other units keep their planned reader."""
    refs, layout, needs, kinds, chunk, round_bytes = case
    tensors, pieces, files = save_fake(refs, layout)
    world = len(needs)
    nodes = [f"n{r % 2 if two_nodes else 0}" for r in range(world)]
    topo = topology(store, "gloo", nodes)
    held = {}
    for name in sorted(files):
        holding = data.draw(st.sets(st.sampled_from(sorted(set(nodes)))), label=name)
        short = data.draw(st.booleans(), label=f"{name} short")
        size = len(files[name]) // 2 if short else len(files[name])
        held[name] = (tuple(r for r in range(world) if nodes[r] in holding), size)
    group = plan_load(tensors, pieces, needs, chunk_bytes=chunk, round_bytes=round_bytes, topology=topo)
    planned = {shape_of(u): u.reader for u in union_units(rank_plans(tensors, pieces, needs, chunk, round_bytes, topo))}
    drafts = [plan_rank(tensors, pieces, needs, r, chunk_bytes=chunk, round_bytes=round_bytes, p2p_min_bytes=P2P,
                        topology=topo, held=held) for r in range(world)]
    plans = [agree_rounds(d, [x.share for x in drafts], tensors) for d in drafts]
    union = check_union(plans, group, tensors, round_bytes)
    check_exact(refs, union, tensors, files, needs)
    for u in union.units:
        ranks, size = held[u.file]
        covered = bool(ranks) and size >= int(u.run_offsets.max()) + u.run_bytes
        before = planned[shape_of(u)]
        if covered:
            assert u.reader in ranks and (before not in ranks or u.reader == before), (u.file, u.reader, ranks, before)
        else:
            assert u.reader == before


def union_units(plans: list[LoadPlan]) -> list:
    return [u for r, p in enumerate(plans) for u in p.units if u.reader == r]


@pytest.mark.parametrize("world", [4, 8, 16])
def test_rank_plans_cut_about_as_many_rounds_as_the_group_plan(world):
    """Row -> column on ``world`` ranks, 1 GiB, 256 MiB rounds: the rounds agreed from the rank plans' shares
    are at most one more than the group plan's (the union of each rank's own cuts made up to ``world`` times
    as many, each a synchronising exchange: 8 instead of 2 at 8 ranks)."""
    shape, matrices = (8192, 4096), 8
    tensors = {f"t{m}": TensorMeta(fqn=f"t{m}", dtype="float32", shape=shape) for m in range(matrices)}
    pieces = {}
    for m in range(matrices):
        rows = [(shape[0] * i // world, shape[0] * (i + 1) // world) for i in range(world)]
        pieces[f"t{m}"] = [PieceMeta(fqn=f"t{m}", region=Box((lo, 0), (hi - lo, shape[1])), file=f"data/rank-{i:05d}.bin",
                                     byte_offset=m * (hi - lo) * shape[1] * 4, byte_length=(hi - lo) * shape[1] * 4, crc32c=0)
                           for i, (lo, hi) in enumerate(rows)]
    needs = [[TargetPiece(fqn=f"t{m}", region=Box((0, shape[1] * i // world), (shape[0], shape[1] // world)))
              for m in range(matrices)] for i in range(world)]
    topo = topology("node_local", "gloo", ["n"] * world, cores=2 * world)
    group = plan_load(tensors, pieces, needs, chunk_bytes=32 << 20, round_bytes=256 << 20, topology=topo)
    plans = rank_plans(tensors, pieces, needs, 32 << 20, 256 << 20, topo)
    check_union(plans, group, tensors, 256 << 20)
    assert len(plans[0].rounds) <= len(group.rounds) + 1, (len(plans[0].rounds), len(group.rounds))


def test_a_rank_lists_the_pieces_of_the_files_it_reads_as_taken():
    """Two tensors in two files, padded apart; rank 1 reads only file ``b``: its plan's ``taken`` lists
    every piece of ``b`` (of either tensor: a gap its coalesced request would read through is taken where
    any piece lies) and nothing of ``a``, which it never reads."""
    tensors = {k: TensorMeta(fqn=k, dtype="float32", shape=(4, 8)) for k in ("u", "v")}
    pieces = {k: [PieceMeta(fqn=k, region=Box((2 * i, 0), (2, 8)), file="ab"[i], byte_offset=256 * i + 128 * t,
                            byte_length=64, crc32c=0) for i in range(2)] for t, k in enumerate(("u", "v"))}
    needs = [[TargetPiece(fqn="u", region=Box((2 * r, 0), (2, 8)))] for r in range(2)]
    plans = rank_plans(tensors, pieces, needs, 1 << 20, 1 << 20, topology("object_store", "gloo", ["n", "n"]))
    assert {u.file for u in plans[1].units if u.reader == 1} == {"b"}
    taken = sorted((f, int(o), n) for f, offsets, n in plans[1].taken for o in offsets)
    assert taken == [("b", 256, 64), ("b", 384, 64)]


def test_an_index_told_its_few_queries_scans_and_finds_the_same():
    """16 column shards queried once: scanned (no axes built), the same answers as the built index."""
    boxes = [Box((0, 4 * i), (8, 4)) for i in range(16)]
    once, built = BoxIndex(boxes, queries=1), BoxIndex(boxes, queries=SCAN_QUERIES)
    assert not once.axes and once.bounds and built.axes and built.bounds is None
    for q in (Box((0, 6), (8, 4)), Box((3, 0), (2, 64)), Box((0, 63), (1, 1))):
        assert once.overlapping(q) == built.overlapping(q) == BoxIndex(boxes).overlapping(q)
