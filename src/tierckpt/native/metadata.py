"""Checkpoint metadata: what was saved and where its bytes are, and its codecs. Never pickled.

Three documents per checkpoint generation (see docs/format.md):

* ``meta/header.json`` — :class:`CheckpointMeta`: format version, the world that saved it, files,
  non-tensor objects, totals, timings and user tags.
* ``meta/tensors.parquet`` — one row per tensor (:class:`TensorMeta`): fqn, dtype, global shape.
* ``meta/pieces.parquet`` — one row per saved piece (:class:`PieceMeta`): its region, file, byte
  range and checksum, sorted by fqn in small row groups, so a rank reads only the row groups of the
  tensors it loads (:func:`decode_pieces` skips the rest using the fqn column's statistics).

The records themselves are in :mod:`tierckpt.native.records` (imported from here, with the codecs); this
module encodes and decodes the documents. Decoding validates everything it returns (names, shapes,
regions, byte lengths, keys), so a crafted file yields :class:`~tierckpt.errors.CorruptCheckpointError`
and never an out-of-bounds read.
"""

from __future__ import annotations

import bisect
import io
import json
import math
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tierckpt.errors import CheckpointError, CorruptCheckpointError
from tierckpt.native.keys import validate_key
from tierckpt.native.layout import FORMAT_NAME, FORMAT_VERSION, validate_generation
from tierckpt.native.records import (
    FORMAT_MINOR, MAX_NDIM, MAX_NUMEL, CheckpointMeta, FileMeta, ObjectMeta, PieceMeta, TensorMeta, dtype_from_name,
    dtype_name, itemsize,
)
from tierckpt.native.regions import Box, FlatRange, Region

__all__ = [
    "FORMAT_MINOR", "MAX_HEADER_BYTES", "MAX_NDIM", "MAX_NUMEL", "MAX_TABLE_BYTES", "CheckpointMeta", "FileMeta",
    "ObjectMeta", "PieceMeta", "TensorMeta", "decode_header", "decode_pieces", "decode_tensors", "dtype_from_name",
    "dtype_name", "encode_header", "encode_pieces", "encode_tensors", "itemsize",
]


# -- header (JSON) ---------------------------------------------------------------------------------
_HEADER_FIELDS = tuple(f.name for f in fields(CheckpointMeta))
_OBJECT_FIELDS = tuple(f.name for f in fields(ObjectMeta))
_FILE_FIELDS = tuple(f.name for f in fields(FileMeta))


def encode_header(meta: CheckpointMeta) -> bytes:
    """The header's JSON: ``dataclasses.asdict``'s document, built field by field (``asdict`` deep-copies
    every value through its generic recursion: a quarter of the saver thread's CPU per checkpoint)."""
    doc: dict[str, Any] = {name: getattr(meta, name) for name in _HEADER_FIELDS}
    doc["files"] = [{name: getattr(f, name) for name in _FILE_FIELDS} for f in meta.files]
    doc["objects"] = [{name: getattr(o, name) for name in _OBJECT_FIELDS} for o in meta.objects]
    doc["format"] = FORMAT_NAME
    # Compact: json's C encoder writes it (``indent`` takes the pure-Python one, 5x slower on every save).
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _int(value: Any, what: str, lo: int = 0, hi: int = MAX_NUMEL * 16) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CorruptCheckpointError(f"invalid {what} {value!r} in checkpoint metadata")
    return value


MAX_HEADER_BYTES = 64 << 20
"""Largest ``meta/header.json`` a reader accepts (read whole: a crafted size must not exhaust memory)."""
MAX_TABLE_BYTES = 1 << 30
"""Largest Parquet table a reader reads whole."""
MAX_UNIX_TIME = 1e11
"""Timestamps past this (year 5138) are corruption, not dates."""


