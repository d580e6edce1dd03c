"""Metadata codec: round trips, row-group skipping, and hostile input that must only ever raise
CorruptCheckpointError (never another exception, never a value that points outside the checkpoint)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierckpt.errors import CorruptCheckpointError
from tierckpt.native.metadata import (
    FORMAT_VERSION, MAX_NUMEL, PIECES_PER_ROW_GROUP, CheckpointMeta, FileMeta, ObjectMeta, PieceMeta, TensorMeta,
    decode_header, decode_pieces, decode_tensors, encode_header, encode_pieces, encode_tensors,
)
from tierckpt.native.regions import Box, FlatRange

TENSORS = {
    "w": TensorMeta(fqn="w", dtype="bfloat16", shape=(4, 6)),
    "flat": TensorMeta(fqn="flat", dtype="float32", shape=(3, 5)),
    "scalar": TensorMeta(fqn="scalar", dtype="int64", shape=()),
    "empty": TensorMeta(fqn="empty", dtype="bool", shape=(0, 7)),
}


def header(**changes) -> CheckpointMeta:
    base = dict(
        generation="g-0001700000000000-abcdef012345",
        world_size=4,
        created_unix=1700000000.25,
        frameworks=("fsdp2", "optimizer"),
        files=(FileMeta(key="data/rank-00000.bin", size=4096), FileMeta(key="objects/rank-00001.bin", size=12)),
        objects=(
            ObjectMeta(key="step", rank=None, file="objects/rank-00001.bin", byte_offset=0, byte_length=12,
                       crc32c=2**32 - 1, codec="torch"),
            ObjectMeta(key="rng", rank=3, file="objects/rank-00003.bin", byte_offset=7, byte_length=1,
                       crc32c=0, codec="pickle"),
        ),
        num_tensors=4,
        num_pieces=5,
        tensor_bytes=112,
        timings={"rank0.write": 0.5},
        tags={"run": "a/b"},
    )
    base.update(changes)
    return CheckpointMeta(**base)


def header_doc(**changes) -> dict:
    doc = json.loads(encode_header(header()))
    doc.update(changes)
    return doc


def piece(fqn="w", region=Box((0, 0), (2, 6)), file="data/rank-00000.bin", byte_offset=0, byte_length=None, crc=7):
    if byte_length is None:
        byte_length = region.numel * {"bfloat16": 2, "float32": 4, "int64": 8, "bool": 1}[TENSORS[fqn].dtype]
    return PieceMeta(fqn=fqn, region=region, file=file, byte_offset=byte_offset, byte_length=byte_length, crc32c=crc)


PIECES = [
    piece(),
    piece(region=Box((2, 0), (2, 6)), file="data/rank-00001.bin", crc=2**32 - 1),
    piece("flat", FlatRange(3, 11), byte_offset=64),
    piece("flat", FlatRange(0, 3), file="data/rank-00002.bin"),
    piece("flat", FlatRange(11, 15), file="data/rank-00003.bin", byte_offset=128),
    piece("scalar", Box((), ()), byte_offset=192),
    piece("empty", Box((0, 0), (0, 7)), byte_offset=256),
]


# -- round trips -------------------------------------------------------------------------------------
def test_the_header_is_the_json_of_every_field():
    """Built field by field, the header is exactly the document ``dataclasses.asdict`` gives (and its format)."""
    import dataclasses

    meta = header(structure={"": ["model", "optim"], "model": ["w"]}, frameworks=("ddp", "optimizer"))
    expected = {**dataclasses.asdict(meta), "format": "tierckpt"}
    assert json.loads(encode_header(meta)) == json.loads(json.dumps(expected))


def test_header_round_trip():
    """encode_header/decode_header preserve every field, including None ranks and both codecs."""
    meta = header()
    assert decode_header(encode_header(meta)) == meta


def test_tensors_round_trip():
    """encode_tensors/decode_tensors preserve dtype and shape, including 0-d and zero-size shapes."""
    assert decode_tensors(encode_tensors(TENSORS.values())) == TENSORS


def test_pieces_round_trip():
    """Box, flat, 0-d and zero-size pieces come back identical (grouped by fqn)."""
    decoded = decode_pieces(encode_pieces(PIECES), TENSORS)
    assert sorted((p for ps in decoded.values() for p in ps), key=repr) == sorted(PIECES, key=repr)
    assert decoded["scalar"][0].region == Box((), ())
    assert {p.region for p in decoded["flat"]} == {FlatRange(0, 3), FlatRange(3, 11), FlatRange(11, 15)}


def test_decode_pieces_filter_returns_exactly_the_wanted_rows():
    """An fqn filter returns only the wanted tensors' pieces; unknown fqns give nothing."""
    data = encode_pieces(PIECES)
    decoded = decode_pieces(data, TENSORS, ["flat", "scalar", "nope"])
    assert set(decoded) == {"flat", "scalar"}
    assert len(decoded["flat"]) == 3 and len(decoded["scalar"]) == 1
    assert decode_pieces(data, TENSORS, []) == {}


