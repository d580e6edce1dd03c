"""One file of the node memory tier copied to the chain below, checked against the CRC-32C its save recorded.

The write-down (:mod:`.writedown`) moves a tier file below before the ``COMMIT`` below may name it. A
tier file is plain memory: a bit flipped there after the save (a fault, a stray write) must not be
written down and committed as if it were the checkpoint. So each copy goes through the engine's one
checked copy (:func:`tierckpt.node.copy.copy_checked`: the bytes are checksummed in the one pass
that reads them, kernel-side copies where the chain below is a local file) and compares the result with what the save recorded: the
generation's manifest (sealed from the writers' stamps) or else the file's stamp (:mod:`.stamps`, the
writer's own count, which a change in place does not update). A mismatch aborts the copy before it is
published below, so the write-down of that generation stops loudly and the chain below keeps its
previous commit. The CRC computed here is handed to a writer below that takes a stated one (the node
disk cache, another tier), so no byte is checksummed twice. A file with no recorded CRC (neither sealed
nor stamped: written by an older version, or the stamp lost with a file system without user attributes
and a process gone before sealing) is copied as is.
"""

from __future__ import annotations

import mmap

from tierckpt.backends import Backend
from tierckpt.backends.file_open import open_shared
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, ChecksumMismatchError
from tierckpt.node.copy import CopySource, copy_checked, map_fd
from tierckpt.node.ledger import Tier
from tierckpt.node.memory import stamps
from tierckpt.node.memory.downlog import generation_of
from tierckpt.node.memory.manifest import FileEntry
from tierckpt.node.memory.memory import MemoryTier
from tierckpt.node.memory.pagepool import kept_pages


async def copy_down(tier: MemoryTier, below: Backend, key: str) -> None:
    """Copy ``key`` from ``tier`` to ``below`` if its bytes have the size and CRC-32C its save recorded;
    else raise :class:`ChecksumMismatchError` (nothing is published below)."""
    path = tier.path_of(key)
    try:
        recorded = _recorded(tier, key)
    except FileNotFoundError:
        raise _gone(tier, key) from None

    def mismatch(got: FileEntry) -> CheckpointError:
        return _mismatch(tier, below, key, got, recorded)

    source = CopySource(path, Tier.MEMORY, recorded, mismatch, lambda: _gone(tier, key), open_shared,
                        in_place=tier.inline_calls, mapped=kept_pages)
    await copy_checked(source, below, key)


def _recorded(tier: MemoryTier, key: str) -> FileEntry | None:
    """The size and CRC-32C the save recorded for ``key``: its generation's manifest, else its stamp."""
    generation = generation_of(key)
    sealed = tier.held(generation).get(key) if generation is not None else None
    return sealed if sealed is not None else stamps.written(tier.path_of(key))


def _mismatch(tier: MemoryTier, below: Backend, key: str, got: FileEntry, recorded: FileEntry | None) -> CheckpointError:
    assert recorded is not None
    return ChecksumMismatchError(
        f"the node memory tier's copy of {tier.uri.rstrip('/')}/{key} at {tier.path_of(key)} has {got.size} bytes with "
        f"CRC-32C {got.crc32c:#010x}, but its save recorded {recorded.size} bytes with {recorded.crc32c:#010x}: it "
        f"was corrupted in node memory after the save, so it was not written down to {below.root_uri}, which keeps "
        "its previous commit. Load that one (storage_options={'memory': False}) or a copy on a peer node, or save "
        "the checkpoint again",
        key, 0, got.size,
    )


def _gone(tier: MemoryTier, key: str) -> CheckpointError:
    return CheckpointNotFoundError(f"{tier.uri_of(key)} left the memory tier before it was written down")


def map_file(path: str) -> mmap.mmap:
    """The tier file at ``path`` mapped read-only (its pages already in memory: populated at once), under
    its shared lock (:mod:`.pagepool`), held by the mapping's own descriptor until it is closed."""
    with open(open_shared(path), "rb", buffering=0) as f:
        return map_fd(f.fileno())
