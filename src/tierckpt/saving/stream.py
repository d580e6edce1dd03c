"""A save's data step, on every rank: stream the pieces it was assigned into its data file, write its objects.

A synchronous save streams straight from tensor memory (:func:`_stream_direct`); an asynchronous one
copies through the reusable staging buffer, or straight into the node memory tier's file, and returns
once every byte is copied (:func:`_stream_staged`). :func:`_finish_rank` then waits for the file,
writes the objects file and returns the rank's piece, object and file records.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping
from typing import Any

import crc32c
import torch

from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.io.scheduler import get_scheduler
from tierckpt.io.staging import Chunk, FileStream, stream_through_halves
from tierckpt.native.metadata import FileMeta, ObjectMeta, PieceMeta
from tierckpt.saving.prepared import _Prepared
from tierckpt.saving.process import _PROCESS
from tierckpt.saving.snapshot import OpenStream, pinned, rank_pieces, take_snapshot


def _on_written(p: _Prepared) -> Any:
    """What a file stream tells the bytes it wrote: the save's progress bar, if it has one."""
    return p.monitor.progress.add if p.monitor.progress is not None else None


def _open_stream(p: _Prepared) -> FileStream | None:
    writes = p.plan.writes[p.comm.rank]
    if not writes:
        return None
    return FileStream(p.backend, layout.in_generation(p.generation, writes[0].file), len(writes), on_written=_on_written(p))


def _stream_direct(p: _Prepared) -> FileStream | None:
    """Synchronous path: stream pieces straight from tensor memory (no snapshot copy)."""
    stream = _open_stream(p)
    if stream is None:
        return None
    with stream.abort_on_error():
        position = 0
        for index, offset, tensor in rank_pieces(p.flat, p.plan, p.comm.rank):
            if offset > position:
                stream.put(Chunk(memoryview(bytes(offset - position))))
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            stream.put(Chunk(memoryview(data.numpy()), [(index, 0, data.numel())]))
            position = offset + data.numel()
    return stream


def _stream_staged(p: _Prepared, staging_bytes: int | None) -> OpenStream:
    """Asynchronous path: take the snapshot whole (:mod:`tierckpt.saving.snapshot`; its file is named by the
    background finish) — or, when the file exceeds ``staging_bytes``, copy it through the staging buffer's
    halves as they are written — and return when every byte is copied."""
    snapshot = take_snapshot(p.flat, p.plan, p.comm.rank, p.node, staging_bytes, p.monitor)
    if snapshot is not None:
        return snapshot.deferred(p, _on_written(p))
    size = p.plan.file_sizes[p.comm.rank]
    capacity = staging_bytes or size  # set: take_snapshot declined a file larger than it
    with p.monitor.phase("stage"):
        stream = _open_stream(p)
        assert stream is not None  # a file larger than the staging buffer has pieces
        if not pinned(p.flat):  # no spare to copy into: one is wanted for the next save
            p.node.want_spare(layout.in_generation(p.generation, p.plan.writes[p.comm.rank][0].file), size)
        with stream.abort_on_error():
            stream_through_halves(stream, rank_pieces(p.flat, p.plan, p.comm.rank),
                                  _PROCESS.staging.acquire(capacity, pin=pinned(p.flat))[:capacity])
    p.monitor.count("bytes_staged", size)
    return lambda: stream


def _finish_rank(p: _Prepared, stream: FileStream | None) -> tuple[list[PieceMeta], list[ObjectMeta], list[FileMeta], dict[str, float]]:
    with p.monitor.phase("write"):
        pieces, objects, files = _drain_rank(p, stream)
    return pieces, objects, files, p.monitor.summary()


def _drain_rank(p: _Prepared, stream: FileStream | None) -> tuple[list[PieceMeta], list[ObjectMeta], list[FileMeta]]:
    """Wait for this rank's data file to be written and write its objects file."""
    rank = p.comm.rank
    pieces: list[PieceMeta] = []
    files: list[FileMeta] = []
    objects, blob = _objects_of_rank(p)
    # The objects file is written while the data file is finished: on an object store, a round trip less.
    put = _put_all(p.backend, {layout.in_generation(p.generation, layout.objects_file(rank)): blob}) if blob else None
    if stream is not None:
        try:
            checksums = stream.finish()
        except BaseException:
            if put is not None:  # nothing of this save may land after the failure is reported
                concurrent.futures.wait([put])
            raise
        writes = p.plan.writes[rank]
        pieces = [
            PieceMeta(
                fqn=w.fqn, region=w.region, file=w.file, byte_offset=w.byte_offset, byte_length=w.byte_length,
                crc32c=c.crc32c, block_bytes=c.block_bytes, block_crc32c=c.block_crc32c,
            )
            for w, c in zip(writes, checksums)
        ]
        files.append(FileMeta(key=writes[0].file, size=p.plan.file_sizes[rank]))
        p.monitor.count("bytes_written", p.plan.file_sizes[rank])
        p.monitor.add_seconds("checksum", stream.checksum_s)
        p.monitor.add_seconds("file_write", stream.write_s)
    if put is not None:
        put.result()
        files.append(FileMeta(key=layout.objects_file(rank), size=len(blob)))
    return pieces, objects, files


def _put_all(backend: Backend, documents: Mapping[str, bytes]) -> concurrent.futures.Future[None]:
    """Start writing every document at once; the future is done when all are written (or failed:
    it raises the first error, after every write has ended)."""
    sched = get_scheduler()

    async def put_all() -> None:
        results = await asyncio.gather(
            *(backend.put(key, data) for key, data in documents.items()), return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    return sched.submit(put_all())


def _objects_of_rank(p: _Prepared) -> tuple[list[ObjectMeta], bytes]:
    rank = p.comm.rank
    objects: list[ObjectMeta] = []
    blobs: list[bytes] = []
    offset = 0
    for key in sorted(p.encoded):
        owner = p.owners.get(key)
        if owner is not None and owner != rank:
            continue
        data, codec = p.encoded[key]
        objects.append(
            ObjectMeta(
                key=key, rank=None if owner is not None else rank, file=layout.objects_file(rank),
                byte_offset=offset, byte_length=len(data), crc32c=crc32c.crc32c(data), codec=codec,
            )
        )
        blobs.append(data)
        offset += len(data)
    return objects, b"".join(blobs)
