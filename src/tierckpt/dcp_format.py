"""Reading a torch.distributed.checkpoint (DCP) directory in place, as a tierckpt checkpoint.

A DCP directory (``FileSystemWriter`` or ``FsspecWriter``) holds ``.metadata``, a pickle of DCP's
``Metadata``, and data files ``__<rank>_<n>.distcp``. Each saved chunk of a tensor is a segment of a
data file (file, offset, length) holding ``torch.save`` of that chunk: an uncompressed zip archive
whose record ``<archive>/data/<key>`` is the chunk's raw bytes. This module finds those bytes
without unpickling any tensor and describes every chunk as a :class:`~tierckpt.metadata.PieceMeta`
(a box, its file and byte range), so the ordinary loader reads a DCP checkpoint with its own
planner: byte-range reads, each byte read once per group, any resharding.

How (rank 0, when a load or ``tierckpt inspect`` finds ``.metadata`` and no ``COMMIT``):

1. ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, which admits only DCP's metadata
   classes, ``torch.Size``, dtypes, layouts, memory formats, paths and builtin data types: a crafted
   file cannot run code, it is refused with :class:`~tierckpt.errors.CorruptCheckpointError`.
2. For every tensor chunk, the first and last :data:`PROBE_BYTES` of its segment are read, all
   chunks at once. The zip's end record and central directory (tail) say where ``data.pkl``,
   ``byteorder`` and the data record are; ``data.pkl`` is parsed by :class:`_TensorPickle` (storage
   key, dtype, offset, size, stride: nothing is built or called), and the data record's local header
   gives where the raw bytes start. Bytes that the first reads missed are fetched in further rounds.
3. Non-tensor entries (``torch.save`` bytes) become objects: rank 0 reads them once for the CRC-32C
   the loader checks, and marks them ``torch`` when a weights-only load reads them, else ``pickle``
   (loaded only with ``allow_pickle=True``).

What cannot be read in place raises :class:`~tierckpt.errors.CheckpointError` naming what was found
and the ``tierckpt convert --from dcp`` command: stream transforms (DCP extensions, e.g.
compression), DCP files written as safetensors, chunks stored in another memory layout than row-major
(channels-last), big-endian data, tensors with conjugate or negative bits. DCP writes no checksums,
so pieces carry ``crc32c=0`` and everything that checks CRC-32C (``load(verify=True)``, ``tierckpt
verify``) refuses a DCP checkpoint (:func:`refusal`).

DCP rewrites a directory in place when it saves to it again, while the node cache takes every object
but ``COMMIT`` to be immutable: a DCP checkpoint is read past the node cache (:func:`tierckpt.store.without_node_cache`).
"""

from __future__ import annotations

import asyncio
import functools
import io
import math
import pathlib
import pickle
import re
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

from .backends import Backend
from .keys import validate_key
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from .io.scheduler import ReadRequest, get_scheduler
from .metadata import (
    CheckpointMeta, FileMeta, ObjectMeta, PieceMeta, TensorMeta, _int, _shape, dtype_name, itemsize,
)
from .objects import codec_of, decode_object
from .optim_groups import indexed_aliases
from .store import without_node_cache
from .regions import Box

METADATA_KEY = ".metadata"
FORMAT_TAG = "torch_dcp_version"
"""Header tag of a checkpoint read from a DCP directory; its value is DCP's metadata version."""
PROBE_BYTES = 1024
"""Bytes read from each end of a tensor chunk's segment to find its raw data (zip headers, data.pkl)."""
MAX_ROUNDS = 8
MAX_PICKLE_BYTES = 1 << 20
MAX_RECORDS = 1024

DcpCheckpoint = tuple[CheckpointMeta, dict[str, TensorMeta], dict[str, list[PieceMeta]]]


def convert_command(uri: str) -> str:
    """The command that converts the DCP checkpoint at ``uri`` to a tierckpt one."""
    return f"tierckpt convert --from dcp --to tierckpt {uri} OUT"


