"""The one durability answer of the write-back engine: the :class:`Durable` and :class:`Revocable` protocols.

A write-back link (the node disk cache, the node memory tier) acknowledges a write once it is durable
on this node and writes it down behind; the chain's top answers for the whole chain below it. Callers
that hold a store ask it with :func:`durability_of` (never by probing for methods or by the link's
class) and call ``wait_durable`` / ``status`` / ``sync`` on it. A store without the protocol is durable
where its URI points when a write returns.

Each link's ``wait_durable`` is the one wait :func:`wait_owed`, over its view (:class:`Owed`) of its
journal: the keys it still owes below as :class:`~tierckpt.node.journal.Outstanding` records.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, runtime_checkable

from tierckpt.io.calls import Waiting
from tierckpt.node.journal import Outstanding
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


class Owed(Protocol):
    """One durability wait's view of a link's journal (see :func:`wait_owed`): what the wait still waits for,
    and the link's words for it."""

    async def outstanding(self) -> list[Outstanding]:
        """The keys the wait still waits for, each with its last failure (``final``: for good)."""

    def waiting_for(self, left: list[Outstanding]) -> str:
        """What a long wait says it waits for (printed on stderr now and then)."""

    def failed(self, failed: list[Outstanding], left: list[Outstanding]) -> Exception:
        """The error the wait raises for ``failed`` (sorted by key), some of ``left``."""

    def resume(self, left: list[Outstanding]) -> None:
        """Once, the first time keys are left and none failed: restart what nobody is copying."""

    def overdue(self, left: list[Outstanding], timeout_s: float) -> Exception:
        """The error the wait raises when ``left`` is still owed at ``timeout_s``."""

    def pause_s(self, left: list[Outstanding]) -> float:
        """How long to wait before the next look."""


async def wait_owed(owed: Owed, timeout_s: float | None, *, through_outage: bool) -> None:
    """The one durability wait of the write-back engine (each link's ``wait_durable`` runs it over its journal).

    Looks at what ``owed`` still waits for until nothing is left. A key that failed for good raises
    :meth:`Owed.failed` at once, and so does a transient failure unless ``through_outage``; keys still
    owed at ``timeout_s`` raise :meth:`Owed.overdue`. A long wait says on stderr what it waits for."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    waiting = Waiting()
    resumed = False
    while True:
        left = await owed.outstanding()
        if not left:
            return
        waiting.note(lambda: owed.waiting_for(left))
        failed = sorted((o for o in left if o.error is not None and (o.final or not through_outage)), key=lambda o: o.key)
        if failed:
            raise owed.failed(failed, left)
        if not resumed:
            owed.resume(left)
            resumed = True
        if deadline is not None and time.monotonic() > deadline:
            raise owed.overdue(left, timeout_s)  # type: ignore[arg-type]  # a deadline is set only with timeout_s
        await asyncio.sleep(owed.pause_s(left))
