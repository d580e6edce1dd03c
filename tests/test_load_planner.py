"""Load planner: every needed element delivered exactly once, exact reads, rounds, errors, scale.

Plans are executed here in pure torch against fake data files: a reference tensor is laid out per
the saved pieces, each read unit is assembled from its runs' byte offsets, and its deliveries are
copied into the targets — the same contract the loader follows — then compared bit-exactly.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.errors import CorruptCheckpointError
from tierckpt.loading.api import DEFAULT_CHUNK_BYTES, DEFAULT_ROUND_BYTES
from tierckpt.native.metadata import PieceMeta, TensorMeta, itemsize
from tierckpt.planner import LoadPlan, TargetPiece, plan_load, topology
from tierckpt.native.regions import Box, FlatRange, Region

SIZES = {"chunk_bytes": DEFAULT_CHUNK_BYTES, "round_bytes": DEFAULT_ROUND_BYTES}
"""The planner has no defaults: these tests pass load()'s."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "uint8": torch.uint8}


# -- helpers -----------------------------------------------------------------------------------------
def reference(shape: tuple[int, ...], dtype: str, seed: int = 0) -> torch.Tensor:
    """A tensor whose every element differs from its neighbours (as far as the dtype allows)."""
    n = math.prod(shape)
    values = torch.randperm(max(n, 1), generator=torch.Generator().manual_seed(seed))[:n] + 1
    return values.to(DTYPES[dtype]).reshape(shape)


def region_values(ref: torch.Tensor, region: Region) -> torch.Tensor:
    """The elements of ``region`` of ``ref``, packed row-major (as a piece or a target stores them)."""
    if isinstance(region, FlatRange):
        return ref.reshape(-1)[region.start : region.stop].clone()
    return ref[region.slices()].contiguous().reshape(-1)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def save_fake(
    refs: dict[str, torch.Tensor], layout: dict[str, list[tuple[int, Region]]], pad: int = 13
) -> tuple[dict[str, TensorMeta], dict[str, list[PieceMeta]], dict[str, bytes]]:
    """Write each tensor's pieces (rank, region) into per-rank fake files, with padding between pieces."""
    files: dict[str, bytearray] = defaultdict(bytearray)
    tensors: dict[str, TensorMeta] = {}
    pieces: dict[str, list[PieceMeta]] = defaultdict(list)
    for fqn, ref in refs.items():
        dtype = str(ref.dtype).removeprefix("torch.")
        tensors[fqn] = TensorMeta(fqn=fqn, dtype=dtype, shape=tuple(ref.shape))
        for rank, region in layout[fqn]:
            name = f"data/rank-{rank:05d}.bin"
            data = tensor_bytes(region_values(ref, region))
            files[name] += b"\xee" * pad
            offset = len(files[name])
            files[name] += data
            pieces[fqn].append(PieceMeta(fqn=fqn, region=region, file=name, byte_offset=offset,
                                         byte_length=len(data), crc32c=0))
    return tensors, dict(pieces), {k: bytes(v) for k, v in files.items()}


def execute(plan: LoadPlan, tensors: dict[str, TensorMeta], files: dict[str, bytes],
            needs: list[list[TargetPiece]]) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Run a plan: returns each rank's target tensors (packed, as stored) and per-element hit counts."""
    out, hits = [], []
    for rank_needs in needs:
        out.append([torch.zeros(n.region.numel, dtype=tensors[n.fqn].torch_dtype) for n in rank_needs])
        hits.append([torch.zeros(n.region.numel, dtype=torch.int64) for n in rank_needs])
    for unit in plan.units:
        data = b"".join(files[unit.file][o : o + unit.run_bytes] for o in unit.run_offsets.tolist())
        assert len(data) == unit.nbytes == unit.box.numel * itemsize(tensors[unit.fqn].torch_dtype)
        source = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(tensors[unit.fqn].torch_dtype)
        source = source.reshape(unit.box.lengths)
        for d in unit.deliveries:
            assert unit.box.contains(d.box) and d.target_box.box.contains(d.box)
            part = source[d.box.relative_to(unit.box).slices()]
            tb = d.target_box
            for store in (out[d.rank][d.target], hits[d.rank][d.target]):
                view = store[tb.element_offset : tb.element_offset + tb.box.numel].view(tb.box.lengths)
                view = view[d.box.relative_to(tb.box).slices()]
                if store.dtype == torch.int64 and store is hits[d.rank][d.target]:
                    view += 1
                else:
                    view.copy_(part)
    return out, hits


