"""An async save's snapshot: one rank's data file copied out of the training state before the file is named.

The copy needs the rank's pieces and their offsets in its file (the plan), not the generation the file
goes into. So when a rank offers the pieces of its previous save, :mod:`tierckpt.saving.api` takes the snapshot
under that save's plan *while* the group agrees on the plan and names the generation
(:func:`tierckpt.saving.plan._agree`, in a thread of its own): training waits for the longer of the two,
not their sum. The snapshot is kept when the group agreed on the same plan, else it is released and
taken again under the new one (another rank's state changed: a second copy, once).

The bytes go into the memory that will become the file when the store has such (the node memory tier's
spare, :meth:`~tierckpt.node.face.NodeFace.take_spare`), else into the process's reusable staging
buffer. A file larger than the staging buffer is not taken whole: it streams through the buffer's halves
once named (:func:`tierckpt.saving.stream._stream_staged`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierckpt.native import layout
from tierckpt.node.face import NodeFace, Spare
from tierckpt.io.staging import FileStream, Spans, copy_whole, file_bytes, queue_whole
from tierckpt.monitor import Monitor
from tierckpt.planner import SavePlan
from tierckpt.saving.prepared import _Prepared
from tierckpt.saving.process import _PROCESS
from tierckpt.errors import CheckpointError
from tierckpt.native.regions import Box, FlatRange, Region
from tierckpt.state.adapters import FlatState, TensorEntry


OpenStream = Callable[[], FileStream | None]
"""What a staged async save hands its background finish: the call that opens this rank's data file stream
(``None``: the rank writes no file)."""


@dataclass(eq=False)
class Snapshot:
    """One rank's data file, copied whole: its bytes in :attr:`buffer`, taken under :attr:`plan`."""

    plan: SavePlan
    buffer: torch.Tensor
    spans: Spans
    spare: Spare | None
    """The memory the bytes are in when it can become the file (else the staging buffer holds them)."""
    pinned: bool
    """Copied from CUDA into pinned memory: no spare is taken or wanted."""

    def stream(self, p: _Prepared, on_written: Callable[[int], None] | None = None) -> FileStream | None:
        """Write the snapshot as this rank's data file of ``p``'s generation (``None``: the rank writes none).
        The spare becomes the file where it can; else its bytes are written and it is released after."""
        writes = self.plan.writes[p.comm.rank]
        if not writes:
            return None
        key = layout.in_generation(p.generation, writes[0].file)
        size = self.buffer.numel()
        # Without a spare, the store is told one is wanted for the next save (made once this file is written).
        writer = p.node.mapped_writer(key, size, self.spare) if not self.pinned else None
        release = self.spare.release if self.spare is not None and writer is None else None
        if writer is not None:
            p.monitor.count("snapshots_into_tier")  # the copy went straight into the tier's file
        stream = FileStream(p.backend, key, len(writes), writer=writer, on_written=on_written, release=release)
        queue_whole(stream, self.buffer, self.spans)
        p.monitor.count("bytes_staged", size)
        return stream

    def deferred(self, p: _Prepared, on_written: Callable[[int], None] | None = None) -> OpenStream:
        """:meth:`stream`, for the save's background finish to call: naming the file out of the snapshot (the
        tier's rename and truncate, the stream's set-up: about 1 ms) is then off the training thread. The
        snapshot is released if its stream cannot be opened."""

        def open_stream() -> FileStream | None:
            try:
                return self.stream(p, on_written)
            except BaseException:
                self.release()
                raise

        return open_stream

    def release(self) -> None:
        """Give the snapshot up unwritten (the group agreed on another plan, or the save failed)."""
        if self.spare is not None:
            self.spare.release()


def take_snapshot(
    flat: FlatState, plan: SavePlan, rank: int, node: NodeFace, staging_bytes: int | None, monitor: Monitor,
) -> Snapshot | None:
    """Copy this rank's pieces under ``plan`` into a spare of the store or the staging buffer; ``None`` when
    the file exceeds ``staging_bytes`` (it must stream through the buffer once named). The caller holds
    ``_PROCESS.staging_lock``."""
    pieces = rank_pieces(flat, plan, rank)
    size = file_bytes(pieces)
    pin = pinned(flat)
    spare = node.take_spare(size) if size and not pin else None
    if spare is not None:
        buffer = spare.buffer[:size]
    elif staging_bytes and staging_bytes < size:
        return None
    else:
        buffer = _PROCESS.staging.acquire(size, pin=pin)[:size]
    try:
        with monitor.phase("stage"):
            spans = copy_whole(pieces, buffer)
    except BaseException:
        if spare is not None:
            spare.release()
        raise
    return Snapshot(plan, buffer, spans, spare, pin)


def pinned(flat: FlatState) -> bool:
    """Whether a snapshot of ``flat`` copies from CUDA (then through pinned memory, never a spare)."""
    return any(e.tensor.is_cuda for e in flat.tensors.values()) and torch.cuda.is_available()


def rank_pieces(flat: FlatState, plan: SavePlan, rank: int) -> list[tuple[int, int, torch.Tensor]]:
    """``(index, byte_offset, tensor)`` of every piece ``rank`` writes under ``plan``, in file order."""
    return [(i, w.byte_offset, _piece_tensor(flat.tensors[w.fqn], w.region)) for i, w in enumerate(plan.writes[rank])]


def _piece_tensor(entry: TensorEntry, region: Region) -> torch.Tensor:
    """The part of an entry's local tensor that holds ``region``."""
    if isinstance(region, FlatRange) and isinstance(entry.region, FlatRange):
        return entry.tensor.reshape(-1)[region.start - entry.region.start : region.stop - entry.region.start]
    if isinstance(region, Box) and isinstance(entry.region, Box):
        return entry.tensor[region.relative_to(entry.region).slices()]
    raise CheckpointError(f"piece of {entry.fqn!r}: a {type(region).__name__} cannot be cut from a {type(entry.region).__name__}")
