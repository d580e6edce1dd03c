"""The write-back engine's one checked copy (``tierckpt.node.copy``): kernel-side into a local file
writer, streamed from the source's pages into any other, the CRC-32C checked before anything is published."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import pytest
import torch

import tierckpt
from tierckpt.backends import LocalBackend
from tierckpt.backends.memory import MemoryBackend
from tierckpt.errors import CheckpointError, ChecksumMismatchError, CheckpointNotFoundError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.node import copy as wcopy
from tierckpt.node import ledger
from tierckpt.node.copy import CopySource, FileSink, copy_checked
from tierckpt.node.written import FileEntry

CHUNK = 64 * 1024


def _source(path: Path, recorded: FileEntry | None) -> CopySource:
    def mismatch(got: FileEntry) -> CheckpointError:
        return ChecksumMismatchError(f"{path}: {got} is not {recorded}", "k", 0, got.size)

    return CopySource(str(path), ledger.Tier.MEMORY, recorded, mismatch,
                      lambda: CheckpointNotFoundError(f"{path} is gone"))


def _file(tmp_path: Path, nbytes: int) -> tuple[Path, bytes]:
    data = os.urandom(nbytes)
    path = tmp_path / "src.bin"
    path.write_bytes(data)
    return path, data


def _copy(source: CopySource, below: object, key: str) -> FileEntry:
    return get_scheduler().run(copy_checked(source, below, key, chunk=CHUNK))  # type: ignore[arg-type]


def _no_temp_files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file()]


def test_a_large_file_is_copied_kernel_side_into_a_local_writer_with_its_crc_checked(tmp_path: Path) -> None:
    path, data = _file(tmp_path, 5 * CHUNK + 123)
    below = LocalBackend(str(tmp_path / "below"))
    writer = get_scheduler().run(below.open_writer("probe"))
    assert isinstance(writer, FileSink)  # the local file writer takes bytes straight from a file
    get_scheduler().run(writer.abort())
    before = ledger.snapshot()["memory.read_back"]
    got = _copy(_source(path, FileEntry(len(data), crc32c.crc32c(data))), below, "g/data/f.bin")
    assert got == FileEntry(len(data), crc32c.crc32c(data))
    assert (tmp_path / "below" / "g" / "data" / "f.bin").read_bytes() == data
    assert ledger.snapshot()["memory.read_back"] - before == len(data)  # read back once


def _resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (``mincore`` over a mapping that touches none)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as mapping:
        vec = (ctypes.c_ubyte * pages)()
        buf = ctypes.c_char.from_buffer(mapping)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) == 0
        finally:
            del buf
    return sum(v & 1 for v in vec)


def _direct_io_refused(directory: Path) -> bool:
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return False
    except OSError:
        return True
    finally:
        (directory / "probe").unlink(missing_ok=True)


def test_a_local_writer_writes_a_copy_down_past_the_page_cache(tmp_path: Path) -> None:
    """The local directory below the memory tier takes a file with O_DIRECT from the source's pages: exact
    bytes (the unaligned tail too), and none of the aligned ones left in the page cache to free later."""
    if _direct_io_refused(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    path, data = _file(tmp_path, 64 * 4096 + 123)
    below = LocalBackend(str(tmp_path / "below"))
    got = _copy(_source(path, FileEntry(len(data), crc32c.crc32c(data))), below, "g/data/f.bin")
    landed = tmp_path / "below" / "g" / "data" / "f.bin"
    assert got == FileEntry(len(data), crc32c.crc32c(data))
    assert _resident_pages(landed) <= 1, "the copy went through the page cache"  # at most the tail's page
    assert landed.read_bytes() == data


def test_a_file_system_that_refuses_direct_writes_gets_the_bytes_through_its_page_cache(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    import fcntl as real

    from tierckpt.backends import files

    class Refusing:
        F_GETFL, F_SETFL = real.F_GETFL, real.F_SETFL

        @staticmethod
        def fcntl(fd: int, cmd: int, arg: int = 0) -> int:
            if cmd == real.F_SETFL and arg & os.O_DIRECT:
                raise OSError(22, "Invalid argument")
            return real.fcntl(fd, cmd, arg)

    monkeypatch.setattr(files, "fcntl", Refusing)
    path, data = _file(tmp_path, 16 * 4096 + 5)
    got = _copy(_source(path, FileEntry(len(data), crc32c.crc32c(data))), LocalBackend(str(tmp_path / "b")), "f")
    assert got == FileEntry(len(data), crc32c.crc32c(data))
    assert (tmp_path / "b" / "f").read_bytes() == data


@pytest.mark.parametrize("nbytes", [CHUNK // 2, 5 * CHUNK + 7])
@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_file_that_differs_from_its_record_is_not_published(tmp_path: Path, nbytes: int, kind: str) -> None:
    """Small (read whole) and large (kernel-side or streamed) files alike: a flipped bit aborts the copy."""
    path, data = _file(tmp_path, nbytes)
    recorded = FileEntry(len(data), crc32c.crc32c(data))
    flipped = bytearray(data)
    flipped[nbytes // 2] ^= 0x10
    path.write_bytes(bytes(flipped))
    below = LocalBackend(str(tmp_path / "below")) if kind == "local" else MemoryBackend(f"memory://copy-{nbytes}")
    with pytest.raises(ChecksumMismatchError, match="is not FileEntry"):
        _copy(_source(path, recorded), below, "g/data/f.bin")
    assert not get_scheduler().run(below.exists("g/data/f.bin"))
    if kind == "local":
        assert _no_temp_files(tmp_path / "below") == []  # the writer's temp file was discarded


def test_a_streamed_copy_into_another_writer_is_exact(tmp_path: Path) -> None:
    path, data = _file(tmp_path, 3 * CHUNK + 5)
    below = MemoryBackend("memory://copy-streamed")
    got = _copy(_source(path, None), below, "g/data/f.bin")  # no record: copied as is
    assert got == FileEntry(len(data), crc32c.crc32c(data))
    assert get_scheduler().run(below.get("g/data/f.bin")) == data


def test_a_file_gone_before_its_copy_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="is gone"):
        _copy(_source(tmp_path / "missing.bin", None), LocalBackend(str(tmp_path / "below")), "k")


def test_the_memory_tier_writes_down_into_the_node_cache_kernel_side(tmp_path: Path, monkeypatch) -> None:
    """Memory tier + node disk cache: files larger than the copy chunk go from tmpfs into the cache file
    kernel-side (the cache's writer takes the stated CRC), then up to the remote; the checkpoint is exact."""
    monkeypatch.setattr(wcopy, "COPY_CHUNK", CHUNK)
    monkeypatch.setenv("TIERCKPT_MEMORY_DIR", str(tmp_path / "mem"))
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path / "cache"))
    copied: list[int] = []
    from tierckpt.node.disk import tiered

    original = tiered._TieredWriter.write_file

    async def counting(self, fd: int, offset: int, length: int, pages=None) -> None:  # type: ignore[no-untyped-def]
        copied.append(length)
        await original(self, fd, offset, length, pages)

    monkeypatch.setattr(tiered._TieredWriter, "write_file", counting)
    state = {"w": torch.arange(1 << 17, dtype=torch.float32), "b": torch.ones(1 << 10)}
    uri = f"local://{tmp_path / 'remote'}"
    before = ledger.snapshot()
    tierckpt.save(uri, state, storage_options={"memory": True, "cache": True})
    delta = {k: v - before[k] for k, v in ledger.snapshot().items()}
    assert copied and min(copied) > CHUNK, copied  # the data file went down kernel-side
    assert delta["node-disk.landed"] >= sum(copied)
    got = tierckpt.load(uri, storage_options={"memory": False, "cache": False})
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])