def decode_header(data: bytes, name: str = "meta/header.json") -> CheckpointMeta:
    """The validated header; any malformed field raises :class:`CorruptCheckpointError` naming ``name`` and the field."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, over-long ints, deep nesting
        raise CorruptCheckpointError(f"checkpoint header {name} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"checkpoint header {name} does not name the tierckpt format")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"checkpoint format version {version!r} in {name} is not supported (this tierckpt reads {FORMAT_VERSION}); "
            "upgrade tierckpt to read it"
        )

    def field(key: str, convert: Any, *default: Any) -> Any:
        if key not in doc:
            if default:
                return default[0]
            raise CorruptCheckpointError(f"checkpoint header {name} has no field {key!r}")
        try:
            return convert(doc[key])
        except (CorruptCheckpointError, KeyError, TypeError, AttributeError, ValueError, OverflowError) as exc:
            detail = str(exc) if isinstance(exc, CorruptCheckpointError) else f"{type(exc).__name__}: {exc}"
            raise CorruptCheckpointError(f"checkpoint header {name}: field {key!r} is malformed: {detail}") from exc

    world = field("world_size", lambda v: _int(v, "world_size", 1, 1 << 24))
    return CheckpointMeta(
        format_minor=field("format_minor", lambda v: _int(v, "format_minor"), 0),
        generation=field("generation", validate_generation),
        world_size=world,
        created_unix=field("created_unix", lambda v: _float(v, "created_unix", 0.0, MAX_UNIX_TIME)),
        frameworks=field("frameworks", lambda v: tuple(_str(x, "framework") for x in _list(v)), ()),
        files=field("files", lambda v: tuple(_file_meta(f) for f in _list(v))),
        objects=field("objects", lambda v: tuple(_object_meta(o, world) for o in _list(v))),
        num_tensors=field("num_tensors", lambda v: _int(v, "num_tensors")),
        num_pieces=field("num_pieces", lambda v: _int(v, "num_pieces")),
        tensor_bytes=field("tensor_bytes", lambda v: _int(v, "tensor_bytes")),
        timings=field("timings", lambda v: {_str(k, "timing name"): _float(x, "timing") for k, x in _dict(v).items()}, {}),
        tags=field("tags", lambda v: {_str(k, "tag"): _str(_scalar_text(x), "tag value") for k, x in _dict(v).items()}, {}),
        structure=field("structure", lambda v: {
            _str(k, "structure node"): [_str(x, "structure name") for x in _list(names)] for k, names in _dict(v).items()
        } if v is not None else None, None),
    )


def _object_meta(o: Any, world: int) -> ObjectMeta:
    o = _dict(o)
    return ObjectMeta(
        key=_str(o["key"], "object key"),
        rank=None if o["rank"] is None else _int(o["rank"], "object rank", 0, world - 1),
        file=validate_key(o["file"]),
        byte_offset=_int(o["byte_offset"], "object offset"),
        byte_length=_int(o["byte_length"], "object length"),
        crc32c=_int(o["crc32c"], "object checksum", 0, 2**32 - 1),
        codec=_codec(o["codec"]),
    )


def _file_meta(f: Any) -> FileMeta:
    f = _dict(f)
    return FileMeta(key=validate_key(f["key"]), size=_int(f["size"], "file size"))


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"expected a list, found {type(value).__name__}")
    return value


def _dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"expected an object, found {type(value).__name__}")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str) or "\x00" in value:
        raise CorruptCheckpointError(f"invalid {what} {value!r}: expected a string without NUL")
    return value


def _scalar_text(value: Any) -> Any:
    """Tags saved as numbers or booleans read back as their text (nested values stay invalid)."""
    return str(value) if isinstance(value, (int, float, bool)) or value is None else value


def _float(value: Any, what: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not lo <= value <= hi:
        raise CorruptCheckpointError(f"invalid {what} {value!r}: expected a finite number in [{lo}, {hi}]")
    return float(value)


def _codec(name: Any) -> str:
    if name not in ("torch", "pickle"):
        raise CorruptCheckpointError(f"unknown object codec {name!r} in checkpoint metadata")
    return name


# -- tensors and pieces (Parquet) ------------------------------------------------------------------
_TENSOR_SCHEMA = pa.schema([("fqn", pa.string()), ("dtype", pa.string()), ("shape", pa.list_(pa.int64()))])
_PIECE_SCHEMA = pa.schema(
    [
        ("fqn", pa.string()),
        ("kind", pa.string()),
        ("offsets", pa.list_(pa.int64())),
        ("lengths", pa.list_(pa.int64())),
        ("file", pa.string()),
        ("byte_offset", pa.int64()),
        ("byte_length", pa.int64()),
        ("crc32c", pa.uint32()),
        ("crc_block_bytes", pa.int64()),
        ("block_crc32c", pa.list_(pa.uint32())),
    ]
)
_PIECE_SCHEMA_WITHOUT_BLOCKS = pa.schema(list(_PIECE_SCHEMA)[:8])
"""Pieces tables written before block checksums (still read; their pieces are one block each)."""
MAX_BLOCK_BYTES = 1 << 40
PIECES_PER_ROW_GROUP = 2048


def _to_parquet(table: pa.Table, row_group_size: int) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=row_group_size, compression="zstd", write_statistics=True)
    return sink.getvalue()


def encode_tensors(tensors: Iterable[TensorMeta]) -> bytes:
    rows = sorted(tensors, key=lambda t: t.fqn)
    table = pa.table(
        {"fqn": [t.fqn for t in rows], "dtype": [t.dtype for t in rows], "shape": [list(t.shape) for t in rows]},
        schema=_TENSOR_SCHEMA,
    )
    return _to_parquet(table, 1 << 16)


def decode_tensors(source: Any, rows: int | None = None) -> dict[str, TensorMeta]:
    """All tensors of a checkpoint by fqn; ``source`` is bytes, a path, or a file object. ``rows``: the
    count the header declares (``num_tensors``), checked against the table's footer before decoding."""
    table = _read_table(source, "tensors", rows)
    if table.schema.remove_metadata() != _TENSOR_SCHEMA:
        raise CorruptCheckpointError("the tensors table has an unexpected schema")
    out: dict[str, TensorMeta] = {}
    for fqn, dtype, shape in zip(*(_column(table, c, "tensors") for c in ("fqn", "dtype", "shape"))):
        if not isinstance(fqn, str) or not fqn:
            raise CorruptCheckpointError(f"invalid tensor name {fqn!r} in checkpoint metadata")
        dtype_from_name(dtype)
        out[fqn] = TensorMeta(fqn=fqn, dtype=dtype, shape=_shape(shape, fqn))
    return out


