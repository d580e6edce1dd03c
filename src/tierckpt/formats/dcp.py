"""Reading a torch.distributed.checkpoint (DCP) directory in place, as a tierckpt checkpoint.

A DCP directory (``FileSystemWriter`` or ``FsspecWriter``) holds ``.metadata``, a pickle of DCP's
``Metadata``, and data files ``__<rank>_<n>.distcp``. Each saved chunk of a tensor is a segment of a
data file (file, offset, length) holding ``torch.save`` of that chunk: an uncompressed zip archive
whose record ``<archive>/data/<key>`` is the chunk's raw bytes. This module finds those bytes
without unpickling any tensor and describes every chunk as a :class:`~tierckpt.native.metadata.PieceMeta`
(a box, its file and byte range), so the ordinary loader reads a DCP checkpoint with its own
planner: byte-range reads, each byte read once per group, any resharding.

How (rank 0, when a load or ``tierckpt inspect`` finds ``.metadata`` and no ``COMMIT``):

1. ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, which admits only DCP's metadata
   classes, ``torch.Size``, dtypes, layouts, memory formats, paths and builtin data types, each handed
   out as a stand-in made for this file (:mod:`tierckpt.formats.pickle_seal`): a crafted file can neither run
   code nor change a global of the process, it is refused with :class:`~tierckpt.errors.CorruptCheckpointError`.
2. For every tensor chunk, both ends of its segment are read, all chunks at once; the standard
   library's zipfile then reads the archive from those bytes (fetching any others it needs with
   ranged reads, within caps), and :mod:`tierckpt.formats.dcp_chunks` finds where the raw bytes start.
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
but ``COMMIT`` to be immutable: its reader (:data:`tierckpt.formats.select.DCP`) hands this module the chain
below the node cache.
"""

from __future__ import annotations

import asyncio
import functools
import io
import pathlib
import pickle
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

from tierckpt.backends import Backend
from tierckpt.formats.reader import Root
from tierckpt.formats.dcp_chunks import SegmentFile, Unreadable, first_reads, raw_data_offset
from tierckpt.native.keys import validate_key
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from tierckpt.io.scheduler import ReadRequest, get_scheduler
from tierckpt.native.metadata import (
    CheckpointMeta, FileMeta, ObjectMeta, PieceMeta, TensorMeta, _int, _shape, dtype_name, itemsize,
)
from tierckpt.formats.objects import codec_of, decode_object
from tierckpt.state.optim_groups import indexed_aliases
from tierckpt.formats.pickle_seal import Constructor, SealedGlobals, sealed_class
from tierckpt.native.regions import Box

FORMAT = "torch DCP"
"""The reader's name (:attr:`tierckpt.formats.reader.CheckpointReader.format`)."""
METADATA_KEY = ".metadata"
FORMAT_TAG = "torch_dcp_version"
"""Header tag of a checkpoint read from a DCP directory; its value is DCP's metadata version."""

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


def holds(root: Root) -> bool:
    """Whether ``root`` is a DCP directory (``.metadata``, or DCP's data or per-rank metadata files)."""
    return root.has(METADATA_KEY) or any(_DCP_FILE.match(k) for k in root.keys)


def read_dcp(backend: Backend) -> DcpCheckpoint:
    """Header, tensor table and every piece of the DCP checkpoint at the root of ``backend`` (a chain
    below the node cache)."""
    uri = backend.root_uri
    sched = get_scheduler()
    try:
        raw = sched.run(backend.get_capped(METADATA_KEY, MAX_METADATA_BYTES))
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
MAX_METADATA_BYTES = 256 << 20
"""The largest ``.metadata`` read (refused unread, from its size): it grows with tensors x chunks, about
200 bytes per chunk: over a million chunks)."""


def _tensor_properties_state(self: Any, state: Any) -> None:
    """``TensorProperties.__setstate__`` given the memory format's encoding as its number: the pickle gets
    no enum member (they are process-wide objects; ``BUILD`` could change one)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, TensorProperties

    dtype, layout, requires_grad, encoding, pin_memory = state
    TensorProperties.__setstate__(self, (dtype, layout, requires_grad, _MEM_FORMAT_ENCODING(encoding), pin_memory))


def _memory_format_number(value: Any) -> int:
    """What the pickle's ``_MEM_FORMAT_ENCODING(value)`` becomes: the checked number, not the shared member."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    return _MEM_FORMAT_ENCODING(value).value


@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Every global a DCP ``.metadata`` pickle may name, and what it resolves to (each unpickler hands out
    :func:`~tierckpt.formats.pickle_seal.sealed` stand-ins of these, never the globals themselves)."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as dcp_metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex",
            "StorageMeta",
        )
    }
    allowed[("torch.distributed.checkpoint.metadata", "TensorProperties")] = sealed_class(
        dcp_metadata.TensorProperties, __setstate__=_tensor_properties_state,
    )
    allowed[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = Constructor(_memory_format_number)
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
        allowed.update({(module, n): Constructor(pathlib.PurePosixPath) for n in ("PosixPath", "PurePosixPath")})
        allowed.update({(module, n): Constructor(pathlib.PureWindowsPath) for n in ("WindowsPath", "PureWindowsPath")})
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global is refused before it is looked up, and the admitted ones
    are handed out sealed (:mod:`tierckpt.formats.pickle_seal`): the file builds values, it changes no global."""

    def __init__(self, data: bytes, uri: str) -> None:
        super().__init__(io.BytesIO(data))
        self.uri = uri
        self.admitted = SealedGlobals(_metadata_globals())

    def find_class(self, module: str, name: str) -> Any:
        found = self.admitted.get(module, name)
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
    place whichever convention saved them (:func:`tierckpt.state.optim_groups.indexed_aliases`)."""
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


# -- tensor chunks: where the raw bytes are inside each torch.save archive (dcp_chunks) ------------------
def _locate(backend: Backend, tensors: dict[str, TensorMeta], chunks: list[Chunk]) -> list[PieceMeta]:
    """A piece per chunk, its byte range being the chunk's raw bytes inside its ``torch.save`` archive.
    Both ends of every segment are read first, all at once; zipfile fetches what else it needs."""
    uri = backend.root_uri
    segments = [SegmentFile(backend, seg.file, seg.offset, seg.length) for _, _, seg in chunks]
    spans = [(i, s, e) for i, (_, _, seg) in enumerate(chunks) for s, e in first_reads(seg.length)]
    datas = _read_ranges(backend, [(chunks[i][2].file, chunks[i][2].offset + s, chunks[i][2].offset + e) for i, s, e in spans])
    for (i, s, _), data in zip(spans, datas):
        segments[i].add(s, data)
    pieces = []
    for (fqn, box, seg), segment in zip(chunks, segments):
        tensor = tensors[fqn]
        try:
            start = raw_data_offset(segment, tensor.torch_dtype, box.lengths)
        except Unreadable as exc:
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
        pieces.append(PieceMeta(
            fqn=fqn, region=box, file=seg.file, byte_offset=seg.offset + start,
            byte_length=box.numel * itemsize(tensor.torch_dtype), crc32c=0,
        ))
    return pieces
