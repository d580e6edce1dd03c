"""What a ``torch.save`` file holds, and where its tensors' bytes are, without unpickling it.

A ``torch.save`` file is an uncompressed zip archive: ``<archive>/data.pkl`` pickles the saved
structure, each tensor storage is the raw record ``<archive>/data/<key>``. :func:`read_archives` reads
each file's zip directory (its tail), its ``data.pkl`` and the local headers of its storage records
by ranged reads, and unpickles ``data.pkl`` with :class:`_ArchiveUnpickler`: containers, numbers,
strings and ``torch.Size`` come out as themselves, every tensor as a :class:`StoredTensor` (dtype,
shape, and the byte offset of its first element in the file), and any other class (a DeepSpeed enum,
a loss scaler, a named tuple) as an inert :class:`Opaque` that records its name and arguments. No
function or constructor of the file is ever called, so a crafted file cannot run code.

Used by :mod:`tierckpt.deepspeed_format` to read a DeepSpeed checkpoint's tensors in place (the
loader then reads only their byte ranges). A file that is not such an archive (truncated, corrupt,
compressed, big-endian) raises :class:`~tierckpt.errors.CorruptCheckpointError` naming the file.
"""

from __future__ import annotations

import concurrent.futures
import functools
import io
import math
import pickle
import struct
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

from .dcp_chunks import (
    SavedTensor, SegmentFile, TensorPickle, Unreadable, data_span, open_archive, rebuild_v2, rebuild_v3, tensor_globals,
)
from .backends import Backend
from .deadline import carried
from .errors import CheckpointError, CorruptCheckpointError
from .io.scheduler import get_scheduler
from .metadata import itemsize

TAIL_BYTES = 64 << 10
"""Bytes read from the end of a file at first: the zip directory of a checkpoint file is well inside."""
MAX_PICKLE_BYTES = 256 << 20
"""The largest ``data.pkl`` read (a DeepSpeed rank file's grows with the number of parameters)."""
MAX_HEADER_READ_BYTES = 64 << 20
"""The most read of one file beside its ``data.pkl``: the zip directory and the storage records' local headers."""
MAX_RECORDS = 1 << 20
"""The most records a file's zip directory may claim."""
PARALLEL_FILES = 16


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A saved tensor: its elements are ``numel`` row-major values of ``dtype`` from ``byte_offset`` of ``file``."""

    file: str
    byte_offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class Archive:
    """One ``torch.save`` file: its unpickled structure, and where its ``data.pkl`` record is."""

    value: Any
    pickle_offset: int
    pickle_length: int
    pickle_crc32c: int


class Opaque:
    """An instance of a class the archive names but tierckpt does not build: its arguments and state, inert."""

    qualname = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>"


@functools.cache
def _opaque_class(module: str, name: str) -> type[Opaque]:
    return type(name, (Opaque,), {"qualname": f"{module}.{name}"})


class _PlainTensorType:
    """``torch.Tensor`` or ``torch.nn.Parameter`` as the type a tensor with Python attributes is rebuilt as."""


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """``torch._tensor._rebuild_from_type_v2``: a tensor that carries Python attributes (DeepSpeed's
    ``ds_id``); the attributes are dropped, only a plain tensor or parameter type is admitted."""
    if new_type is not _PlainTensorType or not isinstance(args, tuple):
        raise Unreadable(f"holds a tensor of type {new_type!r}")
    return func(*args)


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any, state: Any = None) -> Any:
    """``torch._utils._rebuild_parameter(_with_state)``: a parameter is read as its data."""
    return data


_TENSOR_WRAPPERS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): _PlainTensorType,
    ("torch.nn.parameter", "Parameter"): _PlainTensorType,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
}


class _ArchiveUnpickler(pickle.Unpickler):
    """Unpickles a ``data.pkl``: tensors become :class:`SavedTensor`, unknown classes :class:`Opaque`."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _TENSOR_WRAPPERS:
            return _TENSOR_WRAPPERS[(module, name)]
        found = tensor_globals().get((module, name))
        return found if found is not None else _opaque_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        return TensorPickle.persistent_load(self, pid)  # type: ignore[arg-type]


def unpickle(data: bytes) -> Any:
    """A ``data.pkl``'s structure, read as :class:`_ArchiveUnpickler` does (tensors as storage references)."""
    return _ArchiveUnpickler(data).load()


def read_archives(backend: Backend, files: Sequence[str]) -> dict[str, Archive]:
    """Each file as an :class:`Archive`, its tensors as :class:`StoredTensor` (files read in parallel)."""
    read = carried(_read_archive)
    with concurrent.futures.ThreadPoolExecutor(min(PARALLEL_FILES, max(1, len(files)))) as pool:
        futures = {f: pool.submit(read, backend, f) for f in files}
        return {f: fut.result() for f, fut in futures.items()}


