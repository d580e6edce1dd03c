"""Taking back a commit of the node memory tier that was not written down (a synchronous save whose
write-down failed raises, so the generation it committed must be loadable nowhere, this node included).

The write-downs of the generation stop; the chain below takes back its part (the node disk cache drops
what it holds of the generation and its pending ``COMMIT``: :meth:`tierckpt.node.disk.durable.DurableMixin.withdraw`);
then the tier's ``COMMIT`` is the save's base again when the tier holds that generation (a checkpoint
saved with ``persist=False`` stays committed in memory), else it goes, and the generation's files,
manifests and write-down log leave the tier. Nothing is taken back when the ``COMMIT`` reached the chain
below after all: the save succeeded.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from tierckpt.errors import CheckpointError
from tierckpt.native.layout import COMMIT, CommitRecord
from tierckpt.node.durability import revocable_of
from tierckpt.node.memory.downlog import generation_of
from tierckpt.node.memory.linkview import LinkView
from tierckpt.node.memory.writedown import WriteDown


class Withdrawing(LinkView, Protocol):
    """A memory link with its write-down (what a withdrawal stops)."""

    writedown: WriteDown


async def withdraw(link: Withdrawing, generation: str, record: bytes, base: bytes | None) -> list[str] | None:
    """See the module docstring: why the write-down failed, or ``None`` when ``record`` reached the chain below."""
    name = generation.rstrip("/").rpartition("/")[2]
    failures = [f"{link.uri_of(key)}: {why}" for key, (why, _) in sorted(link.writedown.failures.items())
                if generation_of(key) == name or key == COMMIT]
    await link.writedown.cancel(f"{name}/", exact=False)  # its files' and its COMMIT's write-downs
    below = revocable_of(link.below)  # a write-back chain below (the node disk cache)
    if below is not None:
        below_failures = await below.withdraw(generation, record, base)
        if below_failures is None:
            return None
        failures += below_failures
    else:
        try:
            if await link.below.get(COMMIT) == record:
                return None
        except CheckpointError:
            pass
    await asyncio.to_thread(_drop_from_tier, link, name, record, base)
    return failures


async def drop_uncommitted(link: Withdrawing, generation: str) -> None:
    """A save of ``generation`` failed on its committing rank (which withdraws the commit on its own node):
    on every other node the generation's write-downs stop and its files leave the tier, unless the tier's
    ``COMMIT`` names it (then it was committed after all: nothing is dropped). The chain below is left to
    the committing rank."""
    name = generation.rstrip("/").rpartition("/")[2]
    record = await asyncio.to_thread(link.memory_tier.committed)
    if record is not None and record.generation == name:
        return
    await link.writedown.cancel(f"{name}/", exact=False)
    await asyncio.to_thread(link.memory_tier.evict, name)
    await asyncio.to_thread(link.down.forget, name)
    link.forget_keys(name)


def _drop_from_tier(link: LinkView, name: str, record: bytes, base: bytes | None) -> None:
    tier = link.memory_tier
    previous = CommitRecord.decode(base).generation if base is not None else None
    if previous is not None and previous != name and tier.keys_of(previous):
        tier.commit_in_thread(COMMIT, base, record)  # type: ignore[arg-type]  # back to the save's base
    tier.evict(name)  # COMMIT first when it still names the generation
    link.down.forget(name)
    link.forget_keys(name)
