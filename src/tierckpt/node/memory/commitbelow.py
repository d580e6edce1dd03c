"""The last step of a write-down: the tier's ``COMMIT`` committed in the chain below, as a compare-and-swap.

:meth:`~.writedown.WriteDown.commit_below` runs it once every file the commit depends on is below.
"""

from __future__ import annotations

from collections.abc import Mapping

from tierckpt.backends.base import Backend, Unconditional
from tierckpt.backends.bounded import MAX_RECORD_BYTES
from tierckpt.errors import CheckpointBusyError, CheckpointNotFoundError, TransientStorageError
from tierckpt.native.layout import COMMIT, CommitRecord

CATCH_UP = object()
"""``expected`` of a commit pushed by ``sync``: swap against what the chain below holds if it is older."""


async def commit_below(below: Backend, data: bytes, record: CommitRecord,
                       expected: bytes | None | Unconditional | object, after: Mapping[str, int | None] | None) -> None:
    """Commit ``data`` below against ``expected``; a chain below that holds an older commit than
    ``expected`` (an earlier write-down never landed) is caught up; a newer one is a conflict."""
    if expected is not CATCH_UP:
        try:
            await below.commit(COMMIT, data, expected=expected, after=after)  # type: ignore[arg-type]
            return
        except CheckpointBusyError:
            pass
    for _ in range(3):  # catch up; another writer of this node may land the same record meanwhile
        try:
            current: bytes | None = await below.get_capped(COMMIT, MAX_RECORD_BYTES)
        except CheckpointNotFoundError:
            current = None
        if current == data:
            return  # already there (a retried request that landed, or another process's sync)
        theirs = CommitRecord.decode(current) if current is not None else None
        if theirs is not None and theirs.seq >= record.seq:
            raise CheckpointBusyError(
                f"{below.root_uri} holds generation {theirs.generation} (commit {theirs.seq}), committed by "
                f"another writer; generation {record.generation} (commit {record.seq}) stays in this node's "
                "memory tier only"
            )
        try:
            await below.commit(COMMIT, data, expected=current, after=after)
            return
        except CheckpointBusyError:
            continue
    raise TransientStorageError(f"the COMMIT of {below.root_uri} keeps changing while generation "
                                f"{record.generation} is written down; retrying")

