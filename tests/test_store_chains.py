"""The contract suite (tests/backend_contract.py) against every link and every chain that
:func:`tierckpt.store.open_store` builds, each driven on the I/O scheduler's own loop (where stores run
in the library, so the scheduling link really takes slots, retries and records metrics).

Chains: a local path, ``memory://``, S3 without the node cache (each: the backend behind its
scheduling link), S3 through the node cache, and a local path through the node cache (the chain the
cache's own commands build for any URI); the node memory link on top of a local path and of S3
through the node cache, each once with keys inside a checkpoint generation (which the link keeps in the
memory tier and writes down behind) and once with other keys (which it passes through). Plus: the
rules that decide the cache and the memory tier, and the shared priority queue of one remote.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from backend_contract import BackendContract  # noqa: E402

from tierckpt.backends import Backend, LocalBackend, MemoryBackend, S3Backend  # noqa: E402
from tierckpt.backends.base import UNCONDITIONAL, ObjectWriter, Unconditional  # noqa: E402
from tierckpt.node.disk import CacheConfig, TieredBackend  # noqa: E402
from tierckpt.errors import CheckpointError, CheckpointNotFoundError  # noqa: E402
from tierckpt.io.scheduled import ScheduledBackend  # noqa: E402
from tierckpt.io.scheduler import get_scheduler  # noqa: E402
from tierckpt.store import (  # noqa: E402
    cache_config_for, durability_of, memory_config_for, memory_tier_of, node_cache_over, open_cached_store, open_store,
    uploader_of,
)
from tierckpt.node.memory import MemoryConfig  # noqa: E402
from tierckpt.node.memory.link import MemoryLink  # noqa: E402

_T = TypeVar("_T")


async def _on_loop(make: Callable[[], Awaitable[_T]]) -> _T:
    """Run the coroutine ``make()`` on the scheduler's loop and await it from the test's loop."""

    async def run() -> _T:
        return await make()

    return await asyncio.wrap_future(get_scheduler().submit(run()))


class _WriterOnLoop(ObjectWriter):
    def __init__(self, inner: ObjectWriter) -> None:
        self._inner, self._uri = inner, getattr(inner, "_uri", "?")

    async def write(self, data: bytes | memoryview) -> None:
        await _on_loop(lambda: self._inner.write(data))

    async def close(self) -> None:
        await _on_loop(self._inner.close)

    async def abort(self) -> None:
        await _on_loop(self._inner.abort)


class OnSchedulerLoop(Backend):
    """Test adapter: every call of ``store`` runs on the I/O scheduler's loop."""

    def __init__(self, store: Backend) -> None:
        super().__init__(store.root_uri)
        self.store = store

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await _on_loop(lambda: self.store.put(key, data))

    async def open_writer(self, key: str) -> ObjectWriter:
        return _WriterOnLoop(await _on_loop(lambda: self.store.open_writer(key)))

    async def get(self, key: str) -> bytes:
        return await _on_loop(lambda: self.store.get(key))

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        return await _on_loop(lambda: self.store.get_range(key, start, end))

    async def read_into(self, key: str, start: int, out: memoryview) -> None:
        await _on_loop(lambda: self.store.read_into(key, start, out))

    async def read_runs(self, key: str, offsets: Sequence[int], run_bytes: int, out: memoryview, digest: Any = None) -> Any:
        return await _on_loop(lambda: self.store.read_runs(key, offsets, run_bytes, out, digest))

    async def exists(self, key: str) -> bool:
        return await _on_loop(lambda: self.store.exists(key))

    async def size(self, key: str) -> int:
        return await _on_loop(lambda: self.store.size(key))

    async def list(self, prefix: str = "") -> list[str]:
        return await _on_loop(lambda: self.store.list(prefix))

    async def delete(self, key: str) -> None:
        await _on_loop(lambda: self.store.delete(key))

    async def delete_prefix(self, prefix: str) -> None:
        await _on_loop(lambda: self.store.delete_prefix(prefix))

    async def commit(self, key: str, data: bytes, *, expected: bytes | None | Unconditional = UNCONDITIONAL,
                     after: Any = None) -> None:
        await _on_loop(lambda: self.store.commit(key, data, expected=expected, after=after))


