"""A fully staged file reaches its writer only at ``finish()``: the snapshot call returns before any
checksum or write of it starts (they would compete with the caller for the cores); the file is exact."""

from __future__ import annotations

import os

import crc32c
import pytest
import torch

from tierckpt.backends.local import LocalBackend
from tierckpt.io.staging import FileStream, copy_whole, queue_whole


def _pieces() -> list[tuple[int, int, torch.Tensor]]:
    a = torch.arange(3 << 18, dtype=torch.float32)  # 3 MiB
    b = torch.arange(1000, dtype=torch.int64) * 7
    return [(0, 0, a), (1, a.nbytes + 64, b)]  # 64 bytes of padding between the pieces


def _expected(pieces: list[tuple[int, int, torch.Tensor]]) -> bytes:
    out = bytearray()
    for _, offset, tensor in pieces:
        out += bytes(offset - len(out))
        out += tensor.numpy().tobytes()
    return bytes(out)


def test_whole_file_is_written_only_by_finish(tmp_path):
    backend = LocalBackend(str(tmp_path))
    pieces = _pieces()
    expected = _expected(pieces)
    buffer = torch.empty(len(expected), dtype=torch.uint8)
    stream = FileStream(backend, "data/f.bin", len(pieces))
    with stream.abort_on_error():
        queue_whole(stream, buffer, copy_whole(pieces, buffer))
    assert stream.bytes_written == 0  # nothing handed to the writer during the snapshot call
    assert not os.path.exists(tmp_path / "data" / "f.bin")
    checksums = stream.finish()
    assert stream.bytes_written == len(expected)
    assert (tmp_path / "data" / "f.bin").read_bytes() == expected
    for (_, _, tensor), sums in zip(pieces, checksums):
        assert sums.crc32c == crc32c.crc32c(tensor.numpy().tobytes())
    assert [len(s.block_crc32c) for s in checksums] == [3, 1]


def test_a_failed_snapshot_never_writes_its_deferred_chunks(tmp_path):
    backend = LocalBackend(str(tmp_path))
    pieces = _pieces()
    buffer = torch.empty(len(_expected(pieces)), dtype=torch.uint8)
    stream = FileStream(backend, "data/f.bin", len(pieces))
    with pytest.raises(RuntimeError, match="staging broke"):
        with stream.abort_on_error():
            queue_whole(stream, buffer, copy_whole(pieces, buffer))
            raise RuntimeError("staging broke")
    with pytest.raises(Exception, match="abandoned"):
        stream.finish()  # the writer was aborted: finishing reports it
    assert stream.bytes_written == 0
    assert not os.path.exists(tmp_path / "data" / "f.bin")
    assert not [n for _, _, files in os.walk(tmp_path) for n in files]
