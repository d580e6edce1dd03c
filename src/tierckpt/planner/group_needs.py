"""Every rank's needs of a load, grouped so that a rank's plan reads one digest per tensor, not N needs.

A rank's plan (:func:`.rank_plan.plan_rank`) plans tensors laid out alike once: the same shape, dtype, saved
regions and the same region needed on every rank. Read from N lists of :class:`~.plan_types.TargetPiece`,
recognising that costs N needs per tensor on every rank (the group's N x tensors needs). Here each rank's
needs are what the needs all-gather carries (:mod:`tierckpt.loading.wire`): the positions of its tensors among
the checkpoint's sorted names, in its own order, and for each its *class*: its region's number among the
rank's distinct regions (a whole tensor is one class whatever its shape: ``None``). Classes are numbered
across the group (rank by rank), so a tensor's needs on every rank are one row of class numbers (-1 where a
rank does not need it): two tensors of one shape are needed alike on every rank exactly when their rows are
equal, compared as bytes (:meth:`GroupNeeds.digest`). The matrices are filled by a few array operations,
whatever the number of ranks; a tensor's every need is decoded only for the first tensor of a layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from tierckpt.errors import CheckpointError
from tierckpt.native.metadata import TensorMeta
from tierckpt.native.regions import Box, Region
from tierckpt.planner.plan_types import TargetPiece

ClassRegion = Region | None
"""A class's region: ``None`` for the whole tensor (a replicated parameter, of any shape)."""
WireRegion = tuple[tuple[int, ...], tuple[int, ...]] | Region | None
"""A class's region as the needs all-gather carries it: a box as ``(offsets, lengths)``."""

RankNeeds = tuple[np.ndarray, np.ndarray, list[ClassRegion]]
"""One rank's needs: positions (``int32``, in its order), each need's class among its own (``int32``) and
those classes' regions."""


def rank_needs(needs: Sequence[TargetPiece], position: Mapping[str, int], tensors: Mapping[str, TensorMeta]) -> RankNeeds:
    """One rank's needs (of tensors of ``tensors``; ``position``: each one's among their sorted names) as
    positions and classes; a region that covers its whole tensor as a box is the class ``None``."""
    classes: dict[object, int] = {}
    regions: list[ClassRegion] = []
    numbers = []
    for n in needs:
        region: ClassRegion = n.region
        if type(region) is Box and region == Box.full(tensors[n.fqn].shape):
            region = None
        key = None if region is None else ((region.offsets, region.lengths) if type(region) is Box else (region.start, region.stop))
        number = classes.get(key)
        if number is None:
            number = classes[key] = len(regions)
            regions.append(region)
        numbers.append(number)
    return (np.array([position[n.fqn] for n in needs], dtype=np.int32), np.array(numbers, dtype=np.int32), regions)


