"""The load plan's data: what a rank needs (:class:`TargetPiece`), what a read unit delivers to whom
(:class:`Delivery`), the units (:class:`ReadUnit`) and the plan (:class:`LoadPlan`) that
:func:`~.load_planner.plan_load` returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tierckpt.native.regions import Box, Region, StoredBox
from tierckpt.planner.routes import DIRECT, EXCHANGE, NODE, Route


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetPiece:
    """What one rank needs of tensor ``fqn``: the region its local tensor holds."""

    fqn: str
    region: Region


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """Elements ``box`` of a unit go to ``rank``'s target number ``target``."""

    rank: int
    target: int
    target_box: StoredBox
    """The target's stored box that receives them (global coordinates, offset in local storage)."""
    box: Box

    @property
    def numel(self) -> int:
        return self.box.numel


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ReadUnit:
    """A box of one saved piece, read by one rank into a packed row-major buffer."""

    fqn: str
    dtype: str
    box: Box
    file: str
    run_offsets: np.ndarray
    """Byte offset in ``file`` of each contiguous run, in order."""
    run_bytes: int
    reader: int
    deliveries: tuple[Delivery, ...]
    round: int

    @property
    def nbytes(self) -> int:
        return len(self.run_offsets) * self.run_bytes

    @property
    def route(self) -> Route:
        """``exchange`` when some of its elements go to another rank, else ``direct``."""
        return EXCHANGE if any(d.rank != self.reader for d in self.deliveries) else DIRECT

    def route_in(self, nodes: Sequence[str]) -> Route:
        """:attr:`route`, with ``node`` for a unit delivering to other ranks of its reader's node only,
        on a group of several nodes (``nodes``: each rank's node). For many units, :func:`route_finder`."""
        return route_finder(nodes)(self)


def route_finder(nodes: Sequence[str]) -> Callable[[ReadUnit], Route]:
    """:meth:`ReadUnit.route_in` for the units of one group (``nodes``: each rank's node), the nodes looked
    at once: a load's plan has a unit per tensor or chunk, up to hundreds of thousands."""
    if len(set(nodes)) <= 1:
        return lambda unit: unit.route

    def route_of(unit: ReadUnit) -> Route:
        route = unit.route
        if route == EXCHANGE and all(nodes[d.rank] == nodes[unit.reader] for d in unit.deliveries):
            return NODE
        return route

    return route_of


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadPlan:
    """The units a load reads, in rounds. :func:`~.load_planner.plan_load` gives the whole group's (every
    unit of every rank); :func:`~.rank_plan.agree_rounds` one rank's (``rank`` set): the units it reads or
    receives from, the same rounds, exchange and message decisions on every rank."""

    units: tuple[ReadUnit, ...]
    rounds: tuple[tuple[int, ...], ...]
    """Unit indices of each round, in plan order."""
    exchanges: tuple[bool, ...]
    """Whether a round moves bytes between ranks (else its all-to-all is skipped)."""
    world_size: int
    bytes_read: int
    bytes_delivered: int
    """Bytes that reach targets, summed over ranks (replicated needs count once per rank)."""
    bytes_read_per_rank: tuple[int, ...] = field(default=())
    rank: int | None = None
    """The rank whose units this plan holds (``None``: every rank's); ``bytes_read`` and
    ``bytes_delivered`` then count that rank's reads and what they deliver."""
    point_to_point: tuple[bool, ...] = ()
    """Per round, whether its deliveries between ranks go as one message each (agreed by the group);
    empty: the read step decides from the round's units, which then must be every rank's."""
    checkers: tuple[int, ...] = ()
    """The rank that checks each unit's checksums (empty: :func:`tierckpt.io.readcheck.checking_ranks`
    of the units, which then must be every rank's)."""
    taken: tuple[tuple[str, np.ndarray, int], ...] | None = None
    """``(file, run offsets, run bytes)`` covering every byte any rank may read of each file this plan's
    rank reads (``None``: the units', which then must be every rank's): a coalesced request reads
    through a gap only where none lies."""

    @property
    def requests(self) -> int:
        return sum(len(u.run_offsets) for u in self.units)

    def bytes_by_route(self, nodes: Sequence[str] = ()) -> dict[Route, int]:
        """Bytes read by the units of each route (by :attr:`rank`'s units, in a rank's plan); with ``nodes``
        (each rank's node), units shared within their reader's node count as ``node``."""
        out: dict[Route, int] = {DIRECT: 0, NODE: 0, EXCHANGE: 0}
        route_of = route_finder(nodes)
        for u in self.units:
            if self.rank is None or u.reader == self.rank:
                out[route_of(u)] += u.nbytes
        return out


def whole_to_other(reader: int, box: Box, deliveries: Sequence[Delivery]) -> bool:
    """Whether a unit goes, as read, whole to one rank other than its reader: the read step then reads it
    straight into its place in the round's send buffer, so the reader holds its bytes once, not twice."""
    return len(deliveries) == 1 and deliveries[0].rank != reader and deliveries[0].box == box