class InGeneration(Backend):
    """Test adapter: every key of ``store`` inside one checkpoint generation (``g-.../<key>``), so the
    memory link keeps it in the memory tier; ``list`` strips the generation again."""

    GEN = "g-00000001-1700000000000-c0ffee"

    def __init__(self, store: Backend) -> None:
        super().__init__(store.root_uri)
        self.store = store

    def _k(self, key: str) -> str:
        return f"{self.GEN}/{key}"

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self.store.put(self._k(key), data)

    async def open_writer(self, key: str) -> ObjectWriter:
        return await self.store.open_writer(self._k(key))

    async def get(self, key: str) -> bytes:
        return await self.store.get(self._k(key))

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        return await self.store.get_range(self._k(key), start, end)

    async def read_into(self, key: str, start: int, out: memoryview) -> None:
        await self.store.read_into(self._k(key), start, out)

    async def read_runs(self, key: str, offsets: Sequence[int], run_bytes: int, out: memoryview) -> None:
        await self.store.read_runs(self._k(key), offsets, run_bytes, out)

    async def exists(self, key: str) -> bool:
        return await self.store.exists(self._k(key))

    async def size(self, key: str) -> int:
        return await self.store.size(self._k(key))

    async def list(self, prefix: str = "") -> list[str]:
        return [k.partition("/")[2] for k in await self.store.list(self._k(prefix))]

    async def delete(self, key: str) -> None:
        await self.store.delete(self._k(key))

    async def delete_prefix(self, prefix: str) -> None:
        await self.store.delete_prefix(self._k(prefix))

    async def commit(self, key: str, data: bytes, *, expected: bytes | None | Unconditional = UNCONDITIONAL,
                     after: Any = None) -> None:
        await self.store.commit(self._k(key), data, expected=expected, after=after)


def _memory(tmp_path: Path) -> MemoryConfig:
    return MemoryConfig(directory=str(tmp_path / "memory-tier"), budget_bytes=1 << 30)


def _config(tmp_path: Path) -> CacheConfig:
    return CacheConfig(directory=str(tmp_path / "cache"), block_bytes=64 * 1024, exit_wait_s=0, poll_s=0.01)


