"""Where a torch DCP tensor chunk's raw bytes are inside its ``torch.save`` archive, found without
building the tensor (used by :mod:`tierckpt.formats.dcp`).

Each chunk of a DCP data file is a segment holding ``torch.save`` of the chunk: an uncompressed zip
archive whose record ``<archive>/data/<key>`` is the chunk's raw bytes. The standard library's
:mod:`zipfile` reads the archive through a :class:`SegmentFile`, a file object over the segment that
serves the bytes already fetched (both ends of every segment are fetched up front, all chunks at once)
and fetches what else zipfile asks for with ranged reads: nothing is downloaded whole. ``data.pkl`` is
parsed by :class:`TensorPickle` (storage key, dtype, offset, size, stride: nothing is built or
called), and the data record's local header gives where the raw bytes start.

Every read is bounded (:data:`MAX_READ_BYTES` at once, :data:`MAX_SEGMENT_READ_BYTES` per archive), so a
crafted archive cannot make tierckpt fetch a multi-gigabyte "directory". What tierckpt does not read in
place raises :class:`Unreadable` (the caller names the conversion); a malformed archive raises
:class:`~tierckpt.errors.CorruptCheckpointError`.
"""

from __future__ import annotations

import functools
import io
import math
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tierckpt.backends import Backend
from tierckpt.errors import CorruptCheckpointError
from tierckpt.io.rangefile import SeekableReader
from tierckpt.io.scheduler import get_scheduler
from tierckpt.native.metadata import _int, itemsize
from tierckpt.formats.pickle_seal import SealedGlobals

PROBE_BYTES = 1024
"""Bytes fetched from each end of a chunk's segment up front (zip headers, data.pkl, the directory), and
the least fetched when zipfile asks for bytes not read yet."""
MAX_READ_BYTES = 1 << 20
"""The most zipfile may ask for in one read of a segment (a zip directory, a data.pkl)."""
MAX_SEGMENT_READ_BYTES = 4 << 20
"""The most read of one segment in all."""
MAX_RECORDS = 1024


class Unreadable(Exception):
    """The segment is valid but not something tierckpt reads in place; the message says what it is."""


class SegmentFile(SeekableReader):
    """A read-only, seekable file over bytes ``[offset, offset + length)`` of ``key``: serves what was
    fetched already (:meth:`add`) and fetches the rest with ranged reads, within the caps above."""

    def __init__(
        self, backend: Backend, key: str, offset: int, length: int, *,
        max_read: int = MAX_READ_BYTES, max_total: int = MAX_SEGMENT_READ_BYTES, least_fetch: int = PROBE_BYTES,
    ) -> None:
        super().__init__(length)
        self._backend, self._key, self._offset = backend, key, offset
        self._max_read, self._max_total, self._least_fetch = max_read, max_total, least_fetch
        self._parts: list[tuple[int, bytes]] = []
        self._fetched = 0

    def add(self, start: int, data: bytes) -> None:
        """Bytes ``[start, start + len(data))`` of the segment, fetched by the caller."""
        self._parts.append((start, data))

    def take(self, start: int, n: int) -> bytes:
        """Bytes ``[start, start + n)`` of the segment (fetched when not held)."""
        if start < 0 or n < 0 or start + n > self.length:
            raise CorruptCheckpointError(f"a zip record points to bytes {start}..{start + n}, past the segment's {self.length}")
        if n > self._max_read:
            raise CorruptCheckpointError(f"a zip record asks for {n} bytes at once, more than {self._max_read}")
        for at, data in self._parts:
            if at <= start and start + n <= at + len(data):
                return data[start - at : start - at + n]
        end = min(self.length, max(start + n, start + self._least_fetch))
        self._fetched += end - start
        if self._fetched > self._max_total:
            raise CorruptCheckpointError(f"its zip records need more than {self._max_total} bytes read")
        buffer = bytearray(end - start)
        get_scheduler().run(self._backend.read_into(self._key, self._offset + start, memoryview(buffer)))
        data = bytes(buffer)
        self._parts.append((start, data))
        return data[:n]

    def read(self, size: int | None = -1) -> bytes:
        """Up to ``size`` bytes from the position (the rest of the segment when negative), refused past
        the caps before anything is fetched or allocated."""
        rest = self.length - self._position
        count = max(0, rest if size is None or size < 0 else min(size, rest))
        data = self.take(self._position, count) if count else b""
        self._position += count
        return data

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)


