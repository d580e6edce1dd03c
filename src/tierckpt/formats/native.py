"""The native checkpoint reader (:data:`NATIVE`): ``COMMIT``, the header, the tensor and pieces tables
of the generation ``COMMIT`` names, read through a store's chain.

Every document is bounded before it is read (a crafted size is refused unread) and checked against the
size and CRC-32C that ``COMMIT`` records for it. Which reader reads a directory is decided once, by
:mod:`tierckpt.formats.select`; this one reads a directory that holds a ``COMMIT`` record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.formats.reader import NATIVE_FORMAT, Checkpoint, Root
from tierckpt.backends.bounded import MAX_RECORD_BYTES
from tierckpt.formats.foreign import missing_commit_error
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, MissingFileError
from tierckpt.io.rangefile import RangeFile
from tierckpt.io.scheduler import get_scheduler
from tierckpt.native.metadata import (
    MAX_HEADER_BYTES, MAX_TABLE_BYTES, PieceMeta, decode_header, decode_pieces, decode_tensors,
)

RACE_RETRIES = 8
"""How many times a load that lost its generation to a newer commit starts again on the newer one (each
attempt fails only if a whole save cycle completes during it)."""
WHOLE_PIECES_BYTES = 8 << 20
"""A pieces table up to this size is read whole and checked against its CRC-32C in ``COMMIT``; a larger
one is read by row groups (only those a load needs), and ``verify`` checks its CRC."""



def read_commit(backend: Backend) -> layout.CommitRecord:
    """The decoded ``COMMIT`` record. Without one: an interrupted save if the root holds uncommitted
    generations, else an error saying what the root is (:func:`tierckpt.formats.foreign.missing_commit_error`)."""
    sched = get_scheduler()
    try:
        return layout.CommitRecord.decode(sched.run(backend.get_capped(layout.COMMIT, MAX_RECORD_BYTES)))
    except CheckpointNotFoundError:
        raise missing_commit_error(backend.root_uri, sched.run(backend.list(""))) from None


def newer_commit(backend: Backend, generation: str) -> layout.CommitRecord | None:
    """The ``COMMIT`` record if it now names another generation than ``generation`` (else ``None``)."""
    try:
        record = read_commit(backend)
    except CheckpointError:
        return None
    return record if record.generation != generation else None


_METADATA = ((layout.HEADER, MAX_HEADER_BYTES), (layout.TENSORS, MAX_TABLE_BYTES))
"""The documents a native checkpoint's metadata is read from, each with the most bytes it may hold."""


def small_pieces(record: layout.CommitRecord | None) -> bool:
    """Whether ``record`` (``COMMIT``) records a pieces table at most :data:`WHOLE_PIECES_BYTES` long: one read
    whole, with the header and the tensor table, and checked (a larger one is read by the row groups a load
    needs)."""
    recorded = record.checksum(layout.PIECES) if record is not None else None
    return recorded is not None and recorded.size <= WHOLE_PIECES_BYTES


def metadata_documents(record: layout.CommitRecord) -> tuple[tuple[str, int], ...]:
    """The metadata documents ``record`` names, each with the most bytes it may hold, in the order they are read
    and checked: :data:`_METADATA`, and the pieces table when it is small (:func:`small_pieces`)."""
    return (*_METADATA, (layout.PIECES, MAX_TABLE_BYTES)) if small_pieces(record) else _METADATA


async def _fetch_committed(
    backend: Backend, record: layout.CommitRecord | None,
) -> tuple[layout.CommitRecord | None, list[bytes | BaseException]]:
    """``COMMIT`` (unless ``record`` is it) and the metadata documents it names, in one trip through the I/O
    loop (the documents at once: on an object store each is two round trips, size then read). ``(None, [])``
    when the root has no ``COMMIT``; a document that failed is its exception, raised by :func:`_checked`."""
    if record is None:
        try:
            record = layout.CommitRecord.decode(await backend.get_capped(layout.COMMIT, MAX_RECORD_BYTES))
        except CheckpointNotFoundError:
            return None, []
    documents = await asyncio.gather(*(
        backend.get_capped(layout.in_generation(record.generation, key), _cap(record, key, limit))
        for key, limit in metadata_documents(record)
    ), return_exceptions=True)
    return record, documents


def _checked(backend: Backend, record: layout.CommitRecord, documents: Sequence[bytes | BaseException]) -> list[bytes]:
    """The metadata documents, each checked against ``COMMIT``'s checksum; the first failure, in
    :func:`metadata_documents`' order, is raised."""
    for (key, _), data in zip(metadata_documents(record), documents):
        if isinstance(data, BaseException):
            raise data
        record.check_document(key, data, backend.root_uri)
    return documents  # type: ignore[return-value]


def read_native(backend: Backend) -> Checkpoint | None:
    """The native checkpoint at the root of ``backend``, its ``COMMIT`` and the metadata it names read in one
    trip through the I/O loop; ``None`` where the root has no ``COMMIT`` (another reader's, or none)."""
    record, documents = get_scheduler().run(_fetch_committed(backend, None))
    return None if record is None else read_committed(backend, record, documents)


