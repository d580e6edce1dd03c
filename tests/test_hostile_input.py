"""Crafted checkpoints: path escapes, symlinks out of the root, absurd sizes, pickles, fuzzed metadata.

Only :class:`CorruptCheckpointError` / :class:`CheckpointError` may come out, quickly, without reading
outside the checkpoint root, allocating unbounded memory or running code.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierckpt
from tierckpt.cli.main import main as cli_main
from tierckpt.errors import CheckpointError, CorruptCheckpointError
from tierckpt.native.metadata import decode_header, decode_pieces, decode_tensors

from tamper import reseal


def _save(root: Path) -> tuple[str, str]:
    uri = str(root / "ckpt")
    tierckpt.save(uri, {"w": torch.arange(64, dtype=torch.float32), "step": 3})
    gen = json.loads((root / "ckpt" / "COMMIT").read_text())["generation"]
    return uri, gen


def _target() -> dict[str, Any]:
    return {"w": torch.zeros(64), "step": -1}


def _rewrite_pieces(path: Path, **changes: Any) -> None:
    table = pq.read_table(path)
    cols = {name: table.column(name).to_pylist() for name in table.schema.names}
    for k, v in changes.items():
        cols[k] = [v] * table.num_rows
    pq.write_table(pa.table(cols, schema=table.schema), path)
    reseal(path.parents[2])


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/etc/passwd", "data/../../../etc/passwd", "data//x", "./data/rank-00000.bin"])
def test_piece_file_outside_root_refused(tmp_path: Path, bad: str) -> None:
    uri, gen = _save(tmp_path)
    _rewrite_pieces(tmp_path / "ckpt" / gen / "meta" / "pieces.parquet", file=bad)
    target = _target()
    with pytest.raises(CorruptCheckpointError):
        tierckpt.load(uri, target)
    assert torch.equal(target["w"], torch.zeros(64))


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/etc/hostname"])
def test_header_object_outside_root_refused(tmp_path: Path, bad: str) -> None:
    uri, gen = _save(tmp_path)
    header = tmp_path / "ckpt" / gen / "meta" / "header.json"
    doc = json.loads(header.read_text())
    doc["objects"][0]["file"] = bad
    header.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError):
        tierckpt.load(uri, _target())


def test_symlink_out_of_root_not_followed(tmp_path: Path) -> None:
    """data/rank-0.bin -> a file outside the root: never read as checkpoint data."""
    uri, gen = _save(tmp_path)
    data = tmp_path / "ckpt" / gen / "data" / "rank-00000.bin"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\x42" * data.stat().st_size)  # same size: only a symlink check can catch it
    data.unlink()
    data.symlink_to(outside)
    target = _target()
    with pytest.raises(CheckpointError):
        tierckpt.load(uri, target)  # without verify: the size check passes, so only refusing symlinks helps
    assert torch.equal(target["w"], torch.zeros(64))


def test_symlink_out_of_root_caught_by_verify(tmp_path: Path) -> None:
    uri, gen = _save(tmp_path)
    data = tmp_path / "ckpt" / gen / "data" / "rank-00000.bin"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\x42" * data.stat().st_size)
    data.unlink()
    data.symlink_to(outside)
    target = _target()
    with pytest.raises(CorruptCheckpointError):
        tierckpt.load(uri, target, verify=True)
    assert torch.equal(target["w"], torch.zeros(64))


def test_symlink_to_system_file_size_mismatch(tmp_path: Path) -> None:
    uri, gen = _save(tmp_path)
    data = tmp_path / "ckpt" / gen / "data" / "rank-00000.bin"
    data.unlink()
    data.symlink_to("/etc/hostname")
    with pytest.raises(CorruptCheckpointError):
        tierckpt.load(uri, _target())


def test_absurd_shape_refused_quickly(tmp_path: Path) -> None:
    uri, gen = _save(tmp_path)
    path = tmp_path / "ckpt" / gen / "meta" / "tensors.parquet"
    table = pq.read_table(path)
    cols = {n: table.column(n).to_pylist() for n in table.schema.names}
    cols["shape"] = [[1 << 31, 1 << 31]] * table.num_rows  # 2^62 elements
    pq.write_table(pa.table(cols, schema=table.schema), path)
    started = time.monotonic()
    with pytest.raises(CorruptCheckpointError):
        tierckpt.load(uri, _target())
    assert time.monotonic() - started < 5


def test_absurd_piece_count_bounded(tmp_path: Path) -> None:
    """A header claiming 10^7 pieces and 2^60 bytes: the loader trusts the tables, not the counts."""
    uri, gen = _save(tmp_path)
    header = tmp_path / "ckpt" / gen / "meta" / "header.json"
    doc = json.loads(header.read_text())
    doc["num_pieces"] = 10**7
    doc["tensor_bytes"] = 1 << 60
    header.write_text(json.dumps(doc))
    started = time.monotonic()
    target = _target()
    try:
        tierckpt.load(uri, target)
    except CorruptCheckpointError:
        pass
    assert time.monotonic() - started < 5


def test_absurd_file_size_and_offsets(tmp_path: Path) -> None:
    uri, gen = _save(tmp_path)
    _rewrite_pieces(tmp_path / "ckpt" / gen / "meta" / "pieces.parquet", byte_offset=1 << 62)
    started = time.monotonic()
    with pytest.raises(CorruptCheckpointError):
        tierckpt.load(uri, _target())
    assert time.monotonic() - started < 5


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


@pytest.mark.parametrize("codec", ["pickle", "torch"])
def test_pickle_object_refused_without_allow_pickle(tmp_path: Path, codec: str) -> None:
    uri, gen = _save(tmp_path)
    marker = tmp_path / "PWNED"
    payload = pickle.dumps({"x": _Marker(str(marker))})
    buf = io.BytesIO()
    torch.save(_Marker(str(marker)), buf)  # a torch.save container whose unpickling opens the marker file
    payload = buf.getvalue()
    assert not marker.exists()
    import crc32c

    obj_file = tmp_path / "ckpt" / gen / "objects" / "rank-00000.bin"
    obj_file.write_bytes(payload)
    header = tmp_path / "ckpt" / gen / "meta" / "header.json"
    doc = json.loads(header.read_text())
    for f in doc["files"]:
        if f["key"].startswith("objects/"):
            f["size"] = len(payload)
    doc["objects"][0].update(byte_offset=0, byte_length=len(payload), crc32c=crc32c.crc32c(payload), codec=codec)
    header.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError):
        tierckpt.load(uri, _target())
    assert not marker.exists(), "unpickling ran code"


# -- fuzz of the metadata decoders ---------------------------------------------------------------
def valid_documents() -> tuple[bytes, bytes, bytes]:
    from tierckpt.native.metadata import CheckpointMeta, FileMeta, ObjectMeta, PieceMeta, TensorMeta, encode_header, encode_pieces, encode_tensors
    from tierckpt.native.regions import Box, FlatRange

    header = encode_header(CheckpointMeta(
        generation="g-1-abc", world_size=2, created_unix=1.0, frameworks=("module",),
        files=(FileMeta(key="data/rank-00000.bin", size=4096),),
        objects=(ObjectMeta(key="step", rank=None, file="objects/rank-00000.bin", byte_offset=0, byte_length=10, crc32c=5, codec="torch"),),
        num_tensors=2, num_pieces=3, tensor_bytes=1024, timings={"rank0.plan": 0.1}, tags={"a": "b"},
    ))
    tensors = [TensorMeta(fqn="a", dtype="float32", shape=(8, 16)), TensorMeta(fqn="b", dtype="bfloat16", shape=(100,))]
    pieces = [
        PieceMeta(fqn="a", region=Box((0, 0), (4, 16)), file="data/rank-00000.bin", byte_offset=0, byte_length=256, crc32c=1),
        PieceMeta(fqn="a", region=Box((4, 0), (4, 16)), file="data/rank-00001.bin", byte_offset=0, byte_length=256, crc32c=2),
        PieceMeta(fqn="b", region=FlatRange(0, 100), file="data/rank-00000.bin", byte_offset=256, byte_length=200, crc32c=3),
    ]
    return header, encode_tensors(tensors), encode_pieces(pieces)


HEADER, TENSORS, PIECES = valid_documents()
TENSOR_META = decode_tensors(TENSORS)


def mutate(data: bytes, draw: Any) -> bytes:
    """Bit flips, truncation, byte overwrites, or (for JSON) random edits of values."""
    kind = draw(st.sampled_from(["flip", "truncate", "overwrite", "json", "splice"]))
    buf = bytearray(data)
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        buf = buf[: draw(st.integers(0, len(buf) - 1))]
    elif kind == "overwrite":
        i = draw(st.integers(0, len(buf) - 1))
        chunk = draw(st.binary(min_size=1, max_size=16))
        buf[i : i + len(chunk)] = chunk
    elif kind == "splice":
        i = draw(st.integers(0, len(buf)))
        buf[i:i] = draw(st.binary(max_size=32))
    else:
        try:
            doc = json.loads(bytes(buf))
        except ValueError:
            return bytes(buf)
        json_value = st.recursive(
            st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
            max_leaves=6,
        )
        for _ in range(draw(st.integers(1, 4))):
            node = doc
            path = []
            while isinstance(node, (dict, list)) and node and draw(st.booleans()):
                key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
                path.append((node, key))
                node = node[key]
            if path:
                parent, key = path[-1]
                if draw(st.booleans()):
                    parent[key] = draw(json_value)
                elif isinstance(parent, dict):
                    del parent[key]
            else:
                doc = draw(json_value)
        buf = bytearray(json.dumps(doc).encode())
    return bytes(buf)


def decode_all(which: str, data: bytes) -> str:
    """Decode; return 'ok' or 'corrupt'. Anything else propagates (a finding)."""
    try:
        if which == "header":
            decode_header(data)
        elif which == "tensors":
            decode_tensors(data)
        else:
            decode_pieces(data, TENSOR_META)
    except CorruptCheckpointError:
        return "corrupt"
    return "ok"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), which=st.sampled_from(["header", "tensors", "pieces"]))
def test_fuzz_metadata_decoders(data: Any, which: str) -> None:
    source = {"header": HEADER, "tensors": TENSORS, "pieces": PIECES}[which]
    decode_all(which, mutate(source, data.draw))


@pytest.mark.parametrize("which", ["tensors", "pieces"])
def test_invalid_utf8_in_string_column(which: str) -> None:
    """Found by benchmarks/fuzz_metadata.py (seed 0): one flipped bit in an fqn's bytes."""
    source = {"tensors": TENSORS, "pieces": PIECES}[which]
    table = pq.read_table(pa.BufferReader(source))
    fqn = table.column("fqn").to_pylist()[0].encode()
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="none", use_dictionary=False)
    data = sink.getvalue().replace(fqn, b"\xb3" * len(fqn))  # statistics and data alike
    assert decode_all(which, data) == "corrupt"


