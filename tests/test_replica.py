"""Peer replicas: the pure peer choice, and real gloo groups simulating nodes on one machine.

Each simulated node has its own ``TIERCKPT_NODE_ID`` and memory-tier directory; the replicator copies
every node's files to its peers' tiers over a dedicated gloo group. Checked: bit-exact copies with
CRC-checked manifests and ``COMMIT`` on the peers, the level ``replicated`` only when every peer
acknowledged, a refusing peer (budget full) and a peer killed mid-replication leaving ``memory`` with
the reason within a bounded time.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import crc32c
import pytest

from distributed import free_port
from tierckpt.errors import CheckpointError
from tierckpt.node.memory.peers import plan_replicas, replica_count

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import replica_child  # noqa: E402


# -- peer choice (pure) ------------------------------------------------------------------------------------
def test_default_replica_count() -> None:
    assert replica_count(1, {}) == 0 and replica_count(2, {}) == 1 and replica_count(8, {}) == 1
    assert replica_count(4, {"TIERCKPT_REPLICAS": "3"}) == 3
    with pytest.raises(CheckpointError, match="TIERCKPT_REPLICAS=2 but the job spans 2 node.*at most 1"):
        replica_count(2, {"TIERCKPT_REPLICAS": "2"})
    with pytest.raises(CheckpointError, match="TIERCKPT_REPLICAS='-1'"):
        replica_count(2, {"TIERCKPT_REPLICAS": "-1"})


def test_nodes_leaders_and_peers() -> None:
    plan = plan_replicas(["b", "b", "a", "a", "c", "c"], env={})
    assert plan.nodes == ("b", "a", "c") and plan.leaders == (0, 2, 4) and plan.replicas == 1
    assert [plan.targets(i) for i in range(3)] == [(1,), (2,), (0,)]
    assert [plan.sources(i) for i in range(3)] == [(2,), (0,), (1,)]
    assert plan_replicas(["x", "x"], env={}).replicas == 0
    with pytest.raises(CheckpointError, match="3 replicas per node cannot be placed on the job's 3 node"):
        plan_replicas(["a", "b", "c"], replicas=3)


@pytest.mark.parametrize("nodes", range(1, 7))
def test_losing_any_r_nodes_loses_nothing_and_stages_pair_up(nodes: int) -> None:
    for replicas in range(nodes):
        plan = plan_replicas([f"n{i}" for i in range(nodes)], replicas=replicas)
        for i in range(nodes):
            holders = {i, *plan.targets(i)}
            assert len(holders) == replicas + 1  # R distinct other nodes
            for k, target in enumerate(plan.targets(i)):
                assert plan.sources(target)[k] == i  # a sender's k-th transfer meets its receiver's k-th


# -- real gloo groups in the worker pool ---------------------------------------------------------------------
URI = "s3://bucket/run/step-3"
DATA = 2 * (1 << 20) + 12345  # not a whole number of pages


def data_of(rank: int) -> bytes:
    return bytes((rank * 13 + i) % 256 for i in range(256)) * (DATA // 256) + bytes([rank]) * (DATA % 256)


def _replicate_scenario(workdir: str, per_node: int, replicas: int | None, small_budget_node: str | None,
                        damage_sent: bool = False) -> dict:
    """Every rank writes its file into its node's tier, rank 0 also metadata and COMMIT; all replicate.

    ``damage_sent``: rank 0 flips the first byte of each file it sends, after its manifest recorded the CRC-32C."""
    import asyncio

    import torch.distributed as dist

    from tierckpt.native.layout import COMMIT, CommitRecord, new_generation
    from tierckpt.node.memory import MemoryConfig, NodeMemory
    from tierckpt.node.memory import transfer
    from tierckpt.node.memory.replica import Replicator

    rank = dist.get_rank()
    node_name = f"node-{rank // per_node}"
    saved = os.environ.get("TIERCKPT_NODE_ID")
    os.environ["TIERCKPT_NODE_ID"] = node_name
    try:
        budget = 4 * DATA if node_name == small_budget_node else 1 << 30
        node = NodeMemory(MemoryConfig(directory=os.path.join(workdir, node_name), budget_bytes=budget))
        box = [new_generation(1) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        generation = box[0]
        tier = node.tier(URI)
        asyncio.run(tier.put(f"{generation}/data/rank-{rank:05d}.bin", data_of(rank)))
        if rank == 0:
            asyncio.run(tier.put(f"{generation}/meta/header.json", b'{"header": true}'))
            asyncio.run(tier.put(f"{generation}/objects/rank-00000.bin", b""))  # an empty file travels too
        dist.barrier()
        if rank == 0:
            asyncio.run(tier.commit(COMMIT, CommitRecord(generation, 1.0, 1).encode()))
        dist.barrier()
        send_file = transfer.Stream.send_file

        def damaged_send(self: transfer.Stream, fd: int, nbytes: int, key: str) -> None:
            sent = bytearray(os.pread(fd, nbytes, 0))
            if sent:
                sent[0] ^= 0xFF
            self.conn.sendall(sent)

        if damage_sent and rank == 0:
            transfer.Stream.send_file = damaged_send  # type: ignore[method-assign]
        try:
            replicator = Replicator(node, replicas=replicas, timeout_s=30)
            result = replicator.replicate(URI, generation).wait(timeout_s=120)
            replicator.close()
        finally:
            transfer.Stream.send_file = send_file  # type: ignore[method-assign]
        dist.barrier()
        return {"generation": generation, "node": node_name, "level": result.level.value, "reason": result.reason,
                "acknowledged": list(result.acknowledged), "held": sorted(tier.held(generation)),
                "problems": tier.verify(generation)}
    finally:
        if saved is None:
            os.environ.pop("TIERCKPT_NODE_ID", None)
        else:
            os.environ["TIERCKPT_NODE_ID"] = saved


def tier_file(workdir: Path, node: str, key: str) -> bytes:
    from tierckpt.node.memory.memory import uri_digest

    return (workdir / node / uri_digest(URI) / "objects" / key).read_bytes()


def test_two_nodes_of_two_ranks_replicate_bit_exact(dist_pool, tmp_path: Path) -> None:
    results = dist_pool.run(_replicate_scenario, str(tmp_path), 2, None, None)
    generation = results[0]["generation"]
    files = [f"{generation}/data/rank-{r:05d}.bin" for r in range(4)] + [
        f"{generation}/meta/header.json", f"{generation}/objects/rank-00000.bin"]
    for r in results:
        assert r["level"] == "replicated" and r["reason"] is None, r
        assert r["held"] == sorted(files) and r["problems"] == []  # each node: its own files and its peer's
    assert results[0]["acknowledged"] == ["node-1"] and results[2]["acknowledged"] == ["node-0"]
    for node in ("node-0", "node-1"):
        for r in range(4):
            assert tier_file(tmp_path, node, f"{generation}/data/rank-{r:05d}.bin") == data_of(r)
    assert tier_file(tmp_path, "node-1", "COMMIT") == tier_file(tmp_path, "node-0", "COMMIT")
    assert tier_file(tmp_path, "node-1", f"{generation}/meta/header.json") == b'{"header": true}'
    assert tier_file(tmp_path, "node-1", f"{generation}/objects/rank-00000.bin") == b""


def test_a_replica_damaged_on_the_way_is_discarded_where_it_lands(dist_pool, tmp_path: Path) -> None:
    results = dist_pool.run(_replicate_scenario, str(tmp_path), 2, None, None, True)
    generation = results[0]["generation"]
    node0, node1 = results[0], results[2]
    assert node0["level"] == "memory" and "arrived with" in node0["reason"] and "discarded" in node0["reason"], node0
    assert node1["level"] == "replicated", node1  # the other way round is undamaged
    with pytest.raises(FileNotFoundError):
        tier_file(tmp_path, "node-1", f"{generation}/data/rank-00000.bin")


def test_four_nodes_two_replicas_each(dist_pool, tmp_path: Path) -> None:
    results = dist_pool.run(_replicate_scenario, str(tmp_path), 1, 2, None)
    generation = results[0]["generation"]
    for rank, r in enumerate(results):
        assert r["level"] == "replicated", r
        assert r["acknowledged"] == [f"node-{(rank + 1) % 4}", f"node-{(rank + 2) % 4}"]
        own = {f"{generation}/data/rank-{s:05d}.bin" for s in (rank, (rank - 1) % 4, (rank - 2) % 4)}
        assert own <= set(r["held"]) and f"{generation}/data/rank-{(rank + 1) % 4:05d}.bin" not in r["held"]
        for s in (rank, (rank - 1) % 4, (rank - 2) % 4):
            assert crc32c.crc32c(tier_file(tmp_path, f"node-{rank}", f"{generation}/data/rank-{s:05d}.bin")) == crc32c.crc32c(data_of(s))


def test_a_peer_without_room_refuses_and_the_level_stays_memory(dist_pool, tmp_path: Path) -> None:
    results = dist_pool.run(_replicate_scenario, str(tmp_path), 2, None, "node-1")  # node-1 holds 4 files at most
    node0, node1 = results[0], results[2]
    assert node1["level"] == "replicated"  # node-0 had room for node-1's files
    assert node0["level"] == "memory" and node0["acknowledged"] == []
    assert "peer node-1 (rank 2) refused" in node0["reason"] and "TIERCKPT_MEMORY_BYTES" in node0["reason"]
    assert results[1]["level"] == "memory"  # the node's other rank reads the same level
    assert not any(k.endswith("rank-00000.bin") for k in node1["held"])


# -- a node lost during replication (separate processes, so one can die) ---------------------------------------
def _generation_in_tier(directory: str, rank: int, payload: bytes) -> tuple[object, str]:
    """A node memory under ``directory`` holding rank ``rank``'s ``payload`` in a new generation of
    :data:`URI` that rank 0 commits (every rank of the default group calls it)."""
    import asyncio

    import torch.distributed as dist

    from tierckpt.native.layout import COMMIT, CommitRecord, new_generation
    from tierckpt.node.memory import MemoryConfig, NodeMemory

    node = NodeMemory(MemoryConfig(directory=directory, budget_bytes=1 << 30))
    box = [new_generation(1) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tier = node.tier(URI)
    asyncio.run(tier.put(f"{box[0]}/data/rank-{rank:05d}.bin", payload))
    dist.barrier()
    if rank == 0:
        asyncio.run(tier.commit(COMMIT, CommitRecord(box[0], 1.0, 1).encode()))
    dist.barrier()
    return node, box[0]


@contextlib.contextmanager
def _as_node(rank: int) -> Iterator[str]:
    """This process as a rank of node ``node-{rank // 2}`` (2 ranks per node) while inside; the node's name."""
    saved = os.environ.get("TIERCKPT_NODE_ID")
    os.environ["TIERCKPT_NODE_ID"] = f"node-{rank // 2}"
    try:
        yield os.environ["TIERCKPT_NODE_ID"]
    finally:
        if saved is None:
            os.environ.pop("TIERCKPT_NODE_ID", None)
        else:
            os.environ["TIERCKPT_NODE_ID"] = saved


def _two_replicators_scenario(workdir: str) -> dict:
    """Two memory tier configurations (directories ``a`` and ``b``), each with its replicator over the default
    group, replicate a generation at the same time: ``b``'s files hold ``a``'s bytes reversed, so a message
    taken by the other replicator shows."""
    import torch.distributed as dist

    from tierckpt.node.memory.replica import Replicator

    rank = dist.get_rank()
    with _as_node(rank) as node_name:
        replicators, generations = {}, {}
        for config in ("a", "b"):
            payload = data_of(rank)[::-1] if config == "b" else data_of(rank)
            node, generations[config] = _generation_in_tier(os.path.join(workdir, config, node_name), rank, payload)
            replicators[config] = Replicator(node, timeout_s=30)
        handles = {config: r.replicate(URI, generations[config]) for config, r in replicators.items()}
        results = {config: handle.wait(timeout_s=120) for config, handle in handles.items()}
        for replicator in replicators.values():
            replicator.close()
        dist.barrier()
        a, b = replicators["a"], replicators["b"]
        return {"generations": generations, "levels": {c: [r.level.value, r.reason] for c, r in results.items()},
                "one_side_group": a.side_group is not None and a.side_group is b.side_group,
                "channels_differ": a._wire._channel != b._wire._channel}


def test_two_replicators_of_one_process_share_its_side_group_on_channels_of_their_own(dist_pool, tmp_path: Path) -> None:
    results = dist_pool.run(_two_replicators_scenario, str(tmp_path))
    for r in results:
        assert r["levels"] == {"a": ["replicated", None], "b": ["replicated", None]}, r
        assert r["one_side_group"] and r["channels_differ"], r
    for config in ("a", "b"):
        generation = results[0]["generations"][config]
        for node in ("node-0", "node-1"):
            for rank in range(4):
                sent = data_of(rank)[::-1] if config == "b" else data_of(rank)
                assert tier_file(tmp_path / config, node, f"{generation}/data/rank-{rank:05d}.bin") == sent


def _without_a_side_group_scenario(workdir: str) -> dict:
    """A group whose store torch does not share (so no side group): the replicator replicates over a gloo
    group of its own, and a load's lanes are the group itself."""
    import torch.distributed as dist

    from tierckpt.comm import Comm
    from tierckpt.loading import peer_lanes
    from tierckpt.node.memory import sidegroup
    from tierckpt.node.memory.replica import Replicator

    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size())))
    store_of = sidegroup._store_of
    sidegroup._store_of = lambda g: None if g is group else store_of(g)
    try:
        with _as_node(rank) as node_name:
            node, generation = _generation_in_tier(os.path.join(workdir, node_name), rank, data_of(rank))
            replicator = Replicator(node, group=group, timeout_s=30)
            result = replicator.replicate(URI, generation).wait(timeout_s=120)
            replicator.close()
        lanes = peer_lanes.lanes_of(Comm(group), tag=9)
        dist.barrier()
        return {"generation": generation, "level": [result.level.value, result.reason],
                "side_group": replicator.side_group, "lanes": [lanes.count, lanes.side, lanes.tag]}
    finally:
        sidegroup._store_of = store_of


