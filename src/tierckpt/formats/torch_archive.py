"""What a ``torch.save`` file holds, and where its tensors' bytes are, without unpickling it.

A ``torch.save`` file is an uncompressed zip archive: ``<archive>/data.pkl`` pickles the saved
structure, each tensor storage is the raw record ``<archive>/data/<key>``. :func:`read_archives` reads
each file's zip directory (its tail), its ``data.pkl`` and the local headers of its storage records
by ranged reads, and unpickles ``data.pkl`` with :class:`_ArchiveUnpickler`: containers, numbers,
strings and ``torch.Size`` come out as themselves, every tensor as a :class:`StoredTensor` (dtype,
shape, and the byte offset of its first element in the file), and any other class (a DeepSpeed enum,
a loss scaler, a named tuple) as an inert :class:`Opaque` that records its name and arguments. No
function or constructor of the file is ever called, so a crafted file cannot run code.

Used by :mod:`tierckpt.formats.deepspeed` to read a DeepSpeed checkpoint's tensors in place (the
loader then reads only their byte ranges). A file that is not such an archive (truncated, corrupt,
compressed, big-endian) raises :class:`~tierckpt.errors.CorruptCheckpointError` naming the file.
"""

from __future__ import annotations

import concurrent.futures
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

from tierckpt.formats.dcp_chunks import (
    SavedTensor, SegmentFile, TensorPickle, Unreadable, data_span, open_archive, tensor_globals,
)
from tierckpt.backends import Backend
from tierckpt.deadline import carried, current as current_deadline
from tierckpt.errors import CheckpointError, CorruptCheckpointError
from tierckpt.io.scheduler import get_scheduler
from tierckpt.native.metadata import itemsize
from tierckpt.formats.pickle_seal import SealedGlobals, sealed_class

TAIL_BYTES = 64 << 10
"""Bytes read from the end of a file at first: the zip directory of a checkpoint file is well inside."""
MAX_PICKLE_BYTES = 256 << 20
"""The largest ``data.pkl`` read (a DeepSpeed rank file's grows with the number of parameters)."""
MAX_HEADER_READ_BYTES = 64 << 20
"""The most read of one file beside its ``data.pkl``: the zip directory and the storage records' local headers."""
MAX_RECORDS = 1 << 20
"""The most records a file's zip directory may claim."""
PARALLEL_FILES = 16
MAX_OPAQUE_CLASSES = 4096
"""The most distinct class names one ``data.pkl`` may name (a DeepSpeed rank file names a few dozen)."""
MAX_DEPTH = 200
"""The deepest a ``data.pkl``'s containers may nest."""
DEADLINE_CHECK_VISITS = 4096
"""How often (in containers visited) the walk of a ``data.pkl`` looks at the operation's deadline."""


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


class _PlainTensorType:
    """``torch.Tensor`` or ``torch.nn.Parameter`` as the type a tensor with Python attributes is rebuilt as."""


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """``torch._tensor._rebuild_from_type_v2``: a tensor that carries Python attributes (DeepSpeed's
    ``ds_id``); the attributes are dropped, only a plain tensor or parameter type is admitted."""
    if not (isinstance(new_type, type) and issubclass(new_type, _PlainTensorType)) or not isinstance(args, tuple):
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
_REBUILDS = (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"))


class _ArchiveUnpickler(pickle.Unpickler):
    """Unpickles a ``data.pkl``: tensors become :class:`SavedTensor` (each listed in ``saved`` when given),
    unknown classes :class:`Opaque`. Every global it hands out is made for this unpickler and sealed
    (:mod:`tierckpt.formats.pickle_seal`): the file changes nothing the next file sees, and what it names is
    dropped with it (at most :data:`MAX_OPAQUE_CLASSES` class names per file)."""

    def __init__(self, data: bytes, saved: list[SavedTensor] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        admitted = {**tensor_globals(), **_TENSOR_WRAPPERS}
        if saved is not None:
            admitted.update({key: _listing(admitted[key], saved) for key in _REBUILDS})
        self.admitted = SealedGlobals(admitted)
        self.opaque: dict[tuple[str, str], type[Opaque]] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = self.admitted.get(module, name)
        if found is not None:
            return found
        if (module, name) not in self.opaque:
            if len(self.opaque) >= MAX_OPAQUE_CLASSES:
                raise CorruptCheckpointError(f"its data.pkl names more than {MAX_OPAQUE_CLASSES} classes")
            self.opaque[(module, name)] = sealed_class(Opaque, name=name, qualname=f"{module}.{name}")
        return self.opaque[(module, name)]

    def persistent_load(self, pid: Any) -> Any:
        return TensorPickle.persistent_load(self, pid)  # type: ignore[arg-type]


def _listing(rebuild: Any, saved: list[SavedTensor]) -> Any:
    """``rebuild`` (a tensor rebuild function) that also appends each tensor it makes to ``saved``."""
    def rebuild_and_list(*args: Any) -> SavedTensor:
        tensor = rebuild(*args)
        saved.append(tensor)
        return tensor
    return rebuild_and_list


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
    value = _ArchiveUnpickler(data, saved).load()
    located = {key: data_span(segment, records, f"{prefix}data/{key}") for key in sorted({t.storage.key for t in saved})}
    value = _Replacer({id(t): _stored(file, t, located) for t in saved}).replace(value, 0)
    return Archive(value=value, pickle_offset=start, pickle_length=n, pickle_crc32c=crc32c.crc32c(data))


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


class _Replacer:
    """Replaces each saved tensor of an unpickled structure by its :class:`StoredTensor`, rebuilding the
    containers. Each container is visited once (a memo by identity: a crafted file's DAG of shared tuples,
    2^depth paths, costs one visit per node), at most :data:`MAX_DEPTH` deep, and the walk stops at the
    operation's deadline."""

    def __init__(self, stored: dict[int, StoredTensor]) -> None:
        self.done: dict[int, Any] = dict(stored)
        self.visits = 0

    def replace(self, value: Any, depth: int) -> Any:
        if id(value) in self.done:
            return self.done[id(value)]
        if not isinstance(value, (dict, list)) and type(value) is not tuple:
            return value
        if depth >= MAX_DEPTH:
            raise CorruptCheckpointError(f"its data.pkl nests containers more than {MAX_DEPTH} deep")
        self.visits += 1
        if self.visits % DEADLINE_CHECK_VISITS == 0 and (left := current_deadline()) is not None and left.remaining() < 0:
            raise left.exceeded("the walk of a data.pkl")
        self.done[id(value)] = value  # a list or dict that holds itself is rebuilt in place
        if isinstance(value, dict):
            for k in list(value):
                value[k] = self.replace(value[k], depth + 1)
        elif isinstance(value, list):
            value[:] = [self.replace(v, depth + 1) for v in value]
        else:
            self.done[id(value)] = value = tuple(self.replace(v, depth + 1) for v in value)
        return value