def refusal(uri: str) -> str:
    """The message for an operation that needs a tierckpt checkpoint but found a DCP directory."""
    return (
        f"{uri!r} is a torch DCP checkpoint directory (no COMMIT record), not a tierckpt one. "
        "tierckpt.load (without verify=True: DCP writes no checksums), `tierckpt inspect` and "
        f"`tierckpt convert --to safetensors` read it in place; for anything else convert it: {convert_command(uri)}"
    )


_DCP_FILE = re.compile(r"^__\d+(_\d+\.distcp|\.metadata)$")
"""Data files and per-rank metadata files of a DCP directory (``__0_0.distcp``, ``__0.metadata``)."""


def is_dcp(backend: Backend) -> bool:
    """Whether the root of ``backend`` is a DCP directory (``.metadata``, or DCP's data or per-rank metadata files)."""
    sched = get_scheduler()
    backend = without_node_cache(backend)
    return bool(sched.run(backend.exists(METADATA_KEY))) or any(_DCP_FILE.match(k) for k in sched.run(backend.list("")))


def read_dcp(backend: Backend) -> DcpCheckpoint:
    """Header, tensor table and every piece of the DCP checkpoint at the root of ``backend``."""
    backend = without_node_cache(backend)
    uri = backend.root_uri
    sched = get_scheduler()
    try:
        raw = sched.run(backend.get(METADATA_KEY))
    except CheckpointNotFoundError:
        if any(k.endswith(".metadata") for k in sched.run(backend.list(""))):
            raise CheckpointError(
                f"{uri!r} is a torch DCP checkpoint saved with use_collectives=False (one __<rank>.metadata per rank, "
                f"no {METADATA_KEY}), which tierckpt does not read; load it with torch.distributed.checkpoint"
            ) from None
        raise IncompleteCheckpointError(
            f"{uri!r} holds torch DCP data files but no {METADATA_KEY}: the DCP save was interrupted or is still running"
        ) from None
    metadata = unpickle_metadata(raw, uri)
    try:
        tensors, chunks, object_segments = _entries(metadata, uri)
    except (AttributeError, TypeError, ValueError) as exc:  # a crafted pickle gave admitted classes odd fields
        raise CorruptCheckpointError(f"the {METADATA_KEY} of DCP checkpoint {uri!r} is malformed: {exc!r}") from exc
    files = _file_sizes(backend, {s.file for _, _, s in chunks} | {s.file for s in object_segments.values()})
    for seg in [s for _, _, s in chunks] + list(object_segments.values()):
        if seg.offset + seg.length > files[seg.file]:
            raise CorruptCheckpointError(
                f"DCP checkpoint {uri!r}: {seg.file!r} has {files[seg.file]} bytes, its metadata points to "
                f"bytes {seg.offset}..{seg.offset + seg.length}: the file is truncated"
            )
    pieces: dict[str, list[PieceMeta]] = {fqn: [] for fqn in tensors}
    for piece in _locate(backend, tensors, chunks):
        pieces[piece.fqn].append(piece)
    objects = _objects(backend, object_segments)
    ranks = {m.group(1) for f in files if (m := re.match(r"__(\d+)_", f))}
    meta = CheckpointMeta(
        generation="",
        world_size=max(1, len(ranks)),
        created_unix=0.0,
        frameworks=("torch DCP",),
        files=tuple(FileMeta(key=k, size=v) for k, v in sorted(files.items())),
        objects=objects,
        num_tensors=len(tensors),
        num_pieces=len(chunks),
        tensor_bytes=sum(t.nbytes for t in tensors.values()),
        tags={FORMAT_TAG: str(getattr(metadata, "version", None) or "unknown")},
    )
    return meta, tensors, pieces


