"""A compare-and-swap commit's two halves that stores share: the error of a refused commit, and the check of
a check-then-write commit (stores without conditional writes; see :meth:`tierckpt.backends.base.Backend.commit`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierckpt.errors import CheckpointBusyError, CheckpointNotFoundError
from tierckpt.backends.base import UNCONDITIONAL, Unconditional

if TYPE_CHECKING:
    from tierckpt.backends.base import Backend


def commit_refused(uri: str, expected: bytes | None, current: bytes | None | str) -> CheckpointBusyError:
    """The error of a compare-and-swap commit that found ``current`` (bytes, ``None`` for no object, or
    a description) instead of ``expected`` at ``uri``."""
    found = current if isinstance(current, str) else "no object" if current is None else f"{len(current)} other bytes"
    wanted = "no object" if expected is None else f"the {len(expected)} bytes read before"
    return CheckpointBusyError(f"commit of {uri} refused: it expected {wanted} there and found {found}; another "
                               "writer committed meanwhile")


async def check_expected(backend: Backend, key: str, expected: bytes | None | Unconditional, uri: str) -> None:
    """The check half of a check-then-write commit (stores without conditional writes): raise
    :func:`commit_refused` (naming ``uri``) unless ``key`` holds ``expected`` (``None``: no object)."""
    if expected is UNCONDITIONAL:
        return
    try:
        current: bytes | None = await backend.get(key)
    except CheckpointNotFoundError:
        current = None
    if current != expected:
        raise commit_refused(uri, expected, current)
