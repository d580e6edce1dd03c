"""The check half of a write-back link's commit: ``expected`` against this node's view of the key.

A write-back link (the node disk cache, the node memory tier) commits on the node and commits below
behind the caller, itself as a compare-and-swap against the base the saver gave. Its acknowledgement
checks ``expected`` against the node's view first: what the link committed last, else what the chain
below holds. When that view cannot be read because the chain below does not answer
(:class:`~tierckpt.errors.TransientStorageError`) and ``expected`` is ``None`` (a URI this node never
saw), the commit is accepted: the compare-and-swap below decides once it runs, and a chain below that
holds another writer's commit refuses it loudly then.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tierckpt.backends.base import UNCONDITIONAL, Unconditional
from tierckpt.backends.commit_check import commit_refused
from tierckpt.errors import TransientStorageError


async def check_node_view(uri: str, expected: bytes | None | Unconditional,
                          node_view: Callable[[], Awaitable[bytes | None]]) -> None:
    """Raise :func:`~tierckpt.backends.commit_check.commit_refused` (naming ``uri``) unless ``node_view()``
    (the key's bytes on this node's view, ``None``: no object) holds ``expected``; see the module docstring."""
    if expected is UNCONDITIONAL:
        return
    try:
        current = await node_view()
    except TransientStorageError:
        if expected is None:
            return  # a URI this node never saw, the chain below unreachable: the write-behind's CAS decides
        raise
    if current != expected:
        raise commit_refused(uri, expected, current)