class NativeReader:
    """Reads a directory holding a ``COMMIT`` record (:class:`~tierckpt.formats.reader.CheckpointReader`)."""

    format = NATIVE_FORMAT
    generations = True
    checksums = True

    def holds(self, root: Root) -> bool:
        return root.has(layout.COMMIT)

    def read(self, backend: Backend) -> Checkpoint:
        return read_committed(backend)

    def pieces(self, backend: Backend, ckpt: Checkpoint, fqns: set[str] | None) -> dict[str, list[PieceMeta]]:
        return read_table_pieces(backend, ckpt, fqns)

    def source(self, backend: Backend) -> Backend:
        return backend

    def refusal(self, uri: str) -> str | None:
        return None


NATIVE = NativeReader()


def read_committed(
    backend: Backend, record: layout.CommitRecord | None = None, documents: list[bytes | BaseException] | None = None,
) -> Checkpoint:
    """Follow ``COMMIT`` (``record``, when already read, with the ``documents`` it names when read too) to the
    committed generation and read its header and tensor table, and its pieces table when small (following a
    newer ``COMMIT`` when a save deleted the generation meanwhile)."""
    record = record or read_commit(backend)
    attempt = 0
    while True:
        gen = record.generation
        try:
            if documents is None:
                _, documents = get_scheduler().run(_fetch_committed(backend, record))
            header, table, *pieces = _checked(backend, record, documents)
            return decoded_checkpoint(record, header, table, pieces[0] if pieces else None)
        except CheckpointNotFoundError as exc:
            newer = newer_commit(backend, gen)
            if newer is not None and attempt < RACE_RETRIES:
                record, documents, attempt = newer, None, attempt + 1
                continue
            raise MissingFileError(
                f"checkpoint {backend.root_uri!r} is committed as {gen!r} but its metadata is missing: {exc}"
            ) from exc


def decoded_checkpoint(
    record: layout.CommitRecord, header: bytes, tensors: bytes, pieces_table: bytes | None = None,
) -> Checkpoint:
    """The checkpoint ``record`` names, from its header and tensor table (and its whole pieces table, when
    read with them; all already checked against ``record``): the header must name the same generation."""
    meta = decode_header(header, layout.HEADER)
    if meta.generation != record.generation:
        raise CorruptCheckpointError(f"header of {record.generation!r} names generation {meta.generation!r}")
    return Checkpoint(meta=meta, tensors=decode_tensors(tensors, meta.num_tensors), record=record,
                      pieces_table=pieces_table)


def _cap(record: layout.CommitRecord | None, key: str, limit: int) -> int:
    """The most bytes document ``key`` may hold: what ``record`` (``COMMIT``) records for it, else ``limit``."""
    recorded = record.checksum(key) if record is not None else None
    return limit if recorded is None else min(limit, recorded.size)


def read_document(backend: Backend, key: str, limit: int) -> bytes:
    """A whole metadata document, refused unread (:class:`~tierckpt.errors.OversizedFileError`) when the
    store says it is larger than ``limit``."""
    return get_scheduler().run(backend.get_capped(key, limit))


def whole_pieces(backend: Backend, ckpt: Checkpoint) -> bytes | None:
    """The whole pieces table of ``ckpt``, checked against its CRC-32C in ``COMMIT``, when ``COMMIT``
    records it at most :data:`WHOLE_PIECES_BYTES` long; ``None`` otherwise (a larger table is read by row
    groups once the tensors a load needs are known; a table without a recorded checksum is read as before
    by :func:`read_table_pieces`)."""
    return _pieces_document(backend, ckpt) if small_pieces(ckpt.record) else None


def _pieces_document(backend: Backend, ckpt: Checkpoint) -> bytes:
    """The whole pieces table, checked against ``COMMIT`` when it records the table's checksum (the copy
    read with the header, when there is one)."""
    if ckpt.pieces_table is not None:
        return ckpt.pieces_table
    try:
        data = read_document(backend, layout.pieces_key(ckpt.meta.generation), _cap(ckpt.record, layout.PIECES, MAX_TABLE_BYTES))
    except CheckpointNotFoundError as exc:
        raise CorruptCheckpointError(f"checkpoint {backend.root_uri!r} has no pieces table: {exc}") from exc
    if ckpt.record is not None:
        ckpt.record.check_document(layout.PIECES, data, backend.root_uri)
    return data


def read_table_pieces(backend: Backend, ckpt: Checkpoint, fqns: set[str] | None = None) -> dict[str, list[PieceMeta]]:
    """The validated pieces of the tensors in ``fqns`` (all when ``None``), from the pieces table.

    The table is read whole and checked against its CRC-32C in ``COMMIT`` when all of it is wanted or
    it is at most :data:`WHOLE_PIECES_BYTES`; otherwise only the table's footer and the row groups that
    can hold ``fqns`` are fetched.
    """
    if fqns is None or small_pieces(ckpt.record):
        return decode_pieces(_pieces_document(backend, ckpt), ckpt.tensors, fqns, ckpt.meta.num_pieces)
    try:
        return decode_pieces(RangeFile(backend, layout.pieces_key(ckpt.meta.generation)), ckpt.tensors, fqns,
                             ckpt.meta.num_pieces)
    except CheckpointNotFoundError as exc:
        raise CorruptCheckpointError(f"checkpoint {backend.root_uri!r} has no pieces table: {exc}") from exc
