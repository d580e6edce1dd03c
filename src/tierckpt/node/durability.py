"""The one durability answer of the write-back engine: the :class:`Durable` and :class:`Revocable` protocols.

A write-back link (the node disk cache, the node memory tier) acknowledges a write once it is durable
on this node and writes it down behind; the chain's top answers for the whole chain below it. Callers
that hold a store ask it with :func:`durability_of` (never by probing for methods or by the link's
class) and call ``wait_durable`` / ``status`` / ``sync`` on it. A store without the protocol is durable
where its URI points when a write returns.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tierckpt.node.status import StoreStatus


@runtime_checkable
class Durable(Protocol):
    """What a write-back store offers about the durability of what was written through it."""

    async def wait_durable(self, generation: str | None = None, timeout_s: float | None = None, *,
                           through_outage: bool = True) -> None:
        """Wait until every write (of ``generation``) reached the remote; raise when one failed for good,
        at ``timeout_s``, or (``through_outage=False``) as soon as one failed at all."""

    async def status(self) -> StoreStatus:
        """The committed generation on this node and on the remote, and what is still pending."""

    async def sync(self, timeout_s: float | None = None) -> None:
        """Resume writes left pending by this or a dead process, then :meth:`wait_durable`."""


@runtime_checkable
class Revocable(Protocol):
    """A write-back store that can take back a commit whose write-down failed."""

    async def withdraw(self, generation: str, record: bytes, base: bytes | None) -> list[str] | None:
        """Make ``generation`` (committed on this node by ``record``) committed nowhere, this node's view of
        COMMIT back to ``base``; why its write-downs failed, or ``None`` when ``record`` reached the remote."""


def durability_of(store: object) -> Durable | None:
    """``store`` itself when it is write-back (offers :class:`Durable`), else ``None``."""
    return store if isinstance(store, Durable) else None


def revocable_of(store: object) -> Revocable | None:
    """``store`` itself when it can take back a failed commit (:class:`Revocable`), else ``None``."""
    return store if isinstance(store, Revocable) else None