def test_decode_pieces_reads_only_matching_row_groups(monkeypatch):
    """With > PIECES_PER_ROW_GROUP rows spread over many fqns, a one-fqn filter reads one row group."""
    n = 3 * PIECES_PER_ROW_GROUP + 100
    tensors = {f"t{i:05d}": TensorMeta(fqn=f"t{i:05d}", dtype="float32", shape=(4,)) for i in range(n)}
    pieces = [PieceMeta(fqn=f, region=Box((0,), (4,)), file="data/rank-00000.bin", byte_offset=16 * i,
                        byte_length=16, crc32c=i) for i, f in enumerate(tensors)]
    data = encode_pieces(pieces)
    assert pq.ParquetFile(pa.BufferReader(data)).num_row_groups == 4
    seen: list[list[int]] = []
    original = pq.ParquetFile.read_row_groups

    def spy(self, row_groups, *args, **kwargs):
        seen.append(list(row_groups))
        return original(self, row_groups, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", spy)
    wanted = f"t{2 * PIECES_PER_ROW_GROUP + 5:05d}"
    decoded = decode_pieces(data, tensors, [wanted])
    assert seen == [[2]]
    assert list(decoded) == [wanted] and decoded[wanted][0].crc32c == 2 * PIECES_PER_ROW_GROUP + 5
    seen.clear()
    assert len(decode_pieces(data, tensors)) == n
    assert seen == [[0, 1, 2, 3]]


# -- hostile input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["../x", "/etc/passwd", "data/../../x", "data//x", "./x", "a\\b", ""])
def test_piece_file_key_traversal_rejected(key):
    """A piece whose file key could leave the checkpoint root is rejected."""
    with pytest.raises(CorruptCheckpointError):
        decode_pieces(encode_pieces([piece(file=key)]), TENSORS)


@pytest.mark.parametrize("field", ["files", "objects"])
def test_header_file_key_traversal_rejected(field):
    """Header file and object keys are validated the same way."""
    doc = header_doc()
    doc[field][0]["key" if field == "files" else "file"] = "../../etc/passwd"
    with pytest.raises(CorruptCheckpointError):
        decode_header(json.dumps(doc).encode())


@pytest.mark.parametrize(
    "shape",
    [(1 << 30, 1 << 30, 1 << 30), (MAX_NUMEL + 1,), (-1, 4), tuple([1] * 65)],
    ids=["numel-overflow", "over-max", "negative", "too-many-dims"],
)
def test_absurd_tensor_shapes_rejected(shape):
    """Shapes with too many elements, negative dims or too many dims are refused."""
    data = encode_tensors([TensorMeta(fqn="w", dtype="float32", shape=shape)])
    with pytest.raises(CorruptCheckpointError):
        decode_tensors(data)


def test_unknown_dtype_rejected():
    with pytest.raises(CorruptCheckpointError, match="dtype"):
        decode_tensors(encode_tensors([TensorMeta(fqn="w", dtype="object", shape=(2,))]))


@pytest.mark.parametrize(
    "bad",
    [
        piece(byte_offset=-1),
        piece(region=Box((-1, 0), (2, 6)), byte_length=24),
        piece(region=Box((3, 0), (2, 6))),
        piece(region=Box((0, 0), (2, 7))),
        piece(region=Box((0,), (2,)), byte_length=4),
        piece("flat", FlatRange(10, 16), byte_length=24),
        piece("flat", FlatRange(-2, 3), byte_length=20),
        piece(byte_length=23),
        piece("scalar", Box((), ()), byte_length=0),
        piece(fqn="w", region=Box((0, 0), (2, 6))).__class__(
            fqn="ghost", region=Box((0,), (1,)), file="data/x", byte_offset=0, byte_length=4, crc32c=0),
    ],
    ids=["neg-offset", "neg-box", "box-past-end", "box-too-wide", "wrong-ndim", "flat-past-end", "neg-flat",
         "length-mismatch", "scalar-length", "unknown-fqn"],
)
def test_invalid_pieces_rejected(bad):
    """Negative offsets, regions outside the shape, inconsistent byte lengths, unknown tensors."""
    with pytest.raises(CorruptCheckpointError):
        decode_pieces(encode_pieces([bad]), TENSORS)


def crafted_pieces(**columns) -> bytes:
    """A pieces table with the right schema but arbitrary (possibly null) values."""
    from tierckpt.native.metadata import _PIECE_SCHEMA

    row = {"fqn": "w", "kind": "box", "offsets": [0, 0], "lengths": [2, 6], "file": "data/rank-00000.bin",
           "byte_offset": 0, "byte_length": 24, "crc32c": 5, "crc_block_bytes": 16, "block_crc32c": [1, 2]}
    row.update(columns)
    table = pa.Table.from_pylist([row], schema=_PIECE_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize(
    "columns",
    [{"offsets": [None, 0]}, {"lengths": [2, None]}, {"offsets": None}, {"kind": None}, {"kind": "sphere"},
     {"fqn": None}, {"file": None}, {"byte_offset": None}, {"byte_length": None}, {"crc32c": None},
     {"kind": "flat", "offsets": [0], "lengths": [None]}, {"crc_block_bytes": None}, {"crc_block_bytes": -1},
     {"block_crc32c": [1]}, {"block_crc32c": [1, None]}, {"block_crc32c": None}, {"crc_block_bytes": 0}],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_null_and_unknown_values_in_pieces_rejected(columns):
    """Nulls anywhere (including inside the offset/length lists) and unknown kinds are rejected."""
    assert decode_pieces(crafted_pieces(), TENSORS)["w"][0].region == Box((0, 0), (2, 6))
    with pytest.raises(CorruptCheckpointError):
        decode_pieces(crafted_pieces(**columns), TENSORS)


def test_tensors_table_with_wrong_schema_or_null_names_rejected():
    """A tensors table missing a column, or naming a tensor null, is corrupt."""
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"fqn": ["w"], "shape": [[2]]}), sink)
    with pytest.raises(CorruptCheckpointError):
        decode_tensors(sink.getvalue().to_pybytes())
    from tierckpt.native.metadata import _TENSOR_SCHEMA

    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([{"fqn": None, "dtype": "float32", "shape": [2]}], schema=_TENSOR_SCHEMA), sink)
    with pytest.raises(CorruptCheckpointError):
        decode_tensors(sink.getvalue().to_pybytes())


