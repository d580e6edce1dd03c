"""The engine's one durability wait (``node.durability.wait_owed``), which both links' ``wait_durable`` run over
their journals: what it raises and when it returns, driven by a journal whose looks are scripted."""

from __future__ import annotations

import asyncio

import pytest

from tierckpt.errors import StorageError, TransientStorageError
from tierckpt.node.durability import wait_owed
from tierckpt.node.journal import Outstanding


class _Scripted:
    """A journal view whose successive looks return ``looks`` (the last one again once they run out)."""

    def __init__(self, *looks: list[Outstanding]) -> None:
        self.looks = list(looks)
        self.seen = 0
        self.resumed: list[list[str]] = []

    async def outstanding(self) -> list[Outstanding]:
        self.seen += 1
        return self.looks.pop(0) if len(self.looks) > 1 else self.looks[0]

    def waiting_for(self, left: list[Outstanding]) -> str:
        return f"{len(left)} key(s)"

    def failed(self, failed: list[Outstanding], left: list[Outstanding]) -> Exception:
        return StorageError(f"{failed[0].key} failed ({failed[0].error}) of {len(left)}")

    def resume(self, left: list[Outstanding]) -> None:
        self.resumed.append([o.key for o in left])

    def overdue(self, left: list[Outstanding], timeout_s: float) -> Exception:
        return TransientStorageError(f"{[o.key for o in left]} left after {timeout_s} s")

    def pause_s(self, left: list[Outstanding]) -> float:
        return 0.001


def test_a_transient_failure_is_waited_through_and_the_journal_resumed_once() -> None:
    owed = _Scripted([Outstanding("b", 1), Outstanding("a", 1)],
                     [Outstanding("a", 1, "503 slow down")], [Outstanding("a", 1, "503 slow down")], [])
    asyncio.run(wait_owed(owed, None, through_outage=True))
    assert owed.seen == 4 and owed.resumed == [["b", "a"]]


def test_without_through_outage_a_transient_failure_raises_naming_the_first_key() -> None:
    owed = _Scripted([Outstanding("c", 1), Outstanding("b", 1, "503"), Outstanding("a", None, "timed out")])
    with pytest.raises(StorageError, match=r"^a failed \(timed out\) of 3$"):
        asyncio.run(wait_owed(owed, None, through_outage=False))
    assert owed.resumed == []  # a failure raises before anything is resumed


def test_a_failure_for_good_raises_through_an_outage_too() -> None:
    owed = _Scripted([Outstanding("a", 1)], [Outstanding("a", None, "no such bucket", final=True)])
    with pytest.raises(StorageError, match="no such bucket"):
        asyncio.run(wait_owed(owed, None, through_outage=True))
    assert owed.seen == 2


def test_keys_still_owed_at_the_timeout_raise_the_journals_overdue_error() -> None:
    owed = _Scripted([Outstanding("a", 1)])
    with pytest.raises(TransientStorageError, match=r"\['a'\] left after 0.05 s"):
        asyncio.run(wait_owed(owed, 0.05, through_outage=True))
    assert owed.seen > 2


def test_nothing_owed_returns_at_the_first_look() -> None:
    owed = _Scripted([])
    asyncio.run(wait_owed(owed, 0.0, through_outage=False))
    assert owed.seen == 1 and owed.resumed == []
