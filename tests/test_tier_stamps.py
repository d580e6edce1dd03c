"""Stamps: the CRC-32C a memory-tier file was written with, found by any process, trusted only while the
file is unchanged (tierckpt.node.memory.stamps)."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
from pathlib import Path

import crc32c
import pytest

from tierckpt.node.memory import stamps
from tierckpt.node.memory.manifest import FileEntry


def _write_and_stamp(path: str, data: bytes) -> None:
    Path(path).write_bytes(data)
    stamps.remember(path, FileEntry(len(data), crc32c.crc32c(data)))


@pytest.fixture(params=["attribute", "table"])
def where(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both homes of a stamp: the file's extended attribute, and this process's table (a file system
    without user attributes)."""
    if request.param == "table":
        def refuse(*args: object) -> None:
            raise OSError(errno.EOPNOTSUPP, "no user attributes here")

        monkeypatch.setattr(os, "setxattr", refuse)
        monkeypatch.setattr(os, "getxattr", refuse)
    return request.param


def test_a_stamp_is_recalled_while_the_file_is_unchanged(tmp_path: Path, where: str) -> None:
    path = str(tmp_path / "data.bin")
    _write_and_stamp(path, b"x" * 1000)
    assert stamps.recall(path) == FileEntry(1000, crc32c.crc32c(b"x" * 1000))
    assert stamps.recall(str(tmp_path / "data.bin")) is not None


@pytest.mark.parametrize("change", ["rewritten", "replaced", "touched", "resized"])
def test_a_changed_file_is_not_trusted(tmp_path: Path, where: str, change: str) -> None:
    path = str(tmp_path / "data.bin")
    _write_and_stamp(path, b"x" * 1000)
    st = os.stat(path)
    if change == "rewritten":  # same size, in place, later mtime
        Path(path).write_bytes(b"y" * 1000)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    elif change == "replaced":  # another inode under the name
        Path(path + ".new").write_bytes(b"y" * 1000)
        os.utime(path + ".new", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(path + ".new", path)
    elif change == "touched":
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    else:
        os.truncate(path, 999)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert stamps.recall(path) is None


def test_an_unstamped_or_missing_file(tmp_path: Path, where: str) -> None:
    path = tmp_path / "plain.bin"
    path.write_bytes(b"never stamped")
    assert stamps.recall(str(path)) is None
    with pytest.raises(FileNotFoundError):
        stamps.recall(str(tmp_path / "gone.bin"))


def test_a_malformed_attribute_is_ignored(tmp_path: Path) -> None:
    path = str(tmp_path / "data.bin")
    _write_and_stamp(path, b"abc")
    os.setxattr(path, "user.tierckpt.crc32c", b"short")
    assert stamps.recall(path) is None


def test_forget_under_drops_the_tables_stamps_of_a_directory(tmp_path: Path, where: str) -> None:
    (tmp_path / "g1").mkdir()
    (tmp_path / "g10").mkdir()
    inside, beside = str(tmp_path / "g1" / "a.bin"), str(tmp_path / "g10" / "a.bin")
    _write_and_stamp(inside, b"a")
    _write_and_stamp(beside, b"b")
    stamps.forget_under(str(tmp_path / "g1"))
    assert stamps.recall(beside) == FileEntry(1, crc32c.crc32c(b"b"))
    expected = None if where == "table" else FileEntry(1, crc32c.crc32c(b"a"))  # an attribute goes with its file
    assert stamps.recall(inside) == expected


def test_another_process_finds_the_writers_stamp(tmp_path: Path) -> None:
    path = str(tmp_path / "data.bin")
    data = os.urandom(4096)
    child = mp.get_context("spawn").Process(target=_write_and_stamp, args=(path, data))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert stamps.recall(path) == FileEntry(4096, crc32c.crc32c(data))
