"""A file arriving in the node memory tier in pieces (:class:`IncomingFile`): a save's file this node
produces, or a peer's replica (:mod:`.transfer`)."""

from __future__ import annotations

import os
from collections.abc import Callable

from tierckpt.backends.files import temp_name
from tierckpt.errors import CheckpointError, CorruptCheckpointError
from tierckpt.node.written import WrittenCrc
from tierckpt.node.memory import stamps
from tierckpt.node.memory.manifest import FileEntry
from tierckpt.node.memory.pagepool import claim, let_go_unlinked, writable_pages


class IncomingFile:
    """A file arriving in pieces: temp file, CRC on the way, renamed into place by :meth:`publish` (a file
    this node produces) or checked and renamed by :meth:`finish` (a replica). With its ``size`` known, the
    temp file is a pooled one of the tier when there is one (:func:`~.pagepool.claim`: its pages are
    written over, not allocated), cut to that size."""

    def __init__(self, path: str, name: str, written: WrittenCrc, pool: str, size: int | None = None) -> None:
        """``path``: where the file is published; ``name``: the file in messages (its checkpoint URI and key);
        ``written``: what takes its CRC-32C; ``pool``: the tier's root, whose pooled temp files it may take."""
        self._path, self._name = path, name
        os.makedirs(os.path.dirname(self._path), exist_ok=True)
        self._tmp = os.path.join(os.path.dirname(self._path), temp_name(os.path.basename(self._path)))
        self.reused = size is not None and claim(pool, size, self._tmp)
        """Whether the temp file is a pooled one (written over from its start)."""
        if self.reused:
            try:
                self._file = open(self._tmp, "r+b", buffering=0)
                self._file.truncate(size)
            except OSError:
                self.abort()  # a fresh file instead
                self.reused = False
        if not self.reused:
            # unbuffered: a failed write leaves nothing pending; readable too, so it can be mapped writable
            self._file = open(self._tmp, "w+b", buffering=0)
        self._written = written
        self.size = 0
        """Bytes written by the writes that completed (a write the file system refused is not counted)."""

    def use_stated_crc32c(self) -> bool:
        """Before the first write, for a file this node produces: :meth:`publish` records the CRC-32C its
        producer states (:meth:`state_crc32c`) instead of one computed here (see :class:`WrittenCrc`)."""
        return self._written.use_stated()

    def state_crc32c(self, crc32c: int) -> None:
        self._written.state(crc32c)

    def write(self, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < view.nbytes:
            done += self._file.write(view[done:])
        self._written.add(data)
        self.size += view.nbytes

    def write_in_place(self, nbytes: int, fill: Callable[[memoryview], None]) -> None:
        """Have ``fill`` put the file's ``nbytes`` straight into its pages, then take their CRC-32C: a shared
        mapping of the temp file, every page mapped writable first (:func:`~.pagepool.writable_pages`: no
        fault per page, and a pooled file this process mapped before comes with its pages mapped; where
        tmpfs has no room an ``OSError``, never a ``SIGBUS``). A replica's bytes land there from the
        socket, with no buffer and no ``write`` (which copied each byte once more)."""
        if nbytes == 0:
            return
        self._file.truncate(nbytes)
        pages = writable_pages(self._file.fileno(), nbytes)
        with memoryview(pages.numpy()) as view:
            fill(view)
            self._written.add(view)
        self.size += nbytes

    @property
    def tmp_path(self) -> str:
        """The temp file written so far (the memory link copies it elsewhere when the tier is full)."""
        return self._tmp

    def publish(self) -> FileEntry:
        """Publish what was written (a file this node produced, so its own size and CRC-32C are the truth)."""
        try:
            entry = self._written.entry()
        except CheckpointError:
            self.abort()
            raise
        self._place(entry)
        return entry

    def finish(self, expected: FileEntry) -> None:
        """Publish the file if it has ``expected`` size and CRC-32C; else discard it and raise."""
        got = self._written.computed
        if got != expected:
            self.abort()
            if got is None:
                raise CheckpointError(f"{self._name}: a replica's CRC-32C must be computed where it arrives")
            raise CorruptCheckpointError(
                f"replica of {self._name} arrived with {got.size} bytes and CRC-32C {got.crc32c:#010x}, "
                f"its sender recorded {expected.size} bytes and {expected.crc32c:#010x}; it was discarded"
            )
        self._place(got)

    def _place(self, entry: FileEntry) -> None:
        if self.reused:
            self._file.truncate(entry.size)  # what was written is the whole file
        self._file.close()
        os.replace(self._tmp, self._path)
        stamps.remember(self._path, entry)

    def abort(self) -> None:
        file = getattr(self, "_file", None)
        if file is not None and not file.closed:
            file.close()
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)
            let_go_unlinked()