def test_pieces_table_with_wrong_schema_rejected():
    """A Parquet file that is not a pieces table (with or without an fqn filter) is corrupt."""
    data = encode_tensors(TENSORS.values())
    with pytest.raises(CorruptCheckpointError):
        decode_pieces(data, TENSORS)
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": [1, 2]}), sink)
    for fqns in (None, ["w"]):
        with pytest.raises(CorruptCheckpointError):
            decode_pieces(sink.getvalue().to_pybytes(), TENSORS, fqns)


@pytest.mark.parametrize("cut", [0, 4, 100, -8, -1])
def test_truncated_parquet_rejected(cut):
    """Truncated or garbage Parquet bytes give CorruptCheckpointError for both tables."""
    pieces, tensors = encode_pieces(PIECES), encode_tensors(TENSORS.values())
    with pytest.raises(CorruptCheckpointError):
        decode_pieces(pa.BufferReader(pieces[:cut]), TENSORS)
    with pytest.raises(CorruptCheckpointError):
        decode_pieces(pieces[:cut], TENSORS, ["w"])
    with pytest.raises(CorruptCheckpointError):
        decode_tensors(tensors[:cut])


@pytest.mark.parametrize("version", [0, 2, "1", None, 1.5])
def test_wrong_format_version_rejected(version):
    """Any version other than the one this code reads is refused with a message naming it."""
    with pytest.raises(CorruptCheckpointError, match="version"):
        decode_header(json.dumps(header_doc(format_version=version)).encode())
    assert FORMAT_VERSION == 1