# -- .metadata: a restricted unpickler -----------------------------------------------------------------
@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Every global a DCP ``.metadata`` pickle may name, and what it resolves to."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as dcp_metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
        )
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed.update(
        {("torch", name): value for name, value in vars(torch).items()
         if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))}
    )
    allowed.update({("builtins", t.__name__): t for t in (dict, list, tuple, set, frozenset, str, int, float, complex, bool)})
    allowed[("collections", "OrderedDict")] = OrderedDict
    for module in ("pathlib", "pathlib._local"):  # checkpoint_id; a path is kept pure (never touches the disk)
        allowed.update({(module, n): pathlib.PurePosixPath for n in ("PosixPath", "PurePosixPath")})
        allowed.update({(module, n): pathlib.PureWindowsPath for n in ("WindowsPath", "PureWindowsPath")})
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global is refused before it is looked up."""

    def __init__(self, data: bytes, uri: str) -> None:
        super().__init__(io.BytesIO(data))
        self.uri = uri

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_globals().get((module, name))
        if found is None:
            raise CorruptCheckpointError(
                f"the {METADATA_KEY} of DCP checkpoint {self.uri!r} refers to {module}.{name}, which is not one "
                "of DCP's metadata classes or a builtin data type; it was not unpickled (unpickling can run code). "
                f"If you trust this checkpoint, convert it: {convert_command(self.uri)}"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CorruptCheckpointError(f"the {METADATA_KEY} of DCP checkpoint {self.uri!r} has a persistent reference")


def unpickle_metadata(data: bytes, uri: str) -> Any:
    """DCP's ``Metadata`` from ``.metadata`` bytes, unpickled with :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(data, uri).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to decode untrusted bytes is corruption
        raise CorruptCheckpointError(f"the {METADATA_KEY} of DCP checkpoint {uri!r} cannot be decoded: {exc!r}") from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"the {METADATA_KEY} of {uri!r} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


# -- what the metadata describes -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Segment:
    """Where one DCP entry's ``torch.save`` bytes are."""

    file: str
    offset: int
    length: int


Chunk = tuple[str, Box, _Segment]