def _read_archive(backend: Backend, file: str) -> Archive:
    sched = get_scheduler()
    size = sched.run(backend.size(file))
    segment = SegmentFile(
        backend, file, 0, size, max_read=MAX_PICKLE_BYTES, max_total=MAX_PICKLE_BYTES + MAX_HEADER_READ_BYTES,
        least_fetch=TAIL_BYTES,
    )
    tail = max(0, size - TAIL_BYTES)
    segment.add(tail, sched.run(backend.get_range(file, tail, size)))
    try:
        return _decode(file, segment)
    except CheckpointError as exc:
        if not isinstance(exc, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(
            f"{file!r} of {backend.root_uri!r} is not a readable torch.save file (truncated or corrupt?): {exc}"
        ) from exc
    except Unreadable as exc:
        raise CorruptCheckpointError(
            f"{file!r} of {backend.root_uri!r} is not a readable torch.save file (truncated, corrupt, or written "
            f"otherwise): it {exc}"
        ) from None
    except (zipfile.BadZipFile, pickle.UnpicklingError, struct.error, EOFError, ValueError, TypeError, KeyError,
            IndexError, AttributeError, RecursionError, UnicodeDecodeError, MemoryError) as exc:
        raise CorruptCheckpointError(
            f"{file!r} of {backend.root_uri!r} is not a readable torch.save file (truncated or corrupt?): {exc!r}"
        ) from exc


def _decode(file: str, segment: SegmentFile) -> Archive:
    """The structure of the archive in ``segment`` (the standard library's zipfile reads its directory;
    ``data.pkl`` and the storage records' local headers are fetched by ranged reads)."""
    _, records, prefix = open_archive(segment, MAX_RECORDS)
    start, n = data_span(segment, records, prefix + "data.pkl")
    if n > MAX_PICKLE_BYTES:
        raise CorruptCheckpointError(f"its data.pkl claims {n} bytes")
    saved: list[SavedTensor] = []
    data = segment.take(start, n)
    value = _Unpickler(data, saved).load()
    located = {key: data_span(segment, records, f"{prefix}data/{key}") for key in sorted({t.storage.key for t in saved})}
    value = _replace(value, {id(t): _stored(file, t, located) for t in saved}, set())
    return Archive(value=value, pickle_offset=start, pickle_length=n, pickle_crc32c=crc32c.crc32c(data))


class _Unpickler(_ArchiveUnpickler):
    """:class:`_ArchiveUnpickler` that also lists every tensor it met."""

    def __init__(self, data: bytes, saved: list[SavedTensor]) -> None:
        super().__init__(data)
        self.saved = saved

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if found in (rebuild_v2, rebuild_v3):
            def rebuild(*args: Any) -> SavedTensor:
                tensor = found(*args)
                self.saved.append(tensor)
                return tensor
            return rebuild
        return found


def _stored(file: str, t: SavedTensor, located: dict[str, tuple[int, int]]) -> StoredTensor:
    """Where the elements of ``t`` are in ``file``; only row-major tensors inside their record."""
    start, n = located[t.storage.key]
    item = itemsize(t.dtype)
    row_major = [math.prod(t.size[d + 1:]) for d in range(len(t.size))]
    if any(k > 1 and s != r for k, s, r in zip(t.size, t.stride, row_major)):
        raise Unreadable(f"holds a tensor with strides {list(t.stride)}, not row-major")
    if (t.offset + math.prod(t.size)) * item > n:
        raise CorruptCheckpointError(f"its storage record {t.storage.key!r} holds {n} bytes, fewer than its tensor needs")
    return StoredTensor(file=file, byte_offset=start + t.offset * item, dtype=t.dtype, shape=tuple(t.size))


def _replace(value: Any, stored: dict[int, StoredTensor], seen: set[int]) -> Any:
    """``value`` with each saved tensor replaced by its :class:`StoredTensor` (containers rebuilt)."""
    if id(value) in stored:
        return stored[id(value)]
    if isinstance(value, (dict, list)) and id(value) in seen:
        return value
    if isinstance(value, dict):
        seen.add(id(value))
        for k in list(value):
            value[k] = _replace(value[k], stored, seen)
        return value
    if isinstance(value, list):
        seen.add(id(value))
        value[:] = [_replace(v, stored, seen) for v in value]
        return value
    if type(value) is tuple:
        return tuple(_replace(v, stored, seen) for v in value)
    return value