# -- sizes, file types and fields (every malformed input is CorruptCheckpointError naming the file/field) --
def _header_doc(root: Path, gen: str) -> tuple[Path, dict]:
    header = root / "ckpt" / gen / "meta" / "header.json"
    return header, json.loads(header.read_text())


def _write_header(header: Path, doc: dict) -> None:
    header.write_text(json.dumps(doc))
    reseal(header.parents[2])


@pytest.mark.parametrize("claimed", [1 << 32, 1 << 50], ids=["4GiB", "2^50"])
def test_object_claiming_a_huge_size_is_refused_before_any_allocation(tmp_path: Path, claimed: int) -> None:
    """The header says the object has ``claimed`` bytes; the file has a few hundred: nothing is allocated."""
    import tracemalloc

    uri, gen = _save(tmp_path)
    header, doc = _header_doc(tmp_path, gen)
    doc["objects"][0]["byte_length"] = claimed
    _write_header(header, doc)
    target = _target()
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError) as info:
            tierckpt.load(uri, target)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak} bytes allocated"
    assert "'step'" in str(info.value) and "objects/rank-00000.bin" in str(info.value)
    assert torch.equal(target["w"], torch.zeros(64))


def _run_bounded(code: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a hang fails the test instead of blocking the session)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env)


