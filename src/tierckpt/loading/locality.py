"""Where a load reads each file from when the store has a node memory tier (the loader's locality step).

Each rank reports what its node's memory tier holds of the generation being loaded
(:func:`held_files`: names relative to the generation, sizes and CRC-32Cs from the tier's manifests,
only files whose size is the one the checkpoint's metadata records), beside its needs in the load's
first collective, so locality adds no collective of its own. Then every rank computes the same
:class:`LocalReads`:

* read units are planned per rank with :meth:`LocalReads.holders` (:func:`tierckpt.planner.rank_plan.local_reader`):
  a unit whose file a node holds in full is read by a rank of that node (its planned reader when that
  rank's node holds it, else a holder by the stripe rule), from its memory tier; the load's exchange
  delivers it. Block CRC-32Cs are checked in the read path as for any other read.
* small whole files a rank needs itself (the pieces table, the objects files) but its node does not
  hold — a replacement node, or ranks of another layout — are read by a rank whose node holds them
  and shared with one all-gather (:meth:`LocalReads.share`), only when some rank needs one.
* everything no node holds is read through the store's chain, as without a memory tier.

So a load works with the remote unreachable as long as the group's memory tiers hold every file it
reads, whatever the world size or layout.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c

from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.node.face import NodeTier
from tierckpt.comm import Comm
from tierckpt.errors import CheckpointError
from tierckpt.native.metadata import CheckpointMeta
from tierckpt.node.host import node_id

logger = logging.getLogger("tierckpt")


@dataclass(frozen=True, slots=True)
class HeldFile:
    """A file one node's tiers hold, with the size and CRC-32C recorded when it was written."""

    name: str
    size: int
    crc32c: int


@dataclass(frozen=True, slots=True)
class RankHoldings:
    """What one rank reports: its node, and what that node's tiers hold of the checkpoint."""

    node: str
    files: tuple[HeldFile, ...] = ()


def held_files(tier: NodeTier | None, meta: CheckpointMeta, record: layout.CommitRecord | None) -> tuple[HeldFile, ...] | None:
    """What this node's memory tier holds of ``meta``'s generation (``None``: no memory tier).

    A file counts only if it exists and its sealed size is the size the checkpoint records (the header
    for data and objects files, ``COMMIT`` for metadata documents); an unreadable manifest counts as
    holding nothing (the files are then read through the chain). Files of the generation that no manifest
    lists — the node's processes died between the commit and the seal — are sealed now (read once for
    their CRC-32C) under the origin ``<node>-recovered``, so the group can use them."""
    if tier is None:
        return None
    generation = meta.generation
    sizes = {f.key: f.size for f in meta.files}
    if record is not None:
        sizes.update({key: c.size for key, c in record.checksums})
    try:
        held = tier.held(generation)
        unsealed = [k for k in tier.keys_of(generation) if k not in held and k[len(generation) + 1:] in sizes]
        if unsealed:
            tier.seal(generation, origin=f"{node_id()}-recovered", keys=unsealed)
            held = tier.held(generation)
    except (CheckpointError, OSError) as exc:
        logger.warning("memory tier of %s: %s; reading generation %s through the store", tier.uri, exc, generation)
        return ()
    out = []
    prefix = f"{generation}/"
    for key, entry in sorted(held.items()):
        name = key[len(prefix):]
        if key.startswith(prefix) and sizes.get(name) == entry.size and _has(tier, key):
            out.append(HeldFile(name, entry.size, entry.crc32c))
    return tuple(out)