class TestLocalChain(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        store = open_store(str(tmp_path / "root"))
        assert isinstance(store, ScheduledBackend) and isinstance(store.inner, LocalBackend)
        return OnSchedulerLoop(store)


class TestMemoryChain(BackendContract):
    @pytest.fixture
    def backend(self) -> Backend:
        store = open_store("memory://chains/root")
        assert isinstance(store, ScheduledBackend) and isinstance(store.inner, MemoryBackend)
        return OnSchedulerLoop(store)


class TestS3Chain(BackendContract):
    @pytest.fixture
    def backend(self, s3_bucket_uri: str) -> Backend:
        store = open_store(s3_bucket_uri, {"cache": False})
        assert isinstance(store, ScheduledBackend) and isinstance(store.inner, S3Backend)
        return OnSchedulerLoop(store)


class TestS3ThroughNodeCacheChain(BackendContract):
    @pytest.fixture
    def backend(self, s3_bucket_uri: str, tmp_path: Path) -> Backend:
        store = open_store(s3_bucket_uri, {"cache": _config(tmp_path)})
        assert isinstance(store, TieredBackend) and isinstance(store.link, ScheduledBackend)
        assert durability_of(store) is store
        return OnSchedulerLoop(store)


class TestLocalThroughNodeCacheChain(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        return OnSchedulerLoop(open_cached_store(str(tmp_path / "remote"), {}, _config(tmp_path)))


class TestLocalThroughMemoryLinkChain(BackendContract):
    """Keys inside a generation: written into the memory tier, read from it, written down behind."""

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        store = open_store(str(tmp_path / "root"), {"memory": _memory(tmp_path)})
        assert isinstance(store, MemoryLink) and isinstance(store.below, ScheduledBackend)
        assert memory_tier_of(store) is store.memory_tier and durability_of(store) is store
        return InGeneration(OnSchedulerLoop(store))


class TestLocalThroughMemoryLinkPassThroughChain(BackendContract):
    """Keys outside any generation go straight to the chain below."""

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        return OnSchedulerLoop(open_store(str(tmp_path / "root"), {"memory": _memory(tmp_path)}))


class TestS3ThroughMemoryLinkAndNodeCacheChain(BackendContract):
    @pytest.fixture
    def backend(self, s3_bucket_uri: str, tmp_path: Path) -> Backend:
        store = open_store(s3_bucket_uri, {"cache": _config(tmp_path), "memory": _memory(tmp_path)})
        assert isinstance(store, MemoryLink) and isinstance(store.below, TieredBackend)
        return InGeneration(OnSchedulerLoop(store))


class TestScheduledLinkAlone(BackendContract):
    """The link on a foreign event loop (a test's own): it still retries and forwards everything."""

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        return ScheduledBackend(LocalBackend(str(tmp_path / "root")))


# -- the one rule --------------------------------------------------------------------------------------
def test_one_rule_decides_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path)
    assert cache_config_for(str(tmp_path), config) is None  # local paths: never
    assert cache_config_for("memory://x/y", True) is None
    assert cache_config_for("s3://b/p", False) is None
    assert cache_config_for("s3://b/p", config) == config
    monkeypatch.setenv("TIERCKPT_CACHE", "off")
    assert cache_config_for("s3://b/p") is None  # the environment, by default
    assert cache_config_for("s3://b/p", True) is not None  # an explicit True wins over it
    assert cache_config_for("s3://b/p", CacheConfig(directory=str(tmp_path), enabled=False)) is None
    with pytest.raises(CheckpointError, match="cache="):
        cache_config_for("s3://b/p", "yes")


def test_one_rule_decides_the_memory_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _memory(tmp_path)
    monkeypatch.delenv("TIERCKPT_MEMORY", raising=False)
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(tmp_path / "env-tier"))
    assert memory_config_for("s3://b/p") is None  # off by default
    assert memory_config_for(str(tmp_path), config) == config
    assert memory_config_for("memory://x/y", True) is None  # never for memory://
    assert memory_config_for("s3://b/p", True).directory == str(tmp_path / "env-tier")
    monkeypatch.setenv("TIERCKPT_MEMORY", "on")
    assert memory_config_for(str(tmp_path)) is not None  # local paths too
    assert memory_config_for("s3://b/p", False) is None  # an explicit False wins over the environment
    assert memory_tier_of(open_store(str(tmp_path / "r"), {"memory": False})) is None
    assert memory_tier_of(open_store(str(tmp_path / "r"))) is not None
    monkeypatch.setenv("TIERCKPT_MEMORY", "yes")
    with pytest.raises(CheckpointError, match="TIERCKPT_MEMORY='yes'"):
        memory_config_for("s3://b/p")
    with pytest.raises(CheckpointError, match="memory="):
        memory_config_for("s3://b/p", "on")