def _shape(shape: Any, fqn: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise CorruptCheckpointError(f"invalid shape {shape!r} for tensor {fqn!r} in checkpoint metadata")
    dims = tuple(_int(d, f"dimension of {fqn!r}", 0, MAX_NUMEL) for d in shape)
    if math.prod(dims) > MAX_NUMEL:
        raise CorruptCheckpointError(f"tensor {fqn!r} claims {math.prod(dims)} elements; refusing")
    return dims


def encode_pieces(pieces: Iterable[PieceMeta]) -> bytes:
    rows = sorted(pieces, key=lambda p: (p.fqn, p.file, p.byte_offset))
    kinds, offsets, lengths = [], [], []
    for p in rows:
        if isinstance(p.region, Box):
            kinds.append("box")
            offsets.append(list(p.region.offsets))
            lengths.append(list(p.region.lengths))
        else:
            kinds.append("flat")
            offsets.append([p.region.start])
            lengths.append([p.region.numel])
    table = pa.table(
        {
            "fqn": [p.fqn for p in rows],
            "kind": kinds,
            "offsets": offsets,
            "lengths": lengths,
            "file": [p.file for p in rows],
            "byte_offset": [p.byte_offset for p in rows],
            "byte_length": [p.byte_length for p in rows],
            "crc32c": [p.crc32c for p in rows],
            "crc_block_bytes": [p.block_bytes for p in rows],
            "block_crc32c": [list(p.block_crc32c) for p in rows],
        },
        schema=_PIECE_SCHEMA,
    )
    return _to_parquet(table, PIECES_PER_ROW_GROUP)


def decode_pieces(
    source: Any, tensors: dict[str, TensorMeta], fqns: Iterable[str] | None = None, rows: int | None = None,
) -> dict[str, list[PieceMeta]]:
    """Pieces of the tensors in ``fqns`` (all when ``None``), validated against ``tensors``.

    Only row groups whose fqn range can hold a wanted fqn are read. ``rows``: the count the header
    declares (``num_pieces``), checked against the table's footer before any row is decoded.
    """
    try:
        pf = pq.ParquetFile(pa.BufferReader(source) if isinstance(source, bytes) else source)
        _check_rows(pf, rows, "pieces")
        wanted = None if fqns is None else sorted(set(fqns))
        groups = list(range(pf.num_row_groups))
        schema = _pieces_schema(pf.schema_arrow)
        if wanted is not None:
            col = pf.schema_arrow.get_field_index("fqn")
            groups = [g for g in groups if _group_may_hold(pf.metadata.row_group(g).column(col).statistics, wanted)]
        table = pf.read_row_groups(groups, use_threads=_threads(source)) if groups else _PIECE_SCHEMA.empty_table()
    except CheckpointError:
        raise  # an unexpected schema, or the store failed (transient, not found...): not a broken table
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"cannot read the pieces table: {exc}") from exc
    if _pieces_schema(table.schema) != schema:
        raise CorruptCheckpointError("the pieces table has an unexpected schema")
    wanted_set = None if wanted is None else set(wanted)
    out: dict[str, list[PieceMeta]] = {}
    # Equal regions are one object: a load's plan compares the pieces' regions of tensors to find those saved
    # alike (planner.rank_plan), by identity first (in C), field by field only where they differ.
    shared: dict[Region, Region] = {}
    keys: dict[str, str] = {}  # each file's name checked once (a file holds many pieces)
    columns = [_column(table, name, "pieces") for name in schema.names]
    if schema == _PIECE_SCHEMA_WITHOUT_BLOCKS:
        columns += [[0] * table.num_rows, [[]] * table.num_rows]
    for fqn, kind, offsets, lengths, file, byte_offset, byte_length, crc, block_bytes, blocks in zip(*columns):
        if wanted_set is not None and fqn not in wanted_set:
            continue
        tensor = tensors.get(fqn)
        if tensor is None:
            raise CorruptCheckpointError(f"piece of unknown tensor {fqn!r} in checkpoint metadata")
        region = _region(kind, offsets, lengths, tensor)
        region = shared.setdefault(region, region)
        expected = region.numel * itemsize(tensor.torch_dtype)
        if byte_length != expected:
            raise CorruptCheckpointError(
                f"piece of {fqn!r} in {file!r} claims {byte_length} bytes, its region holds {expected}"
            )
        out.setdefault(fqn, []).append(
            PieceMeta(
                fqn=fqn,
                region=region,
                file=keys[file] if file in keys else keys.setdefault(file, validate_key(file)),
                byte_offset=_int(byte_offset, "byte offset"),
                byte_length=byte_length,
                crc32c=_int(crc, "checksum", 0, 2**32 - 1),
                **_block_checksums(block_bytes, blocks, byte_length, fqn, file),
            )
        )
    return out