def check_exact(refs, plan, tensors, files, needs) -> None:
    """Every target holds exactly the reference's values, and each element was delivered once."""
    out, hits = execute(plan, tensors, files, needs)
    for rank, rank_needs in enumerate(needs):
        for i, need in enumerate(rank_needs):
            assert torch.equal(hits[rank][i], torch.ones_like(hits[rank][i])), (rank, need)
            expected = region_values(refs[need.fqn], need.region)
            assert torch.equal(out[rank][i].view(torch.uint8), expected.view(torch.uint8)), (rank, need)


def check_rounds(plan: LoadPlan, round_bytes: int) -> None:
    """Rounds list every unit once in order; in each round every rank's buffers (read, sent and
    received bytes) stay under round_bytes unless that rank's share is one oversized unit; the
    exchange flag is set iff a delivery crosses ranks. A unit that goes whole to one other rank is read
    straight into the send buffer: its reader holds its bytes once."""
    assert [i for r in plan.rounds for i in r] == list(range(len(plan.units)))
    for index, round_units in enumerate(plan.rounds):
        usage: dict[int, int] = defaultdict(int)
        touching: dict[int, int] = defaultdict(int)
        crosses = False
        for i in round_units:
            u = plan.units[i]
            assert u.round == index
            add: dict[int, int] = defaultdict(int)
            into_send = len(u.deliveries) == 1 and u.deliveries[0].rank != u.reader and u.deliveries[0].box == u.box
            add[u.reader] += 0 if into_send else u.nbytes
            item = u.nbytes // max(u.box.numel, 1)
            for d in u.deliveries:
                if d.rank != u.reader:
                    crosses = True
                    add[d.rank] += d.numel * item
                    add[u.reader] += d.numel * item
            for r, n in add.items():
                usage[r] += n
                touching[r] += 1
        for r, n in usage.items():
            assert n <= round_bytes or touching[r] == 1, (index, r, dict(usage))
        assert plan.exchanges[index] == crosses


def tiles(shape: tuple[int, ...], cuts: list[list[int]]) -> list[Box]:
    """The grid of boxes given sorted interior cut points per dimension."""
    edges = [[0, *c, n] for c, n in zip(cuts, shape)]
    boxes = [Box((), ())]
    for e in edges:
        boxes = [Box(b.offsets + (lo,), b.lengths + (hi - lo,)) for b in boxes for lo, hi in zip(e, e[1:])]
    return boxes


# -- strategies --------------------------------------------------------------------------------------
@st.composite
def partition(draw, shape: tuple[int, ...], max_parts: int = 5) -> list[Region]:
    """A random tiling of the tensor: a box grid or consecutive flat ranges (no empty parts)."""
    numel = math.prod(shape)
    if numel == 0:
        return [Box.full(shape)]
    if shape and draw(st.booleans()):
        cuts = [sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(2, n - 1)))) if n > 1 else [] for n in shape]
        return list(tiles(shape, cuts))
    k = draw(st.integers(1, min(max_parts, numel)))
    points = sorted(draw(st.sets(st.integers(1, numel - 1), min_size=k - 1, max_size=k - 1))) if numel > 1 else []
    edges = [0, *points, numel]
    return [FlatRange(a, b) for a, b in zip(edges, edges[1:])]


