"""TieredBackend: the backend contract (over a local remote and over S3 on moto), write-back,
commit ordering, read-through caching, corruption recovery, eviction and the public functions."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from backend_contract import BackendContract

import tierckpt
from tierckpt.native import layout
from tierckpt.backends import LocalBackend
from tierckpt.backends.base import ObjectWriter
from tierckpt.node.disk import CacheConfig, TieredBackend
from tierckpt.store import node_cache_over
from tierckpt.cache_api import gc, open_tiered, prefetch, status, wait
from tierckpt.node.disk.config import parse_bytes
from tierckpt.node.disk.records import Op
from tierckpt.errors import CorruptCheckpointError, StorageError


def make_config(tmp_path: Path, **overrides: Any) -> CacheConfig:
    values: dict[str, Any] = dict(directory=str(tmp_path / "cache"), block_bytes=64 * 1024, exit_wait_s=0,
                                  poll_s=0.01)
    values.update(overrides)
    return CacheConfig(**values)


class CountingBackend(LocalBackend):
    """A local 'remote' that counts calls and can hold uploads of some keys until released."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.hold = lambda key: False

    async def _maybe_wait(self, key: str) -> None:
        while self.hold(key) and not self.gate.is_set():
            await asyncio.sleep(0.01)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        self.calls.append(("put", key))
        await self._maybe_wait(key)
        await super().put(key, data)

    async def open_writer(self, key: str) -> ObjectWriter:
        self.calls.append(("open_writer", key))
        await self._maybe_wait(key)
        return await super().open_writer(key)

    async def commit(self, key: str, data: bytes, **kwargs: Any) -> None:
        self.calls.append(("commit", key))
        await super().commit(key, data, **kwargs)

    async def get(self, key: str) -> bytes:
        self.calls.append(("get", key))
        return await super().get(key)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        self.calls.append(("get_range", key))
        return await super().get_range(key, start, end)

    async def read_into(self, key: str, start: int, out: memoryview) -> None:
        self.calls.append(("read_into", key))
        await super().read_into(key, start, out)

    async def size(self, key: str) -> int:
        self.calls.append(("size", key))
        return await super().size(key)

    def reads(self) -> list[tuple[str, str]]:
        return [c for c in self.calls if c[0] in ("get", "get_range", "read_into", "size")]


