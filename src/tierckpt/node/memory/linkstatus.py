"""What a :class:`~.link.MemoryLink` reports: :class:`LinkStatus`, each durability level of the newest checkpoint.

Levels (see :class:`~.replica_record.Level`): ``memory`` (committed in this node's memory tier), ``replicated``
(and acknowledged by the peer nodes; the reason when not, as the replicator recorded it), ``local`` (in
the node disk cache, when the chain has one) and ``remote`` (the URI's own store holds its ``COMMIT``).
``memory`` < ``replicated``; ``local`` and ``remote`` are reported separately.
"""

from __future__ import annotations

import asyncio

from tierckpt.comm import describe_error
from tierckpt.backends.bounded import MAX_RECORD_BYTES
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, TransientStorageError
from tierckpt.native.layout import COMMIT, CommitRecord, seq_of
from tierckpt.node.durability import durability_of
from tierckpt.node.levels import Level
from tierckpt.node.status import LinkStatus, StoreStatus
from tierckpt.node.memory.replica_record import recorded_level
from tierckpt.node.memory.linkview import LinkView



async def link_status(link: LinkView) -> LinkStatus:
    """The status of ``link``'s URI on this node (reads the tier, its logs, and the chain below)."""
    tier, down = link.memory_tier, link.down
    record = await asyncio.to_thread(tier.committed)
    memory_generation = record.generation if record is not None else None
    durable = durability_of(link.below)
    below: StoreStatus | None = await durable.status() if durable is not None else None
    if below is not None:
        below_generation, remote_generation, remote_error = below.generation, below.remote_generation, below.remote_error
        unreachable = below.remote_unreachable
    else:
        below_generation, remote_error, unreachable = await _commit_of(link)
        remote_generation = below_generation
    generation = memory_generation
    if below_generation is not None and (generation is None or (seq_of(below_generation) or 0) > (seq_of(generation) or 0)):
        generation = below_generation
    pending: list[str] = []
    errors: list[str] = []
    memory_only = False
    if memory_generation is not None:
        state = await asyncio.to_thread(down.state, memory_generation)
        memory_only = state.memory_only
        pending = await asyncio.to_thread(down.pending, memory_generation, state)
        errors = [f"{k}: {why}" for k, why in sorted(state.errors.items())]
        if pending and memory_generation == below_generation:
            # Committed below, so every file of it is there: its COMMIT and the files this node does not
            # write down itself (replicas it holds, or what a sync of another process or node wrote) were
            # written down by another node, which this node's log never records.
            pending, errors = [], []
    written_down = generation is not None and (generation != memory_generation or not pending)
    if generation is None:
        state_now: Level | None = Level.STAGED if pending else None
    elif generation == memory_generation and pending:
        state_now = Level.LOCAL
    elif below is not None and below.generation == generation:
        state_now = below.state
    else:
        state_now = Level.REMOTE if remote_generation == generation else Level.LOCAL
    replica = recorded_level(tier, generation) if generation is not None else None
    return LinkStatus(
        uri=link.memory_tier.uri,
        generation=generation,
        state=state_now,
        pending_keys=(() if memory_only else tuple(pending)) + (below.pending_keys if below is not None else ()),
        pending_bytes=below.pending_bytes if below is not None else 0,
        errors=tuple(errors) + (below.errors if below is not None else ()),
        remote_generation=remote_generation,
        remote_error=remote_error,
        remote_unreachable=unreachable,
        memory_generation=memory_generation,
        memory_directory=tier.home,
        replicated=replica is not None and replica.level is Level.REPLICATED,
        replica_reason=None if replica is None else replica.reason,
        replica_nodes=() if replica is None else replica.acknowledged,
        node_disk=None if below is None else below.generation == generation,
        written_down=written_down,
        memory_only=memory_only,
    )


async def _commit_of(link: LinkView) -> tuple[str | None, str | None, bool]:
    """The generation the chain below's ``COMMIT`` names, why it could not be read, and whether that is
    because the store did not answer."""
    try:
        return CommitRecord.decode(await link.below.get_capped(COMMIT, MAX_RECORD_BYTES)).generation, None, False
    except CheckpointNotFoundError:
        return None, None, False
    except (CorruptCheckpointError, CheckpointError) as exc:
        return None, describe_error(exc), isinstance(exc, TransientStorageError)