def test_without_a_side_group_the_replicator_uses_a_group_of_its_own(dist_pool, tmp_path: Path) -> None:
    results = dist_pool.run(_without_a_side_group_scenario, str(tmp_path))
    for r in results:
        assert r["level"] == ["replicated", None] and r["side_group"] is None, r
        assert r["lanes"] == [1, None, 9]  # the load streams over its own group, under the stream's tag
    generation = results[0]["generation"]
    for node in ("node-0", "node-1"):
        for rank in range(4):
            assert tier_file(tmp_path, node, f"{generation}/data/rank-{rank:05d}.bin") == data_of(rank)


def _a_leader_that_never_connects_scenario(workdir: str) -> dict:
    """Over a new group (side group timeout 20 s), node-1's leader (rank 2) builds its replicator without
    connecting its pairs; every replicator's timeout is 3 s. Then every rank replicates a generation."""
    import datetime
    import time

    import torch.distributed as dist

    from tierckpt.node.memory.replica import Replicator
    from tierckpt.node.memory.wire import Wire

    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=20))
    connect = Wire.connect
    if rank == 2:
        Wire.connect = lambda self, peers, kind: {}  # type: ignore[method-assign]
    out: dict = {}
    try:
        with _as_node(rank) as node_name:
            node, generation = _generation_in_tier(os.path.join(workdir, node_name), rank, data_of(rank))
            started = time.monotonic()
            replicator = Replicator(node, group=group, timeout_s=3)
            out["built_s"] = time.monotonic() - started
            result = replicator.replicate(URI, generation).wait(timeout_s=60)
            replicator.close()
            out["level"] = [result.level.value, result.reason]
    finally:
        Wire.connect = connect  # type: ignore[method-assign]
    dist.barrier()
    return out


