"""The byte-moving pieces of peer replication (:mod:`.replica`): sending a sealed generation's files
from their pages (mapped through descriptors opened at commit), receiving a transfer's chunks into
alternating buffers and each file into the tier, and adopting a peer's ``COMMIT`` without ever replacing a newer one.
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
from tierckpt.node.memory.memory import MemoryTier


def buffers(chunk_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two chunk buffers: one is filled (or drained) while the other is on the wire."""
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
    """The data chunks of one transfer, received in turn into alternating buffers: the receive of
    chunk ``i + len(bufs)`` is posted as soon as chunk ``i`` has been consumed."""

    def __init__(
        self, sizes: list[int], bufs: tuple[torch.Tensor, ...], post: Callable[[torch.Tensor], dist.Work],
        wait: Callable[[dist.Work], None],
    ) -> None:
        self._sizes, self._bufs, self._post, self._wait = sizes, bufs, post, wait
        self._posted: collections.deque[tuple[torch.Tensor, dist.Work]] = collections.deque()
        self._next = 0
        self._taken = False
        for _ in bufs:
            self._post_next()

    def _post_next(self) -> None:
        if self._next < len(self._sizes):
            view = self._bufs[self._next % len(self._bufs)][: self._sizes[self._next]]
            self._posted.append((view, self._post(view)))
            self._next += 1

    def take(self) -> memoryview:
        """The next chunk's bytes, valid until the next ``take``."""
        if self._taken:
            self._post_next()  # the previous chunk's buffer is free again
        view, work = self._posted.popleft()
        self._wait(work)
        self._taken = True
        return memoryview(view.numpy())


def receive_file(tier: MemoryTier, key: str, entry: FileEntry, chunks: Chunks, chunk_bytes: int) -> str | None:
    """Receive one file of a transfer into ``tier``, in chunks of ``chunk_bytes``: why it was not
    published (a local failure: the rest of the file is still drained, so the transfer stays in step), or
    ``None``. Transport errors raise."""
    failure = None
    incoming: IncomingFile | None = None
    try:
        incoming = tier.receive(key, entry.size)
    except (CheckpointError, OSError) as exc:
        failure = f"cannot write {key}: {exc}"
    try:
        for _ in range(0, entry.size, chunk_bytes):
            view = chunks.take()
            if incoming is not None and failure is None:
                try:
                    incoming.write(view)
                except OSError as exc:
                    failure = f"writing {key} failed: {exc}"
        if incoming is not None and failure is None:
            incoming.finish(entry)
            incoming = None
    except (CheckpointError, OSError) as exc:
        failure = str(exc)
    finally:
        if incoming is not None:
            incoming.abort()
    return failure


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
