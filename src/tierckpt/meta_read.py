"""Reading a committed checkpoint's metadata through a store: ``COMMIT``, the header, the tensor and
pieces tables (used by the loader, ``verify``, ``convert`` and the CLI).

Every document is bounded before it is read (a crafted size is refused unread) and checked against the
size and CRC-32C that ``COMMIT`` records for it; a torch DCP directory (no ``COMMIT``) is read in place
by :mod:`tierckpt.dcp_format` when the caller accepts one, a Hugging Face safetensors folder by
:mod:`tierckpt.safetensors_format`.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

from . import dcp_format, deepspeed_read, layout, safetensors_format
from .backends import Backend
from .deadline import carried
from .bounded import MAX_RECORD_BYTES
from .foreign import missing_commit_error
from .errors import (
    CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError, MissingFileError,
)
from .io.rangefile import RangeFile
from .io.scheduler import get_scheduler
from .metadata import (
    MAX_HEADER_BYTES, MAX_TABLE_BYTES, CheckpointMeta, PieceMeta, TensorMeta, decode_header, decode_pieces,
    decode_tensors,
)

RACE_RETRIES = 8
"""How many times a load that lost its generation to a newer commit starts again on the newer one (each
attempt fails only if a whole save cycle completes during it)."""
WHOLE_PIECES_BYTES = 8 << 20
"""A pieces table up to this size is read whole and checked against its CRC-32C in ``COMMIT``; a larger
one is read by row groups (only those a load needs), and ``verify`` checks its CRC."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A committed checkpoint's header and tensor table."""

    meta: CheckpointMeta
    tensors: dict[str, TensorMeta]
    pieces: dict[str, list[PieceMeta]] | None = None
    """Every piece, when the format lists them with its metadata (a torch DCP directory); else ``None``."""
    record: layout.CommitRecord | None = None
    """The ``COMMIT`` record that named it (its checksums check the other metadata documents)."""


def read_commit(backend: Backend) -> layout.CommitRecord:
    """The decoded ``COMMIT`` record. Without one: an interrupted save if the root holds uncommitted
    generations, else an error saying what the root is (:func:`tierckpt.foreign.missing_commit_error`)."""
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


def _document(backend: Backend, record: layout.CommitRecord, key: str, limit: int) -> bytes:
    """One metadata document of the committed generation (at most ``limit`` bytes), checked against
    ``COMMIT``'s checksum."""
    data = read_document(backend, layout.in_generation(record.generation, key), _cap(record, key, limit))
    record.check_document(key, data, backend.root_uri)
    return data


def read_checkpoint(backend: Backend, *, accept_dcp: bool = False) -> Checkpoint:
    """Follow ``COMMIT`` to the committed generation and read its header and tensor table (following a
    newer ``COMMIT`` when a save deleted the generation meanwhile).

    A torch DCP directory and a Hugging Face safetensors folder are read in place with ``accept_dcp``
    (see :mod:`tierckpt.dcp_format`, :mod:`tierckpt.safetensors_format`) and refused, naming the format
    and the conversion, without it.
    """
    try:
        record = read_commit(backend)
    except (IncompleteCheckpointError, CheckpointNotFoundError):
        if (found := deepspeed_read.read_if_deepspeed(backend, accept_dcp)) is not None:  # DeepSpeed ZeRO, universal
            return Checkpoint(meta=found[0], tensors=found[1], pieces=found[2])
        if not dcp_format.is_dcp(backend):
            if not safetensors_format.is_safetensors(backend):
                raise
            if not accept_dcp:
                raise CheckpointError(safetensors_format.refusal(backend.root_uri)) from None
            meta, tensors, pieces = safetensors_format.read_safetensors(backend)
            return Checkpoint(meta=meta, tensors=tensors, pieces=pieces)
        if not accept_dcp:
            raise CheckpointError(dcp_format.refusal(backend.root_uri)) from None
        meta, tensors, pieces = dcp_format.read_dcp(backend)
        return Checkpoint(meta=meta, tensors=tensors, pieces=pieces)
    attempt = 0
    while True:
        gen = record.generation
        try:
            # Both documents at once: on an object store each is two round trips (size, then read).
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                read = carried(_document)  # with the operation's deadline
                header = pool.submit(read, backend, record, layout.HEADER, MAX_HEADER_BYTES)
                table = pool.submit(read, backend, record, layout.TENSORS, MAX_TABLE_BYTES)
                return decoded_checkpoint(record, header.result(), table.result())
        except CheckpointNotFoundError as exc:
            newer = newer_commit(backend, gen)
            if newer is not None and attempt < RACE_RETRIES:
                record, attempt = newer, attempt + 1
                continue
            raise MissingFileError(
                f"checkpoint {backend.root_uri!r} is committed as {gen!r} but its metadata is missing: {exc}"
            ) from exc


def decoded_checkpoint(record: layout.CommitRecord, header: bytes, tensors: bytes) -> Checkpoint:
    """The checkpoint ``record`` names, from its header and tensor table (both already checked against
    ``record``): the header must name the same generation."""
    meta = decode_header(header, layout.HEADER)
    if meta.generation != record.generation:
        raise CorruptCheckpointError(f"header of {record.generation!r} names generation {meta.generation!r}")
    return Checkpoint(meta=meta, tensors=decode_tensors(tensors, meta.num_tensors), record=record)


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
    groups once the tensors a load needs are known; a table without a recorded checksum, or a torch DCP
    directory's pieces, are read as before by :func:`read_pieces`)."""
    recorded = ckpt.record.checksum(layout.PIECES) if ckpt.record is not None and ckpt.pieces is None else None
    if recorded is None or recorded.size > WHOLE_PIECES_BYTES:
        return None
    return _pieces_document(backend, ckpt)


def _pieces_document(backend: Backend, ckpt: Checkpoint) -> bytes:
    """The whole pieces table, checked against ``COMMIT`` when it records the table's checksum."""
    try:
        data = read_document(backend, layout.pieces_key(ckpt.meta.generation), _cap(ckpt.record, layout.PIECES, MAX_TABLE_BYTES))
    except CheckpointNotFoundError as exc:
        raise CorruptCheckpointError(f"checkpoint {backend.root_uri!r} has no pieces table: {exc}") from exc
    if ckpt.record is not None:
        ckpt.record.check_document(layout.PIECES, data, backend.root_uri)
    return data


def read_pieces(backend: Backend, ckpt: Checkpoint, fqns: set[str] | None = None) -> dict[str, list[PieceMeta]]:
    """The validated pieces of the tensors in ``fqns`` (all when ``None``).

    The table is read whole and checked against its CRC-32C in ``COMMIT`` when all of it is wanted or
    it is at most :data:`WHOLE_PIECES_BYTES`; otherwise only the table's footer and the row groups that
    can hold ``fqns`` are fetched.
    """
    if ckpt.pieces is not None:
        return {f: ckpt.pieces[f] for f in (ckpt.pieces if fqns is None else fqns) if f in ckpt.pieces}
    recorded = ckpt.record.checksum(layout.PIECES) if ckpt.record is not None else None
    if fqns is None or (recorded is not None and recorded.size <= WHOLE_PIECES_BYTES):
        return decode_pieces(_pieces_document(backend, ckpt), ckpt.tensors, fqns, ckpt.meta.num_pieces)
    try:
        return decode_pieces(RangeFile(backend, layout.pieces_key(ckpt.meta.generation)), ckpt.tensors, fqns,
                             ckpt.meta.num_pieces)
    except CheckpointNotFoundError as exc:
        raise CorruptCheckpointError(f"checkpoint {backend.root_uri!r} has no pieces table: {exc}") from exc