def test_a_leader_that_never_connects_is_unreachable_within_the_replicators_timeout(dist_pool, tmp_path: Path) -> None:
    """Node-0's leader gives up on node-1's within the replicator's timeout (not the side group's): its
    generation stays at ``memory`` naming the peer that did not connect, and every rank goes on (no save
    fails on one rank alone)."""
    results = dist_pool.run(_a_leader_that_never_connects_scenario, str(tmp_path))
    level, reason = results[0]["level"]
    assert level == "memory" and "peer node-1 (rank 2) is unreachable since: it did not connect to rank 0" in reason, reason
    assert results[0]["built_s"] < 15  # the replicator's 3 s, not the side group's 20 s
    assert results[2]["level"][0] == "memory" and "peer node-0 (rank 0)" in results[2]["level"][1]  # bounded too


def run_children(tmp_path: Path, fail: str) -> tuple[list[subprocess.Popen], str]:
    """Four ranks on two simulated nodes; node-1's leader fails (``fail``) on its first file of generation 2."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "replica_child.py"), str(r), "4", "2", str(port), str(tmp_path),
             f"--fail={fail}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for r in range(4)
    ]
    try:
        for p in procs[:3] if fail == "kill" else procs[:2]:  # node-0, and node-1's leader when it dies
            p.wait(timeout=150)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    logs = "\n".join(f"--- rank {r} ---\n{p.stdout.read().decode(errors='replace')}" for r, p in enumerate(procs))
    return procs, logs


def test_a_peer_killed_mid_replication_leaves_memory_with_the_reason(tmp_path: Path) -> None:
    procs, logs = run_children(tmp_path, "kill")
    assert procs[2].returncode == 9, logs  # the leader of node-1 died on its first received file
    leader, other = (json.loads((tmp_path / f"result-{r}.json").read_text())["results"] for r in (0, 1))
    first, second = sorted(leader)
    assert leader[first]["level"] == "replicated" and leader[first]["acknowledged"] == ["node-1"], logs
    assert leader[second]["level"] == "memory" and leader[second]["acknowledged"] == []
    assert "peer node-1 (rank 2) failed during replication" in leader[second]["reason"]
    assert leader[second]["seconds"] < 30  # bounded by the replicator's timeout, not a hang
    assert leader[second]["seconds"] < 5  # seen at once (its stream and gloo pair close with it), not at the 10 s timeout
    assert other[second]["level"] == "memory" and other[second]["reason"] == leader[second]["reason"]
    # The survivor of node-1's memory still holds the previous generation whole, and nothing of the new one.
    from tierckpt.node.memory import MemoryConfig, MemoryTier

    survivor = MemoryTier(replica_child.URI, MemoryConfig(directory=str(tmp_path / "node-1" / "shm"), budget_bytes=1 << 30))
    assert survivor.verify(first) == [] and sorted(survivor.held(first)) == sorted(
        [f"{first}/data/rank-{r:05d}.bin" for r in range(4)] + [f"{first}/meta/header.json"]
    )
    assert survivor.committed().generation == first
    for r in range(4):
        assert (Path(survivor.path_of(f"{first}/data/rank-{r:05d}.bin"))).read_bytes() == replica_child.data_of(r, 1)
    assert [m.origin for m in survivor.manifests(second)] == ["node-1"]  # only its own files, never node-0's


def test_a_stuck_peer_times_out_and_the_level_stays_memory(tmp_path: Path) -> None:
    procs, logs = run_children(tmp_path, "hang")
    leader, other = (json.loads((tmp_path / f"result-{r}.json").read_text())["results"] for r in (0, 1))
    first, second = sorted(leader)
    assert leader[first]["level"] == "replicated", logs
    assert leader[second]["level"] == "memory" and "peer node-1 (rank 2) failed during replication" in leader[second]["reason"]
    assert "Timed out" in leader[second]["reason"] or "timeout" in leader[second]["reason"].lower()
    assert 9 < leader[second]["seconds"] < 30  # the replicator's 10 s step timeout, not a hang
    assert other[second]["level"] == "memory"


# -- adopting a peer's COMMIT (pure, no process group) -------------------------------------------------------
def test_a_peers_commit_is_adopted_only_when_newer_and_without_an_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica's ``COMMIT`` replaces an older record, never the same or a newer one; it is adopted
    synchronously (the receiving thread builds no event loop while training runs)."""
    import asyncio

    from tierckpt.native.layout import COMMIT, CommitRecord
    from tierckpt.node.memory.config import MemoryConfig
    from tierckpt.node.memory.nodememory import NodeMemory
    from tierckpt.node.memory.transfer import adopt_commit

    tier = NodeMemory(MemoryConfig(directory=str(tmp_path / "shm"), budget_bytes=1 << 20)).tier("s3://b/run")
    older, newer = (CommitRecord(f"g-0000000{s}-0000000000000-{s:012x}", 1.0, seq=s).encode() for s in (4, 5))

    def current() -> bytes:
        return Path(tier.path_of(COMMIT)).read_bytes()

    monkeypatch.setattr(asyncio, "run", lambda *a, **k: pytest.fail("adopt_commit started an event loop"))
    adopt_commit(tier, older)  # nothing committed yet: adopted
    assert current() == older
    adopt_commit(tier, newer)
    assert current() == newer
    adopt_commit(tier, older)  # an older record never replaces a newer one
    assert current() == newer
    adopt_commit(tier, newer)  # the same record: unchanged
    assert current() == newer and tier.committed().seq == 5
