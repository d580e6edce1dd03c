"""Recovery from node memory with real process groups: 2 simulated nodes x 2 ranks on this machine.

Each simulated node is a set of processes with their own ``TIERCKPT_NODE_ID`` and
``TIERCKPT_MEMORY_DIR`` (``tests/recovery_child.py``); processes end with ``os._exit``, as in a crash.
The URI's own store is a local directory that is deleted before every restart, so a restart can only
read from the memory tiers. Checked: bit-exact loads (FSDP2-style ``Shard(0)`` DTensors, and plain
replicated tensors as DDP holds them), after a crash of every process, after the loss of a whole node
(with a fresh replacement node, and on the surviving node alone), and that a node lost during
replication leaves the new checkpoint at ``memory`` while the previous, replicated one recovers.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import time
from pathlib import Path

import pytest

import recovery_child
from tierckpt.node.memory.sidegroup import LANES
from tierckpt.node.memory.memory import SPARE_PREFIX
from distributed import free_port

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed.tensor", "tierckpt", "scenarios", "recovery_child"])


class Job:
    """One launch of ranks placed on simulated nodes (``nodes[r]``: rank ``r``'s node)."""

    def __init__(self, workdir: Path, nodes: list[str], layout: str, extra_env: dict[str, str] | None = None,
                 node_caches: bool = False, **spec: object) -> None:
        """``node_caches``: each node has its own node-cache directory too (``TIERCKPT_CACHE_DIR`` under the
        node's directory, lost with it), as separate machines do; else the ranks share one under ``workdir``."""
        self.workdir, self.nodes = workdir, nodes
        port = free_port()
        self.results = [workdir / f"result-{i}-{port}.json" for i in range(len(nodes))]
        self.procs = []
        for rank, node in enumerate(nodes):
            env = {
                "TIERCKPT_NODE_ID": node, "TIERCKPT_MEMORY_DIR": str(workdir / node / "shm"), "TIERCKPT_MEMORY": "on",
                "TIERCKPT_MEMORY_BYTES": "256M", "OMP_NUM_THREADS": "1", **(extra_env or {}),
            }
            # Each node its own cache, or one the job's nodes share: never the session's, so uploads a job
            # leaves pending (an unreachable remote) are not another test's to sync.
            env["TIERCKPT_CACHE_DIR"] = str(workdir / node / "cache" if node_caches else workdir / "cache")
            body = {"launched": time.monotonic(), "rank": rank, "world": len(nodes), "port": port, "layout": layout, "result": str(self.results[rank]), **spec}
            proc = _CTX.Process(target=recovery_child.run, args=(body, env), daemon=True)
            proc.start()
            self.procs.append(proc)

    def wait(self, ranks: list[int] | None = None, timeout_s: float = 90) -> list[dict]:
        """The results of ``ranks`` (default all) once they exited (their output is in the test's)."""
        out = []
        for rank in ranks if ranks is not None else range(len(self.procs)):
            proc = self.procs[rank]
            proc.join(timeout_s)
            if proc.is_alive():
                self.kill()
                raise AssertionError(f"rank {rank} did not finish within {timeout_s}s")
            assert proc.exitcode == 0 and self.results[rank].exists(), f"rank {rank} exited {proc.exitcode} (output above)"
            out.append(json.loads(self.results[rank].read_text()))
        return out

    def kill(self, ranks: list[int] | None = None) -> None:
        for rank in ranks if ranks is not None else range(len(self.procs)):
            proc = self.procs[rank]
            if proc.is_alive():
                proc.kill()
            proc.join()


def lose(workdir: Path, *nodes: str) -> None:
    """The remote store becomes unreachable; ``nodes`` lose their memory (their processes are gone)."""
    shutil.rmtree(workdir / "remote", ignore_errors=True)
    for node in nodes:
        shutil.rmtree(workdir / node, ignore_errors=True)


TENSOR_BYTES = 67 * 24 * 4 + 33 * 7 * 2 + 9 * 8
"""The bytes of the tensors recovery_child saves: a load reads each exactly once per group."""


def assert_exact(results: list[dict], uri: str, tensor_bytes: int | None = TENSOR_BYTES) -> None:
    for r in results:
        load = r["loads"][uri]
        assert "error" not in load, load.get("trace")
        assert load["differs"] == [], f"{r['node']}: {load['differs']} differ from what was saved"
        assert load["bytes_read"] == load["bytes_read_memory"], f"{r['node']} read from outside the memory tiers"
    if tensor_bytes is not None:
        assert sum(r["loads"][uri]["bytes_read"] for r in results) == tensor_bytes


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def uri_of(workdir: Path, step: int) -> str:
    return str(workdir / "remote" / f"step-{step}")


def test_processes_killed_after_commit_restart_from_memory(workdir: Path) -> None:
    uri = uri_of(workdir, 1)
    nodes = ["node-0", "node-0", "node-1", "node-1"]
    saved = Job(workdir, nodes, "shard", saves=[{"uri": uri, "seed": 1, "level": "memory"}]).wait()
    assert all(r["saves"][uri]["ok"] for r in saved), saved
    lose(workdir)  # every process is gone (os._exit after the commit), and the remote with them
    unsealed = list((workdir / "node-1" / "shm").glob("*/manifests"))
    assert unsealed
    for manifests in unsealed:
        shutil.rmtree(manifests)  # as if node-1's processes died before sealing their files
    assert_exact(Job(workdir, nodes, "shard", loads=[{"uri": uri, "seed": 1}]).wait(), uri)


def test_every_rank_reaches_remote_while_its_node_holds_peers_replicas(workdir: Path) -> None:
    """``wait("remote")`` after ``replicated`` returns on every node: the replicas a node holds are
    their own node's to write down, and the COMMIT another node writes down is found below."""
    uri = uri_of(workdir, 1)
    saved = Job(workdir, ["node-0", "node-1"], "shard", saves=[{"uri": uri, "seed": 1, "level": ["replicated", "remote"]}]).wait()
    assert all(r["saves"][uri]["ok"] for r in saved), saved
    assert (Path(uri) / "COMMIT").is_file()


def test_each_file_is_written_down_once_when_replicas_arrive_first(workdir: Path) -> None:
    """With a slow store, each node's replicas reach its peer before their own node has written them down;
    the committing rank's write-down waits for them below and does not copy them a second time (it did:
    twice the upload traffic)."""
    uri = uri_of(workdir, 1)
    done = Job(workdir, ["node-0", "node-0", "node-1", "node-1"], "shard", slow_write_down_s=1.0,
               saves=[{"uri": uri, "seed": 1, "level": ["replicated", "remote"]}]).wait()
    assert all(r["saves"][uri]["ok"] for r in done), done
    copies = [key for r in done for key in r["write_downs"]]
    assert sum("/data/" in key for key in copies) == 4, copies  # one data file per rank
    assert len(copies) == len(set(copies)), sorted(copies)


def test_a_lost_node_is_rebuilt_from_its_peer_and_the_survivor_reshards(workdir: Path) -> None:
    uri = uri_of(workdir, 1)
    saved = Job(workdir, ["node-0", "node-0", "node-1", "node-1"], "shard",
                saves=[{"uri": uri, "seed": 1, "level": "replicated"}]).wait()
    assert all(r["saves"][uri]["ok"] for r in saved), saved
    lose(workdir, "node-0")  # the node of rank 0, which wrote the metadata and COMMIT
    # A fresh node takes the lost one's place (ranks 0 and 1): it holds nothing, it reads from node-1's memory
    # (verify=True too: node-1's ranks re-read every piece from their tier, the fresh node cannot).
    fresh = Job(workdir, ["node-2", "node-2", "node-1", "node-1"], "shard",
                loads=[{"uri": uri, "seed": 1, "verify": True}]).wait()
    assert_exact(fresh, uri)
    assert [r["loads"][uri]["bytes_read"] > 0 for r in fresh] == [False, False, True, True]  # node-1 reads it all
    # What the fresh node's ranks need goes to them whole: read straight into the send buffer, never packed.
    assert [r["loads"][uri]["bytes_exchanged"] > 0 for r in fresh] == [True, True, False, False]
    assert [r["loads"][uri]["bytes_packed"] for r in fresh] == [0, 0, 0, 0]
    assert fresh[2]["loads"][uri]["level"]["level"] == "replicated"
    # Rank 0's node holds no copy: rank 2 reads the metadata through the chain and broadcasts it with the pieces
    # table, so the fresh node's ranks need no agreement of their own on the table. Seven all-gathers of objects
    # (each a gather and a broadcast over gloo): the tiers' reads, the needs, the objects file the fresh node
    # lacks, the file checks, verify, the read, the apply; one broadcast of the metadata.
    for r in fresh:
        collectives = dict(r["loads"][uri]["collectives"])
        collectives.pop("all_to_all_single", None)
        assert collectives == {"monitored_barrier": 1, "gather": 7, "broadcast": 8}, collectives
    # The surviving node alone, 2 ranks, plain replicated tensors (DDP) instead of Shard(0) over 4.
    alone = Job(workdir, ["node-1", "node-1"], "replicate", loads=[{"uri": uri, "seed": 1}]).wait()
    assert_exact(alone, uri)


def test_a_memory_only_checkpoint_is_replicated_and_recovers_after_a_node_loss(workdir: Path) -> None:
    """``persist=False``: nothing reaches where the URI points, yet the checkpoint reaches ``replicated`` and
    the surviving node alone (2 ranks, resharded to plain tensors) loads it bit-exact from its memory."""
    uri = uri_of(workdir, 1)
    saved = Job(workdir, ["node-0", "node-0", "node-1", "node-1"], "shard",
                saves=[{"uri": uri, "seed": 1, "level": "replicated", "persist": False}]).wait()
    assert all(r["saves"][uri]["ok"] and not r["saves"][uri]["at_uri"] for r in saved), saved
    assert not Path(uri).exists()
    lose(workdir, "node-0")
    assert_exact(Job(workdir, ["node-1", "node-1"], "replicate", loads=[{"uri": uri, "seed": 1}]).wait(), uri)


def test_a_node_lost_during_replication_keeps_the_previous_checkpoint(workdir: Path) -> None:
    old, new = uri_of(workdir, 1), uri_of(workdir, 2)
    job = Job(workdir, ["node-0", "node-0", "node-1", "node-1"], "shard", kill_rank=2, saves=[
        {"uri": old, "seed": 1, "level": "replicated"},
        {"uri": new, "seed": 2, "level": "replicated", "kill_receiver": True},
    ])
    survivors = job.wait([0, 1])
    job.kill([2, 3])  # node-1 is lost: its leader died receiving node-0's replica, the other rank with it
    lose(workdir, "node-1")
    for r in survivors:
        assert r["saves"][old]["ok"], r
        assert not r["saves"][new]["ok"] and "not replicated" in r["saves"][new]["error"], r
    loaded = Job(workdir, ["node-0", "node-0"], "shard", loads=[{"uri": old, "seed": 1}, {"uri": new, "seed": 2}]).wait()
    assert_exact(loaded, old)
    for r in loaded:
        assert r["loads"][old]["level"]["level"] == "replicated"
        assert r["loads"][new]["level"]["level"] == "memory" and r["loads"][new]["level"]["reason"]
        # node-1's files of it reached node-0 only if node-1's sender finished before it died: then the load
        # is exact, else it fails naming the missing file; never wrong bytes.
        assert "error" in r["loads"][new] or r["loads"][new]["differs"] == [], r["loads"][new]


def test_the_manager_resumes_from_the_newest_step_whole_in_memory_after_a_node_loss(workdir: Path) -> None:
    """Step 2 committed in both nodes' memory but never replicated (``TIERCKPT_REPLICAS=0``), then node-1
    and the remote are lost: step 2's node-1 files are nowhere, so ``load_latest`` on the surviving node
    skips it and resumes from step 1, whole in node-0's memory (its own files and node-1's replicas)."""
    nodes = ["node-0", "node-0", "node-1", "node-1"]
    first = Job(workdir, nodes, "shard", saves=[{"uri": uri_of(workdir, 1), "seed": 1, "level": "replicated"}]).wait()
    assert all(r["saves"][uri_of(workdir, 1)]["ok"] for r in first), first
    second = Job(workdir, nodes, "shard", extra_env={"TIERCKPT_REPLICAS": "0"},
                 saves=[{"uri": uri_of(workdir, 2), "seed": 2, "level": "memory"}]).wait()
    assert all(r["saves"][uri_of(workdir, 2)]["ok"] for r in second), second
    lose(workdir, "node-1")
    resumed = Job(workdir, ["node-0", "node-0"], "shard",
                  latest={"root": str(workdir / "remote"), "seeds": {"1": 1, "2": 2}}).wait()
    for r in resumed:
        assert "error" not in r["latest"], r["latest"].get("trace")
        assert r["latest"] == {"step": 1, "differs": []}, r["latest"]


def test_the_manager_keeps_the_newest_step_replicated_on_every_node(workdir: Path) -> None:
    """``keep_last=1`` with the memory tier: each save keeps, beside the newest step, the newest one that
    every node recorded ``replicated`` when it started (deleting it at the next commit would leave no step
    whole in memory if a node were lost while the new one replicates)."""
    saves = [{"step": step, "seed": step} for step in (1, 2, 3)]
    done = Job(workdir, ["node-0", "node-1"], "shard",
               manager={"root": str(workdir / "remote"), "keep_last": 1, "saves": saves}).wait()
    assert [r["steps"] for r in done[0]["manager"]] == [[1], [1, 2], [2, 3]], done[0]["manager"]


def test_the_manager_with_persist_every_resumes_from_memory_or_from_the_newest_persisted_step(workdir: Path) -> None:
    """``persist_every=2``: step 3 lives in the nodes' memory only (replicated), step 2 also where the root
    points. A node lost: the survivor alone resumes from step 3 (its own files and the lost node's
    replicas). Every node's memory lost: a restart resumes from step 2, whole where the root points."""
    root = workdir / "remote"
    saves = [{"step": step, "seed": step} for step in (1, 2, 3)]
    done = Job(workdir, ["node-0", "node-1"], "shard",
               manager={"root": str(root), "keep_last": 1, "persist_every": 2, "saves": saves}).wait()
    assert [r["steps"] for r in done[0]["manager"]] == [[1], [1, 2], [2, 3]], done[0]["manager"]
    assert sorted(p.parent.name for p in root.glob("step-*/COMMIT")) == ["step-00000002"]
    seeds = {"1": 1, "2": 2, "3": 3}
    shutil.rmtree(workdir / "node-1")
    alone = Job(workdir, ["node-0", "node-0"], "replicate", latest={"root": str(root), "seeds": seeds}).wait()
    assert [r["latest"] for r in alone] == [{"step": 3, "differs": []}] * 2, alone
    shutil.rmtree(workdir / "node-0")
    fresh = Job(workdir, ["node-2", "node-3"], "shard", latest={"root": str(root), "seeds": seeds}).wait()
    assert [r["latest"] for r in fresh] == [{"step": 2, "differs": []}] * 2, fresh


def test_one_node_says_why_replicated_is_not_available(workdir: Path) -> None:
    uri = uri_of(workdir, 1)
    saved = Job(workdir, ["node-0", "node-0"], "shard", saves=[{"uri": uri, "seed": 1, "level": "replicated"}]).wait()
    for r in saved:
        assert not r["saves"][uri]["ok"]
        assert "not replicated: no peer holds a replica: the job spans one node" in r["saves"][uri]["error"], r
    lose(workdir)
    assert_exact(Job(workdir, ["node-0", "node-0"], "shard", loads=[{"uri": uri, "seed": 1}]).wait(), uri)


def test_an_unreachable_s3_remote_from_save_to_recovery(workdir: Path, refused_endpoint: str) -> None:
    down = {"TIERCKPT_S3_ENDPOINT_URL": refused_endpoint, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    uri = "s3://bucket/run/step-1"
    saved = Job(workdir, ["node-0", "node-0", "node-1", "node-1"], "shard", extra_env=down,
                saves=[{"uri": uri, "seed": 1, "level": "replicated"}]).wait()
    assert all(r["saves"][uri]["ok"] for r in saved), saved
    lose(workdir, "node-1")
    assert_exact(Job(workdir, ["node-0", "node-0"], "replicate", extra_env=down, loads=[{"uri": uri, "seed": 1}]).wait(), uri)


def test_fsdp2_on_two_nodes_to_ddp_on_the_surviving_node(workdir: Path) -> None:
    uri, expected = uri_of(workdir, 1), str(workdir / "expected.pt")
    saved = Job(workdir, ["node-0", "node-0", "node-1", "node-1"], "fsdp2", expected=expected,
                saves=[{"uri": uri, "seed": 1, "level": "replicated"}]).wait()
    assert all(r["saves"][uri]["ok"] for r in saved), saved
    lose(workdir, "node-0")
    loaded = Job(workdir, ["node-1", "node-1"], "ddp", expected=expected, loads=[{"uri": uri, "seed": 1}]).wait()
    assert_exact(loaded, uri, tensor_bytes=None)  # model and optimizer state, bit-exact, all from node-1's memory


@pytest.mark.multiproc
def test_a_failed_synchronous_save_leaves_no_node_holding_its_generation(workdir: Path) -> None:
    """A synchronous save whose write-down fails is taken back on every node, not only on the committing
    rank's: the other node's memory tier drops the generation's files and still commits the previous one."""
    uri = uri_of(workdir, 1)
    saves = [{"uri": uri, "seed": 1, "level": "replicated", "key": "first"},
             {"uri": uri, "seed": 2, "sync": True, "fail_write_downs": True, "key": "failed"}]
    results = Job(workdir, ["node-0", "node-1"], "shard", saves=saves).wait()
    first = results[0]["saves"]["first"]
    assert first["ok"], results
    assert "not committed anywhere" in results[0]["saves"]["failed"]["error"], results[0]
    assert "saving checkpoint" in results[1]["saves"]["failed"]["error"], results[1]
    assert json.loads((Path(uri) / "COMMIT").read_text())["generation"] == first["generation"]
    for node in ("node-0", "node-1"):
        (home,) = (workdir / node / "shm").glob("*/objects")
        held = sorted(p.name for p in home.glob("g-*") if not p.name.startswith(SPARE_PREFIX))  # not the async spare
        assert held == [first["generation"]], node
        assert json.loads((home / "COMMIT").read_text())["generation"] == first["generation"], node


@pytest.mark.multiproc
@pytest.mark.node_scale
def test_two_nodes_of_four_ranks_rebuild_a_lost_node_from_its_peer(workdir: Path) -> None:
    """Node scale: 2 simulated nodes x 4 ranks save ``Shard(0)`` over 8 into their memory tiers, each node's
    files replicated to the other. Node-1 is lost with the remote; a replacement node's 4 ranks and node-0's
    4 load bit-exact from node-0's tier and its replica: node-0's ranks read every byte once, the replacement
    node's ranks read none (their parts arrive over the wire)."""
    uri = uri_of(workdir, 1)
    saved = Job(workdir, ["node-0"] * 4 + ["node-1"] * 4, "shard",
                saves=[{"uri": uri, "seed": 1, "level": "replicated"}]).wait(timeout_s=180)
    assert all(r["saves"][uri]["ok"] for r in saved), saved
    lose(workdir, "node-1")
    fresh = Job(workdir, ["node-0"] * 4 + ["node-2"] * 4, "shard", loads=[{"uri": uri, "seed": 1}]).wait(timeout_s=180)
    assert_exact(fresh, uri)
    assert [r["loads"][uri]["bytes_read"] for r in fresh[4:]] == [0, 0, 0, 0]
    assert all(r["loads"][uri]["bytes_exchanged"] > 0 for r in fresh[4:])


BIG_PART = 4096 * 512 * 4 // 4
"""Each of 4 ranks' part of the ``big`` layout's 8 MiB tensor: a unit that streams in peer recovery."""


def _lose_node_1_of_big(workdir: Path, uri: str) -> None:
    saved = Job(workdir, ["node-0", "node-0", "node-1", "node-1"], "big",
                saves=[{"uri": uri, "seed": 1, "level": "replicated"}]).wait()
    assert all(r["saves"][uri]["ok"] for r in saved), saved
    lose(workdir, "node-1")


@pytest.mark.multiproc
def test_a_lost_nodes_units_stream_from_its_peers_tier_checked_by_the_receiver(workdir: Path) -> None:
    """Node-1 is lost; node-0 holds its replica. The replacement node's large units go from node-0's tier
    pages straight to the wire (``bytes_streamed``: never copied into a send buffer first) and the
    receiving ranks check their CRC-32Cs as they land (``bytes_checked``: exactly their big parts)."""
    uri = uri_of(workdir, 1)
    _lose_node_1_of_big(workdir, uri)
    fresh = Job(workdir, ["node-0", "node-0", "node-2", "node-2"], "big", loads=[{"uri": uri, "seed": 1}]).wait()
    assert_exact(fresh, uri, TENSOR_BYTES + 4 * BIG_PART)
    loads = [r["loads"][uri] for r in fresh]
    assert sum(load["bytes_streamed"] for load in loads[:2]) == 2 * BIG_PART  # node-1's two big parts
    assert [load["bytes_streamed"] for load in loads[2:]] == [0, 0]
    assert [load["stream_lanes"] for load in loads] == [LANES] * 4  # several connections per pair (peer_lanes)
    assert [load["bytes_checked"] for load in loads[2:]] == [BIG_PART, BIG_PART]
    assert [load["bytes_packed"] for load in loads] == [0, 0, 0, 0]
    # The replacement node holds no metadata: rank 0 sends what it read from its tier, the pieces table with
    # it, so no rank shares or agrees on the table on its own: one broadcast of the metadata and six all-gathers
    # of objects (each a gather and a broadcast over gloo): the tiers' reads, the needs, the objects file the
    # replacement node lacks (the state's "extra"), the file checks, the read, the apply.
    for load in loads:
        load["collectives"].pop("all_to_all_single", None)
        assert load["collectives"] == {"monitored_barrier": 1, "gather": 6, "broadcast": 7}, load["collectives"]


@pytest.mark.multiproc
def test_a_replacement_node_that_cannot_read_the_probes_sample_still_recovers(workdir: Path) -> None:
    """Routes measured as a job measures them (no ``$TIERCKPT_ROUTE_COSTS``): node-1 and the remote are lost,
    and a reshard onto node-0 and a fresh node opens a route to choose, so the group probes the store with
    the largest data file, node-1's: node-0 holds its replica, the fresh node cannot read it. The probe
    keeps the store's prior and the load recovers bit-exact (it failed "measuring the store" before)."""
    uri = uri_of(workdir, 1)
    _lose_node_1_of_big(workdir, uri)
    fresh = Job(workdir, ["node-0", "node-2"], "big", loads=[{"uri": uri, "seed": 1}],
                extra_env={"TIERCKPT_ROUTE_COSTS": ""}).wait()
    assert_exact(fresh, uri, None)
    assert sum(r["loads"][uri]["bytes_read"] for r in fresh) >= 4 * BIG_PART


@pytest.mark.multiproc
def test_replication_and_a_streamed_recovery_share_one_side_group(workdir: Path) -> None:
    """In the same processes, a save replicated to the peer node and then, node-1's memory and the remote lost,
    a load whose node-1 parts stream from node-0's replica: bit-exact, and every process made exactly one
    side group (``tierckpt.node.memory.sidegroup``) over the job's group, used by both the replicator and
    the load's lanes."""
    uri = uri_of(workdir, 1)
    results = Job(workdir, ["node-0", "node-0", "node-1", "node-1"], "big",
                  saves=[{"uri": uri, "seed": 1, "level": ["replicated", "remote"]}],
                  lose_after_saves=["node-1"], loads=[{"uri": uri, "seed": 1}]).wait()
    assert all(r["saves"][uri]["ok"] for r in results), results
    assert_exact(results, uri, TENSOR_BYTES + 4 * BIG_PART)
    loads = [r["loads"][uri] for r in results]
    assert sum(load["bytes_streamed"] for load in loads[:2]) == 2 * BIG_PART  # node-1's parts, from node-0's replica
    assert [load["stream_lanes"] for load in loads] == [LANES] * 4
    assert [r["side_groups"] for r in results] == [[["lanes", "replica"]]] * 4


@pytest.mark.multiproc
def test_a_damaged_replica_chunk_fails_the_streamed_recovery_naming_the_file_and_the_peer(workdir: Path) -> None:
    """One byte of node-0's replica of rank 2's data file flipped (inside rank 2's big part): the receiving
    rank's check of the streamed chunk fails, and every rank's load raises naming the file, the bytes and
    the peer whose tier sent them (never a silent load of damaged bytes)."""
    uri = uri_of(workdir, 1)
    _lose_node_1_of_big(workdir, uri)
    [replica] = [p for p in (workdir / "node-0" / "shm").rglob("rank-00002.bin")]
    size = replica.stat().st_size
    assert size >= BIG_PART
    with open(replica, "r+b") as f:  # the middle of the file: inside the 2 MiB part, whatever the order
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    fresh = Job(workdir, ["node-0", "node-0", "node-2", "node-2"], "big", loads=[{"uri": uri, "seed": 1}]).wait()
    errors = [r["loads"][uri].get("error", "") for r in fresh]
    assert all("ChecksumMismatchError" in e or "checksum mismatch" in e for e in errors), errors
    named = [e for e in errors if "streamed in peer recovery from rank" in e]
    assert named, errors
    for e in named:
        assert "rank-00002.bin" in e and "node 'node-0'" in e, e
