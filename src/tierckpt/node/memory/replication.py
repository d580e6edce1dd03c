"""The saver's replication step: peer replicas of each checkpoint committed to the node memory tier.

A save through a store with a memory tier (:func:`tierckpt.store.memory_tier_of`), in a job where
torch.distributed is initialised, replicates each committed generation to the peer nodes:

* :func:`replicator_for` runs in the save's foreground, on every rank at the same point (the save's
  preparation, which every rank reaches together): the first save of a (process, group, memory
  directory) builds its :class:`~.replica.Replicator` there — one all-gather of node ids on the
  group (the side group it sends over needs none; a gloo group of the replicator's own, where there is no
  side group, is created there too) — and later saves reuse it. Nothing
  is ever built from a background thread, so an ``async_save`` never issues a collective on
  training's group behind training's back.
* :meth:`Replication.start` runs after the commit (in the background for ``async_save``): it calls
  :meth:`~.replica.Replicator.replicate`, which issues no collective at all (the transfers run on
  the side group, :mod:`.sidegroup`, in the replicator's own threads).
* :meth:`Replication.wait` is ``SaveHandle.wait("replicated")``: the level of this node's files,
  raising :class:`ReplicationError` with the reason when it stayed ``memory``. It returns once this
  node also took its peers' replicas of the generation, so a job that exits after every rank's
  ``wait("replicated")`` returned leaves every node's files replicated.
* :func:`stop_replicators` ends replication before the process's groups go away: the saver's exit
  drain calls it (waiting, within the exit wait, for replication in flight, so a job that exits right
  after ``wait()`` still replicates its last checkpoint), and so does ``dist.destroy_process_group()``
  of the default group, which destroys the replicators' groups too (the first replicator registers
  that with :func:`tierckpt.node.lifecycle.before_default_group_destroyed`; a reference taken with
  ``from torch.distributed import destroy_process_group`` before that is not wrapped, and the exit
  drain then reports any replication cut short). A replication cut short is recorded as ``memory``
  with the reason, never ``replicated``.

The replicators themselves are kept in the process's one registry of live replicators
(:data:`.live.REPLICATORS`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

from tierckpt.errors import CheckpointError
from tierckpt.node import lifecycle
from tierckpt.node.host import node_id
from tierckpt.node.memory.downlog import durable_copies, owed_copies
from tierckpt.node.memory.live import REPLICATORS
from tierckpt.node.memory.replica_record import Level, ReplicaHandle, ReplicaResult
from tierckpt.node.memory.memory import MemoryTier
from tierckpt.node.memory.nodememory import NodeMemory
from tierckpt.node.memory.replica import Replicator

TIER_OFF = (
    "the node memory tier is off for this URI, so there is nothing to replicate (turn it on with "
    "TIERCKPT_MEMORY=on or the storage option memory=True)"
)
RANK_LOCAL = (
    "the save was rank-local (group='self'): replicas go to the other nodes of a process group, and this "
    "save had none (save with the job's process group to replicate)"
)
NOT_DISTRIBUTED = (
    "torch.distributed is not initialised: replicas go to the other nodes of the job's process group "
    "(call init_process_group before saving)"
)


class ReplicationError(CheckpointError):
    """A checkpoint is not (or cannot be) replicated to peer nodes; the message says why."""


def replicator_for(tier: MemoryTier | None, group: dist.ProcessGroup | str | None, group_key: Any) -> tuple[Replicator | None, str | None]:
    """The replicator of ``group`` for the memory tier ``tier`` (built on first use), or ``(None, why not)``.

    Every rank of ``group`` must call it at the same foreground point (it may run collectives on
    ``group``); ``group_key`` names the group the same way the saver's plan cache does.
    """
    if tier is None:
        return None, TIER_OFF
    if isinstance(group, str):  # "self": a rank-local save (comm.SELF)
        return None, RANK_LOCAL
    if not (dist.is_available() and dist.is_initialized()):
        return None, NOT_DISTRIBUTED
    # A default group created again (destroy_process_group, init_process_group) needs a new replicator.
    key = (group_key if group is not None else id(dist.group.WORLD), tier.config)

    def build() -> Replicator:
        memory = NodeMemory(tier.config)
        # A receiver may evict only what the chain below holds whole (the memory link's write-down log), and
        # keeps a superseded generation the chain below is still owed by this node.
        replicator = Replicator(memory, group=group, durable_below=lambda: durable_copies(memory),
                                owed_below=lambda: owed_copies(memory, node_id()))
        lifecycle.before_default_group_destroyed(_stop_before_destroy)
        return replicator

    return REPLICATORS.built_for(key, build), None


def exit_wait_s() -> float:
    """How long the exit drain may wait for replication: the longest ``exit_wait_s`` of the memory
    tier configurations of this process's busy replicators (0: none busy)."""
    return REPLICATORS.exit_wait_s()