def test_only_a_local_file_tells_its_size_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``size_at_once``: a local path's chain stats the file in the calling thread (a missing one is not
    found); a memory store, and a chain whose top is the node memory link, answer ``None`` (the I/O loop)."""
    monkeypatch.delenv("TIERCKPT_MEMORY", raising=False)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "f.bin").write_bytes(b"x" * 1234)
    local = open_store(str(tmp_path / "r"), {"memory": False})
    assert isinstance(local, ScheduledBackend) and local.size_at_once("f.bin") == 1234
    with pytest.raises(CheckpointNotFoundError, match="f2.bin"):
        local.size_at_once("f2.bin")
    assert open_store("memory://sizes/r").size_at_once("f.bin") is None
    tiered = open_store(str(tmp_path / "r"), {"memory": _memory(tmp_path)})
    assert isinstance(tiered, MemoryLink) and tiered.size_at_once("f.bin") is None


@pytest.mark.parametrize("at_once", [16, 0])
def test_a_load_checks_few_local_files_at_once_and_many_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at_once: int,
) -> None:
    """The data files' size check of a load: in the calling thread up to ``SIZES_AT_ONCE`` local files (here
    the one file), else on the I/O loop (``SIZES_AT_ONCE`` 0); the load is exact either way."""
    import torch

    import tierckpt
    from tierckpt.loading import generation as load_generation

    monkeypatch.delenv("TIERCKPT_MEMORY", raising=False)
    saved = {"w": torch.arange(4096.0).reshape(64, 64)}
    tierckpt.save(str(tmp_path / "ck"), saved, storage_options={"memory": False})
    calls = {"size_at_once": 0, "size": 0}
    at_once_fn, size_fn = LocalBackend.size_at_once, LocalBackend.size

    def counted_at_once(self: LocalBackend, key: str) -> int:
        calls["size_at_once"] += "/data/" in key
        return at_once_fn(self, key)

    async def counted_size(self: LocalBackend, key: str) -> int:
        calls["size"] += "/data/" in key
        return await size_fn(self, key)

    monkeypatch.setattr(LocalBackend, "size_at_once", counted_at_once)
    monkeypatch.setattr(LocalBackend, "size", counted_size)
    monkeypatch.setattr(load_generation, "SIZES_AT_ONCE", at_once)
    got = {"w": torch.zeros(64, 64)}
    tierckpt.load(str(tmp_path / "ck"), got, storage_options={"memory": False})
    assert torch.equal(got["w"], saved["w"])
    assert calls == ({"size_at_once": 1, "size": 0} if at_once else {"size_at_once": 0, "size": 1})


def test_links_of_one_remote_share_one_priority_queue(tmp_path: Path) -> None:
    a = ScheduledBackend(LocalBackend(str(tmp_path / "r")))
    b = ScheduledBackend(LocalBackend(str(tmp_path / "r") + "/"))
    sched = get_scheduler()
    assert a.queue == b.queue
    sched.run(a.put("k", b"v"))
    assert sched.run(b.get("k")) == b"v"
    assert sched._slot(a.queue) is sched._slot(b.queue)
    ops = [r for r in sched.metrics.records() if r.backend.rstrip("/") == a.root_uri and r.key == "k"]
    assert {r.op for r in ops} >= {"put", "get"}


def test_one_uploader_and_catalogue_per_cache_directory(tmp_path: Path) -> None:
    """Every store of a cache directory shares the process's one uploader and catalogue handle, whatever
    spelling names the directory (LMDB refuses a second handle in a process)."""
    config = CacheConfig(directory=str(tmp_path / "cache"), exit_wait_s=0)
    spelled_apart = CacheConfig(directory=str(tmp_path / "x" / ".." / "cache") + "/", exit_wait_s=0)
    a = node_cache_over(LocalBackend(str(tmp_path / "r1")), config)
    b = node_cache_over(LocalBackend(str(tmp_path / "r2")), spelled_apart)
    assert a.uploader is b.uploader is uploader_of(config) and a.catalog is b.catalog
    with pytest.raises(ValueError, match="cannot serve the cache"):
        TieredBackend(LocalBackend(str(tmp_path / "r3")), CacheConfig(directory=str(tmp_path / "other")), a.uploader)


_FORKING_PARENT = """
import os, sys
from tierckpt.backends import LocalBackend
from tierckpt.node.disk import CacheConfig
from tierckpt.errors import StorageError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.store import node_cache_over