def first_reads(length: int) -> list[tuple[int, int]]:
    """The spans of a segment fetched up front: both ends (the whole of a short one)."""
    if length <= 2 * PROBE_BYTES:
        return [(0, length)]
    return [(0, PROBE_BYTES), (length - PROBE_BYTES, length)]


def raw_data_offset(segment: SegmentFile, dtype: torch.dtype, sizes: tuple[int, ...]) -> int:
    """Where a ``torch.save``-d chunk's raw, row-major bytes start inside its segment."""
    hint = "; a DCP file written as safetensors?"
    archive, records, prefix = open_archive(segment, MAX_RECORDS, hint)
    try:
        saved = TensorPickle(stored_record(archive, records, prefix + "data.pkl")).load()
    except zipfile.BadZipFile as exc:
        raise CorruptCheckpointError(f"its zip records are malformed: {exc}") from exc
    if not isinstance(saved, SavedTensor):
        raise Unreadable(f"holds a {type(saved).__name__}, not a tensor")
    if saved.dtype != dtype or saved.size != tuple(sizes):
        raise CorruptCheckpointError(f"holds a {saved.dtype} tensor of shape {list(saved.size)}, the metadata says {dtype} {list(sizes)}")
    row_major = [math.prod(sizes[d + 1 :]) for d in range(len(sizes))]
    if any(n > 1 and s != r for n, s, r in zip(sizes, saved.stride, row_major)):
        raise Unreadable(f"is stored with strides {list(saved.stride)}, not row-major (e.g. channels-last)")
    item = itemsize(dtype)
    start, n = data_span(segment, records, f"{prefix}data/{saved.storage.key}")
    if saved.offset * item + math.prod(sizes) * item > n:
        raise CorruptCheckpointError(f"its data record holds {n} bytes, fewer than the tensor needs")
    return start + saved.offset * item


