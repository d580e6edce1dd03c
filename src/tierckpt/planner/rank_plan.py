"""Per-rank load planning: each rank plans only the units it reads or receives from.

:func:`~.load_planner.plan_load` computes the whole group's plan on every rank: at N ranks resharding
rows to columns, N^2 (saved box, target) pairs each. Here rank ``r`` plans what concerns it, in two steps
around one collective the loader already makes (:mod:`tierckpt.loading.generation`):

1. :func:`plan_rank` visits only the saved boxes its own targets meet (:class:`~.box_index.BoxIndex`),
   finds the other ranks that need each of them (an index of every rank's target boxes: its exchange
   partners), and cuts and routes each box exactly as the group plan does (:mod:`.slab_units`, same
   inputs in the same order, so the same slabs, routes, units and deliveries). Whatever a rank computes
   about a unit is a function of that unit's saved box and the needs that meet it, so every rank that
   keeps the unit computes the same:

   * **reader** (:func:`stripe_reader`): among the ranks that need nearly the most of it
     (:data:`~.load_order.READER_SHARE`), the one at position ``(file number + offset // chunk_bytes)``
     modulo their count. Units of one file within one ``chunk_bytes`` stripe share a reader (its
     neighbouring units coalesce into one request), successive stripes and files rotate over the
     candidates. A direct unit's reader is the one rank it delivers to, as before.
   * **checker**: ranks of one node that read the same runs directly share the checksum work by the
     same stripe rule (the group plan's :func:`tierckpt.io.readcheck.checking_ranks` balances by load).

   It returns a :class:`RankDraft`: the kept units in the group's order (by :data:`UnitKey`: file, first
   byte, ...) and a small :class:`RoundShare` to all-gather: the bytes its buffers hold (read, sent and
   received) in runs of consecutive keys of at most ``round_bytes / 8`` each, and the keys of the units it reads that deliver to other
   ranks (and of those with a delivery under the point-to-point minimum): a few per unit.
2. :func:`agree_rounds`, with every rank's share: the group plan's greedy over the merged runs, in key
   order, a new round starting at a run when some rank's bytes in the round would pass ``round_bytes``
   (units of one key stay in one round; a run a round's start cuts through counts whole in both), so each
   rank's usage in a round stays under ``round_bytes`` unless a round holds one oversized key of it, and no round is cut where no rank needs it (the union of
   each rank's own cuts, used before, split a load into up to N times the group plan's rounds, each a
   synchronising exchange); a round exchanges when a rank reads a unit in it that delivers elsewhere, and
   goes point to point unless a rank sends a small delivery in it. Every rank evaluates the same function
   of the same gathered shares: the same rounds, exchanges and messages.

Tensors laid out alike (shape, dtype, saved regions and every rank's regions: a model's layers) are
recognised by one digest of every rank's needs (:class:`~.group_needs.GroupNeeds`, as the needs all-gather
carries them: no rank's need is read per tensor) and their pieces' regions, planned once per rank and
moved to each one's files, offsets and target numbers (those of the piece each saved box lies in, and of
the need at the same place); a unit a rank only receives from keeps only its
deliveries to that rank (all the read step reads of it). Its ``taken`` covers the pieces of the files it
reads: its own coalesced requests read through no gap another read needs, and it lists nothing else.

Costs: a rank's work is, per layout, the saved boxes it touches times the ranks that need each (its
partners), plus the stored boxes of the group's targets and the saved boxes of the layout's first tensor
(linear; a flat range split into boxes only where it can meet this rank's targets; indexed only where its
queries would cost more scanned: :class:`~.box_index.BoxIndex`); per
tensor, its needs' digest, its pieces' regions compared with its layout's (in C, by identity where the
pieces table's decoding shared equal regions: linear in the pieces, a few nanoseconds each) and moving the
units it keeps; once, numbering the checkpoint's files and listing the pieces of the files it reads
(linear in the pieces). Each byte is read once per group on exchanged units (one reader each) and the
group's routes, coalescing and memory bound hold.
Pure and deterministic like the group planner.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tierckpt.errors import CheckpointError
from tierckpt.native.metadata import PieceMeta, TensorMeta, itemsize
from tierckpt.native.regions import Box, Region, StoredBox, stored_boxes
from tierckpt.planner.box_index import BoxIndex
from tierckpt.planner.group_needs import GroupNeeds
from tierckpt.planner.load_order import READER_SHARE
from tierckpt.planner.plan_types import Delivery, LoadPlan, ReadUnit, TargetPiece, whole_to_other
from tierckpt.planner.routes import Topology, topology_for
from tierckpt.planner.slab_units import Need, Saved, check_covered, flat_span, saved_box_units, saved_boxes

UnitKey = tuple[str, int, str, tuple[int, ...], tuple[int, ...]]
"""A unit's place in the group's order: file, first byte, tensor, box offsets and lengths. Every rank
that holds a unit gives it the same key; a reader's and a receiver's units between them sort alike."""


@dataclass(frozen=True, slots=True)
class RoundShare:
    """What one rank all-gathers so that every rank forms the same rounds."""

    usage: tuple[tuple[UnitKey, UnitKey, int], ...]
    """The bytes its buffers hold for its units, in runs of consecutive keys (:data:`SEGMENTS`): each run's
    first and last key and its bytes, in key order."""
    round_bytes: int
    """The bound it was asked for (the group takes the smallest)."""
    crossing: tuple[UnitKey, ...]
    """Keys of the units it reads that deliver to another rank."""
    small: tuple[UnitKey, ...]
    """Keys of the units it reads with a delivery to another rank under the point-to-point minimum."""


@dataclass(frozen=True, slots=True)
class RankDraft:
    """One rank's units before the rounds are agreed (:func:`plan_rank`)."""

    rank: int
    world_size: int
    drafts: tuple[dict, ...]
    """Unit fields (reader set, no round), in key order."""
    keys: tuple[UnitKey, ...]
    checkers: tuple[int, ...]
    share: RoundShare
    taken: tuple[tuple[str, np.ndarray, int], ...]

    def reads(self) -> list[tuple[str, np.ndarray, int]]:
        """``(file, run offsets, run bytes)`` of each unit this rank reads."""
        return [(d["file"], d["run_offsets"], d["run_bytes"]) for d in self.drafts if d["reader"] == self.rank]


