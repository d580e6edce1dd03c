"""Step 4 of a load (:mod:`tierckpt.loading.api`): the read step, run on every rank of the loading group.

Round by round, :class:`ReadStep` reads the units this rank is the reader of (straight into the target's
memory when a unit is exactly one contiguous CPU part of one target, else into a round buffer),
checks the CRC-32C of what it reads (:mod:`tierckpt.io.readcheck`), copies its own deliveries into
place, and exchanges the rest with one all-to-all per round. A unit that goes whole to one other rank
is read straight into its place in the round's send buffer (no packing copy: at tmpfs speed, the
packing copy into fresh pages cost as much as the read and the all-to-all); over gloo, a round of large
deliveries sends each as one message, received straight into its target (no copy out of a buffer).
Round *k + 1*'s reads are in flight on the I/O loop while round *k* is delivered and exchanged, so
storage and the network overlap, and at most two rounds' buffers are alive at once. With a node memory
tier, a unit whose file this rank's node holds is read from the tier
(:class:`~tierckpt.loading.locality.LocalReads`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.comm import Comm
from tierckpt.io.coalesce import GAPS_UNREAD, Taken, coalesce, read_group
from tierckpt.io.readcheck import DIGEST_RUN_BYTES, RUN_DIGEST, ReadChecker, checking_ranks
from tierckpt.io.scheduler import DEFAULT_PART_BYTES, ReadRequest, get_scheduler
from tierckpt.loading.locality import LocalReads
from tierckpt.native.metadata import itemsize
from tierckpt.monitor import Monitor
from tierckpt.loading.peer_stream import PeerStream
from tierckpt.planner import LoadPlan, ReadUnit
from tierckpt.planner.load_planner import COALESCE_GAP_BYTES, whole_to_other
from tierckpt.loading.targets import contiguous_target, deliver, direct_buffer, unit_dtype
from tierckpt.state.adapters import TensorEntry


def _digest(unit: ReadUnit, checked: bool) -> Callable[[memoryview], int] | None:
    """What a strided read of ``unit`` takes of each run: its CRC-32C as it is read when this rank checks the
    unit and its runs are short (:data:`~tierckpt.io.readcheck.DIGEST_RUN_BYTES`), else nothing."""
    return RUN_DIGEST if checked and unit.run_bytes <= DIGEST_RUN_BYTES else None


def _strided_groups(units: list[ReadUnit], strided: list[bool], digested: list[bool], max_bytes: int) -> list[list[int]]:
    """The positions of the ``strided`` units (many runs, a local file), grouped by file and by whether their
    runs' CRCs are taken (``digested``), in order, each group of at most ``max_bytes`` (a larger unit alone):
    a group is read in one call (one thread hop, one open). A column window of a resharded load reads a window
    of every saved piece of a file, 64 units per rank at 8 ranks, each a hop before."""
    groups: list[list[int]] = []
    open_group: dict[tuple[str, bool], tuple[list[int], int]] = {}
    for i, unit in enumerate(units):
        if not strided[i]:
            continue
        key = (unit.file, digested[i])
        group, nbytes = open_group.get(key, ([], max_bytes))
        if nbytes + unit.nbytes > max_bytes:
            group, nbytes = [], 0
            groups.append(group)
        group.append(i)
        open_group[key] = (group, nbytes + unit.nbytes)
    return groups


EXCHANGE_ALIGN = 16
"""Each delivery starts at a multiple of this many bytes in the exchange stream, so any dtype can view it."""


P2P_MIN_BYTES = 1 << 20
"""Deliveries between ranks at least this large may each go as one message, straight into the target."""


def _padded(nbytes: int) -> int:
    return -(-nbytes // EXCHANGE_ALIGN) * EXCHANGE_ALIGN


@dataclass
class _Round:
    """One round's units, the buffers they are read into, its send buffer, and the reads in flight."""

    indices: tuple[int, ...]
    buffers: dict[int, torch.Tensor]
    direct: set[int]
    """Units read straight into their target."""
    in_send: set[int]
    """Units read straight into their place in :attr:`send`."""
    send: torch.Tensor
    send_sizes: list[int]
    send_at: dict[tuple[int, int], int]
    """(unit, delivery) -> byte offset in :attr:`send` of each delivery to another rank."""
    landed: concurrent.futures.Future
    """Done when the round's bytes are read (its checksums may still be being checked)."""
    reads: Any
    """Done when the round's bytes are read and checked."""
    sent_in_place: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """(unit, delivery) -> the delivery's bytes where it is sent from its place in the read buffer (point to
    point, a contiguous part): not packed into :attr:`send`."""


