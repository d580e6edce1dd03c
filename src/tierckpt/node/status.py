"""What a write-back store reports: :class:`StoreStatus` (every link), :class:`LinkStatus` (with the memory tier).

Two questions are kept apart on every node: what is committed *on this node* (the node cache's
newest ``COMMIT``, pending upload or not) and what is committed *on the remote* (the ``COMMIT`` the
URI's own store holds, read from it). Only the second survives the loss of the node.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierckpt.node.levels import Level


UNREACHABLE = "unreachable"
"""The state ``status`` and ``ls`` report for a checkpoint this node holds committed, nothing of it pending,
while the remote does not answer: whether it is committed where its URI points is unknown (neither
``remote`` nor ``node-only``; :attr:`StoreStatus.remote_unknown`)."""


@dataclass(frozen=True, slots=True)
class StoreStatus:
    """Durability of one store, as this node sees it and as the remote holds it."""

    uri: str
    generation: str | None
    """The generation committed on this node (its newest COMMIT, pending upload or uploaded)."""
    state: Level | None
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
        """Committed on the remote, with nothing left to upload; never while the remote does not answer (what
        it holds is then unknown)."""
        return self.state == Level.REMOTE and not self.pending_keys and not self.remote_unreachable

    @property
    def remote_unknown(self) -> bool:
        """Whether where the generation stands on the remote is unknown: nothing of it is pending on this node
        (it uploaded or fetched it once), and the remote does not answer now. With uploads pending it is known
        not to be there (its ``COMMIT`` goes last), so this is ``False``."""
        return self.state == Level.REMOTE and self.remote_unreachable and not self.committed_on_remote

    @property
    def reported_state(self) -> str | None:
        """:attr:`state` as ``tierckpt status`` reports it: :data:`UNREACHABLE` instead of ``remote`` when
        :attr:`remote_unknown`, else the level's name (``None``: nothing committed and nothing staged)."""
        if self.remote_unknown:
            return UNREACHABLE
        return None if self.state is None else self.state.value

    @property
    def committed_on_node(self) -> bool:
        """Whether this node's cache holds a committed generation (uploaded or not)."""
        return self.generation is not None

    @property
    def only_in_memory(self) -> bool:
        """Whether the generation is committed in this node's memory tier and not written down below it."""
        return False

    def levels(self) -> list[tuple[str, bool, str]]:
        """``(level, reached, detail)`` of each level a node tier reports (none here: see :class:`LinkStatus`)."""
        return []

    @property
    def committed_on_remote(self) -> bool:
        """Whether the remote holds the COMMIT of the generation committed on this node."""
        return self.generation is not None and self.remote_generation == self.generation


@dataclass(frozen=True, slots=True)
class LinkStatus(StoreStatus):
    """A :class:`StoreStatus` (the view below the tier) plus the memory tier's levels."""

    memory_generation: str | None = None
    """The generation the memory tier's ``COMMIT`` names (``None``: none)."""
    memory_directory: str = ""
    replicated: bool = False
    replica_reason: str | None = None
    """Why the generation is not ``replicated`` (the replicator's record; ``None`` when it is)."""
    replica_nodes: tuple[str, ...] = ()
    """The peer nodes that acknowledged this node's files of the generation (where its replicas are)."""
    node_disk: bool | None = None
    """Whether the node disk cache holds the generation committed (``None``: the chain has no disk cache)."""
    written_down: bool = False
    """Whether the chain below the memory tier holds every file of the generation and its ``COMMIT``."""
    memory_only: bool = False
    """The generation was saved with ``persist=False``: held in memory (and on the peers) only, not written
    down until ``tierckpt sync``."""

    @property
    def in_memory(self) -> bool:
        return self.generation is not None and self.memory_generation == self.generation

    @property
    def only_in_memory(self) -> bool:
        return self.in_memory and not self.written_down

    def levels(self) -> list[tuple[str, bool, str]]:
        """``(level, reached, detail)`` for memory, replicated, local and remote, in that order."""
        remote_detail = (
            f"held in memory only (saved with persist=False); `tierckpt sync {self.uri}` writes it down"
            if self.memory_only and self.in_memory
            else f"the remote's COMMIT names {self.remote_generation}" if self.remote_generation
            else f"the remote cannot be read: {self.remote_error}" if self.remote_error else "the remote has no COMMIT"
        )
        return [
            (Level.MEMORY.value, self.in_memory,
             f"in {self.memory_directory}" if self.in_memory else "not in this node's memory tier"),
            (Level.REPLICATED.value, self.replicated, f"in the memory of {', '.join(self.replica_nodes) or 'every peer'}" if self.replicated
             else self.replica_reason or "no replication recorded"),
            (Level.LOCAL.value, bool(self.node_disk),
             "no node disk cache in the chain" if self.node_disk is None
             else "committed in the node disk cache" if self.node_disk
             else "held in memory only (saved with persist=False)" if self.memory_only and self.in_memory
             else "not in the node disk cache yet"),
            (Level.REMOTE.value, self.committed_on_remote,
             "committed on the remote" if self.committed_on_remote else remote_detail),
        ]
