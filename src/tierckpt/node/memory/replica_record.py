"""The durability level of a generation on this node's side, as the replicator records it.

``memory``: committed in this node's memory tier; ``replicated``: and acknowledged, CRC-checked, by
every peer node that holds this node's replicas (``local``, node disk, and ``remote`` are reported
beside them by the memory link's status, :meth:`.link.MemoryLink.status`). The node's leader records each generation's final
:class:`ReplicaResult` in the tier (``levels/<generation>.json``) before waking its waiters, so the
node's other ranks, and a restart, read the same level; :class:`ReplicaHandle` waits for it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass

from tierckpt.backends.bounded import MAX_TIER_RECORD_BYTES, read_capped
from tierckpt.node.levels import Level
from tierckpt.node.memory.memory import MemoryTier, write_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaResult:
    """The level of one generation of one URI for this node's files."""

    uri: str
    generation: str
    level: Level
    peers: tuple[str, ...]
    """The nodes that should hold this node's replicas."""
    acknowledged: tuple[str, ...]
    reason: str | None = None
    """Why the level is not ``replicated`` (``None`` when it is)."""

    def encode(self) -> bytes:
        return json.dumps({
            "uri": self.uri, "generation": self.generation, "level": self.level.value, "peers": list(self.peers),
            "acknowledged": list(self.acknowledged), "reason": self.reason,
        }).encode()

    @staticmethod
    def decode(data: bytes) -> ReplicaResult:
        doc = json.loads(data)
        return ReplicaResult(
            uri=doc["uri"], generation=doc["generation"], level=Level(doc["level"]), peers=tuple(doc["peers"]),
            acknowledged=tuple(doc["acknowledged"]), reason=doc["reason"],
        )


def level_path(tier: MemoryTier, generation: str) -> str:
    """Where the leader records the level of ``generation`` in the tier."""
    return os.path.join(tier.home, "levels", f"{generation}.json")


def recorded_level(tier: MemoryTier, generation: str) -> ReplicaResult | None:
    """The level recorded for ``generation`` in this node's tier (``None``: none yet)."""
    try:
        return ReplicaResult.decode(read_capped(level_path(tier, generation), MAX_TIER_RECORD_BYTES))
    except FileNotFoundError:
        return None


class ReplicaHandle:
    """The replication of one generation: :meth:`wait` for its final level, :meth:`status` for the level now."""

    def __init__(self, tier: MemoryTier, generation: str, peers: tuple[str, ...]) -> None:
        self._tier, self._generation, self._peers = tier, generation, peers
        self._done = threading.Event()
        self._finishing = threading.Lock()
        self._result: ReplicaResult | None = None

    def _finish(self, result: ReplicaResult) -> bool:
        """Record the level in the tier, then wake the waiters (so a process that exits as soon as its
        wait returns has recorded it for the node's other ranks and for a restart). The first result
        is final: a transfer that ends after its replication was reported cut short changes nothing.
        Whether this call recorded ``result``."""
        with self._finishing:
            if self._done.is_set():
                return False
            try:
                write_atomic(level_path(self._tier, self._generation), result.encode())
            except OSError as exc:  # the node's other ranks then see no level and report "in progress"
                log.warning("cannot record the level of %s %s: %s", self._tier.uri, self._generation, exc)
            self._result = result
            self._done.set()
            return True

    def finished(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` until this process recorded the final level; whether it did."""
        return self._done.wait(timeout_s)

    def _poll(self) -> ReplicaResult | None:
        if self._result is None:
            self._result = recorded_level(self._tier, self._generation)
        return self._result

    def status(self) -> ReplicaResult:
        """The final result once known, else ``memory`` with "in progress"."""
        return self._poll() or ReplicaResult(
            uri=self._tier.uri, generation=self._generation, level=Level.MEMORY, peers=self._peers,
            acknowledged=(), reason="replication in progress",
        )

    def wait(self, timeout_s: float | None = None) -> ReplicaResult:
        """The final result; :class:`TimeoutError` naming the checkpoint if it is not known within ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(
                    f"replication of {self._tier.uri} generation {self._generation} not finished within {timeout_s}s"
                )
            self._done.wait(0.05 if left is None else min(0.05, left))
        return self._result  # type: ignore[return-value]