class ReadStep:
    """Runs a :class:`LoadPlan` on one rank: reads, local copies and one all-to-all per round.

    Round *k + 1*'s reads are in flight on the I/O loop while round *k* is delivered and exchanged,
    so storage and the network overlap; at most two rounds' buffers are alive at once.
    """

    def __init__(
        self, backend: Backend, gen: str, plan: LoadPlan, targets: list[TensorEntry], comm: Comm, monitor: Monitor,
        checker: ReadChecker | None, nodes: list[str], chunk_bytes: int, local: LocalReads,
    ) -> None:
        self.backend, self.gen, self.plan, self.targets, self.comm, self.monitor = backend, gen, plan, targets, comm, monitor
        self.local = local
        self.checker = checker
        # Units that ranks of one node read alike are checked by one of them (io.readcheck).
        # A rank's own plan names them (planner.rank_plan); the group plan's units are every rank's.
        self.checks = (list(plan.checkers) or checking_ranks(plan.units, nodes)) if checker is not None else []
        self.sched = get_scheduler()
        # Neighbouring units of a file, of at most the size the load reads in one unit, become one request
        # where requests are dear (io.coalesce: across padding nobody reads, ``taken``) and one call (one
        # thread hop) for a file on this node, whose gaps are never read (see _start). A rank's own plan
        # lists the pieces of the files it reads (all its requests may read through); the group plan, its units.
        self.coalesce = not backend.capabilities.local_path
        self.coalesce_bytes = max(1, min(chunk_bytes, DEFAULT_PART_BYTES))
        runs = plan.taken if plan.taken is not None else ((u.file, u.run_offsets, u.run_bytes) for u in plan.units)
        self.taken = Taken(runs) if self.coalesce else None
        # A peer's replica streams from its tier's pages, checked by its receiver (tierckpt.loading.peer_stream).
        self.stream = PeerStream(plan, comm, local, gen, checker, monitor, nodes,
                                 lambda u, d: contiguous_target(targets[d.target], d, unit_dtype(u)),
                                 lambda u, d, data: deliver(targets[d.target], d, data.view(unit_dtype(u))))
        self.stream.checkers(self.checks)

    def run(self) -> None:
        """Read, check and deliver every round. A read that fails (a unit failing its checksum, a store
        error) does not end this rank's rounds: the other ranks wait for its part of each exchange, so it
        keeps exchanging (whatever its buffers hold: the load fails) and raises the first failure after the
        last round, and the load's agreement then fails on every rank, in time, with this rank's error."""
        rounds = list(zip(self.plan.rounds, self.plan.exchanges))
        with torch.no_grad():
            self.stream.send_all()  # on the wire while this rank reads its own units
        pending = self._start(rounds[0][0]) if rounds else None
        failure: BaseException | None = None
        for k, (_, exchange) in enumerate(rounds):
            current = pending
            failure = failure or _failure_of(current.landed)
            pending = self._start(rounds[k + 1][0]) if k + 1 < len(rounds) else None  # overlaps round k's checks
            failure = failure or _failure_of(current.reads)
            with torch.no_grad():
                self._deliver_round(current, exchange, k)
        failure = failure or self.stream.finish()
        if failure is not None:
            raise failure

    def _send_layout(self, indices: tuple[int, ...]) -> tuple[list[int], dict[tuple[int, int], int]]:
        """Bytes this rank sends each rank in a round, and where each delivery to another rank lies in
        the round's send buffer: per destination, consecutive, each padded to :data:`EXCHANGE_ALIGN`, in
        unit then delivery order (the order in which the receivers take them, see :meth:`_exchange`)."""
        me, world = self.comm.rank, self.comm.world_size
        sizes = [0] * world
        placed: list[tuple[int, int, int, int]] = []
        for i in indices:
            unit = self.plan.units[i]
            if unit.reader != me or i in self.stream:
                continue
            size = itemsize(unit_dtype(unit))
            for j, d in enumerate(unit.deliveries):
                if d.rank != me:
                    placed.append((i, j, d.rank, sizes[d.rank]))
                    sizes[d.rank] += _padded(d.numel * size)
        starts = np.cumsum([0] + sizes[:-1]).tolist()
        return sizes, {(i, j): starts[r] + at for i, j, r, at in placed}

    def _start(self, indices: tuple[int, ...]) -> _Round:
        """Allocate this rank's buffers for a round and start reading into them."""
        buffers: dict[int, torch.Tensor] = {}
        direct: set[int] = set()
        in_send: set[int] = set()
        send_sizes, send_at = self._send_layout(indices)
        send = torch.empty(sum(send_sizes), dtype=torch.uint8)
        with torch.no_grad():
            self.stream.receive(indices)
        reads: list[tuple[ReadUnit, memoryview]] = []
        checked: list[bool] = []
        for i in indices:
            unit = self.plan.units[i]
            if unit.reader != self.comm.rank or i in self.stream:
                continue
            buf = direct_buffer(unit, self.targets, self.comm.rank)
            if buf is not None:
                direct.add(i)
            elif whole_to_other(unit.reader, unit.box, unit.deliveries):
                at = send_at[(i, 0)]
                buf = send[at : at + unit.nbytes]
                in_send.add(i)
            else:
                buf = torch.empty(unit.nbytes, dtype=torch.uint8)
            buffers[i] = buf
            reads.append((unit, memoryview(buf.numpy())))
            checked.append(self.checker is not None and self.checks[i] == self.comm.rank)
            self.monitor.count("bytes_read", unit.nbytes)
            self.monitor.count("bytes_checked", unit.nbytes if checked[-1] else 0)
        # A file on this node (local disk, the node's memory tier): neighbouring units are read in one
        # call, to save thread hops; elsewhere where requests are dear (io.coalesce), in one request.
        local = [self.local.source(u.file, self.backend).capabilities.local_path for u, _ in reads]
        ranges = [(u.file, int(u.run_offsets[0]), u.nbytes) if len(u.run_offsets) == 1 else None for u, _ in reads]
        grouped = [r is not None and here for r, here in zip(ranges, local)]  # contiguous units of local files
        strided = [len(u.run_offsets) > 1 and here for (u, _), here in zip(reads, local)]  # strided units of local files
        groups = [g for g in coalesce([r if here else None for r, here in zip(ranges, grouped)],
                                      self.coalesce_bytes, self.coalesce_bytes, GAPS_UNREAD) if grouped[g[0]]]
        groups += _strided_groups([u for u, _ in reads], strided, [_digest(u, c) is not None for (u, _), c in zip(reads, checked)],
                                  self.coalesce_bytes)
        groups += [g for g in coalesce([r if self.coalesce and not here else None for r, here in zip(ranges, grouped)],
                                       self.coalesce_bytes, COALESCE_GAP_BYTES, self.taken)
                   if not grouped[g[0]] and not strided[g[0]]]
        self.monitor.count("requests", sum(
            1 if len(g) > 1 and not local[g[0]] else sum(len(reads[j][0].run_offsets) for j in g) for g in groups))
        landed: concurrent.futures.Future = concurrent.futures.Future()
        reading = self.sched.submit(self._read(reads, groups, checked, landed))
        return _Round(indices, buffers, direct, in_send, send, send_sizes, send_at, landed, reading)

    async def _read(
        self, reads: list[tuple[ReadUnit, memoryview]], groups: list[list[int]], checked: list[bool],
        landed: concurrent.futures.Future,
    ) -> None:
        """Read a round's units, each group of ``reads`` in one request or call (then set ``landed``); the
        checksums of each unit this rank checks (``checked``) are checked as soon as it lands, overlapping
        the other reads: on the I/O loop when the read took every block's CRC (a compare), else in a
        worker thread."""
        sched, checker = self.sched, self.checker

        # What each checked unit's check covers: (run offsets, run bytes, their bytes, each run's CRC-32C
        # taken as it was read, or None); a unit read whole and checked afterwards is absent.
        segments: dict[int, list[tuple[Any, int, memoryview, list[int] | None]]] = {}

        async def read(group: list[int]) -> None:
            i = group[0]
            unit, view = reads[i]
            backend = self.local.source(unit.file, self.backend)  # its node's memory tier, or the chain
            key = layout.in_generation(self.gen, unit.file)
            if len(unit.run_offsets) > 1 and backend.capabilities.local_path:  # one call for the group (_strided_groups)
                got = await backend.read_segments(
                    key, [(reads[j][0].run_offsets.tolist(), reads[j][0].run_bytes, reads[j][1]) for j in group],
                    _digest(unit, checked[i]))
                segments.update((j, [(reads[j][0].run_offsets, reads[j][0].run_bytes, reads[j][1], crcs)])
                                for j, crcs in zip(group, got))
            elif len(unit.run_offsets) > 1:
                got = await backend.read_runs(key, unit.run_offsets.tolist(), unit.run_bytes, view, _digest(unit, checked[i]))
                segments[i] = [(unit.run_offsets, unit.run_bytes, view, got)]
            elif backend.capabilities.local_path:
                segments.update(await _read_local(backend, key, group))
            else:
                await read_group(sched, backend, [
                    ReadRequest(key=key, start=int(reads[j][0].run_offsets[0]), out=reads[j][1]) for j in group
                ])

        async def _read_local(backend: Backend, key: str, group: list[int]) -> dict[int, list]:
            """Contiguous units of one local file, all in one call (:meth:`Backend.read_segments`); a unit
            this rank checks is read block by block, each block's CRC taken while it is in the CPU cache
            (:meth:`ReadChecker.block_runs`): no second pass over its bytes."""
            parts: list[tuple[int, list[int], int, memoryview]] = []
            for j in group:
                unit, view = reads[j]
                start = int(unit.run_offsets[0])
                cuts = checker.block_runs(unit.fqn, unit.file, start, unit.nbytes) if checked[j] else [(start, unit.nbytes, 1)]
                at = 0
                for first, run_bytes, count in cuts:
                    parts.append((j, [first + k * run_bytes for k in range(count)], run_bytes, view[at : at + run_bytes * count]))
                    at += run_bytes * count
            digest = RUN_DIGEST if any(checked[j] for j in group) else None
            crcs = await backend.read_segments(key, [(offsets, n, out) for _, offsets, n, out in parts], digest)
            out: dict[int, list] = {}
            for (j, offsets, n, part), got in zip(parts, crcs):
                if checked[j]:
                    out.setdefault(j, []).append((np.array(offsets, dtype=np.int64), n, part, got))
            return out

        def check_units(units: list[tuple[ReadUnit, list[tuple[Any, int, memoryview, list[int] | None]]]]) -> None:
            for unit, parts in units:
                for offsets, run_bytes, data, crcs in parts:
                    checker.add(checker.check(unit.fqn, unit.file, offsets, run_bytes, data, crcs))

        async def check(group: list[int], task: asyncio.Future) -> None:
            """Check the units of ``group`` this rank checks, once the group is read: on the I/O loop those whose
            read took every block's CRC (a compare, cheaper than a thread hop), the rest in one worker thread
            (folding many runs' CRCs or checksumming the bytes)."""
            await task
            inline, threaded = [], []
            for i in group:
                if checked[i]:
                    unit, view = reads[i]
                    parts = segments.get(i, [(unit.run_offsets, unit.run_bytes, view, None)])
                    contiguous = len(unit.run_offsets) == 1 and all(crcs is not None for *_, crcs in parts)
                    (inline if contiguous else threaded).append((unit, parts))
            check_units(inline)
            if threaded:
                await asyncio.to_thread(check_units, threaded)

        tasks = [asyncio.ensure_future(read(g)) for g in groups]
        checks = [asyncio.ensure_future(check(g, t)) for g, t in zip(groups, tasks) if any(checked[i] for i in g)]
        try:
            await asyncio.gather(*tasks)
        except BaseException as exc:
            landed.set_exception(exc)
            for c in checks:
                c.cancel()
            await asyncio.gather(*tasks, *checks, return_exceptions=True)
            raise
        landed.set_result(None)
        failed = [r for r in await asyncio.gather(*checks, return_exceptions=True) if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    def _deliver_round(self, rnd: _Round, exchange: bool, k: int) -> None:
        """Deliver the round's units this rank read: its own parts into its targets, the others' packed into
        the send buffer, or, point to point, sent from where they were read when they are contiguous there
        (a replicated unit, a row range: the reader copies nothing for them); then the exchange."""
        me = self.comm.rank
        units = [(i, self.plan.units[i]) for i in rnd.indices if i not in self.stream]  # streamed: peer_stream
        point_to_point = exchange and self._point_to_point(units, k)
        for i, unit in units:
            if unit.reader != me or i in rnd.direct or i in rnd.in_send:
                continue
            source = rnd.buffers.pop(i).view(unit_dtype(unit)).view(unit.box.lengths)
            for j, d in enumerate(unit.deliveries):
                part = source[d.box.relative_to(unit.box).slices()]
                if d.rank == me:
                    deliver(self.targets[d.target], d, part)
                elif point_to_point and part.is_contiguous():
                    rnd.sent_in_place[(i, j)] = part.reshape(-1).view(torch.uint8)
                    self.monitor.count("bytes_sent_in_place", part.nbytes)
                else:
                    at, nbytes = rnd.send_at[(i, j)], d.numel * part.element_size()
                    rnd.send[at : at + nbytes].view(part.dtype).view(d.box.lengths).copy_(part)
                    self.monitor.count("bytes_packed", nbytes)
        rnd.buffers.clear()
        if exchange:
            self._exchange(units, rnd, point_to_point)

    def _exchange(self, units: list[tuple[int, ReadUnit]], rnd: _Round, point_to_point: bool) -> None:
        me = self.comm.rank
        recv_sizes = [0] * self.comm.world_size
        incoming = []
        for _, unit in units:
            if unit.reader == me:
                continue
            for d in unit.deliveries:
                if d.rank == me:
                    nbytes = d.numel * itemsize(unit_dtype(unit))
                    recv_sizes[unit.reader] += _padded(nbytes)
                    incoming.append((unit, d, nbytes))
        self.monitor.count("bytes_exchanged", sum(recv_sizes))
        if point_to_point:
            self._exchange_into_targets(units, rnd, incoming)
            return
        received = self.comm.all_to_all_bytes(rnd.send, rnd.send_sizes, recv_sizes)
        cursors = [0] * self.comm.world_size
        for unit, d, nbytes in incoming:
            at = cursors[unit.reader]
            cursors[unit.reader] += _padded(nbytes)
            deliver(self.targets[d.target], d, received[unit.reader][at : at + nbytes].view(unit_dtype(unit)))

    def _point_to_point(self, units: list[tuple[int, ReadUnit]], k: int) -> bool:
        """Whether a round's deliveries between ranks go as one message each, straight into their targets,
        instead of one all-to-all into a buffer copied out afterwards: over gloo (CPU), when every one is at
        least :data:`P2P_MIN_BYTES` (a message each costs little beside its bytes). Decided from the
        plan alone, so every rank decides alike."""
        if self.comm.backend != "gloo":
            return False
        if self.plan.point_to_point:  # a rank's own plan: the group agreed on round k (planner.rank_plan)
            return self.plan.point_to_point[k]
        return all(
            d.numel * itemsize(unit_dtype(unit)) >= P2P_MIN_BYTES
            for _, unit in units for d in unit.deliveries if d.rank != unit.reader
        )

    def _exchange_into_targets(self, units: list[tuple[int, ReadUnit]], rnd: _Round, incoming: list) -> None:
        """Each delivery between ranks as one message, in unit then delivery order on both sides (so
        the messages of each pair of ranks match in order): sent from its place in the send buffer,
        received straight into its target when that is one contiguous CPU part of the same dtype (else
        into a buffer, then copied)."""
        me = self.comm.rank
        def sent(i: int, j: int, unit: ReadUnit, d: Any) -> torch.Tensor:
            in_place = rnd.sent_in_place.get((i, j))
            if in_place is not None:
                return in_place
            return rnd.send[rnd.send_at[(i, j)] : rnd.send_at[(i, j)] + d.numel * itemsize(unit_dtype(unit))]

        sends = [(d.rank, sent(i, j, unit, d))
                 for i, unit in units if unit.reader == me for j, d in enumerate(unit.deliveries) if d.rank != me]
        recvs, copies = [], []
        for unit, d, nbytes in incoming:
            into = contiguous_target(self.targets[d.target], d, unit_dtype(unit))
            if into is None:
                into = torch.empty(nbytes, dtype=torch.uint8)
                copies.append((d, into, unit))
            recvs.append((unit.reader, into))
        self.comm.send_recv(sends, recvs)
        for d, buf, unit in copies:
            deliver(self.targets[d.target], d, buf.view(unit_dtype(unit)))
        self.monitor.count("bytes_received_in_place", sum(b.numel() for _, b in recvs) - sum(b.numel() for _, b, _ in copies))


def _failure_of(done: concurrent.futures.Future) -> Exception | None:
    """Wait for ``done``; the exception it ended with (``None`` if none). Anything beyond an ``Exception``
    (an interrupt) is raised at once."""
    try:
        done.result()
    except Exception as exc:  # noqa: BLE001 - raised after the last round, then agreed by the group
        return exc
    return None