def open_archive(segment: SeekableReader, max_records: int, hint: str = "") -> tuple[zipfile.ZipFile, dict[str, zipfile.ZipInfo], str]:
    """The standard library's reader of the ``torch.save`` archive in ``segment``, its records by name and
    the prefix of their names (``"<archive>/"``); refuses more than ``max_records`` records and a
    big-endian archive (``hint`` ends the message of a file that is no such archive)."""
    try:
        archive = zipfile.ZipFile(segment)
    except zipfile.BadZipFile as exc:
        raise Unreadable(f"is not a torch.save archive ({exc}{hint})") from None
    records = {info.filename: info for info in archive.infolist()}
    if len(records) > max_records:
        raise CorruptCheckpointError(f"its zip directory claims {len(records)} records")
    pickles = [n for n in records if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise Unreadable(f"is not a torch.save archive (no data.pkl record{hint})")
    prefix = pickles[0][: -len("data.pkl")]
    try:
        if prefix + "byteorder" in records and stored_record(archive, records, prefix + "byteorder") != b"little":
            raise Unreadable("was saved big-endian")
    except zipfile.BadZipFile as exc:
        raise CorruptCheckpointError(f"its zip records are malformed: {exc}") from exc
    return archive, records, prefix


def _uncompressed(records: dict[str, zipfile.ZipInfo], name: str) -> zipfile.ZipInfo:
    if name not in records:
        raise Unreadable(f"has no {name!r} record")
    info = records[name]
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        raise Unreadable(f"has a compressed {name!r} record")
    return info


def stored_record(archive: zipfile.ZipFile, records: dict[str, zipfile.ZipInfo], name: str) -> bytes:
    """The bytes of a small stored record (zipfile checks its local header and CRC-32)."""
    info = _uncompressed(records, name)
    if info.file_size > MAX_READ_BYTES:
        raise CorruptCheckpointError(f"its {name!r} record claims {info.file_size} bytes")
    return archive.read(info)


def data_span(segment: SegmentFile, records: dict[str, zipfile.ZipInfo], name: str) -> tuple[int, int]:
    """Start and size of a stored record's data inside the segment, from its local header (the data
    itself is not read)."""
    info = _uncompressed(records, name)
    header = struct.unpack(zipfile.structFileHeader, segment.take(info.header_offset, zipfile.sizeFileHeader))
    if header[0] != zipfile.stringFileHeader:
        raise CorruptCheckpointError(f"the local header of {name!r} is malformed")
    name_length, extra_length = header[-2:]
    start = info.header_offset + zipfile.sizeFileHeader + name_length + extra_length
    if start + info.file_size > segment.length:
        raise CorruptCheckpointError(f"record {name!r} runs past the segment")
    return start, info.file_size


# -- data.pkl of one tensor: read what describes it, build nothing -------------------------------------
@dataclass(frozen=True, slots=True)
class StorageRef:
    key: str
    dtype: torch.dtype | None
    """``None`` for an untyped storage (``_rebuild_tensor_v3`` names the dtype)."""


@dataclass(frozen=True, slots=True)
class SavedTensor:
    storage: StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class _StorageType(NamedTuple):
    """A storage class of ``data.pkl`` (``torch.FloatStorage``...), as the dtype it stores: an immutable
    marker (a tuple with no attributes to set), so a pickle cannot change it for the next file."""

    dtype: torch.dtype | None


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, dtype: Any, metadata: Any) -> SavedTensor:
    if not isinstance(storage, StorageRef) or not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError("its data.pkl rebuilds a tensor from something that is not a storage")
    if metadata:
        raise Unreadable(f"is a tensor with extra metadata {sorted(metadata)!r} (conjugate or negative bits)")
    return SavedTensor(
        storage=storage, offset=_int(offset, "storage offset"), size=tuple(_int(n, "size") for n in size),
        stride=tuple(_int(s, "stride") for s in stride), dtype=dtype,
    )


def rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any = None) -> SavedTensor:
    return _rebuild(storage, offset, size, stride, getattr(storage, "dtype", None), metadata)


def rebuild_v3(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, metadata: Any = None,
) -> SavedTensor:
    return _rebuild(storage, offset, size, stride, dtype, metadata)


@functools.cache
def tensor_globals() -> dict[tuple[str, str], Any]:
    """The globals of a plain tensor's ``data.pkl``; storage classes and rebuild functions become markers."""
    allowed: dict[tuple[str, str], Callable[..., Any] | Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): rebuild_v3,
        ("collections", "OrderedDict"): OrderedDict,
        ("torch.storage", "UntypedStorage"): _StorageType(None),
        ("torch", "UntypedStorage"): _StorageType(None),
    }
    allowed.update({("torch", name): _StorageType(dtype) for dtype, name in torch.storage._dtype_to_storage_type_map().items()})
    allowed.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
    return allowed


class TensorPickle(pickle.Unpickler):
    """Reads one tensor's ``data.pkl`` into a :class:`SavedTensor`; refuses anything else. Its globals
    are handed out sealed (:mod:`tierckpt.formats.pickle_seal`)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.admitted = SealedGlobals(tensor_globals())

    def find_class(self, module: str, name: str) -> Any:
        found = self.admitted.get(module, name)
        if found is None:
            raise Unreadable(f"is not a plain tensor (its data.pkl refers to {module}.{name})")
        return found

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[2], str)):
            raise CorruptCheckpointError(f"its data.pkl has an unexpected storage reference {pid!r}")
        return StorageRef(key=pid[2], dtype=pid[1].dtype)
