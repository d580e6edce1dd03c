"""What a write-back store reports about durability: :class:`StoreStatus` and :class:`Durability`.

Two questions are kept apart on every node: what is committed *on this node* (the node cache's
newest ``COMMIT``, pending upload or not) and what is committed *on the remote* (the ``COMMIT`` the
URI's own store holds, read from it). Only the second survives the loss of the node.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Durability(enum.StrEnum):
    """Where the checkpoint a node sees as committed stands."""

    STAGED = "staged"
    """Data written through this node, nothing committed."""
    LOCAL = "local"
    """Committed in this node's cache; the remote does not have this COMMIT yet."""
    REMOTE = "remote"
    """Committed on the remote (the URI's store holds this COMMIT)."""


@dataclass(frozen=True, slots=True)
class StoreStatus:
    """Durability of one store, as this node sees it and as the remote holds it."""

    uri: str
    generation: str | None
    """The generation committed on this node (its newest COMMIT, pending upload or uploaded)."""
    state: Durability | None
    """Where that generation stands (``None``: nothing committed and nothing staged)."""
    pending_keys: tuple[str, ...]
    pending_bytes: int
    errors: tuple[str, ...] = ()
    """Uploads that failed (``key: reason``); ``tierckpt sync`` retries them, ``--drop`` discards them."""
    remote_generation: str | None = None
    """The generation the remote's own COMMIT names (``None``: none, or the remote could not be read)."""
    remote_error: str | None = None
    """Why the remote's COMMIT could not be read (an outage, a missing bucket), else ``None``."""
    remote_unreachable: bool = False
    """Whether that is because the store did not answer (connection refused or timed out, 5xx throughout):
    then "nothing committed" is unknown, not known (``tierckpt status`` exits 7)."""

    @property
    def durable(self) -> bool:
        """Committed on the remote, with nothing left to upload."""
        return self.state == Durability.REMOTE and not self.pending_keys

    @property
    def committed_on_node(self) -> bool:
        """Whether this node's cache holds a committed generation (uploaded or not)."""
        return self.generation is not None

    @property
    def committed_on_remote(self) -> bool:
        """Whether the remote holds the COMMIT of the generation committed on this node."""
        return self.generation is not None and self.remote_generation == self.generation