class TestTieredOverLocal(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> TieredBackend:
        return node_cache_over(LocalBackend(str(tmp_path / "remote")), make_config(tmp_path))

    async def test_everything_reaches_the_remote(self, backend: TieredBackend) -> None:
        await backend.put("a/1", b"one")
        writer = await backend.open_writer("a/2")
        await writer.write(b"two")
        await writer.close()
        await backend.wait_durable()
        assert await backend.remote.get("a/1") == b"one" and await backend.remote.get("a/2") == b"two"


@pytest.mark.s3_servers
class TestTieredOverS3(BackendContract):
    @pytest.fixture
    def backend(self, s3_bucket_uri: str, tmp_path: Path) -> TieredBackend:
        tiered = open_tiered(s3_bucket_uri, make_config(tmp_path))
        assert isinstance(tiered, TieredBackend)
        return tiered

    async def test_remote_matches_after_wait(self, backend: TieredBackend) -> None:
        await backend.put("x/obj", b"payload" * 1000)
        await backend.commit("COMMIT", b"c")
        await backend.wait_durable()
        assert await backend.remote.get("x/obj") == b"payload" * 1000
        assert await backend.remote.get("COMMIT") == b"c"


# -- write-back --------------------------------------------------------------------------------------
@pytest.fixture
def remote(tmp_path: Path) -> CountingBackend:
    return CountingBackend(str(tmp_path / "remote"))


@pytest.fixture
def store(remote: CountingBackend, tmp_path: Path) -> TieredBackend:
    return node_cache_over(remote, make_config(tmp_path))


async def test_write_back_is_local_first_then_remote(remote: CountingBackend, store: TieredBackend) -> None:
    remote.gate.clear()
    remote.hold = lambda key: True
    await store.put("g-1/data/rank-00000.bin", b"d" * 5000)
    assert Path(store.written.path_of("g-1/data/rank-00000.bin")).read_bytes() == b"d" * 5000
    assert not await remote.exists("g-1/data/rank-00000.bin")
    assert store.catalog.pending(store.rh, "g-1/data/rank-00000.bin").op == Op.PUT
    assert store.catalog.generation_state(store.rh, "g-1") == "staged"
    assert await store.get("g-1/data/rank-00000.bin") == b"d" * 5000  # served locally meanwhile
    remote.gate.set()
    await store.wait_durable()
    assert await remote.get("g-1/data/rank-00000.bin") == b"d" * 5000
    assert store.catalog.pending_under(store.rh) == {}


async def test_remote_commit_only_after_all_data(remote: CountingBackend, store: TieredBackend) -> None:
    gen = layout.new_generation()
    remote.gate.clear()
    remote.hold = lambda key: key.endswith("rank-00001.bin")
    await store.put(f"{gen}/data/rank-00000.bin", b"a" * 1000)
    writer = await store.open_writer(f"{gen}/data/rank-00001.bin")
    await writer.write(b"b" * 3000)
    await writer.close()
    await store.commit(layout.COMMIT, layout.CommitRecord(gen, 1.0).encode())
    assert store.catalog.generation_state(store.rh, gen) == "local"
    assert (await store.status()).state == "local"
    await asyncio.sleep(0.3)
    assert await remote.exists(f"{gen}/data/rank-00000.bin")
    assert not await remote.exists(layout.COMMIT), "COMMIT reached the remote before its data"
    remote.gate.set()
    await store.wait_durable(gen)
    assert await remote.exists(layout.COMMIT)
    order = [k for op, k in remote.calls if op in ("put", "open_writer", "commit")]
    assert order.index(layout.COMMIT) > order.index(f"{gen}/data/rank-00001.bin")
    assert store.catalog.generation_state(store.rh, gen) == "remote"
    st = await store.status()
    assert st.generation == gen and st.state == "remote" and st.pending_bytes == 0


async def test_delete_of_old_generation_waits_for_new_commit(remote: CountingBackend, store: TieredBackend) -> None:
    old, new = "g-1-old", "g-2-new"
    await store.put(f"{old}/data/x", b"old")
    await store.commit(layout.COMMIT, layout.CommitRecord(old, 1.0).encode())
    await store.wait_durable()
    remote.gate.clear()
    remote.hold = lambda key: key.startswith(new)
    await store.put(f"{new}/data/x", b"new")
    await store.commit(layout.COMMIT, layout.CommitRecord(new, 2.0).encode())
    await store.delete_prefix(f"{old}/")
    assert not await store.exists(f"{old}/data/x")
    await asyncio.sleep(0.2)
    assert await remote.exists(f"{old}/data/x"), "the remote COMMIT still names the old generation"
    remote.gate.set()
    await store.wait_durable()
    assert not await remote.exists(f"{old}/data/x")
    assert layout.CommitRecord.decode(await remote.get(layout.COMMIT)).generation == new


# -- read-through --------------------------------------------------------------------------------------
async def test_second_read_does_not_touch_the_remote(remote: CountingBackend, store: TieredBackend,
                                                     tmp_path: Path) -> None:
    small, big = b"s" * 1000, os.urandom(300 * 1024)  # big: 5 blocks of 64 KiB
    await remote.put("small", small)
    await remote.put("big", big)
    assert await store.get("small") == small
    assert await store.get_range("big", 70_000, 140_000) == big[70_000:140_000]
    before = len(remote.reads())
    assert await store.get("small") == small
    assert await store.get_range("big", 70_000, 140_000) == big[70_000:140_000]
    assert await store.size("big") == len(big)
    buf = bytearray(1000)
    await store.read_into("big", 100_000, memoryview(buf))
    assert bytes(buf) == big[100_000:101_000]
    assert len(remote.reads()) == before
    # A new instance (another process would be the same) reads from the disk tier.
    again = node_cache_over(remote, make_config(tmp_path))
    assert await again.get("small") == small
    assert await again.get_range("big", 65_536, 131_072) == big[65_536:131_072]
    assert len(remote.reads()) == before
    # Only the touched blocks were fetched.
    blocks = [k for k in os.listdir(Path(store._blocks.root)) if not k.startswith(".")]
    assert blocks and store.catalog.block(store.rh, "big", 4) is None


async def test_corrupted_cache_entries_are_refetched(remote: CountingBackend, store: TieredBackend,
                                                     tmp_path: Path) -> None:
    small, big = os.urandom(1000), os.urandom(200 * 1024)
    await remote.put("small", small)
    await remote.put("big", big)
    assert await store.get("small") == small
    assert await store.get_range("big", 0, 10) == big[:10]
    Path(store.fetched.path_of("small")).write_bytes(b"X" * 1000)  # same size, wrong bytes
    block_path = Path(store._blocks.path_of(store._block_key("big", 0)))
    block_path.write_bytes(b"Y" * 100)  # truncated
    fresh = node_cache_over(remote, make_config(tmp_path))
    before = len(remote.reads())
    assert await fresh.get("small") == small
    assert await fresh.get_range("big", 0, 10) == big[:10]
    assert len(remote.reads()) == before + 2
    assert Path(store.fetched.path_of("small")).read_bytes() == small


async def test_corrupt_unuploaded_data_raises(remote: CountingBackend, store: TieredBackend, tmp_path: Path) -> None:
    remote.gate.clear()
    remote.hold = lambda key: True
    await store.put("g-1/data/x", b"z" * 100)
    await store.cancel_uploads()  # as if the process had died: the upload stays pending
    Path(store.written.path_of("g-1/data/x")).write_bytes(b"q" * 100)
    with pytest.raises(CorruptCheckpointError, match="has not reached the remote"):
        await node_cache_over(remote, make_config(tmp_path)).get("g-1/data/x")
    remote.gate.set()
    with pytest.raises(StorageError, match="CRC-32C"):
        await store.sync()
    assert not await remote.exists("g-1/data/x")
    assert await store.drop_pending() == ["g-1/data/x"]  # what a user does with it (the exit drain would report it)


async def test_eviction_keeps_pending_data(remote: CountingBackend, tmp_path: Path) -> None:
    config = make_config(tmp_path, disk_bytes=100_000)
    store = node_cache_over(remote, config)
    remote.gate.clear()
    remote.hold = lambda key: key.startswith("pending/")
    for i in range(4):
        await store.put(f"pending/{i}", bytes([i]) * 40_000)  # 160 KB pending: over budget, kept
    for i in range(4):
        await remote.put(f"clean/{i}", bytes([i]) * 30_000)
        await store.get(f"clean/{i}")
    for i in range(4):
        assert Path(store.written.path_of(f"pending/{i}")).exists()
    fetched = [i for i in range(4) if Path(store.fetched.path_of(f"clean/{i}")).exists()]
    assert len(fetched) <= 1  # LRU: only the newest fetch could stay
    remote.gate.set()
    await store.wait_durable()
    await remote.put("clean/last", b"l" * 30_000)
    await store.get("clean/last")  # now the uploaded data can be evicted too
    assert store.catalog.usage() <= 100_000
    for i in range(4):
        assert await store.get(f"pending/{i}") == bytes([i]) * 40_000  # still readable (from the remote)


async def test_memory_tier_serves_small_objects(remote: CountingBackend, store: TieredBackend) -> None:
    await remote.put("meta/header.json", b"{}")
    await store.get("meta/header.json")
    os.unlink(store.fetched.path_of("meta/header.json"))
    assert await store.get("meta/header.json") == b"{}"


def test_parse_bytes_and_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert parse_bytes("10G") == 10 * 2**30 and parse_bytes("512M") == 512 * 2**20 and parse_bytes("123") == 123
    assert parse_bytes("1.5KiB") == 1536
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "envcache"))
    monkeypatch.setenv("TIERCKPT_CACHE_BYTES", "2G")
    config = CacheConfig.from_env(memory_bytes="1M")
    assert config.directory == str(tmp_path / "envcache") and config.disk_bytes == 2 * 2**30
    assert config.memory_bytes == 2**20


