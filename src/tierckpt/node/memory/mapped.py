"""Async snapshots straight into the node memory tier: the staging buffer *is* the tier's file.

An ``async_save`` through a :class:`~.link.MemoryLink` takes the process's *spare* (:func:`take_spare`) for
its rank's snapshot: a file of the tier, already allocated, mapped (``mmap``, shared) with every page
writable (:func:`~.pagepool.writable_pages`), prepared in the background after the previous save. The snapshot
copy writes into its pages: one copy from training memory to a node-durable copy, at memcpy speed. Once
the group has named the file, the spare becomes it (:func:`open_mapped`, a rename); the file is then only
checksummed (:class:`MappedFile`'s writes add the CRC-32C, or the save's stream states it, combined
from its pieces' checksums) and renamed into place on close, and written
down like any file of the tier; the next spare is prepared then (not during the copy, whose memory
bandwidth it would take). Without a spare (the first save, a spare evicted, a CUDA state) the
usual path runs: the staging buffer, then a write into the tier; and a spare of the file's size is
prepared for the next save. A fresh mapping would cost more than it saves: allocating and mapping
tmpfs pages is several times slower than a memcpy into warm memory.

The spare lives in the tier as a generation of its own, ``g-00000000-0000000000000-<pid>`` (commit
sequence 0), so it counts in the budget; it is made only when it fits without evicting anything, and
eviction drops it first when a checkpoint needs the room (a spare never fails a save); the link leaves
it out of listings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from collections.abc import Callable, Container
from dataclasses import dataclass


import torch


from tierckpt.node.face import MappedWriter
from tierckpt.backends.files import temp_name
from tierckpt.errors import CheckpointError
from tierckpt.node import lifecycle
from tierckpt.node.memory.background import lower_priority
from tierckpt.node.memory.downlog import generation_of
from tierckpt.node.memory.memory import SPARE_PREFIX, MemoryTier
from tierckpt.node.memory.nodememory import NodeMemory
from tierckpt.node.memory.pagepool import claim, let_go_unlinked, writable_pages
from tierckpt.node.ledger import Tier
from tierckpt.node.written import CrcWriter, WrittenCrc


log = logging.getLogger(__name__)


def is_spare(key: str) -> bool:
    return key.startswith(SPARE_PREFIX)


@dataclass(eq=False)
class SpareFile:
    path: str
    fd: int
    buffer: torch.Tensor
    """The whole file, mapped, every page populated writable."""
    placed: bool = False
    """It became a data file (:func:`open_mapped`), which owns its descriptor now."""

    def release(self) -> None:
        """Delete the spare unless it became a data file (its pages go with the last view of the mapping).
        Its directory stays: the next spare, prepared meanwhile, may be made in it."""
        if not self.placed:
            self.placed = True
            _discard(self.fd, self.path)


_SPARES: dict[str, SpareFile] = {}
"""Tier home -> this process's spare."""
_LOCK = threading.Lock()


class MappedFile(CrcWriter, MappedWriter):
    """A data file whose bytes the snapshot copy wrote into :attr:`buffer`; writes only checksum them."""

    def __init__(self, memory: NodeMemory, tier: MemoryTier, key: str, tmp: str, fd: int, buffer: torch.Tensor,
                 wrote: Callable[[str], None]) -> None:
        """``wrote(key)`` is called once the file is in place (the link then copies it down)."""
        self._memory, self._tier, self._key, self._tmp, self._fd = memory, tier, key, tmp, fd
        self.buffer = buffer
        self._wrote = wrote
        self._written = WrittenCrc(f"{tier.uri}/{key}", Tier.MEMORY)

    @property
    def _uri(self) -> str:  # type: ignore[override]
        """For messages only: resolving the path is not paid inside the snapshot call."""
        return self._tier.uri_of(self._key)

    async def write(self, data: bytes | memoryview) -> None:
        self._check_open()
        await self._written.add_async(memoryview(data).cast("B"))

    async def close(self) -> None:
        self._check_open()
        self._done = True
        size = self._written.size
        try:
            if size != self.buffer.numel():
                raise CheckpointError(f"{self._uri}: {size} bytes streamed into a mapped file of {self.buffer.numel()}")
            entry = self._written.entry()
        except CheckpointError:
            await self.abort()
            raise
        tier = self._tier
        _publish(self._fd, self._tmp, tier.path_of(self._key))
        tier._remember(self._key, entry)
        self._wrote(self._key)
        prepare_in_background(self._memory, tier, size)  # the next save's, once this one's copy is done

    async def abort(self) -> None:
        self._done = True
        await asyncio.to_thread(_discard, self._fd, self._tmp)  # frees the file's pages


def _publish(fd: int, tmp: str, path: str) -> None:
    os.close(fd)
    os.replace(tmp, path)


