"""The node memory tier as the top link of the storage chain (:mod:`tierckpt.node.memory.link`).

Real parts: a local path, the moto S3 server, the fault proxy in front of it for an unreachable remote,
child processes that are SIGKILLed or exit normally. The memory tier lives in a per-test temporary
directory (``TIERCKPT_MEMORY_DIR``), never the node's real ``/dev/shm/tierckpt``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt.native import layout
from tierckpt.backends import LocalBackend
from tierckpt.node.disk import CacheConfig
from tierckpt.errors import TransientStorageError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.store import memory_tier_of, open_store
from tierckpt.node.memory import MemoryConfig, MemoryTierFullError, OnFull
from tierckpt.node.memory.link import MemoryLink

sys.path.insert(0, str(Path(__file__).parent))
from fault_proxy import FaultProxy, Rule  # noqa: E402
from memory_child import options, state  # noqa: E402

CHILD = str(Path(__file__).parent / "memory_child.py")
CKPT_BYTES = 256 * 1024 * 4 + 4096 * 8
"""The tensor bytes of :func:`memory_child.state` (metadata adds a few KiB)."""


@pytest.fixture
def memdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "memory-tier"
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(directory))
    return directory


def mem(memdir: Path, budget: int = 1 << 30, **kw: Any) -> MemoryConfig:
    return MemoryConfig(directory=str(memdir), budget_bytes=budget, exit_wait_s=0, **kw)


def s3(endpoint: str, memory: MemoryConfig | bool = False, cache: CacheConfig | bool = False) -> dict[str, Any]:
    opts = options(endpoint)
    opts.update(memory=memory, cache=cache)
    return opts


def target() -> dict[str, Any]:
    return {"w": torch.zeros(256, 1024), "b": torch.zeros(4096, dtype=torch.int64), "step": -1}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]) and got["step"] == want["step"]


def other_state() -> dict[str, Any]:
    s = state()
    return {"w": s["w"] * 2, "b": s["b"] + 1, "step": 8}


def remote_commit(endpoint: str, uri: str) -> layout.CommitRecord | None:
    """The COMMIT on S3 itself (no memory tier, no cache)."""
    import boto3

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    try:
        return layout.CommitRecord.decode(client.get_object(Bucket=bucket, Key=f"{prefix}/{layout.COMMIT}")["Body"].read())
    except client.exceptions.NoSuchKey:
        return None


def status(store: Any) -> Any:
    return get_scheduler().run(store.status())


def test_a_files_copy_is_logged_as_started_before_its_task_runs(tmp_path: Path, memdir: Path) -> None:
    """A file put in the tier is logged as being copied down by this live process when the copy is asked for,
    not when its background task first runs (which waits behind the I/O loop's other work): until then,
    another process's commit took it for a file whose process is gone and copied it too."""
    import threading

    path = str(tmp_path / "ckpt")
    store = open_store(path, {"memory": mem(memdir)})
    assert isinstance(store, MemoryLink)
    generation = layout.new_generation(1)
    key = f"{generation}/data/rank-00000.bin"
    sched = get_scheduler()
    sched.run(memory_tier_of(store).put(key, b"x" * 64))
    started, release = threading.Event(), threading.Event()

    async def busy() -> None:  # holds the I/O loop's thread: no background task can take a step
        started.set()
        release.wait(30)

    blocker = sched.submit(busy())
    try:
        assert started.wait(30)
        store.writedown.file(key)
        assert key in store.down.state(generation).busy  # logged already, the loop still held
    finally:
        release.set()
        blocker.result(30)
    sched.run(store.writedown.wait(generation, 30, through_outage=False, commit=False))
    assert (Path(path) / key).read_bytes() == b"x" * 64


# -- round trips ------------------------------------------------------------------------------------
def test_sync_save_to_a_local_path_commits_in_memory_and_where_the_uri_points(tmp_path: Path, memdir: Path) -> None:
    path = str(tmp_path / "ckpt")
    config = mem(memdir)
    tierckpt.save(path, state(), storage_options={"memory": config})
    store = open_store(path, {"memory": config})
    assert isinstance(store, MemoryLink)
    tier = memory_tier_of(store)
    record = tier.committed()
    assert record is not None
    # A synchronous save returned: the path itself holds the COMMIT, and the tier holds every file, sealed.
    on_disk = layout.CommitRecord.decode(get_scheduler().run(LocalBackend(path).get(layout.COMMIT)))
    assert on_disk.generation == record.generation
    held = tier.held(record.generation)
    assert any(k.startswith(f"{record.generation}/data/") for k in held) and f"{record.generation}/{layout.HEADER}" in held
    assert tier.verify(record.generation) == []
    for memory in (config, False):
        got = target()
        tierckpt.load(path, got, storage_options={"memory": memory})
        assert_same(got, state())
    st = status(store)
    assert st.in_memory and st.written_down and st.committed_on_remote
    assert [(name, reached) for name, reached, _ in st.levels()] == [
        ("memory", True), ("replicated", False), ("local", False), ("remote", True)]


def test_tier_reads_serve_the_load(tmp_path: Path, memdir: Path) -> None:
    """Once committed in memory, a load reads data from the tier: deleting the written-down copy's data
    files leaves the load bit-exact."""
    path = str(tmp_path / "ckpt")
    config = mem(memdir)
    tierckpt.save(path, state(), storage_options={"memory": config})
    generation = memory_tier_of(open_store(path, {"memory": config})).committed().generation
    for name in os.listdir(os.path.join(path, generation, "data")):
        os.unlink(os.path.join(path, generation, "data", name))
    got = target()
    tierckpt.load(path, got, storage_options={"memory": config})
    assert_same(got, state())


def test_strided_reads_through_the_link_return_each_runs_checksum(tmp_path: Path, memdir: Path) -> None:
    """A checked strided load reads runs through the chain with a digest per run: the link hands it to
    whichever tier serves the file (its own tier here, the path below for a node whose tier is empty)
    and returns each run's CRC-32C."""
    import crc32c

    path = str(tmp_path / "ckpt")
    config = mem(memdir)
    tierckpt.save(path, state(), storage_options={"memory": config})
    generation = memory_tier_of(open_store(path, {"memory": config})).committed().generation
    key = next(f"{generation}/data/{n}" for n in os.listdir(os.path.join(path, generation, "data")))
    whole = get_scheduler().run(LocalBackend(path).get(key))
    offsets, run_bytes = [0, 4096, 3 * 4096], 1000
    want = [crc32c.crc32c(whole[o : o + run_bytes]) for o in offsets]
    for memory in (config, mem(tmp_path / "empty-tier")):
        out = bytearray(len(offsets) * run_bytes)
        got = get_scheduler().run(open_store(path, {"memory": memory}).read_runs(key, offsets, run_bytes, memoryview(out), crc32c.crc32c))
        assert got == want
        assert bytes(out) == b"".join(whole[o : o + run_bytes] for o in offsets)


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
def test_round_trip_to_s3(uri: str, s3_server: str, memdir: Path, tmp_path: Path, cache: bool) -> None:
    cache_config = CacheConfig(directory=str(tmp_path / "cache"), exit_wait_s=0, poll_s=0.01) if cache else False
    tierckpt.save(uri, state(), storage_options=s3(s3_server, mem(memdir), cache_config))
    record = remote_commit(s3_server, uri)
    assert record is not None  # a synchronous save is committed on S3 when it returns
    got = target()
    tierckpt.load(uri, got, storage_options=s3(s3_server))  # S3 alone
    assert_same(got, state())
    st = status(open_store(uri, s3(s3_server, mem(memdir), cache_config)))
    assert st.generation == record.generation and st.in_memory and st.committed_on_remote
    assert st.node_disk is (True if cache else None)


# -- the remote is down -----------------------------------------------------------------------------
def test_remote_down_after_memory_commit_loads_from_memory(proxy: FaultProxy, uri: str, s3_server: str, memdir: Path) -> None:
    proxy.add_rule(Rule("503", count=None))
    opts = s3(proxy.endpoint, mem(memdir))
    handle = tierckpt.async_save(uri, state(), storage_options=opts)
    meta = handle.wait()  # committed in memory while the remote answers nothing but 503
    with pytest.raises(TransientStorageError, match="did not finish within"):
        handle.wait_durable(timeout_s=0.5)
    st = status(open_store(uri, opts))
    assert st.in_memory and not st.committed_on_remote and not st.written_down
    assert remote_commit(s3_server, uri) is None
    got = target()
    tierckpt.load(uri, got, storage_options=opts)
    assert_same(got, state())
    proxy.clear()  # the remote is back: the write-down finishes, COMMIT last
    handle.wait_durable(timeout_s=120)
    assert remote_commit(s3_server, uri).generation == meta.generation
    got = target()
    tierckpt.load(uri, got, storage_options=s3(s3_server))
    assert_same(got, state())


def _child(mode: str, uri: str, endpoint: str, memdir: Path, exit_wait_s: float = 600.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "TIERCKPT_MEMORY_DIR": str(memdir), "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, CHILD, mode, uri, endpoint, str(exit_wait_s)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_killed_after_async_memory_commit_restart_loads_from_memory(
    proxy: FaultProxy, uri: str, s3_server: str, memdir: Path,
) -> None:
    proxy.add_rule(Rule("503", count=None))
    done = _child("kill", uri, proxy.endpoint, memdir)
    assert done.returncode == -9, done.stderr
    generation = done.stdout.split()[-1]
    opts = s3(proxy.endpoint, mem(memdir))
    got = target()
    tierckpt.load(uri, got, storage_options=opts)  # the restart: remote down, the checkpoint in memory
    assert_same(got, state())
    st = status(open_store(uri, opts))
    assert st.memory_generation == generation and not st.committed_on_remote
    proxy.clear()
    from tierckpt.cli import main as cli

    assert cli.main(["sync", uri, "--timeout", "120"]) == 0  # what the dead process left goes down
    assert remote_commit(s3_server, uri).generation == generation
    got = target()
    tierckpt.load(uri, got, storage_options=s3(s3_server))
    assert_same(got, state())


# -- the budget -------------------------------------------------------------------------------------
def test_budget_below_two_checkpoints_evicts_what_is_written_down(tmp_path: Path, memdir: Path) -> None:
    path = str(tmp_path / "ckpt")
    config = mem(memdir, budget=CKPT_BYTES * 3 // 2)
    first = tierckpt.save(path, state(), storage_options={"memory": config})
    second = tierckpt.save(path, other_state(), storage_options={"memory": config}, keep_previous=True)
    tier = memory_tier_of(open_store(path, {"memory": config}))
    assert tier.keys_of(first.generation) == []  # written down, so evicted for the newer one
    assert tier.committed().generation == second.generation
    got = target()
    tierckpt.load(path, got, storage_options={"memory": config})
    assert_same(got, other_state())


def test_budget_below_two_checkpoints_never_evicts_what_is_not_written_down(
    proxy: FaultProxy, uri: str, memdir: Path,
) -> None:
    proxy.add_rule(Rule("503", method="PUT", path="g-00000001", count=None))  # the first one cannot go down
    opts = s3(proxy.endpoint, mem(memdir, budget=CKPT_BYTES * 3 // 2))
    first = tierckpt.async_save(uri, state(), storage_options=opts)
    meta = first.wait()
    second = tierckpt.async_save(uri, other_state(), storage_options=opts)
    with pytest.raises(MemoryTierFullError, match="TIERCKPT_MEMORY_BYTES.*TIERCKPT_MEMORY_FULL=fallback"):
        second.wait()
    tier = memory_tier_of(open_store(uri, opts))
    assert tier.committed().generation == meta.generation and tier.verify(meta.generation) == []
    got = target()
    tierckpt.load(uri, got, storage_options=opts)
    assert_same(got, state())
    proxy.clear()
    first.wait_durable(timeout_s=120)


def test_budget_fallback_writes_the_newest_to_the_next_tier(
    proxy: FaultProxy, uri: str, s3_server: str, memdir: Path,
) -> None:
    proxy.add_rule(Rule("503", method="PUT", path="g-00000001", count=None))
    opts = s3(proxy.endpoint, mem(memdir, budget=CKPT_BYTES * 3 // 2, on_full=OnFull.FALLBACK))
    tierckpt.async_save(uri, state(), storage_options=opts).wait()
    second = tierckpt.async_save(uri, other_state(), storage_options=opts)
    meta = second.wait()
    second.wait_durable(timeout_s=120)
    assert remote_commit(s3_server, uri).generation == meta.generation
    assert memory_tier_of(open_store(uri, opts)).keys_of(meta.generation) == []  # it never entered the tier
    got = target()
    tierckpt.load(uri, got, storage_options=s3(s3_server))
    assert_same(got, other_state())


# -- process exit -----------------------------------------------------------------------------------
def test_exit_drain_writes_the_checkpoint_down(uri: str, s3_server: str, memdir: Path) -> None:
    done = _child("exit", uri, s3_server, memdir)
    assert done.returncode == 0, done.stderr
    assert "did not finish" not in done.stderr
    assert remote_commit(s3_server, uri).generation == done.stdout.split()[-1]


def test_exit_with_the_remote_down_names_the_sync_command(proxy: FaultProxy, uri: str, s3_server: str, memdir: Path) -> None:
    proxy.add_rule(Rule("503", count=None))
    done = _child("exit", uri, proxy.endpoint, memdir, exit_wait_s=1.0)
    assert done.returncode == 0, done.stderr
    assert "from the node memory tier did not finish before exit" in done.stderr
    assert f"tierckpt sync {uri}" in done.stderr and str(memdir) in done.stderr
    assert remote_commit(s3_server, uri) is None
    proxy.clear()
    get_scheduler().run(open_store(uri, s3(proxy.endpoint, mem(memdir))).sync(120))
    assert remote_commit(s3_server, uri).generation == done.stdout.split()[-1]


# -- status surfaces and the manager ----------------------------------------------------------------
def test_status_cli_shows_each_level(tmp_path: Path, memdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tierckpt.cli import main as cli
    from tierckpt.node.memory.replica_record import Level, ReplicaResult, level_path
    from tierckpt.node.memory.memory import write_atomic

    path = str(tmp_path / "ckpt")
    meta = tierckpt.save(path, state(), storage_options={"memory": mem(memdir)})
    tier = memory_tier_of(open_store(path, {"memory": mem(memdir)}))
    # What a replicator records when a peer died mid-replication: the level stays at memory, with the reason.
    write_atomic(level_path(tier, meta.generation), ReplicaResult(
        uri=tier.uri, generation=meta.generation, level=Level.MEMORY, peers=("node-b",), acknowledged=(),
        reason="node-b closed the connection mid-replication").encode())
    assert cli.main(["status", path]) == 0  # TIERCKPT_MEMORY is off here: the tier holds the URI, so it is shown
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert lines["memory"].split()[1] == "yes" and str(memdir) in lines["memory"]
    assert lines["replicated"].split()[1] == "no" and "node-b closed the connection" in lines["replicated"]
    assert lines["remote"].split()[1] == "yes"
    assert cli.main(["status", path, "--json"]) == 0
    doc = __import__("json").loads(capsys.readouterr().out)
    assert doc["memory_generation"] == meta.generation
    assert [lvl[:2] for lvl in doc["levels"]][:2] == [["memory", True], ["replicated", False]]
    # Replicated: the line names where the replicas are.
    write_atomic(level_path(tier, meta.generation), ReplicaResult(
        uri=tier.uri, generation=meta.generation, level=Level.REPLICATED, peers=("node-b",), acknowledged=("node-b",),
        reason=None).encode())
    assert cli.main(["status", path]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["replicated"].split()[1] == "yes" and "in the memory of node-b" in lines["replicated"]


def test_manager_resumes_from_memory_with_the_remote_down(
    proxy: FaultProxy, s3_server: str, memdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tierckpt.cli import main as cli

    import boto3

    bucket = f"memlink-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    root = f"s3://{bucket}/run"
    proxy.add_rule(Rule("503", count=None))  # the remote is down for the whole run
    opts = s3(proxy.endpoint, mem(memdir))
    manager = tierckpt.CheckpointManager(root, use_async=True, storage_options=opts)
    manager.save(1, state())
    manager.save(2, other_state())
    manager.wait()
    restarted = tierckpt.CheckpointManager(root, storage_options=opts)  # a new process after a crash
    got = target()
    assert restarted.load_latest(got) == 2
    assert_same(got, other_state())
    assert restarted.levels(2) == {"memory": True, "replicated": False, "local": False, "remote": False}
    # ls lists the memory-only checkpoints with their levels while the remote answers nothing (exit 7: the
    # listing holds only what this node has).
    monkeypatch.setenv("TIERCKPT_MEMORY", "on")
    monkeypatch.setenv("TIERCKPT_CACHE", "off")
    monkeypatch.setenv("TIERCKPT_S3_ENDPOINT_URL", proxy.endpoint)
    assert cli.main(["ls", root, "--json"]) == cli.EXIT_UNREACHABLE
    doc = __import__("json").loads(capsys.readouterr().out)
    rows = {e["step"]: e for e in doc["checkpoints"]}
    assert set(rows) == {1, 2} and rows[2]["status"] == "node-only"
    assert rows[2]["levels"]["memory"] and not rows[2]["levels"]["remote"]
    assert "memory tier only" in rows[2]["node_only"]
    proxy.clear()
    for step in (1, 2):
        get_scheduler().run(open_store(manager.uri_of(step), opts).sync(120))
    assert remote_commit(s3_server, manager.uri_of(2)) is not None


def test_ranks_of_a_node_share_its_tier(dist_pool: Any, tmp_path: Path, memdir: Path) -> None:
    """Four real gloo ranks on one node: each writes its file into the shared tier and down behind; rank 0's
    commit waits for the others' write-downs; the COMMIT names a generation whose every file is sealed."""
    from memory_child import ranks_share_the_tier

    held = dist_pool.run(ranks_share_the_tier, str(tmp_path / "ckpt"), mem(memdir))[0]
    assert len(held) == 4


def test_manager_retention_with_async_saves_leaves_nothing_pending(tmp_path: Path, memdir: Path) -> None:
    """Retention deletes a step whose write-down may still run (through another store of its URI): that
    write-down stops, nothing of the deleted step lands below afterwards, and no write-down is left."""
    from tierckpt.node.memory import downdrain
    from tierckpt.node.memory.nodememory import NodeMemory

    root = str(tmp_path / "run")
    config = mem(memdir)
    manager = tierckpt.CheckpointManager(root, use_async=True, keep_last=1, storage_options={"memory": config})
    for step in range(1, 4):
        manager.save(step, state() if step % 2 else other_state())
    manager.wait_durable(timeout_s=120)
    for w in list(downdrain.ACTIVE):  # deferred deletes below run after the last COMMIT write-down
        for job in w.pending():
            job.result(timeout=60)
    assert downdrain.drain(0) == []
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["LATEST", "step-00000003"]
    in_memory = {t.uri: t.committed() for t in NodeMemory(config).tiers()}
    assert [u for u, record in in_memory.items() if record is not None] == [manager.uri_of(3)]
    got = target()
    assert tierckpt.CheckpointManager(root, storage_options={"memory": config}).load_latest(got) == 3
    assert_same(got, state())


def test_async_snapshot_goes_straight_into_the_tier(tmp_path: Path, memdir: Path, mapped_uses: list[bool]) -> None:
    """After the first async save, the snapshot copy writes into a spare file of the tier (mapped, touched in
    the background): that file becomes the checkpoint's data file, bit-exact; the spare counts in the tier
    and stays out of listings."""
    import time

    from tierckpt.node.memory import mapped

    path, config = str(tmp_path / "ckpt"), mem(memdir)
    store = open_store(path, {"memory": config})
    try:
        for i in range(3):
            want = {"w": state()["w"] + i, "b": state()["b"] * i, "step": i}
            handle = tierckpt.async_save(path, want, storage_options={"memory": config})
            meta = handle.wait()
            handle.wait_durable(timeout_s=60)
            deadline = time.monotonic() + 60
            while store.memory_tier.home not in mapped._SPARES and time.monotonic() < deadline:
                time.sleep(0.05)  # the next save's spare is made in the background
            assert any(g.startswith(mapped.SPARE_PREFIX) for g in store.memory_tier.generations())
            assert not any(mapped.is_spare(k) for k in get_scheduler().run(store.list("")))
            for memory in (config, False):
                got = target()
                tierckpt.load(path, got, storage_options={"memory": memory})
                assert_same(got, want)
            assert store.memory_tier.committed().generation == meta.generation
        assert mapped_uses == [False, True, True]
    finally:
        mapped._drop_spares()


def test_a_spare_evicted_during_the_copy_is_written_the_usual_way(
    tmp_path: Path, memdir: Path, monkeypatch: pytest.MonkeyPatch, mapped_uses: list[bool],
) -> None:
    """The snapshot is copied into the spare before the file is named; when eviction unlinks the spare in
    that window, the bytes still in its mapping are written through the tier's usual writer: the checkpoint
    is bit-exact and the spare's file is gone from the tier."""
    import time

    from tierckpt.node.memory import link as link_module
    from tierckpt.node.memory import mapped

    path, config = str(tmp_path / "ckpt"), mem(memdir)
    store = open_store(path, {"memory": config})
    taken = []

    def evicted_while_copied(tier: Any, nbytes: int) -> Any:
        spare = mapped.take_spare(tier, nbytes)
        if spare is not None:
            os.unlink(spare.path)  # what eviction does to a spare
            taken.append(spare.path)
        return spare

    monkeypatch.setattr(link_module, "take_spare", evicted_while_copied)
    try:
        for i in range(2):
            live = {"w": state()["w"] * (i + 2), "b": state()["b"] - i, "step": i}
            want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in live.items()}
            handle = tierckpt.async_save(path, live, storage_options={"memory": config})
            for value in live.values():
                if isinstance(value, torch.Tensor):
                    value.add_(100)  # training goes on: the checkpoint holds the values at the call
            handle.wait()
            handle.wait_durable(timeout_s=60)  # written down too, for the load without the tier
            for memory in (config, False):
                got = target()
                tierckpt.load(path, got, storage_options={"memory": memory})
                assert_same(got, want)
            deadline = time.monotonic() + 60
            while store.memory_tier.home not in mapped._SPARES and time.monotonic() < deadline:
                time.sleep(0.05)  # the next save's spare is made in the background
        assert len(taken) == 1 and not os.path.exists(taken[0])
        assert mapped_uses == [False, False]
    finally:
        mapped._drop_spares()


def test_ranks_that_disagree_on_the_tier_fail_together(dist_pool: Any, tmp_path: Path, memdir: Path) -> None:
    """The memory tier on for rank 0 only: every rank raises the same error, naming the ranks and the
    setting to fix, and nothing is committed — neither where the URI points nor in the node's memory."""
    from memory_child import ranks_disagree_on_the_tier

    path = tmp_path / "ckpt"
    messages = dist_pool.run(ranks_disagree_on_the_tier, str(path), mem(memdir))
    assert len(set(messages)) == 1 and "on for ranks [0], off for ranks [1, 2, 3]" in messages[0]
    assert "TIERCKPT_MEMORY" in messages[0]
    assert not (path / "COMMIT").exists() and not list(memdir.rglob("COMMIT"))


def test_a_save_through_the_staging_halves_asks_a_spare_for_the_next(tmp_path: Path, memdir: Path, mapped_uses: list[bool]) -> None:
    """A file larger than ``staging_bytes`` streams through the staging buffer's halves (no spare could hold
    its copy before the file was named): the store is told a spare is wanted, and the next save finds it."""
    import time

    from tierckpt.node.memory import mapped

    path, config = str(tmp_path / "ckpt"), mem(memdir)
    store = open_store(path, {"memory": config})
    try:
        want = {"w": state()["w"], "b": state()["b"], "step": 0}
        tierckpt.async_save(path, want, storage_options={"memory": config}, staging_bytes=4096).wait()
        deadline = time.monotonic() + 60
        while store.memory_tier.home not in mapped._SPARES and time.monotonic() < deadline:
            time.sleep(0.05)  # made in the background once the file is written
        assert store.memory_tier.home in mapped._SPARES, "no spare was prepared after a save through the halves"
        want = {"w": state()["w"] + 1, "b": state()["b"], "step": 1}
        tierckpt.async_save(path, want, storage_options={"memory": config}).wait()
        assert mapped_uses == [True]  # the first save never asked for a mapped file; the second got one
        got = target()
        tierckpt.load(path, got, storage_options={"memory": config})
        assert_same(got, want)
    finally:
        mapped._drop_spares()
