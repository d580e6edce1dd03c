"""The contract suite (tests/backend_contract.py) against every link and every chain that
:func:`tierckpt.store.open_store` builds, each driven on the I/O scheduler's own loop (where stores run
in the library, so the scheduling link really takes slots, retries and records metrics).

Chains: a local path, ``memory://``, S3 without the node cache (each: the backend behind its
scheduling link), S3 through the node cache, and a local path through the node cache (the chain the
cache's own commands build for any URI). Plus: the one rule that decides the cache, and the shared
priority queue of one remote.
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
from tierckpt.cache import CacheConfig, TieredBackend  # noqa: E402
from tierckpt.errors import CheckpointError  # noqa: E402
from tierckpt.io.scheduled import ScheduledBackend  # noqa: E402
from tierckpt.io.scheduler import get_scheduler  # noqa: E402
from tierckpt.store import cache_config_for, durability_of, open_cached_store, open_store  # noqa: E402

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
