"""Where a URI's files live in the node memory tier, what is committed under a root, and COMMIT records.

Pure helpers of the memory link (:mod:`.link`) and of the commands that list or drop tiers.
"""

from __future__ import annotations

import os

from tierckpt.errors import CorruptCheckpointError
from tierckpt.native.layout import COMMIT, CommitRecord
from tierckpt.node.memory.downlog import DownLog
from tierckpt.node.memory.memory import MemoryTier
from tierckpt.node.memory.nodememory import NodeMemory


def tier_uri(uri: str) -> str:
    """The URI a memory tier is kept under: plain paths made absolute (a restart from another working
    directory finds the same tier), others as given."""
    return os.path.abspath(uri) if "://" not in uri else uri.rstrip("/")


def committed_under(memory: NodeMemory, root: str) -> dict[str, list[str]]:
    """Checkpoints under ``root`` committed in the node memory tier: path relative to ``root`` -> its keys
    in the tier (``COMMIT`` and the committed generation's files), for listings that must see a
    checkpoint the chain below does not hold yet (or cannot be reached)."""
    prefix = tier_uri(root).rstrip("/") + "/"
    out: dict[str, list[str]] = {}
    for tier in memory.tiers():
        if not tier.uri.startswith(prefix):
            continue
        record = tier.committed()
        if record is not None:
            out[tier.uri[len(prefix):]] = [COMMIT, *tier.keys_of(record.generation)]
    return out


def empty_tier(tier: MemoryTier) -> None:
    """Every generation of ``tier`` evicted (COMMIT first) and its write-down logs dropped."""
    try:
        os.unlink(tier.path_of(COMMIT))
    except FileNotFoundError:
        pass
    log_of = DownLog(tier)
    for generation in tier.generations():
        tier.evict(generation)
        log_of.forget(generation)


def record_of(data: bytes) -> CommitRecord | None:
    try:
        return CommitRecord.decode(data)
    except CorruptCheckpointError:
        return None


def commit_seq(data: bytes) -> int:
    record = record_of(data)
    return -1 if record is None else record.seq
