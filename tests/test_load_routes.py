"""Load routes: the cost model as a pure function, plans under each topology, and real loads that count
the bytes each route reads and exchanges (DDP resume on one node, on two simulated nodes, from S3)."""

from __future__ import annotations

import pytest

import scenarios_routes
from test_load_planner import check_exact, reference, save_fake
from tierckpt.errors import CheckpointError
from tierckpt.io.readcheck import checking_ranks
from tierckpt.loading.api import DEFAULT_CHUNK_BYTES, DEFAULT_ROUND_BYTES
from tierckpt.node.host import NODE_ID_ENV, node_id
from tierckpt.planner import TargetPiece, plan_load
from tierckpt.planner.routes import (
    DIRECT, EXCHANGE, NODE, RankRead, choose_route, direct_seconds, exchange_seconds, store_kind, topology,
)
from tierckpt.native.regions import Box

MiB = 1 << 20


# -- node identity -----------------------------------------------------------------------------------
def test_node_id_is_the_host_name_unless_overridden(monkeypatch):
    import socket

    monkeypatch.delenv(NODE_ID_ENV, raising=False)
    assert node_id() == socket.gethostname()
    monkeypatch.setenv(NODE_ID_ENV, "rack3-node7")
    assert node_id() == "rack3-node7"
    monkeypatch.setenv(NODE_ID_ENV, "")
    assert node_id() == socket.gethostname()


# -- the cost model ----------------------------------------------------------------------------------
def test_store_kind_of_a_local_path_depends_on_the_nodes():
    assert store_kind(local_path=True, scheme="", nodes=["a", "a"]) == "node_local"
    assert store_kind(local_path=True, scheme="file", nodes=["a", "b"]) == "shared_fs"
    assert store_kind(local_path=False, scheme="s3", nodes=["a", "a"]) == "object_store"
    assert store_kind(local_path=False, scheme="memory", nodes=["a"]) == "memory"


def replicated(world: int, nbytes: int = 64 * MiB) -> list[RankRead]:
    return [RankRead(r, nbytes, 1) for r in range(world)]


@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("exchange", ["gloo", "nccl"])
def test_replicated_slab_on_one_node_reads_a_local_file_directly(world, exchange):
    """DDP resume: every rank needs the whole slab; on one node the repeats come from the page cache."""
    topo = topology("node_local", exchange, ["n"] * world)
    assert choose_route(replicated(world), 64 * MiB, 1, topo) == DIRECT


@pytest.mark.parametrize("nodes", [["a", "b"], ["a"] * 4 + ["b"] * 4])
def test_replicated_slab_across_nodes_is_read_once_and_exchanged(nodes):
    """A local path seen from two nodes is a shared file system: repeats would be storage traffic."""
    topo = topology(store_kind(local_path=True, scheme="", nodes=nodes), "gloo", nodes)
    reads = replicated(len(nodes))
    assert topo.store.kind == "shared_fs"
    assert exchange_seconds(reads, 64 * MiB, 1, topo) < direct_seconds(reads, 64 * MiB, topo)
    assert choose_route(reads, 64 * MiB, 1, topo) == EXCHANGE


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_slab_from_an_object_store_is_read_once(world):
    topo = topology("object_store", "gloo", ["n"] * world)
    assert choose_route(replicated(world), 64 * MiB, 1, topo) == EXCHANGE


@pytest.mark.parametrize("cores", [0, 2, 16])
def test_replicated_slab_from_an_object_store_is_read_once_by_8_ranks_whatever_the_cores(cores):
    """Oversubscribed nodes make node-local messages dearer, never dearer than reading from S3 again."""
    topo = topology("object_store", "gloo", ["n"] * 8, cores)
    assert choose_route(replicated(8), 64 * MiB, 1, topo) == EXCHANGE
    topo = topology("object_store", "gloo", ["a"] * 4 + ["b"] * 4, cores)
    assert choose_route(replicated(8), 64 * MiB, 1, topo) == EXCHANGE


def test_tiny_replicated_tensor_on_local_disk_is_not_worth_a_message():
    """A bias or a step counter: one positional read per rank beats a delivery in an all-to-all."""
    topo = topology("node_local", "gloo", ["n"] * 2)
    assert choose_route(replicated(2, 8), 8, 1, topo) == DIRECT
    assert choose_route(replicated(2, 8), 8, 1, topology("object_store", "gloo", ["n"] * 2)) == EXCHANGE