def _pieces_schema(schema: pa.Schema) -> pa.Schema:
    """The pieces table's schema, which must be the current one or the one before block checksums."""
    schema = schema.remove_metadata()
    if schema not in (_PIECE_SCHEMA, _PIECE_SCHEMA_WITHOUT_BLOCKS):
        raise CorruptCheckpointError("the pieces table has an unexpected schema")
    return schema


def _block_checksums(block_bytes: Any, crcs: Any, byte_length: int, fqn: str, file: str) -> dict[str, Any]:
    """A piece's validated ``block_bytes`` and ``block_crc32c`` (one CRC per block, none when 0). The CRCs
    are a list of uint32 by the table's checked schema: only a null can be wrong in it."""
    block_bytes = _int(block_bytes, f"crc_block_bytes of a piece of {fqn!r} in {file!r}", 0, MAX_BLOCK_BYTES)
    expected = -(-byte_length // block_bytes) if block_bytes else 0
    if not isinstance(crcs, list) or len(crcs) != expected or None in crcs:
        count = len(crcs) if isinstance(crcs, list) else crcs
        raise CorruptCheckpointError(f"invalid block checksums of a piece of {fqn!r} in {file!r}: {count} (nulls: "
                                     f"{isinstance(crcs, list) and None in crcs}) for {byte_length} bytes in blocks of {block_bytes}")
    return {"block_bytes": block_bytes, "block_crc32c": tuple(crcs)}


def _group_may_hold(stats: Any, wanted: list[str]) -> bool:
    if stats is None or not stats.has_min_max:
        return True
    i = bisect.bisect_left(wanted, stats.min)
    return i < len(wanted) and wanted[i] <= stats.max


def _region(kind: Any, offsets: Any, lengths: Any, tensor: TensorMeta) -> Region:
    """A piece's region from its table row, checked against its tensor's shape. The table's schema was
    checked (lists of int64): a value can only be an int or a null, so nulls are all there is to look for."""
    shape = tensor.shape
    if offsets is None or lengths is None or None in offsets or None in lengths:
        raise _bad_region(kind, offsets, lengths, tensor)
    if kind == "box":
        if len(offsets) != len(shape) or len(lengths) != len(shape):
            raise _bad_region(kind, offsets, lengths, tensor)
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, lengths, shape)):
            raise _bad_region(kind, offsets, lengths, tensor)
        return Box(tuple(offsets), tuple(lengths))
    if kind == "flat":
        if len(offsets) != 1 or len(lengths) != 1 or offsets[0] < 0 or lengths[0] < 0:
            raise _bad_region(kind, offsets, lengths, tensor)
        if offsets[0] + lengths[0] > math.prod(shape):
            raise _bad_region(kind, offsets, lengths, tensor)
        return FlatRange(offsets[0], offsets[0] + lengths[0])
    raise _bad_region(kind, offsets, lengths, tensor)


