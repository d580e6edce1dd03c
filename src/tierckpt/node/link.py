"""The write-back link core: the one shape of both node tiers' links, written once over their journals.

A write-back link (the node disk cache's :class:`~tierckpt.node.disk.tiered.TieredBackend`, the node memory
tier's :class:`~tierckpt.node.memory.link.MemoryLink`) acknowledges a write once it is durable on this node
and copies it down behind, recording what it still owes in its journal (:class:`~tierckpt.node.journal.Journal`:
the cache's LMDB catalogue, the tier's write-down log). Four things have the same shape on both media and
live here, in :class:`WriteBackLink`; each medium answers a few small hooks:

``sync``
    Take over what no live process copies — the journal's entries of the sync's scope
    (:meth:`WriteBackLink._sync_scope`) whose owner is gone (``owner=None``), is this process, or whose copy
    failed for good — through :meth:`~WriteBackLink._take_over`, ``COMMIT`` last; wait for them
    (:meth:`~WriteBackLink._wait_own`), then for the chain below's own ``sync``.
``wait_durable``
    The link's own wait (:func:`~tierckpt.node.durability.wait_owed` over its journal), then the chain
    below's, when it is write-back too.
a delete below
    One rule (:meth:`WriteBackLink._delete_below`): a delete reaches the chain below only after a pending
    ``COMMIT`` copy, so the chain below never names a generation that is gone there. The medium says
    whether a ``COMMIT`` copy is pending (:meth:`~WriteBackLink._commit_pending`) and how it runs the
    delete now or after it.
``withdraw``
    Take back a commit that did not go down (a synchronous save that raises): stop this medium's copies of
    the generation (:meth:`~WriteBackLink._stop_copies`, which records why they failed); ask the chain
    below to withdraw its part when it is write-back too, else look whether the record landed below after
    all (:meth:`~WriteBackLink._landed`: then nothing is taken back); else drop this medium's copies of the
    generation and restore the save's base (:meth:`~WriteBackLink._drop_withdrawn`).

What stays per medium, because it differs: the write paths (the cache's publish and upload-while-writing;
the tier's admission, fall-back and spares), the reads, the commit actions below (the remote
compare-and-swap; the commit below with its catch-up) and the status each reports.
"""

from __future__ import annotations

import asyncio
import os
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tierckpt.backends.base import Link
from tierckpt.native.layout import COMMIT
from tierckpt.node.durability import durability_of, revocable_of
from tierckpt.node.journal import Journal, Outstanding


def generation_name(generation: str) -> str:
    """The name of ``generation`` given as a name or as ``dir/name``."""
    return generation.rstrip("/").rpartition("/")[2]


@dataclass(frozen=True, slots=True)
class SyncScope:
    """What one ``sync`` of a link finishes."""

    journal: str
    """The journal's scope (:meth:`~tierckpt.node.journal.Journal.outstanding`): a root's hash, a generation."""
    generation: str | None
    """What the wait after the take-over waits for (``None``: everything the link owes)."""


@dataclass(slots=True)
class Withdrawal:
    """A withdrawal in progress (:meth:`WriteBackLink.withdraw`): the generation and why its copies failed."""

    name: str
    """The generation's name."""
    failures: list[str] = field(default_factory=list)
    """Why this medium's copies of it (and of its ``COMMIT``) failed, as ``uri: why``."""


W = TypeVar("W", bound=Withdrawal)