def stop_replicators(timeout_s: float, why: str) -> list[str]:
    """Stop every replicator the saver built in this process: wait up to ``timeout_s`` in all for
    replication in flight, then end their threads (:meth:`~.replica.Replicator.close`); a later save
    builds new ones. One line per generation cut short, to print."""
    return REPLICATORS.stop(timeout_s, why)


def _stop_before_destroy() -> None:
    """``dist.destroy_process_group()`` of the default group shuts down every group, the replicators' own
    included, and a thread inside a transfer then takes the process down: stop the replicators first."""
    for line in stop_replicators(exit_wait_s(), "the default process group was destroyed"):
        sys.stderr.write(line + "\n")


class Replication:
    """The replication of one save: started after its commit, waited for by ``SaveHandle.wait("replicated")``."""

    def __init__(self, uri: str, tier: MemoryTier | None, replicator: Replicator | None, reason: str | None) -> None:
        self.uri = uri
        self._tier, self._replicator, self._reason = tier, replicator, reason
        self.handle: ReplicaHandle | None = None

    def start(self, generation: str) -> None:
        """Replicate ``generation`` (after it is committed; every rank of the group, in the same order).

        A failure to start (the node's files cannot be sealed) is recorded as the level ``memory`` with
        the reason: the save stays committed, and only ``wait("replicated")`` reports it."""
        if self._replicator is None or self._tier is None:
            return
        try:
            self.handle = self._replicator.replicate(self._tier.uri, generation)
        except (CheckpointError, OSError) as exc:
            handle = ReplicaHandle(self._tier, generation, ())
            handle._finish(ReplicaResult(
                uri=self._tier.uri, generation=generation, level=Level.MEMORY, peers=(), acknowledged=(),
                reason=f"replication could not start: {type(exc).__name__}: {exc}",
            ))
            self.handle = handle

    def wait(self, generation: str, timeout_s: float | None = None) -> ReplicaResult:
        """The level of this node's files of ``generation`` once replicated; :class:`ReplicationError`
        naming the reason when it stayed ``memory`` (or replication is not available)."""
        if self.handle is None:
            raise ReplicationError(
                f"checkpoint {self.uri!r} generation {generation} cannot reach the level 'replicated': "
                f"{self._reason or 'replication did not start'}"
            )
        try:
            result = self.handle.wait(timeout_s)
            # This node's leader also holds its peers' replicas of the generation before it says so:
            # a process that exits once every rank's wait returned cuts no peer's transfer short.
            if self._replicator is not None and self._tier is not None and not self._replicator.wait_received(
                self._tier.uri, generation, timeout_s
            ):
                raise TimeoutError(f"receiving peers' replicas of generation {generation} not finished within {timeout_s}s")
        except TimeoutError as exc:
            raise ReplicationError(f"checkpoint {self.uri!r}: {exc}; its level is still 'memory'") from None
        if result.level is not Level.REPLICATED:
            raise ReplicationError(
                f"checkpoint {self.uri!r} generation {generation} is committed in this node's memory but not "
                f"replicated: {result.reason}"
            )
        return result