def _has(tier: NodeTier, key: str) -> bool:
    """Whether the file ``key`` is in ``tier`` now."""
    try:
        tier.file_size(key)
    except FileNotFoundError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class LocalReads:
    """What every rank's node holds, and this rank's memory tier (the same view on every rank)."""

    rank: int
    tier: NodeTier | None
    holdings: tuple[RankHoldings, ...]
    """``holdings[r]``: rank ``r``'s node and what its memory tier holds (nothing without a tier)."""
    active: bool
    """Whether any rank has a memory tier (else the load reads everything through the chain, as before)."""
    held: tuple[frozenset[str], ...]
    """``held[r]``: the files rank ``r``'s node holds whose copies agree on every node that holds them."""
    entries: dict[str, HeldFile]
    """The agreed size and CRC-32C of each file held somewhere."""

    @staticmethod
    def of(rank: int, tier: NodeTier | None, reports: Sequence[tuple[str, tuple[HeldFile, ...] | None]]) -> LocalReads:
        """From every rank's ``(node, held files or None)``."""
        holdings = tuple(RankHoldings(node, files or ()) for node, files in reports)
        versions: dict[str, set[HeldFile]] = defaultdict(set)
        for h in holdings:
            for f in h.files:
                versions[f.name].add(f)
        entries = {name: next(iter(v)) for name, v in versions.items() if len(v) == 1}
        held = tuple(frozenset(f.name for f in h.files if f.name in entries) for h in holdings)
        return LocalReads(rank, tier, holdings, any(files is not None for _, files in reports), held, entries)

    def holds(self, rank: int, name: str) -> bool:
        """Whether rank ``rank``'s node holds ``name`` (relative to the generation), in agreement with
        every other node that holds it (copies that disagree are never read)."""
        return name in self.held[rank]

    def holders(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """Each file held somewhere in agreement: the ranks whose node holds it (ascending) and its size."""
        ranks: dict[str, list[int]] = defaultdict(list)
        for rank, names in enumerate(self.held):
            for name in names:
                ranks[name].append(rank)
        return {name: (tuple(rs), self.entries[name].size) for name, rs in ranks.items()}

    def here(self, name: str) -> bool:
        """Whether this rank reads ``name`` from its own node's memory tier."""
        return self.tier is not None and self.holds(self.rank, name)

    def source(self, name: str, chain: Backend) -> Backend:
        """Where this rank reads ``name``: its memory tier when its node holds it, else the chain."""
        return self.store(self.here(name), chain)

    def store(self, here: bool, chain: Backend) -> Backend:
        """This rank's memory tier for files its node holds (``here``, :meth:`here`), else the chain."""
        return self.tier if here and self.tier is not None else chain

    def servers(self, needs: Sequence[Sequence[str]]) -> dict[str, int]:
        """For each file some rank needs (``needs[r]``) but its node does not hold, the rank that reads and
        shares it: the lowest rank of a node that holds it. Files no node holds are left to the chain."""
        out: dict[str, int] = {}
        for rank, names in enumerate(needs):
            for name in names:
                if name in out or self.holds(rank, name):
                    continue
                holder = next((r for r in range(len(self.holdings)) if self.holds(r, name)), None)
                if holder is not None:
                    out[name] = holder
        return out

    def share(self, comm: Comm, generation: str, needs: Sequence[Sequence[str]]) -> dict[str, bytes]:
        """The whole files that ranks need but their nodes lack, read from the memory tier of a node that
        holds them and all-gathered (one collective, only when some rank needs one; every rank gets the
        same answer). Each is checked against the size and CRC-32C its holder's manifest recorded."""
        servers = self.servers(needs)
        if not servers:
            return {}
        mine = sorted(name for name, rank in servers.items() if rank == self.rank)

        tier = self.tier  # a rank serves only files its node holds: it has a tier when ``mine`` is not empty

        def read() -> tuple[None, dict[str, bytes]]:
            out = {}
            for name in mine:
                assert tier is not None
                # no more than its holder's manifest records (checked below)
                out[name] = tier.read_file(layout.in_generation(generation, name), self.entries[name].size)
            return None, out

        _, gathered = comm.exchange_agreed(read, "sharing checkpoint files held in peer nodes' memory")
        shared = {name: data for part in gathered for name, data in part.items()}
        for name, data in shared.items():
            entry = self.entries[name]
            if (len(data), crc32c.crc32c(data)) != (entry.size, entry.crc32c):
                raise CheckpointError(
                    f"{name} of generation {generation}, shared from rank {servers[name]}'s memory tier, has "
                    f"{len(data)} bytes with CRC-32C {crc32c.crc32c(data):#010x}; its manifest records "
                    f"{entry.size} and {entry.crc32c:#010x}: the memory tier copy is damaged"
                )
        return shared


def rereaders(files: Sequence[str], local: LocalReads, world: int) -> list[int]:
    """The rank that re-reads each block read only in part (``files[i]``: the block's file): round robin
    over the ranks of the nodes that hold the file, else over every rank (through the chain)."""
    out = []
    turn: dict[tuple[int, ...], int] = {}
    for name in files:
        holders = tuple(r for r in range(world) if local.holds(r, name)) or tuple(range(world))
        k = turn.get(holders, 0)
        out.append(holders[k % len(holders)])
        turn[holders] = k + 1
    return out