class GroupNeeds:
    """Every rank's needs of a load (module docstring), for :func:`.rank_plan.plan_rank`.

    ``names``: the checkpoint's tensor names, sorted (a need's position is its tensor's place there);
    ``pairs``: every rank's needs in rank order, each a ``(position, class among its rank's own)`` row
    (``int32``); ``counts``: each rank's number of needs; ``regions``: each rank's classes' regions, as
    regions or as the all-gather carries them (:data:`WireRegion`, decoded when read)."""

    __slots__ = ("names", "tensors", "world", "classes", "numbers", "regions", "at", "local", "bases", "firsts", "several")

    def __init__(self, names: Sequence[str], tensors: Mapping[str, TensorMeta], pairs: np.ndarray,
                 counts: Sequence[int], regions: Sequence[Sequence[ClassRegion | WireRegion]]) -> None:
        self.names = names
        self.tensors = tensors
        self.world = len(counts)
        self.regions = list(itertools.chain.from_iterable(regions))
        sizes = [len(r) for r in regions]
        self.firsts = [0, *itertools.accumulate(counts)]
        self.bases = [0, *itertools.accumulate(sizes)]
        total = len(pairs)
        self.at, self.local = pairs[:, 0], pairs[:, 1]
        local = self.local
        of = np.repeat(np.arange(self.world), counts)
        # Positions and classes read as unsigned: a negative one is out of range too.
        if total != self.firsts[-1] or total and (
                int(self.at.view(np.uint32).max()) >= len(names) or (local.view(np.uint32) >= np.take(sizes, of)).any()):
            raise CheckpointError(f"needs name tensor positions outside the checkpoint's {len(names)} tensors or "
                                  "regions a rank did not send: the needs all-gather was corrupted")
        # Tensor-major: a tensor's classes (and need numbers) on every rank are one contiguous row.
        self.classes = np.full((len(names), self.world), -1, dtype=np.int32)
        self.classes[self.at, of] = local + np.take(self.bases, of)
        self.numbers = np.full((len(names), self.world), -1, dtype=np.int32)
        numbers = np.arange(total) - np.take(self.firsts, of)
        self.numbers[self.at, of] = numbers
        # A rank may need several regions of one tensor (the planner allows it; a state never asks it): such a
        # tensor's needs are listed whole, and it is planned on its own.
        self.several: dict[int, list[tuple[int, int, int]]] = {}
        if np.count_nonzero(self.numbers >= 0) != total:
            keys, seen = np.unique(self.at.astype(np.int64) * self.world + of, return_counts=True)
            for p in sorted(set((keys[seen > 1] // self.world).tolist())):
                self.several[p] = [(int(of[i]), int(numbers[i]), int(local[i]) + self.bases[of[i]])
                                   for i in np.flatnonzero(self.at == p).tolist()]

    @classmethod
    def of(cls, needs: Sequence[Sequence[TargetPiece]], tensors: Mapping[str, TensorMeta]) -> GroupNeeds:
        """From every rank's list of needs (of tensors of ``tensors``)."""
        names = sorted(tensors)
        position = {name: i for i, name in enumerate(names)}
        ranks = [rank_needs(n, position, tensors) for n in needs]
        pairs = np.zeros((0, 2), dtype=np.int32)
        if ranks:
            pairs = np.concatenate([np.stack([p, c], axis=1) for p, c, _ in ranks]).astype(np.int32).reshape(-1, 2)
        return cls(names, tensors, pairs, [len(p) for p, _, _ in ranks], [r for _, _, r in ranks])

    def region(self, cls_number: int, position: int) -> Region:
        """The region of class ``cls_number`` of the tensor at ``position``."""
        region = self.regions[cls_number]
        if region is None:
            return Box.full(self.tensors[self.names[position]].shape)
        if type(region) is tuple:  # as sent: decoded once, for every layout that reads it
            region = self.regions[cls_number] = Box(*region)
        return region

    def positions(self, rank: int) -> np.ndarray:
        """The positions of rank ``rank``'s tensors, in its order."""
        return self.at[self.firsts[rank]:self.firsts[rank + 1]]

    def of_rank(self, rank: int) -> list[TargetPiece]:
        """Rank ``rank``'s needs, in its order."""
        base, first, end = self.bases[rank], self.firsts[rank], self.firsts[rank + 1]
        pairs = zip(self.at[first:end].tolist(), self.local[first:end].tolist())
        return [TargetPiece(fqn=self.names[p], region=self.region(base + c, p)) for p, c in pairs]

    def needed(self) -> list[int]:
        """The positions of the tensors some rank needs, ascending."""
        return np.flatnonzero((self.classes >= 0).any(axis=1)).tolist()

    def one_rank_per_tensor(self) -> bool:
        """Whether no tensor is needed by more than one rank: every slab is then read by the one rank that
        needs it, whatever the routes cost (:func:`~.routes.choose_route`)."""
        return int((self.classes >= 0).sum(axis=1).max(initial=0)) <= 1

    def digest(self, position: int) -> bytes | tuple[str, int]:
        """The classes of the tensor at ``position`` on every rank: equal for two tensors of one shape exactly
        when every rank needs the same region of both (or neither); a tensor some rank needs several regions
        of has a digest of its own."""
        if position in self.several:
            return ("several", position)
        return self.classes[position].tobytes()

    def needs_of(self, position: int) -> list[tuple[int, int, Region]]:
        """``(rank, need number, region)`` of every need of the tensor at ``position``, in rank order."""
        several = self.several.get(position)
        if several is not None:
            return [(r, number, self.region(c, position)) for r, number, c in several]
        row = self.classes[position].tolist()
        numbers = self.numbers[position].tolist()
        return [(r, numbers[r], self.region(c, position)) for r, c in enumerate(row) if c >= 0]

    def numbers_of(self, position: int) -> list[int]:
        """The need number of the tensor at ``position`` on each rank (-1 where a rank does not need it; not
        asked of a tensor a rank needs several regions of: it is planned on its own)."""
        return self.numbers[position].tolist()
