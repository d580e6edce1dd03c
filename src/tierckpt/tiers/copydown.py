"""One file of the node memory tier copied to the chain below, checked against the CRC-32C its save recorded.

The write-down (:mod:`.writedown`) moves a tier file below before the ``COMMIT`` below may name it. A
tier file is plain memory: a bit flipped there after the save (a fault, a stray write) must not be
written down and committed as if it were the checkpoint. So each copy checksums the bytes as they pass
(one pass, in the copy itself: small files as they are read, large ones chunk by chunk as the chain
below takes them from the tier's own pages) and compares the result with what the save recorded: the
generation's manifest (sealed from the writers' stamps) or else the file's stamp (:mod:`.stamps`, the
writer's own count, which a change in place does not update). A mismatch aborts the copy before it is
published below, so the write-down of that generation stops loudly and the chain below keeps its
previous commit. The CRC computed here is handed to a writer below that takes a stated one (the node
disk cache, another tier), so no byte is checksummed twice. A file with no recorded CRC (neither sealed
nor stamped: written by an older version, or the stamp lost with a file system without user attributes
and a process gone before sealing) is copied as is.
"""

from __future__ import annotations

import asyncio
import mmap
import os

import crc32c

from ..backends import Backend
from ..backends.file_open import open_shared
from ..errors import CheckpointError, CheckpointNotFoundError, ChecksumMismatchError
from ..writeback import ledger
from ..writeback.ledger import Tier
from . import stamps
from .downlog import generation_of
from .manifest import FileEntry
from .memory import MemoryTier

COPY_CHUNK = 8 << 20
"""Files up to this size are read and put whole; larger ones are streamed from a mapping in chunks of it."""


async def copy_down(tier: MemoryTier, below: Backend, key: str) -> None:
    """Copy ``key`` from ``tier`` to ``below`` if its bytes have the size and CRC-32C its save recorded;
    else raise :class:`ChecksumMismatchError` (nothing is published below)."""
    path = tier.path_of(key)
    try:
        size = os.path.getsize(path)
        recorded = await asyncio.to_thread(_recorded, tier, key)
    except FileNotFoundError:
        raise _gone(tier, key) from None
    if size <= COPY_CHUNK:
        data = await asyncio.to_thread(_read, path)
        ledger.read_back(Tier.MEMORY, len(data))
        _check(tier, below, key, FileEntry(len(data), crc32c.crc32c(data)), recorded)
        await below.put(key, data)
        return
    # The chain below reads the tier's own pages (a published tier file never changes or shrinks):
    # no copy into fresh buffers, whose allocation would fault in new pages for every chunk.
    try:
        mapping = await asyncio.to_thread(map_file, path)
    except FileNotFoundError:
        raise _gone(tier, key) from None
    view = memoryview(mapping)
    try:
        writer = await below.open_writer(key)
    except BaseException:
        _unmap(mapping, view)
        raise
    try:
        stated = writer.use_stated_crc32c()
        crc = 0
        for offset in range(0, len(mapping), COPY_CHUNK):
            chunk = view[offset: offset + COPY_CHUNK]
            crc = await asyncio.to_thread(crc32c.crc32c, chunk, crc)
            await writer.write(chunk)
            ledger.read_back(Tier.MEMORY, len(chunk))
        _check(tier, below, key, FileEntry(len(mapping), crc), recorded)
        if stated:
            writer.state_crc32c(crc)
        await writer.close()
    except BaseException:
        await writer.abort()
        raise
    finally:
        _unmap(mapping, view)


def _recorded(tier: MemoryTier, key: str) -> FileEntry | None:
    """The size and CRC-32C the save recorded for ``key``: its generation's manifest, else its stamp."""
    generation = generation_of(key)
    sealed = tier.held(generation).get(key) if generation is not None else None
    return sealed if sealed is not None else stamps.written(tier.path_of(key))


def _check(tier: MemoryTier, below: Backend, key: str, got: FileEntry, recorded: FileEntry | None) -> None:
    if recorded is None or got == recorded:
        return
    raise ChecksumMismatchError(
        f"the node memory tier's copy of {tier.uri.rstrip('/')}/{key} at {tier.path_of(key)} has {got.size} bytes with "
        f"CRC-32C {got.crc32c:#010x}, but its save recorded {recorded.size} bytes with {recorded.crc32c:#010x}: it "
        f"was corrupted in node memory after the save, so it was not written down to {below.root_uri}, which keeps "
        "its previous commit. Load that one (storage_options={'memory': False}) or a copy on a peer node, or save "
        "the checkpoint again",
        key, 0, got.size,
    )


def _gone(tier: MemoryTier, key: str) -> CheckpointError:
    return CheckpointNotFoundError(f"{tier.uri_of(key)} left the memory tier before it was written down")


def _read(path: str) -> bytes:
    with open(open_shared(path), "rb") as f:
        return f.read()


def _unmap(mapping: mmap.mmap, view: memoryview) -> None:
    """Unmap now, or (a writer below still holds a view of it) when its last view goes."""
    try:
        view.release()
        mapping.close()
    except BufferError:
        pass


def map_file(path: str) -> mmap.mmap:
    """The tier file at ``path`` mapped read-only (its pages already in memory: populated at once), under
    its shared lock (:mod:`.pagepool`), held by the mapping's own descriptor until it is closed."""
    with open(open_shared(path), "rb", buffering=0) as f:
        return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
