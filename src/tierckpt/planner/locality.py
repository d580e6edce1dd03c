"""Locality-aware loads: each read unit goes to a rank whose node tiers hold its file. Pure.

After :func:`~.load_planner.plan_load` has chosen the units of a load and a reader for each (the
rank that needs most of it, as if every file were remote), the ranks all-gather what their node
tiers hold of the checkpoint (:class:`RankHoldings`: names, sizes, CRC-32Cs, e.g. from the memory
tier's manifests). :func:`assign_local_readers` then picks each unit's reader:

1. A copy of a file counts only if it covers the unit's bytes (its size reaches the unit's end) and
   every node that holds the file agrees on its size and CRC-32C; files whose copies disagree are
   reported in ``conflicts`` and read from the remote, never from a copy that may be wrong.
2. A unit whose planned reader's node holds the file keeps that reader (no exchange is added).
3. Other units whose file some node holds go, largest first, to the least-loaded rank (in bytes
   read, counting what it already reads) of a holding node; ties go to the lowest rank.
4. A unit that no node holds keeps its planned reader: it is read from the remote as before.

Every unit keeps exactly one reader, so each byte is still read once per group; only who reads it
changes, and the load's exchange delivers it. :func:`relocate` applies the readers to a
:class:`~.load_planner.LoadPlan` and recomputes its memory-bounded rounds.

File names are those of the read units (relative to the generation, ``data/rank-00000.bin``): the
caller strips the generation from the tier's keys.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import CheckpointError
from .load_order import assign_rounds
from .plan_types import LoadPlan


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


@dataclass(frozen=True, slots=True)
class UnitSpan:
    """A read unit as locality sees it: bytes ``[start, end)`` of ``file``, and its planned reader."""

    file: str
    start: int
    end: int
    reader: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Locality:
    """The readers :func:`assign_local_readers` chose."""

    readers: tuple[int, ...]
    """The reader of each unit, in unit order."""
    local: tuple[bool, ...]
    """Whether each unit is read from its reader's node tiers (else from the remote)."""
    conflicts: tuple[str, ...]
    """Files whose copies on different nodes (or ranks) disagree: read from the remote."""
    bytes_per_rank: tuple[int, ...]
    """Bytes each rank reads, from its node's tiers and from the remote."""
    bytes_local: int
    """Bytes read from node tiers (the rest come from the remote)."""


def spans_of(plan: LoadPlan) -> list[UnitSpan]:
    """The units of ``plan`` as byte spans of their files (first run's start to last run's end)."""
    return [
        UnitSpan(u.file, int(u.run_offsets.min()), int(u.run_offsets.max()) + u.run_bytes, u.reader)
        if len(u.run_offsets) else UnitSpan(u.file, 0, 0, u.reader)
        for u in plan.units
    ]


def _agreed_copies(holdings: Sequence[RankHoldings]) -> tuple[dict[str, int], dict[str, set[str]], set[str]]:
    """``(size of each agreed file, nodes holding it, conflicting names)``."""
    versions: dict[str, set[tuple[int, int]]] = defaultdict(set)
    nodes: dict[str, set[str]] = defaultdict(set)
    for rank in holdings:
        for f in rank.files:
            versions[f.name].add((f.size, f.crc32c))
            nodes[f.name].add(rank.node)
    conflicts = {name for name, v in versions.items() if len(v) > 1}
    sizes = {name: next(iter(v))[0] for name, v in versions.items() if name not in conflicts}
    return sizes, nodes, conflicts


def assign_local_readers(units: Sequence[UnitSpan], holdings: Sequence[RankHoldings]) -> Locality:
    """Pick each unit's reader by where its bytes are (see the module docstring). ``holdings[r]``
    is what rank ``r`` of the loading group reported; every rank computes the same answer."""
    world = len(holdings)
    for i, u in enumerate(units):
        if not 0 <= u.reader < world:
            raise CheckpointError(f"read unit {i} of {u.file} names reader {u.reader}, outside the {world} loading ranks")
    sizes, nodes_of, conflicts = _agreed_copies(holdings)
    ranks_on: dict[str, list[int]] = defaultdict(list)
    for rank, h in enumerate(holdings):
        ranks_on[h.node].append(rank)

    def candidates(u: UnitSpan) -> list[int]:
        if sizes.get(u.file, -1) < u.end:
            return []
        return sorted(r for node in nodes_of[u.file] for r in ranks_on[node])

    readers = [u.reader for u in units]
    local = [False] * len(units)
    load = [0] * world
    moving = []
    for i, u in enumerate(units):
        holders = candidates(u)
        if holders and u.reader not in holders:
            moving.append((i, holders))
            continue
        local[i] = bool(holders)
        load[u.reader] += u.nbytes
    for i, holders in sorted(moving, key=lambda m: (-units[m[0]].nbytes, m[0])):
        reader = min(holders, key=lambda r: (load[r], r))
        readers[i], local[i] = reader, True
        load[reader] += units[i].nbytes
    return Locality(
        readers=tuple(readers), local=tuple(local), conflicts=tuple(sorted(conflicts)), bytes_per_rank=tuple(load),
        bytes_local=sum(u.nbytes for u, is_local in zip(units, local) if is_local),
    )


def relocate(plan: LoadPlan, readers: Sequence[int], round_bytes: int) -> LoadPlan:
    """``plan`` with each unit read by ``readers[i]``: same units and deliveries, rounds recomputed
    under ``round_bytes`` (a moved reader adds exchange traffic to the rounds it is in)."""
    if len(readers) != len(plan.units):
        raise CheckpointError(f"{len(readers)} readers for the {len(plan.units)} units of the load plan")
    drafts = [
        dict(
            fqn=u.fqn, dtype=u.dtype, box=u.box, file=u.file, run_offsets=u.run_offsets, run_bytes=u.run_bytes,
            reader=reader, deliveries=u.deliveries, item=u.nbytes // u.box.numel if u.box.numel else 1,
        )
        for u, reader in zip(plan.units, readers)
    ]
    units, rounds, exchanges = assign_rounds(drafts, plan.world_size, round_bytes)
    per_rank = [0] * plan.world_size
    for u in units:
        per_rank[u.reader] += u.nbytes
    return LoadPlan(
        units=units, rounds=rounds, exchanges=exchanges, world_size=plan.world_size, bytes_read=sum(per_rank),
        bytes_delivered=plan.bytes_delivered, bytes_read_per_rank=tuple(per_rank),
    )