def _entries(metadata: Any, uri: str) -> tuple[dict[str, TensorMeta], list[Chunk], dict[str, _Segment]]:
    """Validated tensors, tensor chunks and object segments of unpickled DCP metadata."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    bad = f"the {METADATA_KEY} of DCP checkpoint {uri!r}"
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise CorruptCheckpointError(f"{bad} has no state_dict_metadata or storage_data mapping")
    storage: dict[tuple[str, tuple[int, ...] | None], _Segment] = {}
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo) or not isinstance(index.fqn, str):
            raise CorruptCheckpointError(f"{bad} has a storage entry that is not a MetadataIndex -> _StorageInfo pair")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{uri!r} is a torch DCP checkpoint whose entry {index.fqn!r} is stored through stream transforms "
                f"{list(info.transform_descriptors)!r}, which tierckpt does not read in place; convert it: {convert_command(uri)}"
            )
        offsets = None if index.offset is None else tuple(_int(o, f"chunk offset of {index.fqn!r}") for o in index.offset)
        storage[(index.fqn, offsets)] = _Segment(
            file=validate_key(info.relative_path),
            offset=_int(info.offset, f"offset of {index.fqn!r}"),
            length=_int(info.length, f"length of {index.fqn!r}"),
        )
    tensors: dict[str, TensorMeta] = {}
    chunks: list[Chunk] = []
    objects: dict[str, _Segment] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str) or not fqn:
            raise CorruptCheckpointError(f"{bad} has an entry named {fqn!r}")
        if isinstance(item, BytesStorageMetadata):
            objects[fqn] = _lookup(storage, fqn, None, bad)
            continue
        if not isinstance(item, TensorStorageMetadata) or not isinstance(item.properties.dtype, torch.dtype):
            raise CorruptCheckpointError(f"{bad} describes {fqn!r} as {type(item).__name__}")
        tensor = TensorMeta(fqn=fqn, dtype=dtype_name(item.properties.dtype), shape=_shape(list(item.size), fqn))
        tensors[fqn] = tensor
        for chunk in item.chunks:
            offsets = tuple(_int(o, f"chunk offset of {fqn!r}") for o in chunk.offsets)
            lengths = tuple(_int(n, f"chunk size of {fqn!r}") for n in chunk.sizes)
            if len(offsets) != len(tensor.shape) or len(lengths) != len(tensor.shape) or any(
                o + n > d for o, n, d in zip(offsets, lengths, tensor.shape)
            ):
                raise CorruptCheckpointError(f"{bad} has a chunk {offsets}/{lengths} outside {fqn!r} of shape {tensor.shape}")
            chunks.append((fqn, Box(offsets, lengths), _lookup(storage, fqn, offsets, bad)))
    return tensors, chunks, objects


def _lookup(storage: dict[tuple[str, Any], _Segment], fqn: str, offsets: tuple[int, ...] | None, bad: str) -> _Segment:
    try:
        return storage[(fqn, offsets)]
    except KeyError:
        raise CorruptCheckpointError(f"{bad} has no storage entry for {fqn!r} at {offsets}") from None


def _file_sizes(backend: Backend, files: set[str]) -> dict[str, int]:
    sched = get_scheduler()
    names = sorted(files)

    async def sizes() -> list[int]:
        return list(await asyncio.gather(*(backend.size(f) for f in names)))

    try:
        return dict(zip(names, sched.run(sizes())))
    except CheckpointNotFoundError as exc:
        raise CorruptCheckpointError(f"a data file of DCP checkpoint {backend.root_uri!r} is missing: {exc}") from exc


def _read_ranges(backend: Backend, ranges: list[tuple[str, int, int]]) -> list[bytes]:
    """The bytes ``[start, end)`` of each ``(file, start, end)``, read in parallel."""
    buffers = [bytearray(end - start) for _, start, end in ranges]
    requests = [ReadRequest(key=f, start=s, out=memoryview(b)) for (f, s, _), b in zip(ranges, buffers)]
    sched = get_scheduler()
    sched.run(sched.read(backend, requests))
    return [bytes(b) for b in buffers]


# -- objects ---------------------------------------------------------------------------------------------
def _objects(backend: Backend, segments: dict[str, _Segment]) -> tuple[ObjectMeta, ...]:
    """Object entries; their bytes are read in merged runs (DCP writes them back to back) for CRC and codec.

    An optimizer saved with torch's default (indexed) ``get_state_dict`` has its param group settings
    once per group (``optim.param_groups.0.lr``); each also gets an entry under every parameter's
    flattened name (``optim.param_groups.<fqn>.lr``, the same bytes), so a module and optimizer load in
    place whichever convention saved them (:func:`tierckpt.optim_groups.indexed_aliases`)."""
    ordered = sorted(segments.items(), key=lambda kv: (kv[1].file, kv[1].offset))
    runs: list[list[Any]] = []  # [file, start, end]
    run_of: list[int] = []
    for _, seg in ordered:
        if runs and runs[-1][0] == seg.file and seg.offset <= runs[-1][2]:
            runs[-1][2] = max(runs[-1][2], seg.offset + seg.length)
        else:
            runs.append([seg.file, seg.offset, seg.offset + seg.length])
        run_of.append(len(runs) - 1)
    datas = _read_ranges(backend, [(f, s, e) for f, s, e in runs])
    out = []
    data_of: dict[str, bytes] = {}
    for (key, seg), run in zip(ordered, run_of):
        start = seg.offset - runs[run][1]
        data_of[key] = data = datas[run][start : start + seg.length]
        out.append(ObjectMeta(
            key=key, rank=None, file=seg.file, byte_offset=seg.offset, byte_length=seg.length,
            crc32c=crc32c.crc32c(data), codec=codec_of(data),
        ))
    out += indexed_aliases(out, lambda meta: _group_params(meta, data_of[meta.key]))
    return tuple(sorted(out, key=lambda o: o.key))


def _group_params(meta: ObjectMeta, data: bytes) -> Any:
    """The decoded ``params`` list of an indexed param group; ``None`` when it needs full unpickling."""
    if meta.codec != "torch":
        return None
    try:
        return decode_object(data, meta.codec, meta.key, allow_pickle=False)
    except CheckpointError:
        return None


# -- tensor chunks: where the raw bytes are inside each torch.save archive -------------------------------
class _Missing(Exception):
    """Parsing a segment needs bytes ``[start, end)`` (segment-relative) that were not read yet."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__(start, end)
        self.start, self.end = start, end