def _discard(fd: int, tmp: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        return
    let_go_unlinked()  # a kept mapping of it would hold its pages


def take_spare(tier: MemoryTier, nbytes: int) -> SpareFile | None:
    """This process's spare of the tier, when it has one of at least ``nbytes``, for a snapshot to be copied
    into before its file is named (:func:`open_mapped`); else ``None`` (a smaller one is deleted)."""
    with _LOCK:
        spare = _SPARES.pop(tier.home, None)
    if spare is not None and spare.buffer.numel() < nbytes:
        spare.release()
        return None
    return spare


def open_mapped(memory: NodeMemory, tier: MemoryTier, key: str, nbytes: int, spare: SpareFile | None, *,
                fallback: Container[str], spare_wanted: dict[str, int], wrote: Callable[[str], None]) -> MappedFile | None:
    """``spare`` (from :func:`take_spare`, holding the file's ``nbytes``) as the tier's file for ``key``,
    or ``None``: then the caller writes its bytes the usual way and releases the spare, and a spare of
    ``nbytes`` is prepared in the background for the next save once ``key`` is written (``spare_wanted``,
    key -> size, which the link reads when ``key`` is written). ``fallback``: the generations that go to the
    chain below (the tier is full); ``wrote``: see :class:`MappedFile`."""
    generation = generation_of(key)
    if spare is None or generation is None or generation in fallback or nbytes < 1:
        spare_wanted[key] = nbytes  # made once this file is written (not during its copy)
        return None
    path = tier.path_of(key)
    tmp = os.path.join(os.path.dirname(path), temp_name(os.path.basename(path)))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.fstat(spare.fd).st_nlink == 0:
            raise FileNotFoundError(spare.path)  # evicted: its pages go when the mapping does
        os.replace(spare.path, tmp)  # its bytes were admitted when it was made
        if spare.buffer.numel() > nbytes:
            os.ftruncate(spare.fd, nbytes)
    except OSError as exc:
        log.info("the memory tier's spare of %s is gone (%s); writing the snapshot as usual", tier.uri, exc)
        spare_wanted[key] = nbytes
        return None
    spare.placed = True
    _drop_dir(spare.path)
    return MappedFile(memory, tier, key, tmp, spare.fd, spare.buffer[:nbytes], wrote)


def prepare_in_background(memory: NodeMemory, tier: MemoryTier, nbytes: int) -> None:
    threading.Thread(target=_prepare, args=(memory, tier, nbytes), name="tierckpt-spare", daemon=True).start()


def _drop_dir(path: str) -> None:
    for directory in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        try:
            os.rmdir(directory)
        except OSError:
            return


_PREPARING: set[str] = set()


def _prepare(memory: NodeMemory, tier: MemoryTier, nbytes: int) -> None:
    """Make a spare of ``nbytes`` in the tier (admitted under the budget), mapped and touched, at the
    tier's background priority."""
    lower_priority()
    with _LOCK:
        if tier.home in _PREPARING or tier.home in _SPARES:
            return
        _PREPARING.add(tier.home)
    try:
        _make(memory, tier, nbytes)
    finally:
        with _LOCK:
            _PREPARING.discard(tier.home)


def _make(memory: NodeMemory, tier: MemoryTier, nbytes: int) -> None:
    generation = f"{SPARE_PREFIX}{os.getpid():x}"
    # A name of its own: a spare taken by a save may be released (deleted by name) after this one is made.
    path = tier.path_of(f"{generation}/data/spare-{uuid.uuid4().hex}.bin")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # A pooled file's bytes are in the budget already (the spare takes them over): no admission.
        reused = claim(tier.root, nbytes, path)
        if not reused and not _admitted(memory, tier, generation, nbytes):
            _drop_dir(path)
            return
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (0 if reused else os.O_CREAT | os.O_TRUNC), 0o600)
    except OSError as exc:
        log.info("no spare in the memory tier of %s: %s", tier.uri, exc)
        return
    try:
        os.ftruncate(fd, nbytes)
        buffer = writable_pages(fd, nbytes)  # a pooled file this process mapped before comes mapped
    except OSError as exc:
        log.info("no spare in the memory tier of %s: %s", tier.uri, exc)
        _discard(fd, path)
        _drop_dir(path)
        return
    with _LOCK:
        _SPARES[tier.home] = SpareFile(path, fd, buffer)


def _admitted(memory: NodeMemory, tier: MemoryTier, generation: str, nbytes: int) -> bool:
    """Whether a new spare of ``nbytes`` fits into free room (a spare never evicts a checkpoint)."""
    return memory.admit(tier.uri, generation, nbytes, (), evict=False).fits


def _drop_spares() -> None:
    """At exit: the spares leave the tier (they hold no checkpoint)."""
    with _LOCK:
        spares = list(_SPARES.values())
        _SPARES.clear()
    for spare in spares:
        spare.release()
        _drop_dir(spare.path)


def _forget_after_fork() -> None:
    """A forked child does not share its parent's spares."""
    _SPARES.clear()
    _PREPARING.clear()


lifecycle.at_exit(_drop_spares)
lifecycle.after_fork_in_child(_forget_after_fork)