@pytest.mark.parametrize(
    "data",
    [b"", b"not json", b"\xff\xfe\x00", b"[]", b"null", b'"tierckpt"', b'{"format": "other"}',
     b'{"format": "tierckpt", "x": ' + b"1" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000],
    ids=["empty", "text", "bad-utf8", "list", "null", "string", "other-format", "huge-int", "deep-nesting"],
)
def test_non_header_bytes_rejected(data):
    """Non-JSON, non-dict, foreign, over-long-integer and deeply nested documents are corrupt."""
    with pytest.raises(CorruptCheckpointError):
        decode_header(data)


@pytest.mark.parametrize(
    "changes",
    [
        {"world_size": 0}, {"world_size": True}, {"world_size": "4"}, {"generation": "../g"},
        {"generation": "g-a/b"}, {"created_unix": 10**400}, {"created_unix": "soon"}, {"timings": {"a": 10**400}},
        {"timings": [1]}, {"tags": None}, {"objects": 5}, {"files": [{"key": "x"}]}, {"num_tensors": -1},
    ],
    ids=repr,
)
def test_malformed_header_fields_rejected(changes):
    """Bad types, ranges, generation names and float overflows in the header are corrupt."""
    with pytest.raises(CorruptCheckpointError):
        decode_header(json.dumps(header_doc(**changes)).encode())


@pytest.mark.parametrize(
    "obj_changes",
    [{"rank": 4}, {"rank": -1}, {"codec": "marshal"}, {"crc32c": 2**32}, {"byte_offset": -5}, {"file": "/abs"}],
    ids=repr,
)
def test_malformed_object_records_rejected(obj_changes):
    """Object ranks outside the saved world, unknown codecs and out-of-range numbers are corrupt."""
    doc = header_doc()
    doc["objects"][0].update(obj_changes)
    with pytest.raises(CorruptCheckpointError):
        decode_header(json.dumps(doc).encode())


# -- fuzz --------------------------------------------------------------------------------------------
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                      st.text(max_size=8))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=10)
header_keys = sorted(header_doc())


@st.composite
def mutated_header(draw):
    """A valid header document with some fields replaced, deleted or added at random."""
    doc = header_doc()
    for key in draw(st.lists(st.sampled_from(header_keys + ["extra"]), max_size=4)):
        if draw(st.booleans()):
            doc.pop(key, None)
        else:
            doc[key] = draw(json_value)
    if draw(st.booleans()) and doc.get("objects") and isinstance(doc["objects"], list):
        target = doc["objects"][0]
        if isinstance(target, dict) and target:  # a mutation may have left an empty one
            target[draw(st.sampled_from(sorted(target)))] = draw(json_value)
    return doc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(mutated_header().map(lambda d: json.dumps(d).encode()), st.binary(max_size=64),
                 json_value.map(lambda v: json.dumps(v).encode())))
def test_decode_header_fuzz_only_raises_corrupt(data):
    """Whatever the bytes, decode_header returns a CheckpointMeta or raises CorruptCheckpointError."""
    try:
        meta = decode_header(data)
    except CorruptCheckpointError:
        return
    assert isinstance(meta, CheckpointMeta)