root, cache = sys.argv[1], sys.argv[2]
config = CacheConfig(directory=cache, exit_wait_s=0)
parent = node_cache_over(LocalBackend(root), config)
sched = get_scheduler()
sched.run(parent.put("a", b"from the parent"))
writes = [sched.submit(parent.put(f"busy/{i}", bytes(4096))) for i in range(400)]  # catalogue busy at fork
for i in range(12):
    pid = os.fork()
    if pid == 0:  # the child: a clear error for the parent's cache, its own directory works, a normal exit
        try:
            node_cache_over(LocalBackend(root), config)
            sys.exit(3)
        except StorageError as exc:
            if "forked" not in str(exc) or "spawn" not in str(exc):
                sys.exit(4)
        own = node_cache_over(LocalBackend(root + "-child"), CacheConfig(directory=cache + f"-child{i}", exit_wait_s=0))
        get_scheduler().run(own.put("c", b"child"))
        get_scheduler().run(own.wait_durable(timeout_s=30))
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, (i, status)
for w in writes:
    w.result(timeout=60)
sched.run(parent.wait_durable(timeout_s=60))
assert sched.run(parent.get("a")) == b"from the parent" and len(sched.run(parent.list("busy/"))) == 400
print("OK")
"""


def test_a_forked_child_never_touches_its_parents_cache_handles(tmp_path: Path) -> None:
    """Forks while the parent's node cache is busy (a DataLoader forking its workers mid-upload): each
    child exits normally without hanging on the inherited LMDB handle, gets a clear error naming the fix
    if it opens the parent's cache directory, and works with a directory of its own; the parent goes on.
    (In a process of its own: forking this test process, with every thread the suite has started, is
    not what a training process that forks looks like.)"""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _FORKING_PARENT, str(tmp_path / "r"), str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr
    assert (tmp_path / "r-child" / "c").read_bytes() == b"child"


@pytest.mark.fast
@pytest.mark.parametrize("async_", [False, True])
def test_a_save_and_a_load_split_the_uri_and_assemble_the_chain_once(tmp_path: Path, monkeypatch, async_: bool) -> None:
    """The URI of a save (and of a load) is split once and its chain assembled once: every later step asks
    the store and node face that one open_chain returned."""
    import torch

    import tierckpt
    from tierckpt import backends, store
    from tierckpt.io import scheduled

    counts = {"split": 0, "chain": 0, "scheduled": 0}
    split, chain, init = backends.split_uri, store.open_chain, scheduled.ScheduledBackend.__init__

    def counting_split(uri: str) -> tuple[str, str]:
        counts["split"] += 1
        return split(uri)

    def counting_chain(*args, **kwargs):  # type: ignore[no-untyped-def]
        counts["chain"] += 1
        return chain(*args, **kwargs)

    def counting_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        counts["scheduled"] += 1
        init(self, *args, **kwargs)

    for module in (backends, store):
        monkeypatch.setattr(module, "split_uri", counting_split)
    monkeypatch.setattr(scheduled.ScheduledBackend, "__init__", counting_init)
    for module_name in ("tierckpt.saving.plan", "tierckpt.loading.api"):
        monkeypatch.setattr(module_name + ".open_chain", counting_chain)
    uri, state = str(tmp_path / "ckpt"), {"w": torch.arange(12.0)}
    if async_:
        tierckpt.async_save(uri, state).result()
    else:
        tierckpt.save(uri, state)
    assert counts == {"split": 1, "chain": 1, "scheduled": 1}, counts
    counts.update(split=0, chain=0, scheduled=0)
    got = tierckpt.load(uri, {"w": torch.zeros(12)})
    assert torch.equal(got["w"], state["w"]) and counts == {"split": 1, "chain": 1, "scheduled": 1}, counts
