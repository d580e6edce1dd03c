"""Bytes that fail their save-time checksums after a node cache served them are read again from below.

A node cache records what it fetches as it arrived (see :mod:`tierckpt.node.disk.readthrough`): a download
corrupted on the way, or a cached file that rotted unnoticed, reaches the load's checksum check, which
raises :class:`~tierckpt.errors.ChecksumMismatchError` naming the bytes. Before that error stands, every
rank drops its node cache's copies of the bytes its own errors name (:func:`~tierckpt.store.forget_cached`)
and the group agrees, in one collective, whether any rank dropped one: then the load (or ``verify``)
reads again, and those bytes come from the remote. Bytes already dropped once are not dropped again,
so a mismatch in what the remote itself holds is reported as the corruption it is.
"""

from __future__ import annotations

import logging

from tierckpt.comm import Comm
from tierckpt.errors import ChecksumMismatchError
from tierckpt.node.face import NodeFace
from tierckpt.store import forget_cached

logger = logging.getLogger("tierckpt")

Range = tuple[str, int, int]
"""``(key relative to the checkpoint root, start, end)``."""


def mismatched(error: BaseException) -> set[Range]:
    """The byte ranges that :class:`ChecksumMismatchError` s in ``error``'s chain (this rank's own
    failures, which an agreed error carries as its cause) name."""
    found: set[Range] = set()
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        exc = stack.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, ChecksumMismatchError) and exc.key is not None:
            found.add((exc.key, exc.start, exc.end))
        stack += [exc.__cause__, exc.__context__]
    return found


def drop_and_retry(comm: Comm, node: NodeFace, error: BaseException, dropped_before: set[Range]) -> bool:
    """Whether the group should read again after ``error`` (raised on every rank): each rank drops its node
    cache's copies of the ranges its error names and has not dropped before (added to ``dropped_before``);
    ``True`` on every rank when any rank dropped one. A collective: every rank of ``comm`` calls it."""
    ranges = mismatched(error) - dropped_before
    dropped_before |= ranges
    try:
        mine = forget_cached(node, ranges)
    except Exception as exc:  # noqa: BLE001 - the original error stands; the group must still agree
        logger.warning("could not drop the node cache's copies of %s: %s", sorted(ranges), exc)
        mine = False
    return any(comm.all_gather_object(mine))
