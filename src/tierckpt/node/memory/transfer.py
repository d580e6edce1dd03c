"""The byte-moving pieces of peer replication (:mod:`.replica`): sending a sealed generation's files
from their pages (mapped through descriptors opened at commit), receiving each file's chunks straight
into the pages of its temp file in the tier, and adopting a peer's ``COMMIT`` without ever replacing a newer one.
"""

from __future__ import annotations

import collections
import mmap
import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from tierckpt.backends.file_open import open_shared
from tierckpt.backends.bounded import MAX_RECORD_BYTES, read_capped
from tierckpt.errors import CheckpointError
from tierckpt.native.layout import COMMIT, CommitRecord
from tierckpt.node.memory.manifest import FileEntry, Manifest
from tierckpt.node.memory.incoming import IncomingFile
from tierckpt.node.memory.mapped import populate_writable
from tierckpt.node.memory.memory import MemoryTier

IN_FLIGHT = 2
"""Data chunks on the wire at once in a transfer: a sender's sends, a receiver's posted receives."""


def buffers(chunk_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two chunk buffers, for draining a file the tier cannot take: one is drained while the other is on the wire."""
    return torch.empty(chunk_bytes, dtype=torch.uint8), torch.empty(chunk_bytes, dtype=torch.uint8)


def open_files(tier: MemoryTier, manifest: Manifest) -> dict[str, int]:
    """A descriptor of each file of ``manifest``, opened for reading (all or none), each holding its file's
    shared lock until it is closed (so the page pool never reuses a file being sent: :mod:`.pagepool`)."""
    files: dict[str, int] = {}
    try:
        for key, _ in manifest.files:
            files[key] = open_shared(tier.path_of(key))
    except OSError:
        for fd in files.values():
            os.close(fd)
        raise
    return files


class SentFiles:
    """The files of one sent generation, mapped read-only from the descriptors opened at commit: chunks
    go on the wire straight from the tier's pages. A file shorter than its sealed size is an error."""

    def __init__(self, files: dict[str, int], manifest: Manifest) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        try:
            for key, entry in manifest.files:
                if entry.size == 0:
                    continue
                if os.fstat(files[key]).st_size < entry.size:
                    raise CheckpointError(f"{key} is shorter than its sealed {entry.size} bytes")
                mapping = self._maps[key] = mmap.mmap(files[key], entry.size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
                # A read-only mapping, never written through: the tensor only hands its pages to the wire.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    self._tensors[key] = torch.frombuffer(mapping, dtype=torch.uint8)
        except BaseException:
            self.close()
            raise

    def chunk(self, key: str, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of ``key`` from ``offset``, as a tensor over the file's pages."""
        return self._tensors[key][offset: offset + nbytes]

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        self._tensors.clear()
        for mapping in maps.values():
            try:
                mapping.close()
            except BufferError:
                pass  # a view still exists (a send gloo still holds): unmapped when it goes

    def __enter__(self) -> SentFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Chunks:
    """The data chunks of one file of a transfer, received in turn into ``views``: the receive of chunk
    ``i + depth`` is posted as soon as chunk ``i`` has been consumed (so ``views`` may take turns over
    ``depth`` buffers)."""

    def __init__(
        self, views: list[torch.Tensor], depth: int, post: Callable[[torch.Tensor], dist.Work],
        wait: Callable[[dist.Work], None],
    ) -> None:
        self._views, self._post, self._wait = views, post, wait
        self._posted: collections.deque[tuple[torch.Tensor, dist.Work]] = collections.deque()
        self._next = 0
        self._taken = False
        for _ in range(depth):
            self._post_next()

    def _post_next(self) -> None:
        if self._next < len(self._views):
            view = self._views[self._next]
            self._posted.append((view, self._post(view)))
            self._next += 1

    def take(self) -> memoryview:
        """The next chunk's bytes, valid until the next ``take``."""
        if self._taken:
            self._post_next()  # the previous chunk's view may be received into again
        view, work = self._posted.popleft()
        self._wait(work)
        self._taken = True
        return memoryview(view.numpy())


def receive_file(
    tier: MemoryTier, key: str, entry: FileEntry, post: Callable[[torch.Tensor], dist.Work],
    wait: Callable[[dist.Work], None], scratch: Callable[[], tuple[torch.Tensor, ...]], chunk_bytes: int,
) -> str | None:
    """Receive one file of a transfer into ``tier``, in chunks of ``chunk_bytes`` posted with ``post``: why
    it was not published (a local failure: the file is still drained into the ``scratch()`` buffers, so
    the transfer stays in step), or ``None``. Transport errors raise.

    The chunks land straight in the pages of the tier's temp file (:meth:`.IncomingFile.mapped`, every
    page allocated first: a tier out of memory fails here, never with ``SIGBUS`` mid-transfer), each
    checksummed once it landed: one kernel copy from the socket per byte, and the CRC the check needs."""
    failure = None
    incoming: IncomingFile | None = None
    pages: torch.Tensor | None = None
    try:
        incoming = tier.receive(key, entry.size)
        if entry.size:
            pages = _pages(incoming, entry.size)
    except (CheckpointError, OSError) as exc:
        failure = f"cannot write {key}: {exc}"
    offsets = range(0, entry.size, chunk_bytes)
    if pages is not None:
        views = [pages[o: o + chunk_bytes] for o in offsets]
        depth = IN_FLIGHT
    else:
        drain = scratch() if entry.size else ()
        views = [drain[i % len(drain)][: min(chunk_bytes, entry.size - o)] for i, o in enumerate(offsets)]
        depth = len(drain)
    del pages  # only the views hold the mapping now: it goes with them
    try:
        chunks = Chunks(views, depth, post, wait)
        for _ in offsets:
            landed = chunks.take()
            if incoming is not None and failure is None:
                incoming.received(landed)
            landed.release()
        del views, chunks
        if incoming is not None and failure is None:
            incoming.finish(entry)
            incoming = None
    except (CheckpointError, OSError) as exc:
        failure = str(exc)
    finally:
        if incoming is not None:
            incoming.abort()
    return failure


def _pages(incoming: IncomingFile, size: int) -> torch.Tensor:
    """The incoming file's ``size`` bytes as a writable tensor over its mapped pages, every page allocated."""
    mapping = incoming.mapped(size)
    with warnings.catch_warnings():  # a writable mapping: torch's warning about read-only buffers does not apply
        warnings.simplefilter("ignore", UserWarning)
        pages = torch.frombuffer(mapping, dtype=torch.uint8)
    populate_writable(pages)
    return pages


def adopt_commit(tier: MemoryTier, data: bytes) -> None:
    """Write a peer's ``COMMIT`` unless this tier holds the same or a newer one (compare-and-swap, so a
    commit of this node's own ranks racing it is never overwritten by an older record).

    Synchronous, under the same commit lock as :meth:`~.memory.MemoryTier.commit`: the receiving thread
    must not build an event loop per generation (``asyncio.run`` creates a loop and a worker thread,
    Python-level work that holds the GIL while training runs)."""
    record = CommitRecord.decode(data)
    path = tier.path_of(COMMIT)
    while True:
        try:
            current: bytes | None = read_capped(path, MAX_RECORD_BYTES)
        except FileNotFoundError:
            current = None
        if current is not None and CommitRecord.decode(current).seq >= record.seq:
            return
        if tier.commit_in_thread(COMMIT, data, current):
            return
        # someone committed meanwhile: compare again