def strided(run_bytes: int, world: int = 3, slab: int = 32 * MiB) -> list[RankRead]:
    """Disjoint column blocks of a row slab: each rank's share comes in runs of ``run_bytes``."""
    share = slab // world
    return [RankRead(r, share, share // run_bytes) for r in range(world)]


@pytest.mark.parametrize("store,short,long", [("node_local", 128, 4096), ("object_store", 64 << 10, 4 * MiB)])
def test_disjoint_needs_go_direct_once_runs_amortize_a_request(store, short, long):
    """Local disk: runs of about 1 KiB are worth a pread each; object store: about 1 MiB per GET."""
    topo = topology(store, "gloo", ["n"] * 3)
    assert choose_route(strided(short), 32 * MiB, 1, topo) == EXCHANGE
    assert choose_route(strided(long), 32 * MiB, 1, topo) == DIRECT


def column_windows(world: int, slab: int = 32 * MiB, row: int = 16 << 10) -> list[RankRead]:
    """A row -> column reshard: each rank needs a 1/world column window of every row of the slab, so its
    runs pass over the whole slab."""
    share = slab // world
    return [RankRead(r, share, slab // row, walked=slab - row + row // world) for r in range(world)]


@pytest.mark.parametrize("world,cores,route", [
    (2, 16, DIRECT), (4, 16, DIRECT), (8, 16, EXCHANGE), (16, 16, EXCHANGE),  # a core per rank
    (8, 2, DIRECT), (16, 2, EXCHANGE),  # oversubscribed: the exchange's messages do not overlap
])
def test_a_node_walking_each_slab_once_per_rank_reads_once_and_exchanges_at_scale(world, cores, route):
    """Direct, N ranks each walk the whole slab in the node's page cache; exchanged, one reader walks it."""
    topo = topology("node_local", "gloo", ["n"] * world, cores)
    reads = column_windows(world)
    assert choose_route(reads, 32 * MiB, 1, topo) == route
    # the walk is what tips it: without it (contiguous needs of the same bytes), direct at every size
    flat = [RankRead(r.rank, r.nbytes, r.requests) for r in reads]
    assert choose_route(flat, 32 * MiB, 1, topo) == DIRECT


def test_one_rank_always_reads_directly():
    topo = topology("object_store", "gloo", ["a", "b"])
    assert choose_route([RankRead(1, 10, 10_000)], 10, 1, topo) == DIRECT


# -- plans under a topology ------------------------------------------------------------------------
def ddp_case(world: int):
    ref = reference((64, 16), "float32")
    tensors, pieces, files = save_fake({"w": ref}, {"w": [(0, Box((0, 0), (40, 16))), (1, Box((40, 0), (24, 16)))]})
    needs = [[TargetPiece(fqn="w", region=Box.full((64, 16)))] for _ in range(world)]
    return {"w": ref}, tensors, pieces, files, needs


def test_plan_on_one_node_reads_each_replica_directly_and_exchanges_nothing():
    refs, tensors, pieces, files, needs = ddp_case(3)
    plan = plan_load(tensors, pieces, needs, chunk_bytes=1024, round_bytes=DEFAULT_ROUND_BYTES, topology=topology("node_local", "gloo", ["n"] * 3))
    check_exact(refs, plan, tensors, files, needs)
    assert plan.bytes_read_per_rank == (64 * 16 * 4,) * 3
    assert not any(plan.exchanges) and {u.route for u in plan.units} == {DIRECT}
    assert plan.bytes_by_route() == {DIRECT: 3 * 64 * 16 * 4, NODE: 0, EXCHANGE: 0}


def test_units_read_alike_on_one_node_are_checked_once_sharing_the_work():
    refs, tensors, pieces, files, needs = ddp_case(3)
    plan = plan_load(tensors, pieces, needs, chunk_bytes=1024, round_bytes=DEFAULT_ROUND_BYTES, topology=topology("node_local", "gloo", ["n"] * 3))
    checkers = checking_ranks(plan.units, ["n"] * 3)
    by_bytes: dict[tuple, set[int]] = {}
    for u, checker in zip(plan.units, checkers):
        by_bytes.setdefault((u.file, u.run_offsets.tobytes(), u.run_bytes), set()).add(checker)
    assert all(len(c) == 1 for c in by_bytes.values())  # the same bytes: one checker for all three readers
    assert len(by_bytes) == len(plan.units) // 3
    assert set().union(*by_bytes.values()) == {0, 1, 2}  # the work is shared
    # ranks of different nodes read through different page caches: each checks what it reads
    assert checking_ranks(plan.units, ["a", "b", "c"]) == [u.reader for u in plan.units]


@pytest.mark.parametrize("store,nodes", [("shared_fs", ["a", "b", "c"]), ("object_store", ["n"] * 3)])
def test_plan_across_nodes_or_from_s3_reads_each_byte_once(store, nodes):
    refs, tensors, pieces, files, needs = ddp_case(3)
    plan = plan_load(tensors, pieces, needs, chunk_bytes=1024, round_bytes=DEFAULT_ROUND_BYTES, topology=topology(store, "gloo", nodes))
    check_exact(refs, plan, tensors, files, needs)
    assert plan.bytes_read == 64 * 16 * 4
    assert all(plan.exchanges) and {u.route for u in plan.units} == {EXCHANGE}


def test_plan_on_two_nodes_with_two_ranks_each():
    """Two nodes of two ranks: still one read per byte for the group (the repeats would cross the store)."""
    refs, tensors, pieces, files, needs = ddp_case(4)
    nodes = ["a", "a", "b", "b"]
    plan = plan_load(tensors, pieces, needs, chunk_bytes=1024, round_bytes=DEFAULT_ROUND_BYTES, topology=topology("shared_fs", "gloo", nodes))
    check_exact(refs, plan, tensors, files, needs)
    assert plan.bytes_read == 64 * 16 * 4


def test_topology_must_name_every_rank():
    refs, tensors, pieces, files, needs = ddp_case(2)
    with pytest.raises(CheckpointError, match="1 ranks but 2 ranks load"):
        plan_load(
            tensors, pieces, needs, chunk_bytes=DEFAULT_CHUNK_BYTES, round_bytes=DEFAULT_ROUND_BYTES,
            topology=topology("node_local", "gloo", ["n"]),
        )


# -- real loads: bytes read and exchanged per route ----------------------------------------------------
def _totals(stats: list[dict]) -> tuple[int, int, int, int]:
    ranks = [s for s in stats if s]
    assert len(ranks) == 2
    tensor_bytes, num_tensors = int(ranks[0]["tensor_bytes"]), int(ranks[0]["num_tensors"])
    read = sum(int(s.get("bytes_read", 0)) for s in ranks)
    exchanged = sum(int(s.get("bytes_exchanged", 0)) for s in ranks)
    return tensor_bytes, num_tensors, read, exchanged


@pytest.mark.multiproc
def test_ddp_resume_on_one_node_reads_the_local_file_on_every_rank(dist_pool, tmp_path):
    stats = dist_pool.run(scenarios_routes.ddp_resume, str(tmp_path / "ckpt"), None, False)
    tensor_bytes, _, read, exchanged = _totals(stats)
    assert read == 2 * tensor_bytes  # each rank reads the whole (replicated) state itself
    assert exchanged == 0
    assert all(s.get("units_exchange", 0) == 0 and s["bytes_read_direct"] == tensor_bytes for s in stats if s)
    # the two ranks read the same page cache: each byte's checksum is computed once on the node, the work shared
    checked = [int(s.get("bytes_checked", 0)) for s in stats if s]
    assert sum(checked) == tensor_bytes and min(checked) > 0


@pytest.mark.multiproc
def test_flips_in_a_replicated_direct_load_are_caught_on_every_rank(dist_pool, tmp_path):
    """Checks shared between the ranks of a node still catch every flip, and every rank raises."""
    stats = [s for s in dist_pool.run(scenarios_routes.replicated_flips, str(tmp_path / "ckpt"), 8, 21) if s]
    assert len(stats) == 2
    assert all(s["tried"] == 8 and s["caught"] == 8 for s in stats)
    assert sum(s["bytes_read"] for s in stats) == 2 * stats[0]["tensor_bytes"]
    assert sum(s["bytes_checked"] for s in stats) == stats[0]["tensor_bytes"]


def _read_once(stats: list[dict]) -> None:
    tensor_bytes, num_tensors, read, exchanged = _totals(stats)
    assert read == tensor_bytes  # each byte read once by the group
    assert sum(int(s.get("bytes_checked", 0)) for s in stats if s) == tensor_bytes  # and checked once
    # every byte reaches the other rank once (each delivery padded to 16 bytes in the exchange stream)
    assert tensor_bytes <= exchanged < tensor_bytes + 16 * 4 * num_tensors
    # each unit goes to its reader and to the other rank: its bytes are packed into the send buffer once
    assert sum(int(s.get("bytes_packed", 0)) for s in stats if s) == tensor_bytes
    assert all(s.get("units_direct", 0) == 0 for s in stats if s)


@pytest.mark.multiproc
def test_ddp_resume_on_two_simulated_nodes_reads_once_and_exchanges(dist_pool, tmp_path):
    _read_once(dist_pool.run(scenarios_routes.ddp_resume, str(tmp_path / "ckpt"), None, True))


@pytest.mark.multiproc
def test_ddp_resume_from_s3_reads_once_and_exchanges(dist_pool, s3_bucket_uri, s3_server):
    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing", "region": "us-east-1"}
    _read_once(dist_pool.run(scenarios_routes.ddp_resume, s3_bucket_uri, options, False))


@pytest.mark.multiproc
def test_large_deliveries_between_ranks_land_straight_in_their_targets(dist_pool, tmp_path):
    stats = [s for s in dist_pool.run(scenarios_routes.large_exchange, str(tmp_path / "ckpt")) if s]
    assert len(stats) == 2
    w_bytes = stats[0]["w_bytes"]
    # Every half of w and t is read by one rank and sent to the other; w's halves land in place.
    assert sum(int(s.get("bytes_exchanged", 0)) for s in stats) == 2 * w_bytes
    assert sum(int(s.get("bytes_received_in_place", 0)) for s in stats) == w_bytes
    # Each half is contiguous where its reader read it: sent from there, never packed into a send buffer.
    assert sum(int(s.get("bytes_sent_in_place", 0)) for s in stats) == 2 * w_bytes
    assert sum(int(s.get("bytes_packed", 0)) for s in stats) == 0
    assert sum(int(s.get("bytes_read", 0)) for s in stats) == 2 * w_bytes
