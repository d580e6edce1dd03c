"""Deletes through the memory link: from the tier now, from the chain below once no pending ``COMMIT``
write-down can still name what is deleted there (:func:`delete_from`).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from tierckpt.native.layout import is_generation
from tierckpt.node.memory.downlog import generation_of
from tierckpt.node.memory.linkview import LinkView
from tierckpt.node.memory.roots import empty_tier
from tierckpt.node.memory.writedown import WriteDown, drop_tier


class Deleting(LinkView, Protocol):
    """A memory link with its write-down (deletes stop it first) and its key memory."""

    writedown: WriteDown

    def forget_prefix(self, what: str, *, exact: bool = False) -> None:
        """Forget what the link remembers of the key ``what`` (``exact``) or of the keys under it."""


async def delete_from(link: Deleting, what: str, *, exact: bool) -> None:
    """Drop ``what`` (a key, or a prefix) from the tier now and from the chain below once no pending
    ``COMMIT`` write-down can still name it there."""
    await link.writedown.cancel(what, exact=exact)
    generation = generation_of(what) or (what.rstrip("/") if is_generation(what.rstrip("/")) else None)
    whole = not exact and generation is not None and generation == what.rstrip("/")
    tier_only = whole and await asyncio.to_thread(_newest_is_memory_only, link)
    if exact:
        await link.memory_tier.delete(what)
        link.forget_prefix(what, exact=True)
    else:
        if whole:
            # A whole generation (the sweep's superseded one): evicted, its unread pages to the pool.
            await asyncio.to_thread(link.memory.retire, link.memory_tier, generation)
        else:
            await link.memory_tier.delete_prefix(what)
            if generation:
                await asyncio.to_thread(link.memory_tier.evict, generation)
        link.forget_prefix(what)
        if generation:
            await asyncio.to_thread(link.down.forget, generation)
        for gen in link.memory_tier.generations() if not what else []:
            await asyncio.to_thread(link.memory_tier.evict, gen)
            await asyncio.to_thread(link.down.forget, gen)
    if not exact:
        await _delete_nested(link, what)
    if tier_only:
        return  # the chain below still serves its own newest commit, whichever generation that is
    await link.writedown.after_commits(
        (lambda: link.below.delete(what)) if exact else (lambda: link.below.delete_prefix(what)),
        superseded=generation if whole else None,
    )


def _newest_is_memory_only(link: LinkView) -> bool:
    """Whether the tier's ``COMMIT`` names a generation saved with ``persist=False``: the chain below
    then still holds an older commit, and a superseded generation (the sweep's) is dropped from the
    tier only — deleting it below could take the files of the commit the chain below names."""
    record = link.memory_tier.committed()
    return record is not None and link.down.state(record.generation).memory_only


async def _delete_nested(link: LinkView, prefix: str) -> None:
    """Drop from the node's tier every URI rooted under ``prefix`` of this one (a root deleting a
    step: the step's own tier), stopping this process's write-downs of them first."""
    base = f"{link.memory_tier.uri.rstrip('/')}/{prefix}"
    for tier in await asyncio.to_thread(link.memory.tiers):
        if tier.uri == link.memory_tier.uri or not f"{tier.uri}/".startswith(base):
            continue
        await drop_tier(tier.home)
        await asyncio.to_thread(empty_tier, tier)