class WriteBackLink(Link, Generic[W]):
    """The core of a node tier's write-back link (see the module docstring); ``W``: the medium's
    :class:`Withdrawal` (what its :meth:`_stop_copies` hands to its :meth:`_drop_withdrawn`)."""

    journal: Journal
    """What the link still owes the chain below, as every process of the node and a restart read it."""

    # -- durability ------------------------------------------------------------------------------------
    async def wait_durable(self, generation: str | None = None, timeout_s: float | None = None, *,
                           through_outage: bool = True) -> None:
        """Wait until what this link owes (of ``generation``) is below, then for the chain below's own
        durability (:class:`~tierckpt.node.durability.Durable`)."""
        await self._wait_own(generation, timeout_s, through_outage=through_outage)
        below = durability_of(self.below)
        if below is not None:
            await below.wait_durable(generation, timeout_s, through_outage=through_outage)

    async def sync(self, timeout_s: float | None = None) -> None:
        """Take over what this link's journal owes and no live process copies (left by a dead process, or
        failed for good), ``COMMIT`` last; wait for it; then the chain below's own ``sync``."""
        scope = await self._sync_scope()
        if scope is not None:
            me = os.getpid()
            owed = await asyncio.to_thread(self.journal.outstanding, scope.journal)
            for entry in sorted(owed, key=_commit_last):
                if entry.owner is None or entry.owner == me or entry.final:
                    await self._take_over(scope, entry.key)
            await self._wait_own(scope.generation, timeout_s, through_outage=True)
        below = durability_of(self.below)
        if below is not None:
            await below.sync(timeout_s)

    @abstractmethod
    async def _wait_own(self, generation: str | None, timeout_s: float | None, *, through_outage: bool) -> None:
        """The medium: wait for its own copies down (of ``generation``) as :meth:`wait_durable` says."""

    @abstractmethod
    async def _sync_scope(self) -> SyncScope | None:
        """The medium: what a ``sync`` finishes (``None``: nothing of this link's own)."""

    @abstractmethod
    async def _take_over(self, scope: SyncScope, key: str) -> None:
        """The medium: make a task of this process copy ``key`` down (one already running goes on alone)."""

    # -- deletes below ---------------------------------------------------------------------------------
    async def _delete_below(self, what: str, *, exact: bool, superseded: str | None = None) -> None:
        """Delete ``what`` (a key with ``exact``, else a prefix) from the chain below: now, or after the
        pending ``COMMIT`` copy when there is one, so the chain below never names what is gone there.
        ``superseded``: the generation deleted because a newer commit superseded it (the saver's sweep)."""
        if self._commit_pending(what):
            await self._delete_after_commit(what, exact=exact, superseded=superseded)
        else:
            await self._delete_now(what, exact=exact, superseded=superseded)

    @abstractmethod
    def _commit_pending(self, what: str) -> bool:
        """The medium: whether a copy down of a ``COMMIT`` (other than ``what``) is pending."""

    @abstractmethod
    async def _delete_now(self, what: str, *, exact: bool, superseded: str | None) -> None:
        """The medium: delete ``what`` from the chain below now."""

    @abstractmethod
    async def _delete_after_commit(self, what: str, *, exact: bool, superseded: str | None) -> None:
        """The medium: delete ``what`` from the chain below once the pending ``COMMIT`` copy settled."""

    # -- withdrawal ------------------------------------------------------------------------------------
    async def withdraw(self, generation: str, record: bytes, base: bytes | None) -> list[str] | None:
        """Take back the commit ``record`` of ``generation`` that was not copied down (a synchronous save
        that raises), so that the generation is committed nowhere, this node included; this node's view of
        ``COMMIT`` is ``base`` again (:class:`~tierckpt.node.durability.Revocable`). Returns why the copies
        failed; ``None`` when ``record`` reached the chain below after all (nothing is taken back)."""
        withdrawal = await self._stop_copies(generation_name(generation))
        revocable = revocable_of(self.below)
        below_failures: list[str] = []
        if revocable is not None:
            failed_below = await revocable.withdraw(generation, record, base)
            if failed_below is None:
                return None
            below_failures = failed_below
        elif await self._landed(record, withdrawal):
            return None
        await self._drop_withdrawn(withdrawal, record, base)
        return withdrawal.failures + below_failures

    @abstractmethod
    async def _stop_copies(self, name: str) -> W:
        """The medium: stop this process's copies down of generation ``name`` and of its ``COMMIT``; what
        they owed and why they failed."""

    @abstractmethod
    async def _landed(self, record: bytes, withdrawal: W) -> bool:
        """The medium: whether the chain below holds ``record`` as its ``COMMIT`` (its journal then settled):
        the save succeeded and nothing is taken back."""

    @abstractmethod
    async def _drop_withdrawn(self, withdrawal: W, record: bytes, base: bytes | None) -> None:
        """The medium: drop its copies of the withdrawn generation and make ``base`` its view of ``COMMIT``."""


def _commit_last(entry: Outstanding) -> bool:
    """Sort key: a ``COMMIT`` after the files it names."""
    return entry.key.rpartition("/")[2] == COMMIT