@pytest.mark.parametrize("which", ["meta/header.json", "meta/tensors.parquet", "meta/pieces.parquet", "data/rank-00000.bin"])
def test_fifo_in_place_of_a_file_is_refused_by_load_verify_and_inspect(tmp_path: Path, which: str) -> None:
    uri, gen = _save(tmp_path)
    path = tmp_path / "ckpt" / gen / which
    path.unlink()
    os.mkfifo(path)
    code = f"""
import sys, torch, tierckpt
from tierckpt.cli import main as cli
from tierckpt.errors import CorruptCheckpointError
try:
    tierckpt.load({uri!r}, {{"w": torch.zeros(64), "step": -1}})
except CorruptCheckpointError as exc:
    print("load:", "not a regular file" in str(exc))
else:
    print("load: no error")
print("verify:", cli.main(["verify", {uri!r}]))
print("inspect:", cli.main(["inspect", {uri!r}]) if {which!r}.startswith("meta/") else 5)
"""
    result = _run_bounded(code)
    assert result.returncode == 0, result.stderr
    assert "load: True" in result.stdout, result.stdout + result.stderr
    assert "verify: 5" in result.stdout and "inspect: 5" in result.stdout, result.stdout + result.stderr


def test_huge_sparse_header_is_not_read(tmp_path: Path) -> None:
    """An 8 GiB (sparse) header.json: refused from its size, quickly, without reading it."""
    uri, gen = _save(tmp_path)
    header = tmp_path / "ckpt" / gen / "meta" / "header.json"
    os.truncate(header, 8 << 30)
    started = time.monotonic()
    with pytest.raises(CorruptCheckpointError, match="header.json"):
        tierckpt.load(uri, _target())
    assert time.monotonic() - started < 5
    assert cli_main(["inspect", uri]) == 5


