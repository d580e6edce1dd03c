"""Peer recovery, streamed: units that a node's memory tier holds for a rank of another node go from the
tier file's pages to the wire in chunks, and the receiving rank checks each chunk's CRC-32Cs as it lands.

After a node loss, the ranks of a node holding the lost node's replica read its units for the
replacement ranks (:mod:`tierckpt.loading.locality`). Read like any other unit, each was first copied from
tmpfs into a freshly allocated send buffer (its CRC-32C taken on the way), and went on the wire only
after its round's reads, the holder's own units among them. Here the reader maps the file instead
(read-only and shared: the tier's own pages, no copy) and posts every such unit's chunks at the start of
the read step, so they travel while it reads its own units; gloo moves a chunk once the receiver posted
its receive. The receiver posts its receives round by round, one round ahead like the reads, straight
into the targets (a buffer only where a target is not one contiguous CPU part), and a thread of its own
checks each chunk as soon as it arrived: a chunk ends at a block edge, so its blocks are checked whole,
end to end (what the peer's tier held and what crossed the wire alike). A mismatch raises
:class:`~tierckpt.errors.ChecksumMismatchError` naming the file, the bytes and the peer (rank and node)
whose tier they came from, after the step's other transfers finished (every rank leaves the read step).

Which units stream (:func:`streamed_units`) follows from the plan and the group's holdings alone, so
every rank picks the same ones and posts their messages in the same order (the plan's rounds, then unit
order, then chunk order). The chunks travel on several connections per pair (:mod:`tierckpt.loading.peer_lanes`:
a pair's ``j``-th chunk on lane ``j mod lanes``), or, where the lanes cannot be made, on the load's group
under a tag of their own (:data:`STREAM_TAG`) beside the round exchanges.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from tierckpt.native import layout
from tierckpt.backends.file_open import open_shared
from tierckpt.comm import Comm
from tierckpt.errors import ChecksumMismatchError, CollectiveError, StorageError
from tierckpt.io.readcheck import ReadChecker
from tierckpt.loading.locality import LocalReads
from tierckpt.monitor import Monitor
from tierckpt.loading.peer_lanes import Lanes, Posted, lanes_of
from tierckpt.planner import LoadPlan, ReadUnit
from tierckpt.planner.load_planner import whole_to_other

STREAM_TAG = 0x5EED
"""The point-to-point tag of streamed chunks (the round exchanges use the default tag)."""
STREAM_MIN_BYTES = 1 << 20
"""Units at least this large stream (a message each costs little beside its bytes); smaller ones are
read and exchanged with their round."""
STREAM_CHUNK_BYTES = 32 << 20
"""About this many bytes per message: whole blocks, so the receiver checks each chunk on its own. Fewer, larger
messages moved faster: over four lanes (:mod:`tierckpt.loading.peer_lanes`) 256 MiB took 40 ms in 32 MiB chunks and
63 ms in 8 MiB ones on a 16-core VM (`benchmarks/bench_wire.py`)."""

Receive = tuple[int, ReadUnit, list[tuple[Posted, torch.Tensor, int]], torch.Tensor | None]
"""``(unit index, unit, [(work, bytes it fills, file offset)], target to copy the bytes into or None)``."""


def streamed_units(plan: LoadPlan, local: LocalReads, backend: str) -> dict[int, int]:
    """Unit index -> receiving rank of each unit that streams: over gloo, one contiguous run of at least
    :data:`STREAM_MIN_BYTES`, read from its reader's node memory tier, going whole to one other rank.
    Pure: every rank computes the same answer."""
    if backend != "gloo" or not local.active:
        return {}
    return {
        i: u.deliveries[0].rank for i, u in enumerate(plan.units)
        if len(u.run_offsets) == 1 and u.nbytes >= STREAM_MIN_BYTES and local.holds(u.reader, u.file)
        and whole_to_other(u.reader, u.box, u.deliveries)
    }


def chunks(unit: ReadUnit, checker: ReadChecker | None) -> list[tuple[int, int]]:
    """``(file offset, bytes)`` of each message of ``unit``: cut at the piece's block edges (whole blocks,
    about :data:`STREAM_CHUNK_BYTES` each) when the load checks CRC-32Cs, else every
    :data:`STREAM_CHUNK_BYTES`. Both sides compute the same cuts."""
    start = int(unit.run_offsets[0])
    if checker is None:
        return [(at, min(STREAM_CHUNK_BYTES, start + unit.nbytes - at)) for at in range(start, start + unit.nbytes, STREAM_CHUNK_BYTES)]
    out = []
    for first, run_bytes, count in checker.block_runs(unit.fqn, unit.file, start, unit.nbytes):
        per = max(1, STREAM_CHUNK_BYTES // run_bytes)
        for k in range(0, count, per):
            out.append((first + k * run_bytes, run_bytes * min(per, count - k)))
    return out


class PeerStream:
    """The streamed units of one rank's read step (see the module docstring).

    ``target(unit, delivery)``: the contiguous bytes of a delivery's target, or ``None``;
    ``deliver(unit, delivery, data)``: copies received bytes into a target that is not."""

    def __init__(
        self, plan: LoadPlan, comm: Comm, local: LocalReads, gen: str, checker: ReadChecker | None, monitor: Monitor,
        nodes: list[str], target: Callable[[ReadUnit, Any], torch.Tensor | None],
        deliver: Callable[[ReadUnit, Any, torch.Tensor], None],
    ) -> None:
        self.plan, self.comm, self.local, self.gen, self.checker, self.monitor = plan, comm, local, gen, checker, monitor
        self.nodes, self._target, self._deliver = nodes, target, deliver
        self.receivers = streamed_units(plan, local, comm.backend)
        self.lanes = lanes_of(comm, STREAM_TAG) if self.receivers else Lanes(comm, None, 1, STREAM_TAG)
        if self.receivers:
            monitor.count("stream_lanes", self.lanes.count)
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        self._sends: list[Posted] = []
        self._inbox: queue.Queue[Receive | None] = queue.Queue()
        self._checking: threading.Thread | None = None
        self._error: BaseException | None = None
        self._unsent: BaseException | None = None
        """Why a file this rank streams could not be read (its chunks went as zeros)."""

    def __contains__(self, index: int) -> bool:
        return index in self.receivers

    def checkers(self, checks: list[int]) -> None:
        """Each streamed unit is checked by the rank that receives it (``checks``: the read step's list)."""
        for i, receiver in self.receivers.items():
            checks[i] = receiver

    def send_all(self) -> None:
        """Post every chunk this rank streams, in the plan's round order, from its tier file's mapping.

        A file that cannot be mapped still sends its chunks (zeros: the receiver waits for every one of them),
        and :meth:`finish` returns its error, so the group's agreement raises it on every rank in time."""
        me = self.comm.rank
        for indices in self.plan.rounds:
            for i in indices:
                unit = self.plan.units[i]
                if i not in self.receivers or unit.reader != me:
                    continue
                pages = self._pages_of(unit)
                for at, nbytes in chunks(unit, self.checker):
                    data = pages[at: at + nbytes] if pages is not None else torch.zeros(nbytes, dtype=torch.uint8)
                    self._sends.append(self.lanes.send(data, self.receivers[i]))
                self.monitor.count("bytes_read", unit.nbytes)
                self.monitor.count("bytes_streamed", unit.nbytes)

    def _pages_of(self, unit: ReadUnit) -> torch.Tensor | None:
        """The mapped bytes of ``unit``'s file, or ``None`` (its error kept for :meth:`finish`)."""
        try:
            return self._mapped(unit.file)
        except (OSError, ValueError) as exc:  # ValueError: mmap of an empty (truncated) file
            self._unsent = self._unsent or StorageError(
                f"streaming {unit.file!r} to rank {unit.deliveries[0].rank} "
                f"in peer recovery: this node's memory tier copy could not be read ({exc}); load again with the "
                "remote reachable, or from another node that holds a replica"
            )
            return None

    def _mapped(self, file: str) -> torch.Tensor:
        """The bytes of ``file`` in this node's tier, mapped read-only (its shared lock held until
        :meth:`finish`, so the page pool never reuses it under a send)."""
        if file not in self._maps:
            assert self.local.tier is not None
            fd = open_shared(self.local.tier.path_of(layout.in_generation(self.gen, file)))
            try:
                pages = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)  # the mapping keeps the file; the lock is the open file description's
            with warnings.catch_warnings():  # read-only pages, never written through: handed to the wire
                warnings.simplefilter("ignore", UserWarning)
                self._maps[file] = (pages, torch.frombuffer(pages, dtype=torch.uint8))
        return self._maps[file][1]

    def receive(self, indices: Iterable[int]) -> None:
        """Post the receives of one round's units streamed to this rank, each chunk straight into its target."""
        me = self.comm.rank
        for i in indices:
            unit = self.plan.units[i]
            if self.receivers.get(i) != me:
                continue
            d = unit.deliveries[0]
            into = self._target(unit, d)
            copy = None
            if into is None:
                into = copy = torch.empty(unit.nbytes, dtype=torch.uint8)
            start, posted = int(unit.run_offsets[0]), []
            for at, nbytes in chunks(unit, self.checker):
                view = into[at - start: at - start + nbytes]
                posted.append((self.lanes.recv(view, unit.reader), view, at))
            self.monitor.count("bytes_exchanged", unit.nbytes)
            self.monitor.count("bytes_received_in_place", 0 if copy is not None else unit.nbytes)
            self.monitor.count("bytes_checked", unit.nbytes if self.checker is not None else 0)
            if self._checking is None:
                self._checking = threading.Thread(target=self._check_loop, name="tierckpt-peer-stream", daemon=True)
                self._checking.start()
            self._inbox.put((i, unit, posted, copy))

    def _check_loop(self) -> None:
        """Wait for each received chunk in order and check its blocks; after an error, only drain."""
        with torch.no_grad():
            while (item := self._inbox.get()) is not None:
                i, unit, posted, copy = item
                for work, view, at in posted:
                    try:
                        work.wait()
                        if self._error is None and self.checker is not None:
                            self.checker.add(self.checker.check(
                                unit.fqn, unit.file, np.array([at], dtype=np.int64), view.numel(), memoryview(view.numpy())))
                    except ChecksumMismatchError as exc:
                        self._error = self._error or self._from_peer(unit, exc)
                    except BaseException as exc:  # noqa: BLE001 - raised by finish(), in the read step's thread
                        self._error = self._error or exc
                if copy is not None and self._error is None:
                    self._deliver(unit, unit.deliveries[0], copy)

    def _from_peer(self, unit: ReadUnit, exc: ChecksumMismatchError) -> ChecksumMismatchError:
        """``exc`` naming the peer whose memory tier sent the bytes."""
        return ChecksumMismatchError(
            f"{exc} [streamed in peer recovery from rank {unit.reader} (node {self.nodes[unit.reader]!r}), "
            f"read from its node memory tier's copy of {unit.file!r}: that copy or the transfer is damaged]",
            exc.key, exc.start, exc.end,
        )

    def finish(self) -> BaseException | None:
        """Wait for every chunk sent and received and every check; unmap the files. The first error of a
        receive or a check (raised by the caller once the step's other transfers are done), or ``None``."""
        error: BaseException | None = None
        for work in self._sends:
            try:
                work.wait()
            except RuntimeError as exc:
                error = error or CollectiveError(f"streaming a peer's replica from rank {self.comm.rank} failed: {exc}")
        self._sends.clear()
        if self._checking is not None:
            self._inbox.put(None)
            self._checking.join()
            self._checking = None
        self.lanes.close()
        mappings = [pages for pages, _ in self._maps.values()]
        self._maps.clear()  # the tensors over the pages go first, so the pages can be unmapped
        for pages in mappings:
            try:
                pages.close()
            except BufferError:
                pass  # a view is still referenced: unmapped when it goes
        if isinstance(self._error, RuntimeError) and not isinstance(self._error, ChecksumMismatchError):
            self._error = CollectiveError(f"receiving a peer's streamed replica on rank {self.comm.rank} failed: {self._error}")
        return self._unsent or self._error or error
