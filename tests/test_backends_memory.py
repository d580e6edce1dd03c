"""MemoryBackend: the shared contract plus store naming and reset."""

from __future__ import annotations

import pytest
from backend_contract import BackendContract

from tierckpt.backends import MemoryBackend, open_backend
from tierckpt.backends.memory import MemoryRegistry, reset_memory_stores
from tierckpt.errors import UnsupportedURIError


class TestMemoryBackend(BackendContract):
    @pytest.fixture
    def backend(self) -> MemoryBackend:
        return MemoryBackend("memory://contract/root")

    async def test_same_name_shares_objects_and_prefix_scopes_them(self) -> None:
        whole = open_backend("memory://shared")
        scoped = open_backend("memory://shared/run-1")
        await scoped.put("step-1/data.bin", b"x")
        assert await whole.list() == ["run-1/step-1/data.bin"]
        assert await whole.get("run-1/step-1/data.bin") == b"x"
        assert await open_backend("memory://other").list() == []

    async def test_reset_empties_every_store(self) -> None:
        backend = open_backend("memory://to-reset")
        await backend.put("k", b"v")
        reset_memory_stores()
        assert not await backend.exists("k")
        assert await open_backend("memory://to-reset").list() == []

    async def test_separate_registries_are_isolated(self) -> None:
        private = MemoryBackend("memory://iso", registry=MemoryRegistry())
        await private.put("k", b"v")
        assert not await MemoryBackend("memory://iso").exists("k")

    async def test_store_does_not_alias_caller_buffers(self) -> None:
        backend = open_backend("memory://alias")
        buf = bytearray(b"abc")
        await backend.put("k", memoryview(buf))
        buf[0] = ord("z")
        assert await backend.get("k") == b"abc"

    @pytest.mark.parametrize("uri", ["memory://", "memory:///prefix", "memory://name/../up"])
    def test_bad_uris(self, uri: str) -> None:
        with pytest.raises(UnsupportedURIError, match="memory"):
            MemoryBackend(uri)