class _Unreadable(Exception):
    """The segment is valid but not something tierckpt reads in place; the message says what it is."""


class _Probe:
    """The bytes of one segment read so far."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.parts: list[tuple[int, bytes]] = []

    def take(self, start: int, n: int) -> bytes:
        if start < 0 or n < 0 or start + n > self.length:
            raise CorruptCheckpointError(f"a zip record points to bytes {start}..{start + n}, past the segment's {self.length}")
        for at, data in self.parts:
            if at <= start and start + n <= at + len(data):
                return data[start - at : start - at + n]
        raise _Missing(start, start + n)


def _first_reads(length: int) -> list[tuple[int, int]]:
    if length <= 2 * PROBE_BYTES:
        return [(0, length)]
    return [(0, PROBE_BYTES), (length - PROBE_BYTES, length)]


def _locate(backend: Backend, tensors: dict[str, TensorMeta], chunks: list[Chunk]) -> list[PieceMeta]:
    """A piece per chunk, its byte range being the chunk's raw bytes inside its ``torch.save`` archive."""
    uri = backend.root_uri
    probes = [_Probe(seg.length) for _, _, seg in chunks]
    wanted = {i: _first_reads(seg.length) for i, (_, _, seg) in enumerate(chunks)}
    found: dict[int, PieceMeta] = {}
    for _ in range(MAX_ROUNDS):
        ranges = [(i, s, e) for i, spans in wanted.items() for s, e in spans]
        datas = _read_ranges(backend, [(chunks[i][2].file, chunks[i][2].offset + s, chunks[i][2].offset + e) for i, s, e in ranges])
        for (i, s, _), data in zip(ranges, datas):
            probes[i].parts.append((s, data))
        wanted = {}
        for i in sorted({i for i, _, _ in ranges}):
            fqn, box, seg = chunks[i]
            tensor = tensors[fqn]
            try:
                start = _raw_data_offset(probes[i], tensor.torch_dtype, box.lengths)
            except _Missing as need:
                wanted[i] = [(need.start, min(seg.length, max(need.end, need.start + PROBE_BYTES)))]
                continue
            except _Unreadable as exc:
                raise CheckpointError(
                    f"{uri!r} is a torch DCP checkpoint that tierckpt cannot read in place: the chunk of {fqn!r} at "
                    f"{box.offsets} in {seg.file!r} {exc}; convert it: {convert_command(uri)}"
                ) from None
            except (CorruptCheckpointError, pickle.UnpicklingError, struct.error, EOFError, ValueError, TypeError,
                    KeyError, IndexError, AttributeError, RecursionError, UnicodeDecodeError) as exc:
                raise CorruptCheckpointError(
                    f"DCP checkpoint {uri!r}: the chunk of {fqn!r} at {box.offsets} in {seg.file!r} "
                    f"(bytes {seg.offset}..{seg.offset + seg.length}) is not a readable torch.save archive: {exc}"
                ) from exc
            found[i] = PieceMeta(
                fqn=fqn, region=box, file=seg.file, byte_offset=seg.offset + start,
                byte_length=box.numel * itemsize(tensor.torch_dtype), crc32c=0,
            )
        if not wanted:
            return [found[i] for i in range(len(chunks))]
    raise CorruptCheckpointError(f"DCP checkpoint {uri!r}: the zip records of a chunk were not found in {MAX_ROUNDS} reads")


