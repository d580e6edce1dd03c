"""What the memory link's helpers see of it: :class:`LinkView`, a protocol (so they never import the link).

The write-down (:mod:`.writedown`), the status (:mod:`.linkstatus`), the mapped snapshot files
(:mod:`.mapped`), the streamed writer (:mod:`.linkwriter`) and the exit drain (:mod:`.downdrain`) each take
the :class:`~.link.MemoryLink` they serve as a ``LinkView``; the link imports them, never the reverse.
"""

from __future__ import annotations

from typing import Protocol

from tierckpt.backends.base import Backend
from tierckpt.node.memory.downlog import DownLog
from tierckpt.node.memory.memory import MemoryTier
from tierckpt.node.memory.nodememory import NodeMemory


class LinkView(Protocol):
    """The state and the few calls of a memory link that its helpers use."""

    below: Backend
    """The chain below the tier (node disk cache + remote, or the URI's scheduled backend)."""
    memory: NodeMemory
    """The node's whole memory tier directory."""
    memory_tier: MemoryTier
    """This URI's files in the node memory tier."""
    down: DownLog
    """The tier's write-down journal."""
    origin: str
    """This node (the manifests' origin)."""
    memory_only: set[str]
    """Generations this process saves with ``persist=False``."""
    fallback: dict[str, str]
    """Generations written to the chain below because the tier was full -> why."""
    spare_wanted: dict[str, int]
    """Keys of async saves that found no spare -> the size of the spare to make once they are written."""

    def uri_of(self, key: str) -> str:
        """The full URI of ``key`` (for messages)."""

    async def seal(self, generation: str) -> None:
        """Record the manifest of the node's files of ``generation``."""

    def wrote(self, key: str) -> None:
        """``key`` is complete in the tier: remember it and start its write-down."""

    async def admit(self, generation: str, nbytes: int) -> bool:
        """Make room for ``nbytes`` more of ``generation``; ``False``: it falls back to the chain below."""

    def fall_back(self, generation: str, what: str, exc: BaseException) -> bool:
        """The tier's file system refused ``what``: whether the generation goes below from now on."""

    def forget_keys(self, generation: str) -> None:
        """Forget what this link remembers of ``generation``'s keys (it left the tier)."""
