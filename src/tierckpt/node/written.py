"""Size and CRC-32C of the bytes a link writes to a file on the node (:class:`WrittenCrc`, :class:`CrcWriter`).

Every link of the engine that lands bytes on the node counts them here: the memory tier's writers
(:class:`~tierckpt.node.memory.memory.MemoryTier`'s, :class:`~tierckpt.node.memory.mapped.MappedFile`), replicas
arriving from a peer (:class:`~tierckpt.node.memory.incoming.IncomingFile`) and the node disk cache's writer
(:mod:`tierckpt.node.disk.tiered`). A save's stream may state the CRC instead of having it computed again.
"""

from __future__ import annotations

import asyncio

from dataclasses import dataclass

import crc32c

from tierckpt.backends.base import ObjectWriter
from tierckpt.backends.file_open import open_shared
from tierckpt.errors import CheckpointError
from tierckpt.node import ledger


@dataclass(frozen=True, slots=True)
class FileEntry:
    """Size and CRC-32C of one file of a generation."""

    size: int
    crc32c: int


_READ_CHUNK = 8 << 20
"""Bytes read at a time by :func:`file_crc`."""


def file_crc(path: str, *, shared: bool = False) -> FileEntry:
    """Size and CRC-32C of a file already on the node, read in chunks: the check of a node disk cache's
    whole file, of a memory tier's file at its write-down. ``shared``: hold the file's shared lock while
    reading it (a memory tier's file: its page pool takes only files nobody holds, see
    :mod:`tierckpt.node.memory.pagepool`)."""
    crc = 0
    size = 0
    with open(open_shared(path) if shared else path, "rb", buffering=0) as f:
        while chunk := f.read(_READ_CHUNK):
            crc = crc32c.crc32c(chunk, crc)
            size += len(chunk)
    return FileEntry(size, crc)


_THREAD_CRC_BYTES = 1 << 20
"""Writes at least this large compute their CRC-32C in a worker thread, not on the event loop."""


class WrittenCrc:
    """Size and CRC-32C of the bytes written to a file of the tier, recorded in its manifest.

    Computed as the bytes pass — or, after :meth:`use_stated`, stated by their producer before the file
    is published: a save's stream knows it from its pieces' checksums (see
    :meth:`~tierckpt.backends.base.ObjectWriter.use_stated_crc32c`), so each byte is checksummed once.
    Bytes that arrive from elsewhere (a peer's replica) are always checksummed here: that is the check.
    """

    def __init__(self, uri: str, tier: ledger.Tier) -> None:
        self._uri = uri
        self._tier = tier
        """The tier the bytes land in (counted in :mod:`.ledger`)."""
        self.size = 0
        self._crc: int | None = 0
        """The CRC of the bytes so far; ``None`` once the producer states it instead."""
        self._stated: int | None = None

    def use_stated(self) -> bool:
        """Stop checksumming (before any byte is written; ``False`` after: the CRC is computed here)."""
        if self.size:
            return False
        self._crc = None
        return True

    def state(self, crc: int) -> None:
        if self._crc is not None:
            raise CheckpointError(f"{self._uri}: a CRC-32C was stated for bytes its writer checksums itself")
        self._stated = crc

    def add(self, data: bytes | memoryview) -> None:
        """Count ``data`` and checksum it (unless stated), in the calling thread."""
        if self._crc is not None:
            self._crc = crc32c.crc32c(data, self._crc)
        nbytes = memoryview(data).nbytes
        self.size += nbytes
        ledger.landed(self._tier, nbytes)

    def copied(self, nbytes: int) -> None:
        """Count ``nbytes`` copied into the file kernel-side, unseen here: their CRC must be stated."""
        if self._crc is not None:
            raise CheckpointError(f"{self._uri}: bytes copied kernel-side need their CRC-32C stated first")
        self.size += nbytes
        ledger.landed(self._tier, nbytes)

    async def add_async(self, data: bytes | memoryview) -> None:
        """:meth:`add`, with large checksums in a worker thread (off the event loop)."""
        nbytes = memoryview(data).nbytes
        if self._crc is not None and nbytes >= _THREAD_CRC_BYTES:
            self._crc = await asyncio.to_thread(crc32c.crc32c, data, self._crc)
            self.size += nbytes
            ledger.landed(self._tier, nbytes)
        else:
            self.add(data)

    @property
    def computed(self) -> FileEntry | None:
        """Size and CRC computed here; ``None`` when the producer states the CRC."""
        return FileEntry(self.size, self._crc) if self._crc is not None else None

    def entry(self) -> FileEntry:
        """Size and CRC-32C of everything written; raises when a stated CRC never came."""
        crc = self._crc if self._crc is not None else self._stated
        if crc is None:
            raise CheckpointError(
                f"{self._uri}: its writer was to be told the CRC-32C of its bytes and was not; the file is discarded"
            )
        return FileEntry(self.size, crc)


class CrcWriter(ObjectWriter):
    """An :class:`ObjectWriter` of a link that records its file's size and CRC-32C in :attr:`_written`
    (a save's stream may state the CRC instead: :meth:`use_stated_crc32c`)."""

    _written: WrittenCrc

    def use_stated_crc32c(self) -> bool:
        """A save's stream states the file's CRC-32C (combined from its pieces'): no second pass here."""
        return self._written.use_stated()

    def state_crc32c(self, crc32c: int) -> None:
        self._written.state(crc32c)