_EOCD = struct.Struct("<4sHHHHIIH")
_EOCD64_LOCATOR = struct.Struct("<4sIQI")
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_U32 = 0xFFFFFFFF


def _raw_data_offset(probe: _Probe, dtype: torch.dtype, sizes: tuple[int, ...]) -> int:
    """Where a ``torch.save``-d chunk's raw, row-major bytes start inside its segment."""
    records = _central_directory(probe)
    pickles = [n for n in records if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise _Unreadable("is not a torch.save archive (no data.pkl record; a DCP file written as safetensors?)")
    prefix = pickles[0][: -len("data.pkl")]
    if prefix + "byteorder" in records:
        start, n = _record(probe, records, prefix + "byteorder")
        if probe.take(start, n) != b"little":
            raise _Unreadable("was saved big-endian")
    start, n = _record(probe, records, prefix + "data.pkl")
    if n > MAX_PICKLE_BYTES:
        raise CorruptCheckpointError(f"its data.pkl claims {n} bytes")
    saved = _TensorPickle(probe.take(start, n)).load()
    if not isinstance(saved, _SavedTensor):
        raise _Unreadable(f"holds a {type(saved).__name__}, not a tensor")
    if saved.dtype != dtype or saved.size != tuple(sizes):
        raise CorruptCheckpointError(f"holds a {saved.dtype} tensor of shape {list(saved.size)}, the metadata says {dtype} {list(sizes)}")
    row_major = [math.prod(sizes[d + 1 :]) for d in range(len(sizes))]
    if any(n > 1 and s != r for n, s, r in zip(sizes, saved.stride, row_major)):
        raise _Unreadable(f"is stored with strides {list(saved.stride)}, not row-major (e.g. channels-last)")
    item = itemsize(dtype)
    start, n = _record(probe, records, f"{prefix}data/{saved.storage.key}")
    if saved.offset * item + math.prod(sizes) * item > n:
        raise CorruptCheckpointError(f"its data record holds {n} bytes, fewer than the tensor needs")
    return start + saved.offset * item


def _central_directory(probe: _Probe) -> dict[str, tuple[int, int, int, int]]:
    """Record name -> (compression method, compressed size, size, local header offset)."""
    end = probe.length - _EOCD.size
    if end < 0:
        raise _Unreadable("is not a torch.save archive (too short)")
    sig, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack(probe.take(end, _EOCD.size))
    if sig != b"PK\x05\x06":
        raise _Unreadable("is not a torch.save archive (no zip end record; a DCP file written as safetensors?)")
    if count == 0xFFFF or cd_size == _U32 or cd_offset == _U32:
        sig, _, at, _ = _EOCD64_LOCATOR.unpack(probe.take(end - _EOCD64_LOCATOR.size, _EOCD64_LOCATOR.size))
        if sig != b"PK\x06\x07":
            raise CorruptCheckpointError("its zip64 end record locator is missing")
        sig, *_, count, cd_size, cd_offset = _EOCD64.unpack(probe.take(at, _EOCD64.size))
        if sig != b"PK\x06\x06":
            raise CorruptCheckpointError("its zip64 end record is missing")
    if count > MAX_RECORDS:
        raise CorruptCheckpointError(f"its zip directory claims {count} records")
    directory = probe.take(cd_offset, cd_size)
    records: dict[str, tuple[int, int, int, int]] = {}
    pos = 0
    for _ in range(count):
        sig, _, _, _, method, _, _, _, csize, size, nlen, elen, clen, _, _, _, local = _CENTRAL.unpack_from(directory, pos)
        if sig != b"PK\x01\x02":
            raise CorruptCheckpointError("its zip directory is malformed")
        name = directory[pos + _CENTRAL.size : pos + _CENTRAL.size + nlen].decode()
        extra = directory[pos + _CENTRAL.size + nlen : pos + _CENTRAL.size + nlen + elen]
        size, csize, local = _zip64_values(extra, [size, csize, local])
        records[name] = (method, csize, size, local)
        pos += _CENTRAL.size + nlen + elen + clen
    return records


def _zip64_values(extra: bytes, values: list[int]) -> list[int]:
    """Replace the 0xFFFFFFFF values among (size, compressed size, offset) by those of the zip64 extra field."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            wide = extra[pos + 4 : pos + 4 + n]
            k = 0
            for i, v in enumerate(values):
                if v == _U32:
                    (values[i],) = struct.unpack_from("<Q", wide, k)
                    k += 8
            return values
        pos += 4 + n
    return values


def _record(probe: _Probe, records: dict[str, tuple[int, int, int, int]], name: str) -> tuple[int, int]:
    """Start and size of a stored (uncompressed) record's data inside the segment."""
    if name not in records:
        raise _Unreadable(f"has no {name!r} record")
    method, csize, size, local = records[name]
    if method != 0 or csize != size:
        raise _Unreadable(f"has a compressed {name!r} record")
    sig, *_, nlen, elen = _LOCAL.unpack(probe.take(local, _LOCAL.size))
    if sig != b"PK\x03\x04":
        raise CorruptCheckpointError(f"the local header of {name!r} is malformed")
    start = local + _LOCAL.size + nlen + elen
    if start + size > probe.length:
        raise CorruptCheckpointError(f"record {name!r} runs past the segment")
    return start, size


# -- data.pkl of one tensor: read what describes it, build nothing -------------------------------------
@dataclass(frozen=True, slots=True)
class _StorageRef:
    key: str
    dtype: torch.dtype | None
    """``None`` for an untyped storage (``_rebuild_tensor_v3`` names the dtype)."""


@dataclass(frozen=True, slots=True)
class _SavedTensor:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: torch.dtype | None


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, dtype: Any, metadata: Any) -> _SavedTensor:
    if not isinstance(storage, _StorageRef) or not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError("its data.pkl rebuilds a tensor from something that is not a storage")
    if metadata:
        raise _Unreadable(f"is a tensor with extra metadata {sorted(metadata)!r} (conjugate or negative bits)")
    return _SavedTensor(
        storage=storage, offset=_int(offset, "storage offset"), size=tuple(_int(n, "size") for n in size),
        stride=tuple(_int(s, "stride") for s in stride), dtype=dtype,
    )


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any = None) -> _SavedTensor:
    return _rebuild(storage, offset, size, stride, getattr(storage, "dtype", None), metadata)