@st.composite
def scenario(draw):
    """Tensors of 0..3 dims; a saved tiling over 1..4 ranks; a target layout over 1..4 ranks that is a
    tiling (covering), a subset of one (partial), or the full tensor on every rank (replicated)."""
    save_world = draw(st.integers(1, 4))
    load_world = draw(st.integers(1, 4))
    refs, layout, needs, kinds = {}, {}, [[] for _ in range(load_world)], {}
    for t in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        fqn = f"t{t}"
        refs[fqn] = reference(shape, dtype, seed=t)
        saved = draw(partition(shape))
        layout[fqn] = [(draw(st.integers(0, save_world - 1)), r) for r in saved]
        kind = draw(st.sampled_from(["tiling", "partial", "replicated"]))
        kinds[fqn] = kind
        if kind == "replicated":
            for rank in range(load_world):
                needs[rank].append(TargetPiece(fqn=fqn, region=Box.full(shape)))
            continue
        parts = draw(partition(shape))
        for region in parts:
            if kind == "partial" and draw(st.booleans()):
                continue
            needs[draw(st.integers(0, load_world - 1))].append(TargetPiece(fqn=fqn, region=region))
    chunk = draw(st.sampled_from([8, 64, 32 << 20]))
    round_bytes = draw(st.sampled_from([16, 200, 512 << 20]))
    return refs, layout, needs, kinds, chunk, round_bytes


# -- properties --------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(scenario())
def test_random_reshard_delivers_every_element_once_and_reads_exactly(case):
    """Any saved tiling -> any target layout: targets get the reference bits exactly, each element
    once; bytes read equal the distinct needed bytes (amplification 1.00); rounds respect round_bytes."""
    refs, layout, needs, kinds, chunk, round_bytes = case
    tensors, pieces, files = save_fake(refs, layout)
    plan = plan_load(tensors, pieces, needs, chunk_bytes=chunk, round_bytes=round_bytes)
    check_exact(refs, plan, tensors, files, needs)
    check_rounds(plan, round_bytes)
    distinct = 0
    for fqn, ref in refs.items():
        needed: set[int] = set()
        for rank_needs in needs:
            for n in rank_needs:
                if n.fqn == fqn:
                    idx = torch.arange(ref.numel())
                    needed.update(region_values(idx.reshape(ref.shape), n.region).tolist())
        distinct += len(needed) * ref.element_size()
    assert plan.bytes_read == distinct == sum(plan.bytes_read_per_rank)
    delivered = sum(n.region.numel * refs[n.fqn].element_size() for rank_needs in needs for n in rank_needs)
    assert plan.bytes_delivered == delivered


@settings(max_examples=100, deadline=None)
@given(scenario(), st.sampled_from(["node_local", "shared_fs", "object_store"]), st.booleans())
def test_random_reshard_under_any_topology_is_exact(case, store, two_nodes):
    """Whatever route the cost model takes, targets get the reference bits exactly, each element once;
    the group reads at least the distinct needed bytes and at most each rank's needed bytes once."""
    refs, layout, needs, kinds, chunk, round_bytes = case
    tensors, pieces, files = save_fake(refs, layout)
    nodes = [f"n{r % 2 if two_nodes else 0}" for r in range(len(needs))]
    plan = plan_load(tensors, pieces, needs, chunk_bytes=chunk, round_bytes=round_bytes, topology=topology(store, "gloo", nodes))
    check_exact(refs, plan, tensors, files, needs)
    check_rounds(plan, round_bytes)
    per_rank_needed = sum(n.region.numel * refs[n.fqn].element_size() for rank_needs in needs for n in rank_needs)
    assert plan.bytes_read <= per_rank_needed
    assert sum(plan.bytes_by_route().values()) == plan.bytes_read == sum(plan.bytes_read_per_rank)


def test_row_sharded_save_to_column_sharded_load_reads_once():
    """Rows saved by 2 ranks, columns loaded by 3: bytes_read is the tensor's size, one request per
    saved piece (the slab is read whole and handed out), and every value lands right."""
    ref = reference((6, 9), "float32")
    refs = {"w": ref}
    layout = {"w": [(0, Box((0, 0), (3, 9))), (1, Box((3, 0), (3, 9)))]}
    needs = [[TargetPiece(fqn="w", region=Box((0, 3 * r), (6, 3)))] for r in range(3)]
    tensors, pieces, files = save_fake(refs, layout)
    plan = plan_load(tensors, pieces, needs, **SIZES)
    check_exact(refs, plan, tensors, files, needs)
    assert plan.bytes_read == ref.numel() * 4
    assert plan.requests == 2
    assert plan.bytes_delivered == ref.numel() * 4


