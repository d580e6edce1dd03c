"""The byte-moving pieces of peer replication (:mod:`.replica`): chunk buffers, reading a sealed
file's bytes through a descriptor opened at commit, receiving a transfer's chunks into alternating
buffers, and adopting a peer's ``COMMIT`` without ever replacing a newer one.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import CheckpointBusyError, CheckpointError
from ..layout import COMMIT, CommitRecord
from .manifest import Manifest
from .memory import MemoryTier


def buffers(chunk_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two chunk buffers: one is filled (or drained) while the other is on the wire."""
    return torch.empty(chunk_bytes, dtype=torch.uint8), torch.empty(chunk_bytes, dtype=torch.uint8)


def open_files(tier: MemoryTier, manifest: Manifest) -> dict[str, int]:
    """A descriptor of each file of ``manifest``, opened for reading (all or none)."""
    files: dict[str, int] = {}
    try:
        for key, _ in manifest.files:
            files[key] = os.open(tier.path_of(key), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        for fd in files.values():
            os.close(fd)
        raise
    return files


def read_chunk(fd: int, key: str, offset: int, view: torch.Tensor, sealed_size: int) -> None:
    """Fill ``view`` with the bytes of the file ``key`` (open as ``fd``) at ``offset``."""
    if os.preadv(fd, [view.numpy()], offset) != view.numel():
        raise CheckpointError(f"{key} is shorter than its sealed {sealed_size} bytes")


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


def adopt_commit(tier: MemoryTier, data: bytes) -> None:
    """Write a peer's ``COMMIT`` unless this tier holds the same or a newer one (compare-and-swap, so a
    commit of this node's own ranks racing it is never overwritten by an older record)."""
    record = CommitRecord.decode(data)
    while True:
        try:
            with open(tier.path_of(COMMIT), "rb") as f:
                current: bytes | None = f.read()
        except FileNotFoundError:
            current = None
        if current is not None and CommitRecord.decode(current).seq >= record.seq:
            return
        try:
            asyncio.run(tier.commit(COMMIT, data, expected=current))
            return
        except CheckpointBusyError:
            continue  # someone committed meanwhile: compare again