@pytest.mark.parametrize(
    "field, value",
    [
        ("created_unix", 1e999), ("created_unix", "yesterday"), ("created_unix", -5), ("world_size", 0),
        ("world_size", 2.5), ("generation", None), ("files", {"a": 1}), ("files", [{"key": "data/x\u0000.bin", "size": 1}]),
        ("files", [{"key": "data/rank-00000.bin"}]), ("objects", [{"key": "step"}]), ("objects", "none"),
        ("timings", {"a": 1e999}), ("timings", [1]), ("tags", {"a": [1]}), ("frameworks", "fsdp"), ("num_tensors", -1),
        ("tensor_bytes", "many"),
    ],
)
def test_every_malformed_header_field_is_named(tmp_path: Path, field: str, value: Any) -> None:
    uri, gen = _save(tmp_path)
    header, doc = _header_doc(tmp_path, gen)
    doc[field] = value
    _write_header(header, doc)  # 1e999 is written as Infinity, which json reads back
    with pytest.raises(CorruptCheckpointError) as info:
        tierckpt.load(uri, _target())
    assert "header.json" in str(info.value) and repr(field) in str(info.value), str(info.value)
    assert cli_main(["inspect", uri]) == 5


def test_nul_in_an_object_file_key_is_corruption(tmp_path: Path) -> None:
    uri, gen = _save(tmp_path)
    header, doc = _header_doc(tmp_path, gen)
    doc["objects"][0]["file"] = "objects/rank-0\u0000.bin"
    _write_header(header, doc)
    with pytest.raises(CorruptCheckpointError, match="'objects'"):
        tierckpt.load(uri, _target())


def test_nul_in_a_piece_file_key_is_corruption(tmp_path: Path) -> None:
    uri, gen = _save(tmp_path)
    _rewrite_pieces(tmp_path / "ckpt" / gen / "meta" / "pieces.parquet", file="data/rank-0\u0000.bin")
    with pytest.raises(CorruptCheckpointError, match="control characters"):
        tierckpt.load(uri, _target())


def test_piece_past_the_end_of_its_file_is_refused_before_reading(tmp_path: Path) -> None:
    uri, gen = _save(tmp_path)
    _rewrite_pieces(tmp_path / "ckpt" / gen / "meta" / "pieces.parquet", byte_offset=1 << 20)
    target = _target()
    with pytest.raises(CorruptCheckpointError, match="past the end"):
        tierckpt.load(uri, target)
    assert torch.equal(target["w"], torch.zeros(64))