def test_open_tiered_by_scheme(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    local = open_tiered(str(tmp_path / "x"), config)  # never cached: the URI's backend behind its scheduling link
    assert not isinstance(local, TieredBackend) and isinstance(local.inner, LocalBackend)
    assert not isinstance(open_tiered("memory://m/x", config), TieredBackend)
    tiered = open_tiered("s3://bucket/p", config, endpoint_url="http://127.0.0.1:1", key="k", secret="s")
    assert isinstance(tiered, TieredBackend) and tiered.root_uri == "s3://bucket/p"
    off = CacheConfig(directory=str(tmp_path / "c2"), enabled=False)
    assert not isinstance(open_tiered("s3://bucket/p", off, endpoint_url="http://127.0.0.1:1"), TieredBackend)


# -- end to end ---------------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))


def test_save_to_s3_then_load_from_warm_cache_without_remote(
    s3_bucket_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proxy
) -> None:
    from fault_proxy import Rule

    config = make_config(tmp_path, block_bytes=8 * 2**20)
    cached = {"cache": config, "endpoint_url": proxy.endpoint}  # the endpoint that goes down below
    uri = f"{s3_bucket_uri}/step-100"
    model = _model()
    state = {"model": model.state_dict(), "step": 100}
    tierckpt.async_save(uri, state, storage_options=cached).wait()
    tierckpt.async_save(uri, state, storage_options=cached).wait()  # deletes of the first generation wait for the new COMMIT
    wait(uri, timeout_s=60, config=config, storage_options={"endpoint_url": proxy.endpoint})
    st = status(uri, config=config, storage_options={"endpoint_url": proxy.endpoint})
    assert st.state == "remote" and st.pending_bytes == 0 and st.durable
    # The remote alone has the whole checkpoint.
    target = {"model": _model().state_dict(), "step": 0}
    for t in target["model"].values():
        t.zero_()
    tierckpt.load(uri, target, storage_options={"cache": False})  # plain load from S3
    assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
    # Now with that endpoint unreachable (every connection reset): everything comes from the node cache.
    proxy.add_rule(Rule("reset", count=None))
    target = {"model": _model().state_dict(), "step": 0}
    for t in target["model"].values():
        t.zero_()
    tierckpt.load(uri, target, storage_options={"timeout_s": 2, **cached})
    assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
    assert target["step"] == 100
    assert proxy.hits["reset"] > 0  # the load did ask the endpoint first


def test_prefetch_only_some_tensors_and_gc(s3_bucket_uri: str, tmp_path: Path) -> None:
    """The read cache over a remote: ``prefetch(only=...)`` caches only the matching tensors' blocks, a full
    prefetch the whole data file, and gc deletes by its policy. The checkpoints are on S3, not in a local
    folder: a local path is read in place and never goes through the node cache, so prefetching one copies
    nothing (test_path_uris.py)."""
    from tierckpt.io.scheduler import get_scheduler

    sched = get_scheduler()
    config = make_config(tmp_path, block_bytes=4096)
    root = f"{s3_bucket_uri}/runs"
    torch.manual_seed(1)
    state = {"a.weight": torch.randn(64, 64), "b.weight": torch.randn(64, 64), "step": 1}
    for step in (100, 200, 300, 400):  # straight to S3: the node cache holds nothing of them yet
        tierckpt.save(f"{root}/step-{step}", state, storage_options={"cache": False})
    handle = prefetch(f"{root}/step-400", only=["a.*"], progress=False, config=config)
    assert handle.result(timeout=60) == handle.bytes_total > 0 and not handle.in_place
    store = open_tiered(f"{root}/step-400", config)
    assert isinstance(store, TieredBackend)
    gen = layout.CommitRecord.decode(sched.run(store.get(layout.COMMIT))).generation
    data_key = f"{gen}/data/rank-00000.bin"
    size = sched.run(store.size(data_key))
    cached = [i for i in range(0, (size + 4095) // 4096) if store.catalog.block(store.rh, data_key, i)]
    assert 0 < len(cached) < (size + 4095) // 4096  # only a.weight's blocks (about half)
    full = prefetch(f"{root}/step-300", progress=False, config=config)
    assert full.result(timeout=60) > size
    result = gc(root, keep_last=2, keep_every=200, config=config)
    assert result.kept == ("step-200", "step-300", "step-400") and result.deleted == ("step-100",)
    on_s3 = open_tiered(root, storage_options={"cache": False})
    data_files = {n: [k for k in sched.run(on_s3.list(f"{n}/")) if k.endswith(".bin")] for n in ("step-100", "step-400")}
    assert not data_files["step-100"] and data_files["step-400"]
    assert sched.run(on_s3.exists("step-400/COMMIT"))


def test_save_handle_waits_for_remote_durability(s3_server, s3_bucket_uri):
    """``wait()`` returns at the commit in the node cache; ``wait_durable()`` once the remote has it all."""
    import tierckpt
    from tierckpt.cache_api import status

    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing", "region": "us-east-1"}
    handle = tierckpt.async_save(s3_bucket_uri, {"w": torch.arange(1000.0)}, storage_options=options)
    handle.wait_durable(timeout_s=60)
    assert status(s3_bucket_uri, **options).state == "remote"
    # every stage recorded its time and bytes on this rank, the background upload included
    import boto3

    bucket, prefix = s3_bucket_uri.removeprefix("s3://").split("/", 1)
    listed = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").list_objects_v2(
        Bucket=bucket, Prefix=f"{prefix}/{handle.wait().generation}/"
    )["Contents"]
    assert handle.monitor.counters["bytes_staged"] == 4000
    assert handle.monitor.counters["bytes_uploaded"] == sum(o["Size"] for o in listed) > 4000  # data + metadata
    assert {"stage", "checksum", "file_write", "upload"} <= set(handle.monitor.seconds)
    target = {"w": torch.zeros(1000)}
    tierckpt.load(s3_bucket_uri, target, storage_options={**options, "cache": False})  # S3 itself
    assert torch.equal(target["w"], torch.arange(1000.0))


# -- uploads that follow the local write --------------------------------------------------------------
def _remote_partials(remote: LocalBackend) -> int:
    """Bytes in the remote's unpublished temp files (an upload in progress)."""
    return sum(p.stat().st_size for p in Path(remote.root).rglob("*.partial"))


def _write_parts(store: TieredBackend, key: str, parts: list[bytes], finish: str) -> int:
    """On the I/O loop: write ``parts``, wait for the remote to hold all but the last, then ``finish``
    (close or abort) the writer; return the bytes the remote held before that."""
    from tierckpt.io.scheduler import get_scheduler

    async def run() -> int:
        writer = await store.open_writer(key)
        for part in parts:
            await writer.write(part)
        expected = sum(map(len, parts[:-1]))
        for _ in range(500):
            if _remote_partials(store.remote) >= expected:
                break
            await asyncio.sleep(0.01)
        held = _remote_partials(store.remote)
        await getattr(writer, finish)()
        return held

    return get_scheduler().run(run())


PART = 64 * 1024


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierckpt.node.disk import tiered, uploads

    monkeypatch.setattr(tiered, "UPLOAD_PART_BYTES", PART)
    monkeypatch.setattr(uploads, "UPLOAD_PART_BYTES", PART)


def test_a_streamed_file_is_uploaded_while_it_is_written(remote: CountingBackend, store: TieredBackend, small_parts) -> None:
    from tierckpt.io.scheduler import get_scheduler

    key = "g-1/data/rank-00000.bin"
    parts = [os.urandom(PART) for _ in range(4)]
    held = _write_parts(store, key, parts, "close")
    assert held >= 3 * PART, "the upload should follow the local write, not wait for its close"
    get_scheduler().run(store.wait_durable())
    assert Path(remote.path_of(key)).read_bytes() == b"".join(parts)
    assert remote.calls.count(("open_writer", key)) == 1, "the followed upload is published, not redone"
    uploads = [r for r in get_scheduler().metrics.records() if r.op == "upload" and r.key == key]
    assert uploads and uploads[-1].nbytes == 4 * PART
    assert store.catalog.pending_under(store.rh) == {} and _remote_partials(remote) == 0


def test_an_aborted_write_leaves_nothing_on_the_remote(remote: CountingBackend, store: TieredBackend, small_parts) -> None:
    key = "g-1/data/rank-00000.bin"
    held = _write_parts(store, key, [os.urandom(PART) for _ in range(3)], "abort")
    assert held >= 2 * PART
    assert _remote_partials(remote) == 0 and not Path(remote.path_of(key)).exists()
    assert store.catalog.pending_under(store.rh) == {}


def test_a_rewritten_key_publishes_only_its_last_version(remote: CountingBackend, store: TieredBackend, small_parts) -> None:
    """A second writer of the key abandons the first one's upload; each close is uploaded in turn
    (the first from the local copy) and the remote ends with the second version."""
    from tierckpt.io.scheduler import get_scheduler

    key = "g-1/data/rank-00000.bin"
    first, second = [os.urandom(PART) for _ in range(3)], [os.urandom(PART) for _ in range(2)]

    async def run() -> None:
        a = await store.open_writer(key)
        for part in first:
            await a.write(part)
        b = await store.open_writer(key)
        for part in second:
            await b.write(part)
        await a.close()
        await b.close()
        await store.wait_durable()

    get_scheduler().run(run())
    assert Path(remote.path_of(key)).read_bytes() == b"".join(second)
    assert _remote_partials(remote) == 0 and store.catalog.pending_under(store.rh) == {}


def test_upload_while_writing_can_be_turned_off(remote: CountingBackend, tmp_path: Path, small_parts) -> None:
    from tierckpt.io.scheduler import get_scheduler

    store = node_cache_over(remote, make_config(tmp_path, upload_while_writing=False))
    key = "g-1/data/rank-00000.bin"
    parts = [os.urandom(PART) for _ in range(3)]
    assert _write_parts(store, key, parts[:1] + parts[1:], "close") == 0  # waited the full 5 s: nothing moved
    get_scheduler().run(store.wait_durable())
    assert Path(remote.path_of(key)).read_bytes() == b"".join(parts)


def test_a_root_lists_what_nested_roots_have_not_uploaded_yet(tmp_path: Path) -> None:
    """A run's root lists each step written through the step's own URI as soon as the node cache
    holds it (before its upload); deleting the step through its URI leaves nothing on the remote."""
    from tierckpt.io.scheduler import get_scheduler

    sched = get_scheduler()
    config = make_config(tmp_path)
    step_remote = CountingBackend(str(tmp_path / "remote" / "step-1"))
    step_remote.gate.clear()
    step_remote.hold = lambda key: True
    step = node_cache_over(step_remote, config)
    run = node_cache_over(LocalBackend(str(tmp_path / "remote")), config)
    sched.run(step.put("g-1/data/rank-00000.bin", b"x" * 100))
    sched.run(step.commit("COMMIT", layout.CommitRecord("g-1", 0.0).encode()))
    assert sched.run(run.list("")) == ["step-1/COMMIT", "step-1/g-1/data/rank-00000.bin"]
    assert sched.run(run.list("step-1/g-1/")) == ["step-1/g-1/data/rank-00000.bin"]
    deleting = sched.submit(step.delete_prefix(""))  # waits for the upload in flight, then removes it
    step_remote.gate.set()
    deleting.result(timeout=30)
    sched.run(step.wait_durable())
    assert sched.run(run.list("")) == [] and not any((tmp_path / "remote").rglob("*.bin"))


def test_deleting_a_step_through_the_root_drops_what_its_own_uri_has_pending(tmp_path: Path) -> None:
    """A run's root deletes a step that was written through the step's own URI (what the manager's
    retention does): the step's pending uploads are dropped, an upload in flight removes what it landed,
    and neither the remote nor the node cache serves the deleted checkpoint afterwards."""
    from tierckpt.errors import CheckpointNotFoundError
    from tierckpt.io.scheduler import get_scheduler

    sched = get_scheduler()
    config = make_config(tmp_path)
    step_remote = CountingBackend(str(tmp_path / "remote" / "step-1"))
    step_remote.gate.clear()
    step_remote.hold = lambda key: True
    step = node_cache_over(step_remote, config)  # both share the directory's one uploader
    run = node_cache_over(LocalBackend(str(tmp_path / "remote")), config)
    data_key = "g-1/data/rank-00000.bin"
    sched.run(step.put(data_key, b"x" * 100))
    sched.run(step.commit("COMMIT", layout.CommitRecord("g-1", 0.0).encode(), after={data_key: 100}))
    assert step.catalog.pending_under(step.rh)  # nothing uploaded yet: the remote is held
    deleting = sched.submit(run.delete_prefix("step-1/"))
    step_remote.gate.set()  # the upload in flight lands now, after its key was forgotten
    deleting.result(timeout=30)
    sched.run(step.wait_durable())
    assert step.catalog.pending_under(step.rh) == {} and step.catalog.keys_of_root(step.rh) == set()
    assert not [p for p in (tmp_path / "remote").rglob("*") if p.is_file()]
    assert not any((Path(config.directory) / "objects" / step.rh).rglob("*.bin"))
    assert sched.run(run.list("")) == []
    for key in (data_key, "COMMIT"):
        with pytest.raises(CheckpointNotFoundError):
            sched.run(step.get(key))


def test_node_cache_records_the_crc_stated_by_the_save(
    s3_bucket_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save through the node cache states each data file's CRC-32C (combined from its pieces') to the
    cache's writer, which records it in the catalogue without a second pass; the record equals a fresh
    CRC of the cached file, the upload verifies against it, and the checkpoint loads back bit-exact."""
    import crc32c

    from tierckpt.node.written import WrittenCrc

    stated: list[int] = []
    state_crc, add_async = WrittenCrc.state, WrittenCrc.add_async
    checksummed: list[int] = []

    def stating(written: WrittenCrc, crc: int) -> None:
        stated.append(crc)
        state_crc(written, crc)

    async def adding(written: WrittenCrc, data: bytes | memoryview) -> None:
        if written.computed is not None:
            checksummed.append(memoryview(data).nbytes)
        await add_async(written, data)

    monkeypatch.setattr(WrittenCrc, "state", stating)
    monkeypatch.setattr(WrittenCrc, "add_async", adding)
    config = make_config(tmp_path)
    uri = f"{s3_bucket_uri}/step-1"
    state = {"w": torch.randn(300, 1001, dtype=torch.float64), "b": torch.arange(7, dtype=torch.int8), "step": 1}
    tierckpt.save(uri, state, storage_options={"cache": config, "memory": False})
    wait(uri, timeout_s=60, config=config)

    store = open_tiered(uri, config)
    assert isinstance(store, TieredBackend)
    data_keys = [k for k in store.catalog.keys_of_root(store.rh) if "/data/" in k]
    assert data_keys and len(stated) == len(data_keys)
    assert checksummed == []  # the writer checksummed nothing itself
    for key in data_keys:
        record = store.catalog.obj(store.rh, key)
        assert record is not None and record.crc in stated, key
        cached = Path(store.written.path_of(key)).read_bytes()
        assert record.crc == crc32c.crc32c(cached) and record.size == len(cached), key
    target = {"w": torch.zeros(300, 1001, dtype=torch.float64), "b": torch.zeros(7, dtype=torch.int8), "step": 0}
    tierckpt.load(uri, target, storage_options={"cache": False})  # the remote copy
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"]) and target["step"] == 1
