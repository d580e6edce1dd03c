"""The engine's one copy: a file a link holds on the node, moved to the link below, its CRC-32C checked on the way.

Both node tiers move committed files down through :func:`copy_checked`: the memory tier's write-down
(a tmpfs file, :mod:`tierckpt.node.memory.writedown`) and the node disk cache's uploads (a cache file,
:mod:`tierckpt.node.disk.uploads`). The bytes are read back at most once on their way down, and their
CRC-32C is computed in that same pass and compared with what the save recorded before anything is
published below: a bit flipped on the node after the save aborts the copy (the link below keeps its
previous commit). The CRC is stated to a writer below that takes one (:meth:`ObjectWriter.use_stated_crc32c`),
so no byte is checksummed twice.

How the bytes move depends on the writer below:

* a :class:`FileSink` (a local file system's writer): the CRC is taken over the source's pages through
  one read-only mapping, then the sink writes the file from that mapping with ``O_DIRECT`` (the local
  directory's writer) or has the kernel copy it (``copy_file_range``: the node cache's writer, whose file
  its upload reads again), no user-space copy either way and two thread hops per file;
* any other writer: small files are read and put whole; larger ones are handed to the writer chunk by
  chunk straight from the source's mapping (no copy into fresh buffers), each chunk checksummed as it
  passes.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import crc32c

from tierckpt.backends.base import Backend, ObjectWriter
from tierckpt.backends.local import INLINE_BYTES
from tierckpt.errors import CheckpointError
from tierckpt.node import ledger
from tierckpt.node.written import FileEntry

COPY_CHUNK = 8 << 20
"""Files up to this size are read and put whole; larger ones are streamed in chunks of it."""


@runtime_checkable
class FileSink(Protocol):
    """A writer below that takes bytes straight from a local file, kernel-side."""

    async def write_file(self, fd: int, offset: int, length: int, pages: memoryview | None = None) -> None:
        """Append ``length`` bytes of the file open as ``fd``, from ``offset``; ``pages``, when given, are those
        bytes through a mapping of the file (page-aligned), for a sink that writes from memory."""


Opener = Callable[[str], int]
"""Opens a source file read-only and returns its descriptor (the memory tier takes its shared lock)."""


def open_read(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


class CopySource:
    """Where a copy reads from and what it checks against.

    ``recorded``: the size and CRC-32C the save recorded (``None``: copied as is, e.g. a file written by
    an older version); ``mismatch(got)`` builds the error raised when the bytes differ from it;
    ``gone()`` the error raised when the file left the link before it was copied; ``in_place``: the source
    is on a file system that never waits on a device (the memory tier's tmpfs), so it is opened, and read
    whole when at most :data:`~tierckpt.backends.local.INLINE_BYTES`, in the caller's thread (a hop to a
    worker costs more than that); ``mapped(fd, size)``: the file's first ``size`` bytes through a mapping
    its tier already has (the memory tier's kept mappings), or ``None``: then it is mapped for the copy."""

    def __init__(self, path: str, tier: ledger.Tier, recorded: FileEntry | None,
                 mismatch: Callable[[FileEntry], CheckpointError], gone: Callable[[], CheckpointError],
                 opener: Opener = open_read, *, in_place: bool = False,
                 mapped: Callable[[int, int], memoryview | None] | None = None) -> None:
        self.path, self.tier, self.recorded = path, tier, recorded
        self.mismatch, self.gone, self.opener, self.in_place = mismatch, gone, opener, in_place
        self.mapped = mapped

    def check(self, got: FileEntry) -> None:
        if self.recorded is not None and got != self.recorded:
            raise self.mismatch(got)


async def copy_checked(source: CopySource, below: Backend, key: str, *, chunk: int | None = None) -> FileEntry:
    """Copy ``source`` to ``key`` below if its bytes have the size and CRC-32C recorded; return them.

    Raises ``source.mismatch(...)`` (nothing is published below) or ``source.gone()``. ``chunk``: the
    largest file read and put whole, and the streaming chunk (default :data:`COPY_CHUNK`)."""
    chunk = COPY_CHUNK if chunk is None else chunk
    try:
        if source.in_place and chunk > INLINE_BYTES:
            fd, size, whole = _open(source, INLINE_BYTES)
            if whole is None and size <= chunk:
                whole = await _read_whole(fd, size)
        else:
            fd, size, whole = await asyncio.to_thread(_open, source, chunk)
    except FileNotFoundError:
        raise source.gone() from None
    try:
        if whole is not None:
            data, got = whole
            ledger.read_back(source.tier, len(data))
            source.check(got)
            await below.put(key, data)
            return got
        writer = await below.open_writer(key)
        try:
            stated = writer.use_stated_crc32c()
            if isinstance(writer, FileSink):
                kept = source.mapped(fd, size) if source.mapped is not None else None
                if kept is not None:  # no mapping to make and unmap: the descriptor holds what locks it
                    mapping, view = None, kept
                    crc = await asyncio.to_thread(crc32c.crc32c, view)
                else:
                    mapping, crc = await asyncio.to_thread(_mapped_crc, fd, size)
                    view = memoryview(mapping)
                try:
                    got = FileEntry(size, crc)
                    source.check(got)
                    await writer.write_file(fd, 0, size, view[:size])
                finally:
                    _unmap(mapping, view)
                ledger.read_back(source.tier, size)
            else:
                got = await _stream(fd, size, writer, source.tier, chunk)
                source.check(got)
            if stated:
                writer.state_crc32c(got.crc32c)
            await writer.close()
        except BaseException:
            await writer.abort()
            raise
        return got
    finally:
        os.close(fd)


def _open(source: CopySource, chunk: int) -> tuple[int, int, tuple[bytes, FileEntry] | None]:
    """Open the source: its descriptor, size and, when it is at most ``chunk`` bytes, its bytes with their
    size and CRC-32C (one thread hop for a small file)."""
    fd = source.opener(source.path)
    try:
        size = os.fstat(fd).st_size
        return fd, size, _whole(fd, size) if size <= chunk else None
    except BaseException:
        os.close(fd)
        raise


def _whole(fd: int, size: int) -> tuple[bytes, FileEntry]:
    data = os.pread(fd, size, 0)
    return data, FileEntry(len(data), crc32c.crc32c(data))


async def _read_whole(fd: int, size: int) -> tuple[bytes, FileEntry]:
    """:func:`_whole` in a worker thread (closing ``fd`` if it fails)."""
    try:
        return await asyncio.to_thread(_whole, fd, size)
    except BaseException:
        os.close(fd)
        raise


async def _stream(fd: int, size: int, writer: ObjectWriter, tier: ledger.Tier, chunk: int) -> FileEntry:
    """Hand the file to ``writer`` chunk by chunk from its own pages, checksumming each as it passes."""
    mapping = await asyncio.to_thread(map_fd, fd)
    view = memoryview(mapping)
    try:
        crc = 0
        for offset in range(0, size, chunk):
            part = view[offset: offset + chunk]
            crc = await asyncio.to_thread(crc32c.crc32c, part, crc)
            await writer.write(part)
            ledger.read_back(tier, len(part))
        return FileEntry(size, crc)
    finally:
        _unmap(mapping, view)


def _mapped_crc(fd: int, size: int) -> tuple[mmap.mmap, int]:
    """The file mapped (:func:`map_fd`) and the CRC-32C of its first ``size`` bytes, read through that mapping."""
    mapping = map_fd(fd)
    try:
        return mapping, crc32c.crc32c(memoryview(mapping)[:size])
    except BaseException:
        mapping.close()
        raise


def map_fd(fd: int) -> mmap.mmap:
    """The file open as ``fd`` mapped read-only, its pages populated at once (they are already in memory
    for a tier file, in the page cache for a freshly written cache file)."""
    return mmap.mmap(fd, 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def _unmap(mapping: mmap.mmap | None, view: memoryview) -> None:
    """Unmap now, or (a writer below still holds a view of it) when its last view goes; a mapping the
    tier keeps (``None`` here) is only let go of."""
    try:
        view.release()
        if mapping is not None:
            mapping.close()
    except BufferError:
        pass
