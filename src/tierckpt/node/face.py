"""The node face: everything the engine above a URI's chain asks of the node tiers, in one object.

:func:`tierckpt.store.open_chain` assembles a URI's chain once and returns the store (a plain
:class:`~tierckpt.backends.base.Backend`: put, get, commit...) beside its :class:`NodeFace`. The saver,
the loader, the manager and the formats ask the face, never the store, for what only a node tier has:

* the node memory tier's read view (:attr:`NodeFace.memory_tier`, a :class:`NodeTier`) and a
  ``persist=False`` save (:meth:`NodeFace.keep_in_memory`);
* an async save's snapshot memory that becomes the tier's file (:meth:`NodeFace.take_spare`,
  :meth:`NodeFace.mapped_writer`, :meth:`NodeFace.want_spare`);
* the chain below the node tiers (:attr:`NodeFace.below_memory`, :attr:`NodeFace.below_node`), for what
  must be read where the URI points (``COMMIT`` below the memory tier, a directory rewritten in place);
* this node's cached bytes that failed their checksums (:meth:`NodeFace.forget_cached`), a failed save's
  files (:meth:`NodeFace.drop_uncommitted`);
* durability (:attr:`NodeFace.durable`: wait, status, sync; :attr:`NodeFace.revocable`: withdraw).

A chain with no node tier has a face that answers "not here" to each, so callers never branch on which
links a chain has. The storage backends (:mod:`tierckpt.backends`) know nothing of any of this.

This module also holds the types the face hands out (:class:`NodeTier`, :class:`HeldEntry`,
:class:`Spare`, :class:`MappedWriter`); the links that implement them import them from here.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from tierckpt.backends.base import Backend, ObjectWriter
from tierckpt.native.layout import CommitRecord
from tierckpt.node.durability import Durable, Revocable, durability_of, revocable_of

if TYPE_CHECKING:
    import torch


class HeldEntry(Protocol):
    """The sealed size and CRC-32C of one file a node tier holds."""

    @property
    def size(self) -> int: ...

    @property
    def crc32c(self) -> int: ...


class NodeTier(Backend):
    """One URI's files in a node tier (the node memory tier, tmpfs), as :attr:`NodeFace.memory_tier` hands
    them to the engine above the chain: a backend (reads of files the node holds), plus what a load asks
    of the node's copy without the I/O loop (small reads, sizes, what is sealed) and what the manager asks
    of its ``COMMIT``."""

    uri: str
    """The checkpoint URI whose files these are."""

    @abc.abstractmethod
    def committed(self) -> CommitRecord | None:
        """The record ``COMMIT`` holds in this tier (``None``: none)."""

    @abc.abstractmethod
    def held(self, generation: str) -> Mapping[str, HeldEntry]:
        """Key -> sealed size and CRC-32C of each file of ``generation`` the tier's manifests list."""

    @abc.abstractmethod
    def keys_of(self, generation: str) -> list[str]:
        """Every complete file of ``generation`` in the tier, sealed or not, sorted."""

    @abc.abstractmethod
    def seal(self, generation: str, *, origin: str, keys: Iterable[str] | None = None) -> object:
        """Record a manifest of ``keys`` (default: the files of ``generation`` this node wrote) under ``origin``."""

    @abc.abstractmethod
    def read_file(self, key: str, cap: int) -> bytes:
        """The whole file ``key``, in the calling thread, refused unread past ``cap`` bytes
        (:class:`~tierckpt.errors.OversizedFileError`); a missing one raises :class:`FileNotFoundError`."""

    @abc.abstractmethod
    def file_size(self, key: str) -> int:
        """The size of the file ``key``, in the calling thread; a missing one raises :class:`FileNotFoundError`."""


class MappedWriter(ObjectWriter):
    """A writer whose :attr:`buffer` holds the file's own pages (:meth:`NodeFace.mapped_writer`): the caller
    filled it, then streams the chunks, which the writer only checksums."""

    buffer: torch.Tensor


class Spare(Protocol):
    """Memory that can become a data file of the node memory tier (:meth:`NodeFace.take_spare`)."""

    buffer: torch.Tensor

    def release(self) -> None:
        """Give the memory up, unless it became a file (:meth:`NodeFace.mapped_writer`)."""


