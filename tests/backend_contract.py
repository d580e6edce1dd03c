"""The behaviour every storage backend shares, as a reusable test suite.

Each backend's test module subclasses :class:`BackendContract` and provides a ``backend`` fixture
(in the style of zarr's ``StoreTests``); backend-specific checks go in the subclass.
"""

from __future__ import annotations

import array
import asyncio

import pytest

from tierckpt.backends import Backend
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError

MiB = 2**20
LARGE_CHUNK = 5 * MiB
LARGE_CHUNKS = 13  # 65 MiB: more than one 64 MiB buffer, several S3 multipart parts


def large_chunk(i: int) -> bytes:
    """Chunk ``i`` of the large object: a shared pattern stamped with its index, so order shows."""
    base = bytes(range(256)) * (LARGE_CHUNK // 256)
    return i.to_bytes(8, "little") + base[8:]


class BackendContract:
    """Subclasses provide ``backend`` (a fresh, empty backend) as a fixture."""

    # -- whole objects -----------------------------------------------------------------------------
    async def test_put_get_round_trip(self, backend: Backend) -> None:
        data = bytes(range(256)) * 40
        await backend.put("a/b/obj.bin", data)
        await backend.put("view.bin", memoryview(data)[10:20])
        assert await backend.get("a/b/obj.bin") == data
        assert await backend.get("view.bin") == data[10:20]
        assert await backend.size("a/b/obj.bin") == len(data)
        assert await backend.exists("a/b/obj.bin")

    async def test_empty_object(self, backend: Backend) -> None:
        await backend.put("empty", b"")
        writer = await backend.open_writer("empty-streamed")
        await writer.close()
        for key in ("empty", "empty-streamed"):
            assert await backend.exists(key)
            assert await backend.get(key) == b""
            assert await backend.size(key) == 0
            assert await backend.get_range(key, 0, 0) == b""

    async def test_large_object_streamed_in_chunks(self, backend: Backend) -> None:
        writer = await backend.open_writer("large.bin")
        for i in range(LARGE_CHUNKS):
            await writer.write(large_chunk(i))
        await writer.close()
        total = LARGE_CHUNK * LARGE_CHUNKS
        assert await backend.size("large.bin") == total
        # Every chunk landed in order: its stamp sits at its offset.
        stamps = await asyncio.gather(
            *(backend.get_range("large.bin", i * LARGE_CHUNK, i * LARGE_CHUNK + 8) for i in range(LARGE_CHUNKS))
        )
        assert [int.from_bytes(s, "little") for s in stamps] == list(range(LARGE_CHUNKS))
        # A range across a chunk boundary, and one ending exactly at the end.
        boundary = 3 * LARGE_CHUNK
        assert await backend.get_range("large.bin", boundary - 100, boundary + 100) == (
            large_chunk(2)[-100:] + large_chunk(3)[:100]
        )
        assert await backend.get_range("large.bin", total - 1000, total) == large_chunk(LARGE_CHUNKS - 1)[-1000:]
        assert await backend.get("large.bin") == b"".join(large_chunk(i) for i in range(LARGE_CHUNKS))

    # -- ranges ------------------------------------------------------------------------------------
    async def test_get_range_edges(self, backend: Backend) -> None:
        data = bytes(range(100))
        await backend.put("r.bin", data)
        assert await backend.get_range("r.bin", 0, 0) == b""
        assert await backend.get_range("r.bin", 100, 100) == b""
        assert await backend.get_range("r.bin", 0, 100) == data
        assert await backend.get_range("r.bin", 37, 100) == data[37:]
        assert await backend.get_range("r.bin", 10, 11) == data[10:11]

    @pytest.mark.parametrize(("start", "end"), [(50, 101), (99, 200), (100, 101), (150, 160), (101, 101)])
    async def test_get_range_past_end_is_an_error(self, backend: Backend, start: int, end: int) -> None:
        await backend.put("r.bin", bytes(100))
        with pytest.raises(CorruptCheckpointError) as info:
            await backend.get_range("r.bin", start, end)
        message = str(info.value)
        assert "r.bin" in message and f"[{start}, {end})" in message and "100 bytes" in message

    @pytest.mark.parametrize(("start", "end"), [(-1, 5), (10, 5), (-5, -1)])
    async def test_invalid_range_is_an_error(self, backend: Backend, start: int, end: int) -> None:
        await backend.put("r.bin", bytes(100))
        with pytest.raises(CorruptCheckpointError, match="invalid byte range"):
            await backend.get_range("r.bin", start, end)

    async def test_read_into_fills_the_buffer(self, backend: Backend) -> None:
        data = bytes(range(256)) * 16
        await backend.put("r.bin", data)
        buf = bytearray(b"\xff" * 1000)
        await backend.read_into("r.bin", 123, memoryview(buf)[100:900])
        assert buf[100:900] == data[123:923]
        assert buf[:100] == b"\xff" * 100 and buf[900:] == b"\xff" * 100
        ints = array.array("i", [0] * 4)  # a non-byte buffer is filled byte for byte
        await backend.read_into("r.bin", 8, memoryview(ints))
        assert ints.tobytes() == data[8:24]
        with pytest.raises(CorruptCheckpointError):
            await backend.read_into("r.bin", len(data) - 10, memoryview(bytearray(11)))

    # -- missing objects -----------------------------------------------------------------------------
    async def test_missing_key(self, backend: Backend) -> None:
        assert not await backend.exists("missing/key.bin")
        operations = [
            backend.get("missing/key.bin"),
            backend.get_range("missing/key.bin", 0, 4),
            backend.size("missing/key.bin"),
            backend.read_into("missing/key.bin", 0, memoryview(bytearray(4))),
        ]
        for op in operations:
            with pytest.raises(CheckpointNotFoundError) as info:
                await op
            assert isinstance(info.value, FileNotFoundError)
            assert "missing/key.bin" in str(info.value)

    async def test_a_directory_is_not_an_object(self, backend: Backend) -> None:
        await backend.put("dir/inner.bin", b"x")
        assert not await backend.exists("dir")
        with pytest.raises(CheckpointNotFoundError):
            await backend.size("dir")

    # -- listing and deleting -----------------------------------------------------------------------
    async def test_list(self, backend: Backend) -> None:
        for key in ("b/2", "a/1", "a/sub/3", "ab", "a/2"):
            await backend.put(key, key.encode())
        pending = await backend.open_writer("a/unfinished")
        await pending.write(b"partial")
        assert await backend.list() == ["a/1", "a/2", "a/sub/3", "ab", "b/2"]
        assert await backend.list("a/") == ["a/1", "a/2", "a/sub/3"]
        assert await backend.list("a") == ["a/1", "a/2", "a/sub/3", "ab"]
        assert await backend.list("a/sub/") == ["a/sub/3"]
        assert await backend.list("nothing/") == []
        await pending.abort()

    async def test_delete(self, backend: Backend) -> None:
        await backend.put("d/1", b"1")
        await backend.put("d/2", b"2")
        await backend.put("keep", b"k")
        await backend.delete("d/1")
        assert not await backend.exists("d/1")
        await backend.delete("d/1")  # deleting a missing key is fine
        await backend.delete("never/existed")
        await backend.delete_prefix("d/")
        assert await backend.list() == ["keep"]

    # -- writers -----------------------------------------------------------------------------------
    async def test_writer_object_is_invisible_until_close(self, backend: Backend) -> None:
        writer = await backend.open_writer("w/obj")
        await writer.write(b"hello ")
        await writer.write(memoryview(b"world"))
        assert not await backend.exists("w/obj")
        assert await backend.list() == []
        await writer.close()
        assert await backend.get("w/obj") == b"hello world"
        assert await backend.list() == ["w/obj"]

    async def test_abort_leaves_nothing(self, backend: Backend) -> None:
        writer = await backend.open_writer("w/aborted")
        await writer.write(b"x" * 1000)
        await writer.abort()
        await writer.abort()  # idempotent
        assert not await backend.exists("w/aborted")
        assert await backend.list() == []

    async def test_writer_over_existing_object(self, backend: Backend) -> None:
        await backend.put("w/obj", b"old")
        writer = await backend.open_writer("w/obj")
        await writer.write(b"new content")
        assert await backend.get("w/obj") == b"old"
        await writer.abort()
        assert await backend.get("w/obj") == b"old"
        writer = await backend.open_writer("w/obj")
        await writer.write(b"new content")
        await writer.close()
        assert await backend.get("w/obj") == b"new content"

    async def test_closed_writer_rejects_writes(self, backend: Backend) -> None:
        writer = await backend.open_writer("w/obj")
        await writer.close()
        with pytest.raises(CheckpointError, match="already closed"):
            await writer.write(b"late")

    async def test_concurrent_writers_never_expose_a_partial_object(self, backend: Backend) -> None:
        contents = {name: [name.encode() * 5000 for _ in range(4)] for name in ("first", "second")}
        contents["second"].append(b"tail" * 333)
        writers = {name: await backend.open_writer("same/key") for name in contents}
        for step in range(5):
            for name, writer in writers.items():
                if step < len(contents[name]):
                    await writer.write(contents[name][step])
            assert not await backend.exists("same/key")
        await asyncio.gather(*(w.close() for w in writers.values()))
        final = await backend.get("same/key")
        assert final in {b"".join(chunks) for chunks in contents.values()}
        assert await backend.list() == ["same/key"]

    # -- commit --------------------------------------------------------------------------------------
    async def test_commit_is_visible_and_overwrites(self, backend: Backend) -> None:
        await backend.commit("ckpt/COMMIT", b'{"step": 1}')
        assert await backend.get("ckpt/COMMIT") == b'{"step": 1}'
        await backend.commit("ckpt/COMMIT", b'{"step": 2}')
        assert await backend.get("ckpt/COMMIT") == b'{"step": 2}'
        assert await backend.list("ckpt/") == ["ckpt/COMMIT"]

    # -- keys ----------------------------------------------------------------------------------------
    @pytest.mark.parametrize("key", ["../escape", "a/../../b", "/abs/path", "a//b", "a/./b", "", "a\\b"])
    async def test_unsafe_keys_are_rejected(self, backend: Backend, key: str) -> None:
        for op in (
            backend.put(key, b"x"),
            backend.get(key),
            backend.exists(key),
            backend.open_writer(key),
            backend.commit(key, b"x"),
        ):
            with pytest.raises(CorruptCheckpointError, match="invalid storage key"):
                await op
        with pytest.raises(CorruptCheckpointError, match="invalid storage key"):
            await backend.list("../")