def test_the_retry_rule_grows_caps_and_stops_at_the_deadline() -> None:
    from tierckpt import deadline
    from tierckpt.backends.retry import UPLOAD, WRITE_DOWN, RetryPolicy

    assert [UPLOAD.pause_s(a) for a in (1, 2, 3, 6, 7, 50)] == [1.0, 2.0, 4.0, 30.0, 30.0, 30.0]
    assert all(0.025 <= WRITE_DOWN.pause_s(1) <= 0.05 for _ in range(20))  # jittered in its upper half
    assert all(1.0 <= WRITE_DOWN.pause_s(9) <= 2.0 for _ in range(20))
    with deadline.operation("sync", "memory://x", 0.5):
        assert 0.0 < UPLOAD.pause_s(5) <= 0.5  # never a pause past the waiting operation's deadline
    assert RetryPolicy(first_s=3.0, max_s=1.0).pause_s(1) == 1.0


def test_a_request_retries_by_the_same_rule_with_full_jitter() -> None:
    """The requests' quick retries (``REQUEST``: 50 ms doubling to 2 s, drawn from all of the pause) and the node
    tiers' copies down are one :class:`RetryPolicy`; ``retry_transient`` sleeps what its policy draws."""
    import asyncio

    from tierckpt.backends.retry import REQUEST, WRITE_DOWN, RetryPolicy, retry_transient
    from tierckpt.errors import TransientStorageError

    assert type(REQUEST) is type(WRITE_DOWN) is RetryPolicy
    first = [REQUEST.drawn_s(1) for _ in range(200)]
    assert all(0.0 <= p <= 0.05 for p in first) and min(first) < 0.0125  # full jitter: the lower half too
    assert all(0.0 <= REQUEST.drawn_s(9) <= 2.0 for _ in range(20)) and max(REQUEST.drawn_s(9) for _ in range(200)) > 1.0
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TransientStorageError("the store is out")
        return "landed"

    steady = RetryPolicy(first_s=0.001, max_s=0.001)
    assert asyncio.run(retry_transient(flaky, attempts=3, policy=steady)) == "landed" and len(calls) == 3
