"""What one save carries from its planning step to its streaming and commit steps (:class:`_Prepared`)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

from tierckpt.backends import Backend
from tierckpt.comm import Comm
from tierckpt.monitor import Monitor
from tierckpt.planner import SavePlan
from tierckpt.state.adapters import FlatState
from tierckpt.node.face import NodeFace
from tierckpt.node.memory.replication import Replication


@dataclass
class _Prepared:
    """One save as its first step left it, on one rank: its store and group, the flattened and encoded
    state, the agreed plan and generation, and how it must end (write-back, persist, keep_previous)."""

    uri: str
    comm: Comm
    backend: Backend
    node: NodeFace
    """What the store's node tiers offer (memory tier, spares, durability)."""
    flat: FlatState
    encoded: dict[str, tuple[bytes, str]]
    plan: SavePlan
    owners: dict[str, int | None]
    generation: str
    started: float
    base: concurrent.futures.Future[bytes | None] | None
    """``COMMIT`` as it was when the save began (rank 0 only; ``None`` inside: no commit yet), the
    expected value of the compare-and-swap commit."""
    monitor: Monitor
    tags: dict[str, str]
    keep_previous: bool
    write_back: bool
    """Return at node commit and upload behind (``async_save``); else wait until the store is durable."""
    replication: Replication
    """Peer replication of the generation once committed (a no-op without a memory tier or torch.distributed)."""
    persist: bool
    """Written down where the URI points; ``False``: held in the node memory tier (and on the peers) only."""