def test_flat_save_to_box_load_reads_once():
    """FSDP1-like flat ranges (cutting rows mid-way) -> a 2x2 box grid: amplification 1.00, exact bits."""
    ref = reference((5, 7), "bfloat16")
    refs = {"w": ref}
    layout = {"w": [(0, FlatRange(0, 12)), (1, FlatRange(12, 30)), (2, FlatRange(30, 35))]}
    boxes = tiles((5, 7), [[2], [4]])
    needs = [[TargetPiece(fqn="w", region=b)] for b in boxes]
    tensors, pieces, files = save_fake(refs, layout)
    plan = plan_load(tensors, pieces, needs, **SIZES)
    check_exact(refs, plan, tensors, files, needs)
    assert plan.bytes_read == ref.numel() * 2


def test_replicated_targets_read_once_and_spread_over_ranks():
    """4 ranks all needing the full tensor: the group reads it once in total, every rank reads a share
    (small chunks make several units), and each rank still receives all of it."""
    ref = reference((64, 16), "float32")
    refs = {"w": ref}
    layout = {"w": [(0, Box.full((64, 16)))]}
    needs = [[TargetPiece(fqn="w", region=Box.full((64, 16)))] for _ in range(4)]
    tensors, pieces, files = save_fake(refs, layout)
    plan = plan_load(tensors, pieces, needs, chunk_bytes=16 * 4 * 8, round_bytes=DEFAULT_ROUND_BYTES)
    check_exact(refs, plan, tensors, files, needs)
    assert plan.bytes_read == ref.numel() * 4
    per_rank = plan.bytes_read_per_rank
    assert all(b > 0 for b in per_rank) and max(per_rank) <= 2 * min(per_rank), per_rank
    assert plan.bytes_delivered == 4 * ref.numel() * 4


def test_rounds_are_bounded_with_an_oversized_unit_alone():
    """With round_bytes smaller than one unit, each oversized unit sits alone in its round."""
    ref = reference((8, 8), "float32")
    refs = {"w": ref, "small": reference((2,), "float32")}
    layout = {"w": [(0, Box.full((8, 8)))], "small": [(0, Box.full((2,)))]}
    needs = [[TargetPiece(fqn="small", region=Box.full((2,))), TargetPiece(fqn="w", region=Box.full((8, 8)))]]
    tensors, pieces, files = save_fake(refs, layout)
    plan = plan_load(tensors, pieces, needs, chunk_bytes=DEFAULT_CHUNK_BYTES, round_bytes=100)
    check_exact(refs, plan, tensors, files, needs)
    check_rounds(plan, 100)
    big = [r for r in plan.rounds if any(plan.units[i].nbytes > 100 for i in r)]
    assert big and all(len(r) == 1 for r in big)


def test_missing_piece_raises_corrupt():
    """A saved tiling with one piece dropped cannot serve a full load: CorruptCheckpointError naming it."""
    ref = reference((4, 4), "float32")
    layout = {"w": [(0, Box((0, 0), (2, 4))), (1, Box((2, 0), (2, 4)))]}
    tensors, pieces, _ = save_fake({"w": ref}, layout)
    pieces["w"] = pieces["w"][:1]
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        plan_load(tensors, pieces, [[TargetPiece(fqn="w", region=Box.full((4, 4)))]], **SIZES)
    with pytest.raises(CorruptCheckpointError):
        plan_load(tensors, {}, [[TargetPiece(fqn="w", region=FlatRange(3, 9))]], **SIZES)


def test_overlapping_saved_pieces_raise_corrupt():
    """Saved pieces that overlap (a crafted or broken checkpoint) are detected, not double-written."""
    ref = reference((4, 4), "float32")
    layout = {"w": [(0, Box((0, 0), (3, 4))), (1, Box((2, 0), (2, 4)))]}
    tensors, pieces, _ = save_fake({"w": ref}, layout)
    with pytest.raises(CorruptCheckpointError):
        plan_load(tensors, pieces, [[TargetPiece(fqn="w", region=Box.full((4, 4)))]], **SIZES)


