"""In-process backend for ``memory://NAME[/prefix]`` URIs (tests, staging tiers).

Objects live in a :class:`MemoryRegistry`: a map from store NAME to a dict of full key -> bytes.
Every backend opened on the same NAME in this process sees the same objects; ``prefix`` scopes a
backend to part of the store, like a directory. Nothing is shared across processes.

The module keeps one default registry; :func:`reset_memory_stores` empties it (tests call it after
every test so no state leaks between them). Writers buffer privately and publish the whole object
on ``close``, so readers never see a partial object. Error semantics match the local backend.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from tierckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedURIError,
)
from tierckpt.native.keys import validate_key
from tierckpt.backends.base import UNCONDITIONAL, Backend, ObjectWriter, Unconditional
from tierckpt.backends.commit_check import commit_refused
from tierckpt.backends.files import check_prefix, check_range, range_past_end

_SCHEME = "memory://"


class MemoryRegistry:
    """Named in-memory stores; thread-safe, since backends may be used from several loops."""

    def __init__(self) -> None:
        self._stores: dict[str, dict[str, bytes]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def store(self, name: str) -> Iterator[dict[str, bytes]]:
        """Hold the registry lock and yield the store ``name`` (created empty on first use)."""
        with self._lock:
            yield self._stores.setdefault(name, {})

    def reset(self) -> None:
        """Drop every store."""
        with self._lock:
            self._stores.clear()


_DEFAULT_REGISTRY = MemoryRegistry()


def reset_memory_stores() -> None:
    """Empty the default registry (every ``memory://`` store of this process)."""
    _DEFAULT_REGISTRY.reset()


def _parse(root_uri: str) -> tuple[str, str]:
    rest = root_uri.removeprefix(_SCHEME) if root_uri.startswith(_SCHEME) else None
    name, _, prefix = (rest or "").partition("/")
    prefix = prefix.strip("/")
    if not name:
        raise UnsupportedURIError(
            f"memory URI {root_uri!r} has no store name: use memory://NAME or memory://NAME/prefix"
        )
    if prefix:
        try:
            validate_key(prefix)
        except CorruptCheckpointError as exc:
            raise UnsupportedURIError(f"memory URI {root_uri!r} has an invalid prefix: {exc}") from exc
    return name, prefix


class _MemoryWriter(ObjectWriter):
    """Buffers every chunk; ``close`` publishes the whole object in one assignment."""

    def __init__(self, backend: MemoryBackend, key: str) -> None:
        self._backend = backend
        self._key = key
        self._buf: bytearray | None = bytearray()

    def _open_buffer(self) -> bytearray:
        if self._buf is None:
            raise CheckpointError(
                f"writer for {self._backend.uri_of(self._key)} is already closed or aborted"
            )
        return self._buf

    async def write(self, data: bytes | memoryview) -> None:
        self._open_buffer().extend(memoryview(data).cast("B"))

    async def close(self) -> None:
        data = bytes(self._open_buffer())
        self._buf = None
        await self._backend.put(self._key, data)

    async def abort(self) -> None:
        self._buf = None


class MemoryBackend(Backend):
    """Objects are ``bytes`` in a per-process :class:`MemoryRegistry` store."""

    def __init__(self, root_uri: str, registry: MemoryRegistry | None = None) -> None:
        super().__init__(root_uri)
        self.name, self.prefix = _parse(root_uri)
        self._registry = registry or _DEFAULT_REGISTRY

    def _full(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri_of(self, key: str) -> str:
        """The full URI of ``key``, for messages."""
        return f"{_SCHEME}{self.name}/{self._full(key)}"

    def _lookup(self, key: str) -> bytes:
        full = self._full(key)
        with self._registry.store(self.name) as store:
            data = store.get(full)
        if data is None:
            raise CheckpointNotFoundError(f"no object at {self.uri_of(key)}")
        return data

    async def put(self, key: str, data: bytes | memoryview) -> None:
        full = self._full(key)
        blob = bytes(memoryview(data).cast("B"))
        with self._registry.store(self.name) as store:
            store[full] = blob

    async def open_writer(self, key: str) -> ObjectWriter:
        self._full(key)
        return _MemoryWriter(self, key)

    async def get(self, key: str) -> bytes:
        return self._lookup(key)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        check_range(self.uri_of(key), start, end)
        return bytes(self._slice(key, start, end))

    async def read_into(self, key: str, start: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        check_range(self.uri_of(key), start, start + len(view))
        view[:] = self._slice(key, start, start + len(view))

    def _slice(self, key: str, start: int, end: int) -> memoryview:
        data = self._lookup(key)
        if end > len(data):
            raise range_past_end(self.uri_of(key), start, end, len(data))
        return memoryview(data)[start:end]

    async def exists(self, key: str) -> bool:
        full = self._full(key)
        with self._registry.store(self.name) as store:
            return full in store

    async def size(self, key: str) -> int:
        return len(self._lookup(key))

    async def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        scope = f"{self.prefix}/" if self.prefix else ""
        with self._registry.store(self.name) as store:
            keys = [k[len(scope) :] for k in store if k.startswith(scope)]
        return sorted(k for k in keys if k.startswith(prefix))

    async def delete(self, key: str) -> None:
        full = self._full(key)
        with self._registry.store(self.name) as store:
            store.pop(full, None)

    async def commit(
        self, key: str, data: bytes, *, expected: bytes | None | Unconditional = UNCONDITIONAL,
        after: Mapping[str, int | None] | None = None,
    ) -> None:
        """Compare and set under the registry lock."""
        full = self._full(key)
        blob = bytes(memoryview(data).cast("B"))
        with self._registry.store(self.name) as store:
            current = store.get(full)
            if expected is not UNCONDITIONAL and current != expected:
                raise commit_refused(self.uri_of(key), expected, current)
            store[full] = blob
