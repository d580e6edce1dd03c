"""The one level type of the write-back engine: :class:`Level`, where a checkpoint stands on its way down.

Every link reports in these words: the node disk cache (``staged``, ``local``, ``remote``), the node
memory tier and its replicator (``memory``, ``replicated``), the saver's ``wait_for`` and the CLI's
``status``. ``memory`` < ``replicated``; ``local`` and ``remote`` are reported beside them, not ordered
with them (a checkpoint saved with ``persist=False`` is ``replicated`` and never ``local``).
"""

from __future__ import annotations

import enum


class Level(enum.StrEnum):
    """Where a checkpoint generation stands on this node's side of the chain."""

    STAGED = "staged"
    """Data written through this node, nothing committed."""
    MEMORY = "memory"
    """Committed in this node's memory tier (tmpfs)."""
    REPLICATED = "replicated"
    """And acknowledged, CRC-checked, by every peer node that holds this node's replicas."""
    LOCAL = "local"
    """Committed on this node (its disk cache) and not yet where the URI points."""
    REMOTE = "remote"
    """Committed where the URI points (the URI's own store holds this COMMIT)."""


WAITABLE = (Level.MEMORY, Level.REPLICATED, Level.REMOTE)
"""The levels a save can be told to wait for (``wait_for=``)."""