def _bad_region(kind: Any, offsets: Any, lengths: Any, tensor: TensorMeta) -> CorruptCheckpointError:
    """The error for a piece's region that its tensor cannot hold (built only when raised: formatting it costs
    more than checking a region)."""
    return CorruptCheckpointError(f"invalid {kind} region {offsets}/{lengths} for tensor {tensor.fqn!r} of shape {tensor.shape}")


def _column(table: pa.Table, name: str, what: str) -> list[Any]:
    """A column as Python values; undecodable strings are corruption, not a crash."""
    try:
        return table.column(name).to_pylist()
    except (UnicodeDecodeError, pa.ArrowException, KeyError) as exc:
        raise CorruptCheckpointError(f"the {what} table's column {name!r} cannot be decoded: {exc}") from exc


def _check_rows(pf: pq.ParquetFile, rows: int | None, what: str) -> None:
    """Refuse a table whose footer counts other than the ``rows`` its header declares, before decoding:
    a few MB of a crafted table can expand to millions of rows (gigabytes once decoded)."""
    found = pf.metadata.num_rows
    if rows is not None and found != rows:
        raise CorruptCheckpointError(
            f"the {what} table holds {found} rows, the checkpoint header declares {rows}: the checkpoint is "
            "corrupt or not a tierckpt checkpoint; it is not decoded"
        )


def _read_table(source: Any, what: str, rows: int | None = None) -> pa.Table:
    try:
        # ParquetFile, not read_table: read_table goes through pyarrow.dataset, whose first import (with
        # pyarrow.compute) costs 0.05-0.1 s inside a fresh process's first load.
        pf = pq.ParquetFile(pa.BufferReader(source) if isinstance(source, bytes) else source)
        _check_rows(pf, rows, what)
        return pf.read(use_threads=_threads(source))
    except CheckpointError:
        raise  # the store failed (transient, not found...), not the table
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"cannot read the {what} table: {exc}") from exc


SMALL_TABLE_BYTES = 8 << 20
"""A table given as bytes up to this size is decoded on the calling thread: starting Arrow's thread pool
costs more than it saves on a small table (about 0.5 ms in a fresh process)."""


def _threads(source: Any) -> bool:
    return not (isinstance(source, bytes) and len(source) <= SMALL_TABLE_BYTES)