def test_zero_dim_and_zero_size_tensors():
    """A 0-d tensor is delivered to every rank; a zero-size tensor needs no reads."""
    refs = {"s": reference((), "int64"), "z": reference((0, 3), "float32")}
    layout = {"s": [(0, Box((), ()))], "z": [(0, Box.full((0, 3)))]}
    needs = [[TargetPiece(fqn="s", region=Box((), ())), TargetPiece(fqn="z", region=Box.full((0, 3)))]] * 2
    tensors, pieces, files = save_fake(refs, layout)
    plan = plan_load(tensors, pieces, needs, **SIZES)
    check_exact(refs, plan, tensors, files, needs)
    assert plan.bytes_read == 8 and all(u.fqn == "s" for u in plan.units)


def test_plan_is_deterministic():
    """Equal inputs give equal plans (every rank computes the same one without communication)."""
    ref = reference((12, 10), "float32")
    layout = {"w": [(r, Box((3 * r, 0), (3, 10))) for r in range(4)]}
    tensors, pieces, _ = save_fake({"w": ref}, layout)
    needs = [[TargetPiece(fqn="w", region=FlatRange(40 * r, 40 * r + 40))] for r in range(3)]

    def summary(p: LoadPlan):
        return [(u.fqn, u.box, u.file, u.run_offsets.tolist(), u.run_bytes, u.reader, u.deliveries, u.round)
                for u in p.units]

    assert summary(plan_load(tensors, pieces, needs, **SIZES)) == summary(plan_load(tensors, pieces, needs, **SIZES))


@pytest.mark.slow
def test_scale_1000_tensors_64_ranks_reads_every_byte_once():
    """~1000 tensors saved by 64 FSDP-like row shards (plus replicated norms) and loaded by 64 ranks
    with a different sharding reads each byte once (planning time is measured by benchmarks/bench_planner.py)."""
    world = 64
    tensors: dict[str, TensorMeta] = {}
    pieces: dict[str, list[PieceMeta]] = {}
    needs: list[list[TargetPiece]] = [[] for _ in range(world)]
    offset = [0] * world
    for i in range(1000):
        fqn = f"layers.{i // 10}.p{i % 10}"
        if i % 10 < 6:
            shape = (1024, 256)
            saved = [Box((16 * r, 0), (16, 256)) for r in range(world)]
            wanted = [FlatRange(4096 * r, 4096 * (r + 1)) for r in range(world)]
        else:
            shape = (256,)
            saved = [Box.full(shape)]
            wanted = [Box.full(shape)] * world
        tensors[fqn] = TensorMeta(fqn=fqn, dtype="float32", shape=shape)
        pieces[fqn] = []
        for r, region in enumerate(saved):
            n = region.numel * 4
            pieces[fqn].append(PieceMeta(fqn=fqn, region=region, file=f"data/rank-{r:05d}.bin",
                                         byte_offset=offset[r], byte_length=n, crc32c=0))
            offset[r] += n
        for r, region in enumerate(wanted):
            needs[r].append(TargetPiece(fqn=fqn, region=region))
    plan = plan_load(tensors, pieces, needs, **SIZES)
    assert plan.bytes_read == sum(t.nbytes for t in tensors.values())


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_whole_box_unit_is_what_the_general_path_plans(data):
    """The unchanged layout's shortcut (one target takes a saved box whole) gives the draft the general
    path (slabs, routes, runs) gives for that box: same box, runs, bytes and delivery."""
    from tierckpt.planner import slab_units as lp
    from tierckpt.native.regions import StoredBox

    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    box = Box(offsets, tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets)))
    item = data.draw(st.sampled_from([1, 2, 4, 8]))
    base = data.draw(st.integers(0, 1 << 20))
    meta = TensorMeta(fqn="t", dtype="float32", shape=shape)
    need = (data.draw(st.integers(0, 3)), data.draw(st.integers(0, 9)), StoredBox(box, 0), box)
    chunk = box.numel * item + data.draw(st.integers(0, 64))
    general = lp.box_units(meta, box, "f", base, [need], item, chunk, topology("object_store", "gloo", ("",) * 4))
    whole = lp.whole_box_unit(meta, box, "f", base, need, item)
    assert len(general) == 1
    assert whole.keys() == general[0].keys()
    for key in whole:
        if key == "run_offsets":
            assert whole[key].dtype == general[0][key].dtype and whole[key].tolist() == general[0][key].tolist()
        else:
            assert whole[key] == general[0][key], key