class MemoryLinkParts(Protocol):
    """What the face asks of the node memory link (:class:`tierckpt.node.memory.link.MemoryLink`)."""

    below: Backend
    memory_tier: NodeTier

    def keep_in_memory(self, generation: str) -> bool: ...

    def take_spare(self, nbytes: int) -> Spare | None: ...

    def mapped_writer(self, key: str, nbytes: int, spare: Spare | None) -> MappedWriter | None: ...

    def want_spare(self, key: str, nbytes: int) -> None: ...

    async def drop_uncommitted(self, generation: str) -> None: ...

    async def drop_superseded(self, committed: CommitRecord) -> None: ...


class CacheLinkParts(Protocol):
    """What the face asks of the node disk cache (:class:`tierckpt.node.disk.tiered.TieredBackend`)."""

    link: Backend
    """Its scheduling link over the URI's own backend."""

    async def forget_cached(self, key: str, start: int, end: int) -> bool: ...


class NodeFace:
    """The node tiers of one chain, as the engine above it sees them (see the module docstring).

    ``store`` is the chain's top; ``memory`` and ``cache`` are its node memory link and node disk cache
    when it has them (``None``: that tier is off)."""

    def __init__(self, store: Backend, *, memory: MemoryLinkParts | None = None, cache: CacheLinkParts | None = None) -> None:
        self.store = store
        self._memory = memory
        self._cache = cache
        self.below_memory: Backend = memory.below if memory is not None else store
        """The chain below the node memory tier (what ``COMMIT`` says there, beside the tier's own)."""
        self.below_node: Backend = cache.link if cache is not None else self.below_memory
        """The chain below every node tier: the scheduling link over the URI's own backend (what reads a
        directory rewritten in place, e.g. torch DCP's, whose cached bytes could be stale)."""
        self.durable: Durable | None = durability_of(store)
        """The chain's durability (wait, status, sync) when it writes back; ``None``: a write is durable
        where the URI points when it returns."""
        self.revocable: Revocable | None = revocable_of(store)
        """The chain's way to take back a commit whose write-down failed, when it has one."""

    def without_memory(self) -> NodeFace:
        """The face of the chain below the node memory tier (:attr:`below_memory`): what a load reads through
        when the memory tiers' copies failed."""
        return NodeFace(self.below_memory, cache=self._cache)

    def __repr__(self) -> str:
        return f"NodeFace(memory={self._memory is not None}, cache={self._cache is not None})"

    @property
    def memory_tier(self) -> NodeTier | None:
        """This URI's files in the node memory tier (tmpfs), or ``None`` when the tier is off."""
        return self._memory.memory_tier if self._memory is not None else None

    def keep_in_memory(self, generation: str) -> bool:
        """Hold ``generation`` in the node memory tier only (``persist=False``); ``False``: the chain has no
        memory tier, nothing was done."""
        return self._memory.keep_in_memory(generation) if self._memory is not None else False

    def take_spare(self, nbytes: int) -> Spare | None:
        """Memory of ``nbytes`` or more for an async save's snapshot that can become the file once named
        (:meth:`mapped_writer`); ``None``: use the staging buffer."""
        return self._memory.take_spare(nbytes) if self._memory is not None else None

    def mapped_writer(self, key: str, nbytes: int, spare: Spare | None) -> MappedWriter | None:
        """``spare``, whose ``buffer`` holds the file's ``nbytes``, made the writer of ``key``: its writes only
        checksum what is there. ``None``: write the bytes through the store (then release the spare)."""
        if self._memory is None:
            return None
        return self._memory.mapped_writer(key, nbytes, spare)

    def want_spare(self, key: str, nbytes: int) -> None:
        """A save copied ``key``'s ``nbytes`` without a spare: the memory tier may make one for the next save."""
        if self._memory is not None:
            self._memory.want_spare(key, nbytes)

    async def forget_cached(self, key: str, start: int, end: int) -> bool:
        """Drop this node's cached copies of bytes ``[start, end)`` of ``key`` (they failed their checksums);
        whether any was dropped."""
        return await self._cache.forget_cached(key, start, end) if self._cache is not None else False

    async def drop_uncommitted(self, generation: str) -> None:
        """A save of ``generation`` failed (its commit did not land): drop what this node's memory tier holds
        of it and stop writing it down, leaving the chain below to the rank that withdraws the commit. Every
        rank of a failed save calls it, so no node keeps the generation."""
        if self._memory is not None:
            await self._memory.drop_uncommitted(generation)

    async def drop_superseded(self, committed: CommitRecord) -> None:
        """``committed`` is the URI's commit: drop the generations it superseded from this node's memory tier
        (their pages to the node's pool), leaving the chain below to the committing rank's sweep."""
        if self._memory is not None:
            await self._memory.drop_superseded(committed)