def key_of(draft: dict) -> UnitKey:
    offsets = draft["run_offsets"]
    return (draft["file"], int(offsets[0]) if len(offsets) else 0, draft["fqn"], draft["box"].offsets, draft["box"].lengths)


def stripe_reader(candidates: Sequence[int], file_number: int, offset: int, chunk_bytes: int) -> int:
    """The rank of ``candidates`` (ascending) that reads or checks a unit at byte ``offset`` of file number ``file_number``."""
    return candidates[(file_number + offset // max(chunk_bytes, 1)) % len(candidates)]


def local_reader(planned: int, holders: tuple[Sequence[int], int] | None, file_number: int, offset: int, end: int,
                 chunk_bytes: int) -> int:
    """The reader of a unit of a file the nodes' memory tiers may hold (``holders``: the ranks of the holding
    nodes, ascending, and the file's size): its ``planned`` reader when that rank's node holds a copy that
    covers the unit (no exchange is added) or none does (it is read through the chain), else a holder by the
    stripe rule. Each unit keeps one reader: each byte is still read once per group."""
    if holders is None:
        return planned
    ranks, size = holders
    if not ranks or size < end or planned in ranks:
        return planned
    return stripe_reader(ranks, file_number, offset, chunk_bytes)


def _end(draft: dict) -> int:
    """The end of a unit's last run in its file."""
    offsets = draft["run_offsets"]
    return int(offsets.max()) + draft["run_bytes"] if len(offsets) else 0


def plan_rank(
    tensors: dict[str, TensorMeta],
    pieces: dict[str, list[PieceMeta]],
    needs: GroupNeeds | Sequence[Sequence[TargetPiece]],
    rank: int,
    *,
    chunk_bytes: int,
    round_bytes: int,
    p2p_min_bytes: int,
    topology: Topology | None = None,
    held: Mapping[str, tuple[Sequence[int], int]] | None = None,
) -> RankDraft:
    """Rank ``rank``'s units of a load (step 1 of the module docstring). ``needs``: every rank's needs, as a
    load decodes them from its all-gather (:class:`~.group_needs.GroupNeeds`) or as lists (``needs[r]``: rank
    ``r``'s, grouped here).

    ``held``: the files the nodes' memory tiers hold, each with the ranks of its holding nodes (ascending)
    and its size: a unit of such a file is read by a holder (:func:`local_reader`)."""
    group = needs if isinstance(needs, GroupNeeds) else GroupNeeds.of(needs, tensors)
    world = group.world
    topo = topology_for(topology, world)
    held = held or {}
    here = frozenset(f for f, (ranks, _) in held.items() if rank in ranks)  # files this rank's node holds
    names = group.names
    # Its own tensors, and those it may read for others from its node's memory tier.
    mine = set(group.positions(rank).tolist())
    if here:
        mine.update(p for p in group.needed() if any(x.file in here for x in pieces.get(names[p], ())))
    files = {f: i for i, f in enumerate(sorted({p.file for plist in pieces.values() for p in plist}))}

    kept: list[dict] = []
    checkers: list[int] = []
    # Tensors laid out alike (the same shape, dtype, saved regions and every rank's regions: a model's
    # layers) have the same units up to their files, offsets and target numbers: planned once, reused. A
    # layout is found by its shape, dtype and every rank's needs (one digest), then its saved regions (equal
    # lists: the same objects where the pieces table's decoding shared them, compared in C).
    layouts: dict[tuple, list[tuple[list[Region], list[PieceMeta], list[int], list[Entry]]]] = {}
    for position in sorted(mine):
        fqn = names[position]
        meta = tensors[fqn]
        plist = pieces.get(fqn, [])
        regions = [p.region for p in plist]
        alike = layouts.setdefault((meta.shape, meta.dtype, group.digest(position),
                                    tuple(p.file in here for p in plist) if here else ()), [])
        known = next((k for k in alike if k[0] == regions), None)
        moved = known is not None  # the planned tensor's units, moved to this one's files, offsets and target numbers
        if known is None:
            wanted = [(r, index, sb) for r, index, region in group.needs_of(position)
                      for sb in stored_boxes(region, meta.shape)]
            near = [flat_span(t[2].box, meta.shape) for t in wanted if t[0] == rank]
            saved, piece_of = saved_boxes(meta, plist, near, here)
            lookup = BoxIndex([s[0] for s in saved], queries=sum(t[0] == rank for t in wanted))
            entries = _entries(meta, saved, lookup, wanted, rank, chunk_bytes, topo, here)
            known = (regions, plist, piece_of, entries)
            alike.append(known)
        _, first, piece_of, entries = known
        numbers = group.numbers_of(position) if moved else []
        for si, d, eligible, same, receives in entries:
            piece = plist[piece_of[si]]
            shift = piece.byte_offset - first[piece_of[si]].byte_offset
            offsets = d["run_offsets"]
            start = (int(offsets[0]) if len(offsets) else 0) + shift
            file = piece.file
            number = files[file]
            planned = stripe_reader(eligible, number, start, chunk_bytes)
            reader = planned if file not in held else local_reader(planned, held[file], number, start, _end(d) + shift,
                                                                   chunk_bytes)
            if reader != rank and not receives:
                continue
            # A unit this rank only receives from keeps only its deliveries here (all the read step uses).
            deliveries = d["deliveries"] if reader == rank else tuple(d["deliveries"][k] for k in receives)
            if moved:
                deliveries = tuple(Delivery(rank=x.rank, target=numbers[x.rank], target_box=x.target_box, box=x.box)
                                   for x in deliveries)
            kept.append({**d, "fqn": fqn, "file": file, "run_offsets": offsets + shift if shift else offsets,
                         "reader": reader, "deliveries": deliveries})
            shared = reader == rank == planned and len(same) > 1  # a unit moved to a holder is exchanged
            checkers.append(stripe_reader(same, number, start, chunk_bytes) if shared else reader)

    unsorted = [key_of(d) for d in kept]
    order = sorted(range(len(kept)), key=unsorted.__getitem__)
    kept = [kept[i] for i in order]
    keys = tuple(unsorted[i] for i in order)
    share = _share(kept, keys, rank, round_bytes, p2p_min_bytes)
    return RankDraft(rank=rank, world_size=world, drafts=tuple(kept), keys=keys,
                     checkers=tuple(checkers[i] for i in order), share=share, taken=_taken(kept, rank, pieces))


def _taken(kept: list[dict], rank: int, pieces: dict[str, list[PieceMeta]]) -> tuple[tuple[str, np.ndarray, int], ...]:
    """The pieces of the files ``rank`` reads, by file and length: all a coalesced read of its own may
    read through must avoid (a gap of a file is free where no piece lies; other files it never reads)."""
    reads = {d["file"] for d in kept if d["reader"] == rank}
    if not reads:
        return ()
    starts: dict[tuple[str, int], list[int]] = defaultdict(list)
    for plist in pieces.values():
        for p in plist:
            if p.file in reads:
                starts[(p.file, p.byte_length)].append(p.byte_offset)
    return tuple((file, np.array(offsets, dtype=np.int64), nbytes) for (file, nbytes), offsets in starts.items())


Entry = tuple[int, dict, list[int], list[int], list[int]]
"""A unit ``rank`` may read or receives from: its saved box's number, its draft (reader not set), the
ranks that may read it (:data:`~.load_order.READER_SHARE`), the ranks of this node that read the
same box directly (they share its checks) and the positions of its deliveries to ``rank``."""


def _entries(meta: TensorMeta, saved: list[Saved], lookup: BoxIndex, wanted: list[tuple[int, int, StoredBox]],
             rank: int, chunk_bytes: int, topo: Topology, held_here: frozenset[str]) -> list[Entry]:
    """The units of the saved boxes ``rank``'s targets meet, and of those in files its node's memory tier holds
    (``held_here``: it may read them for others), routed with every rank that needs them."""
    local = [file in held_here for _, file, _ in saved]
    touched: set[int] = {si for si, held in enumerate(local) if held}
    for r, _, target in wanted:
        if r != rank:
            continue
        covered = 0
        for si, inter in lookup.overlapping(target.box):
            touched.add(si)
            covered += inter.numel
        check_covered(meta, rank, target, covered)
    partners = BoxIndex([t[2].box for t in wanted], queries=len(touched))
    entries: list[Entry] = []
    for si in sorted(touched):
        box_needs: list[Need] = [(wanted[ti][0], wanted[ti][1], wanted[ti][2], inter)
                                 for ti, inter in partners.overlapping(saved[si][0])]
        if not box_needs:
            continue
        # Held here, a unit another rank would read for itself may be read here for it: keep every unit's runs.
        drafts = saved_box_units(meta, saved[si], box_needs, chunk_bytes, topo, only=None if local[si] else rank)
        alike: dict[Box, list[int]] = defaultdict(list)  # direct units of this node reading the same box
        for d in drafts:
            if len({x.rank for x in d["deliveries"]}) == 1 and topo.nodes[d["deliveries"][0].rank] == topo.nodes[rank]:
                alike[d["box"]].append(d["deliveries"][0].rank)
        for d in drafts:
            if d["run_offsets"] is None:  # another rank reads it for itself (slab_units.saved_box_units)
                continue
            wanted_of: dict[int, int] = defaultdict(int)
            for x in d["deliveries"]:
                wanted_of[x.rank] += x.numel
            most = max(wanted_of.values())
            eligible = sorted(r for r, n in wanted_of.items() if n >= READER_SHARE * most)
            here = [k for k, x in enumerate(d["deliveries"]) if x.rank == rank]
            if rank in eligible or here or local[si]:
                same = sorted(set(alike[d["box"]])) if len(wanted_of) == 1 else []
                entries.append((si, d, eligible, same, here))
    return entries


def _usage(d: dict, rank: int) -> int:
    """Bytes ``rank`` holds for unit ``d`` in its round: read, sent and received (as the group plan counts)."""
    item = d["item"]
    out = 0
    if d["reader"] == rank:
        if not whole_to_other(rank, d["box"], d["deliveries"]):
            out += d["box"].numel * item
        out += sum(x.numel for x in d["deliveries"] if x.rank != rank) * item
    else:
        out += sum(x.numel for x in d["deliveries"] if x.rank == rank) * item
    return out


SEGMENTS = 8
"""A rank shares its bytes per key in runs of consecutive keys of at most ``round_bytes / SEGMENTS`` each (a
key larger than that alone): a few entries per round's worth of its bytes, whatever its number of units."""


def _share(kept: list[dict], keys: tuple[UnitKey, ...], rank: int, round_bytes: int, p2p_min_bytes: int) -> RoundShare:
    usage: list[tuple[UnitKey, UnitKey, int]] = []
    run = round_bytes // SEGMENTS
    for i, (key, d) in enumerate(zip(keys, kept)):
        add = _usage(d, rank)
        same_key = i > 0 and keys[i - 1] == key  # units of one key stay in one round
        if usage and (same_key or usage[-1][2] + add <= run):
            usage[-1] = (usage[-1][0], key, usage[-1][2] + add)
        else:
            usage.append((key, key, add))
    read = [(k, d) for k, d in zip(keys, kept) if d["reader"] == rank]
    crossing = tuple(k for k, d in read if any(x.rank != rank for x in d["deliveries"]))
    small = tuple(k for k, d in read if any(x.rank != rank and x.numel * d["item"] < p2p_min_bytes for x in d["deliveries"]))
    return RoundShare(usage=tuple(usage), round_bytes=round_bytes, crossing=crossing, small=small)


def _cuts(shares: Sequence[RoundShare]) -> list[UnitKey]:
    """The keys where rounds start after the first: the group plan's greedy over every rank's runs of keys, in
    key order. A run that a round's start cuts through is counted whole in the new round too (its part there
    is not known), so every rank's bytes in a round stay under ``round_bytes`` unless it is one oversized key."""
    limit = min(s.round_bytes for s in shares)
    cuts: list[UnitKey] = []
    held: dict[int, int] = {}  # bytes of each rank in the current round
    last: dict[int, tuple[UnitKey, int]] = {}  # each rank's latest run: its last key and bytes
    # Every rank's runs in key order: one sort in C (each rank's already sorted), not a merge generator's N-way heap.
    merged = sorted([(first, rank, end, nbytes) for rank, s in enumerate(shares) for first, end, nbytes in s.usage])
    for key, events in itertools.groupby(merged, key=lambda e: e[0]):
        adds = [(rank, end, nbytes) for _, rank, end, nbytes in events]
        if held and any(held.get(rank, 0) + nbytes > limit for rank, _, nbytes in adds):
            cuts.append(key)
            held = {rank: nbytes for rank, (end, nbytes) in last.items() if end >= key}
        for rank, end, nbytes in adds:
            held[rank] = held.get(rank, 0) + nbytes
            last[rank] = (end, nbytes)
    return cuts


def agree_rounds(draft: RankDraft, shares: Sequence[RoundShare], tensors: dict[str, TensorMeta]) -> LoadPlan:
    """Rank ``draft.rank``'s :class:`LoadPlan` from every rank's share (step 2 of the module docstring)."""
    if len(shares) != draft.world_size:
        raise CheckpointError(f"{len(shares)} round shares for a load of {draft.world_size} ranks")
    cuts = _cuts(shares)
    count = len(cuts) + 1
    exchanges = [False] * count
    small = [False] * count
    for flags, attr in ((exchanges, "crossing"), (small, "small")):
        for s in shares:
            for key in getattr(s, attr):
                flags[bisect.bisect_right(cuts, key)] = True
    units: list[ReadUnit] = []
    rounds: list[list[int]] = [[] for _ in range(count)]
    bytes_read = bytes_delivered = 0
    for d, key in zip(draft.drafts, draft.keys):
        k = bisect.bisect_right(cuts, key)
        rounds[k].append(len(units))
        units.append(ReadUnit(fqn=d["fqn"], dtype=d["dtype"], box=d["box"], file=d["file"],
                              run_offsets=d["run_offsets"], run_bytes=d["run_bytes"], reader=d["reader"],
                              deliveries=d["deliveries"], round=k))
        if d["reader"] == draft.rank:
            bytes_read += units[-1].nbytes
            bytes_delivered += sum(x.numel for x in d["deliveries"]) * itemsize(tensors[d["fqn"]].torch_dtype)
    return LoadPlan(
        units=tuple(units), rounds=tuple(tuple(r) for r in rounds), exchanges=tuple(exchanges),
        world_size=draft.world_size, rank=draft.rank, bytes_read=bytes_read, bytes_delivered=bytes_delivered,
        point_to_point=tuple(e and not s for e, s in zip(exchanges, small)),
        checkers=draft.checkers, taken=draft.taken,
    )
