"""Node tiers below the checkpoint URI: the node memory tier and its peer replicas.

* :mod:`.config`: :class:`MemoryConfig` (``TIERCKPT_MEMORY_DIR``, ``TIERCKPT_MEMORY_BYTES``, ``TIERCKPT_MEMORY_FULL``).
* :mod:`.memory`: :class:`MemoryTier` (one URI's files in the tier, a backend) and :class:`NodeMemory` (the directory).
* :mod:`.manifest`: per-generation manifests (each file's size and CRC-32C).
* :mod:`.eviction`: the pure admission and eviction policy.
* :mod:`.peers`: the pure peer choice (node i -> nodes i+1..i+R mod N, ``TIERCKPT_REPLICAS``).
* :mod:`.replica`: the :class:`~.replica.Replicator` (copies to other nodes' tiers over gloo); :mod:`.replica_record`: the level it reports.
* :mod:`.sidegroup`: the side group, one gloo group per process and group for tier bytes between nodes
  (the replicators' transfers, :mod:`.wire`, and peer recovery's streamed loads).
* :mod:`.link`: :class:`~.link.MemoryLink`, the tier at the top of a URI's storage chain
  (:func:`tierckpt.store.open_store`); its streamed writer and status are its own; its write-down
  (:mod:`.writedown`, logged in :mod:`.downlog`) and async snapshots straight into the tier's file (:mod:`.mapped`).
"""

from tierckpt.node.memory.config import MemoryConfig, MemoryTierFullError, OnFull
from tierckpt.node.memory.eviction import Admission, TierCopy, copy_id, plan_admission
from tierckpt.node.memory.manifest import FileEntry, Manifest
from tierckpt.node.memory.memory import MemoryTier
from tierckpt.node.memory.nodememory import NodeMemory

__all__ = [
    "Admission", "FileEntry", "Manifest", "MemoryConfig", "MemoryTier", "MemoryTierFullError", "NodeMemory", "OnFull",
    "TierCopy", "copy_id", "plan_admission",
]