def _rebuild_v3(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, metadata: Any = None,
) -> _SavedTensor:
    return _rebuild(storage, offset, size, stride, dtype, metadata)


@functools.cache
def _tensor_globals() -> dict[tuple[str, str], Any]:
    """The globals of a plain tensor's ``data.pkl``; storage classes and rebuild functions become markers."""
    allowed: dict[tuple[str, str], Callable[..., Any] | Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
        ("collections", "OrderedDict"): OrderedDict,
        ("torch.storage", "UntypedStorage"): _StorageType(None),
        ("torch", "UntypedStorage"): _StorageType(None),
    }
    allowed.update({("torch", name): _StorageType(dtype) for dtype, name in torch.storage._dtype_to_storage_type_map().items()})
    allowed.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
    return allowed


class _TensorPickle(pickle.Unpickler):
    """Reads one tensor's ``data.pkl`` into a :class:`_SavedTensor`; refuses anything else."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))

    def find_class(self, module: str, name: str) -> Any:
        found = _tensor_globals().get((module, name))
        if found is None:
            raise _Unreadable(f"is not a plain tensor (its data.pkl refers to {module}.{name})")
        return found

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[2], str)):
            raise CorruptCheckpointError(f"its data.pkl has an unexpected storage reference {pid!r}")
        return _StorageRef(key=pid[2], dtype=pid[1].dtype)
