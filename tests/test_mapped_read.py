"""Mapped reads of resident page cache (tierckpt.backends.mapped_read, the native tierckpt._copycrc):
the same bytes and CRC-32Cs as pread, the fallback whenever they do not apply, and loads that use them
still catching every flipped bit."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scenarios_integrity import flip, piece_bits

import tierckpt
from tierckpt.backends import mapped_read, run_reads
from tierckpt.backends.files import pread_into
from tierckpt.backends.run_reads import pread_runs
from tierckpt.errors import CorruptCheckpointError
from tierckpt.node.memory import MemoryConfig, MemoryTier

native = pytest.mark.skipif(not mapped_read.available(), reason="the native extension is not built for this machine")


def test_the_native_extension_is_built_where_it_can_be() -> None:
    """An x86-64 Linux install with a C compiler builds it (the extension is optional in setup.py, so a
    failed build would otherwise only show as slower loads)."""
    if platform.machine() != "x86_64" or platform.system() != "Linux":
        pytest.skip("the extension is x86-64 Linux only")
    from tierckpt import _copycrc

    assert _copycrc.AVAILABLE == 1


@native
@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=70_000), seed=st.integers(0, 2**32 - 1))
def test_the_native_crc_is_crc32c(data: bytes, seed: int) -> None:
    from tierckpt import _copycrc

    assert _copycrc.crc32c(data) == crc32c.crc32c(data)
    assert _copycrc.crc32c(data, seed) == crc32c.crc32c(data, seed)


@pytest.fixture
def warm_file(tmp_path: Path) -> tuple[str, bytes]:
    data = os.urandom((3 << 20) + 12345)
    path = tmp_path / "data.bin"
    path.write_bytes(data)  # written through the page cache: resident
    return str(path), data


def _runs(offsets: list[int], run_bytes: int, data: bytes) -> tuple[bytes, list[int]]:
    runs = [data[o : o + run_bytes] for o in offsets]
    return b"".join(runs), [crc32c.crc32c(r) for r in runs]


@native
@pytest.mark.parametrize("offsets,run_bytes", [
    ([0], (3 << 20) + 12345),  # the whole file
    ([7], 3 << 20),  # unaligned
    (list(range(5, 3 << 20, 100_003)), 40_009),  # strided, odd lengths
    ([2 << 20, 3, 1 << 20], 400_000),  # out of order
])
def test_mapped_runs_are_the_bytes_and_crcs_pread_gives(warm_file, offsets, run_bytes, monkeypatch) -> None:
    path, data = warm_file
    calls = []
    real = mapped_read._copycrc.copy_runs
    monkeypatch.setattr(mapped_read, "_copycrc", _Spy(real, calls))
    expected, crcs = _runs(offsets, run_bytes, data)
    out = bytearray(len(expected))
    got = pread_runs(path, offsets, run_bytes, memoryview(out), crc32c.crc32c, mapped=True)
    assert calls == ["copied"] and bytes(out) == expected and got == crcs
    out = bytearray(len(expected))
    assert pread_runs(path, offsets, run_bytes, memoryview(out), None, mapped=True) is None
    assert bytes(out) == expected and calls == ["copied", "copied"]


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


@native
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("run_bytes", [1 << 20, 4096])
def test_a_mapped_copy_keeps_few_mapped_pages_resident(tmp_path, run_bytes) -> None:
    """The pages a copy has passed leave its mapping every few MiB: copying 96 MiB raises the process's
    peak resident set by far less than 96 MiB (without the drops, by all of it)."""
    size = 96 << 20
    shm = Path("/dev/shm")  # tmpfs: its pages stay resident, whatever reclaims the page cache meanwhile
    path = (shm if shm.is_dir() else tmp_path) / f"tierckpt-rss-{os.getpid()}-{run_bytes}.bin"
    try:
        path.write_bytes(os.urandom(size))
        out = np.ones(size, dtype=np.uint8)  # touched: resident before the peak is reset
        fd = os.open(path, os.O_RDONLY)
        try:
            Path("/proc/self/clear_refs").write_text("5")  # peak resident set := current
            before = _peak_rss_bytes()
            got = mapped_read._copycrc.copy_runs(fd, np.arange(0, size, run_bytes, dtype=np.int64), run_bytes, memoryview(out), True)
            grew = _peak_rss_bytes() - before
        finally:
            os.close(fd)
        assert got is not None and got[-1] == crc32c.crc32c(path.read_bytes()[-run_bytes:])
    finally:
        path.unlink(missing_ok=True)
    assert grew < 32 << 20


@native
def test_pread_into_takes_the_mapping(warm_file, monkeypatch) -> None:
    path, data = warm_file
    calls = []
    monkeypatch.setattr(mapped_read, "_copycrc", _Spy(mapped_read._copycrc.copy_runs, calls))
    out = bytearray(2 << 20)
    pread_into(path, 1000, memoryview(out), mapped=True)
    assert bytes(out) == data[1000 : 1000 + (2 << 20)] and calls == ["copied"]


@native
def test_pages_not_in_the_page_cache_are_read_with_pread(warm_file, monkeypatch) -> None:
    path, data = warm_file
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages leave the page cache
        assert mapped_read.read_runs(fd, [0], 2 << 20, memoryview(bytearray(2 << 20)), crc32c.crc32c) == (False, None)
    finally:
        os.close(fd)
    out = bytearray(2 << 20)  # the caller then reads with pread: same result
    assert pread_runs(path, [0], 2 << 20, memoryview(out), crc32c.crc32c, mapped=True) == [crc32c.crc32c(data[: 2 << 20])]
    assert bytes(out) == data[: 2 << 20]


@native
def test_what_the_mapping_does_not_serve(warm_file, monkeypatch) -> None:
    path, data = warm_file
    fd = os.open(path, os.O_RDONLY)
    try:
        big = memoryview(bytearray(2 << 20))
        assert mapped_read.read_runs(fd, [len(data) - 100], 2 << 20, big, None) == (False, None)  # past the end
        assert mapped_read.read_runs(fd, [0], 1000, memoryview(bytearray(1000)), None) == (False, None)  # small
        assert mapped_read.read_runs(fd, [0], 2 << 20, big, lambda v: 0) == (False, None)  # another digest
        monkeypatch.setenv(mapped_read.ENV, "off")
        assert mapped_read.read_runs(fd, [0], 2 << 20, big, None) == (False, None)
    finally:
        os.close(fd)
    with pytest.raises(CorruptCheckpointError, match="ends before byte"):  # pread then names the short file
        pread_runs(path, [len(data) - 100], 2 << 20, memoryview(bytearray(2 << 20)), crc32c.crc32c, mapped=True)


@native
def test_bad_arguments_are_refused(warm_file) -> None:
    from tierckpt import _copycrc

    fd = os.open(warm_file[0], os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="len\\(offsets\\) \\* run_bytes"):
            _copycrc.copy_runs(fd, np.array([0, 10], dtype=np.int64), 100, bytearray(150), True)
        with pytest.raises(ValueError, match="negative offset"):
            _copycrc.copy_runs(fd, np.array([-1], dtype=np.int64), 100, bytearray(100), True)
        with pytest.raises(TypeError):
            _copycrc.copy_runs(fd, np.array([0], dtype=np.int64), 100, b"x" * 100, True)  # read-only out
        with pytest.raises(OSError):
            _copycrc.copy_runs(-1, np.array([0], dtype=np.int64), 100, bytearray(100), True)
    finally:
        os.close(fd)


@native
def test_a_default_load_through_the_mapping_catches_flipped_bits(tmp_path, monkeypatch) -> None:
    state = {"w": torch.arange(1 << 20, dtype=torch.float32).reshape(512, 2048)}  # 4 MiB: whole 1 MiB blocks
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), state)
    calls = []
    monkeypatch.setattr(mapped_read, "_copycrc", _Spy(mapped_read._copycrc.copy_runs, calls))
    target = {"w": torch.zeros(512, 2048)}
    tierckpt.load(str(root), target)
    assert torch.equal(target["w"], state["w"]) and calls  # served by the mapping
    (file, first, length, fqn), = piece_bits(root)
    for byte, bit in ((first, 0), (first + length // 2, 7), (first + length - 1, 3)):
        flip(file, byte, bit)
        calls.clear()
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            tierckpt.load(str(root), {"w": torch.zeros(512, 2048)})
        assert calls  # the flipped copy came through the mapping, and its CRC caught it
        flip(file, byte, bit)


@native
async def test_the_memory_tier_reads_through_the_mapping_under_the_shared_lock(tmp_path, monkeypatch) -> None:
    """The tier's files are always resident: its reads copy through the mapping, with the CRC-32Cs, while
    holding the file's shared lock (what keeps the page pool from cutting the file under the mapping)."""
    shm = Path("/dev/shm")
    directory = tmp_path / "shm" if not shm.is_dir() else Path(str(shm / f"tierckpt-test-{os.getpid()}-{tmp_path.name}"))
    tier = MemoryTier("s3://bucket/run", MemoryConfig(directory=str(directory), budget_bytes=1 << 30))
    try:
        data = os.urandom(2 << 20)
        await tier.put("g/data/x.bin", data)
        calls = []
        monkeypatch.setattr(mapped_read, "_copycrc", _Spy(mapped_read._copycrc.copy_runs, calls))
        held = []
        real_open = run_reads.open_regular
        monkeypatch.setattr(run_reads, "open_regular", lambda path, shared: held.append(shared) or real_open(path, shared))
        out = bytearray(2 << 20)
        runs = await tier.read_runs("g/data/x.bin", [0, 1 << 20], 1 << 20, memoryview(out), crc32c.crc32c)
        assert runs == [crc32c.crc32c(data[: 1 << 20]), crc32c.crc32c(data[1 << 20 :])]
        assert bytes(out) == data and calls == ["copied"] and held == [True]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class _Spy:
    """Stands in for the native module, recording each copy that it served (``copied`` for runs into
    one buffer, ``spans`` for a group's spans into their own)."""

    AVAILABLE = 1

    def __init__(self, copy_runs, calls: list[str]) -> None:
        from tierckpt import _copycrc

        self._copy_runs, self._copy_spans, self._calls = copy_runs, _copycrc.copy_spans, calls

    def copy_runs(self, *args):
        got = self._copy_runs(*args)
        if got is not None:
            self._calls.append("copied")
        return got

    def copy_spans(self, *args):
        got = self._copy_spans(*args)
        if got is not None:
            self._calls.append("spans")
        return got


# -- groups of single-run units, each into its own buffer (copy_spans) -----------------------------------
@native
@settings(max_examples=60, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, (3 << 20) + 12345), st.integers(0, 300_000)), min_size=1, max_size=12))
def test_a_group_of_spans_is_the_bytes_and_crcs_pread_gives(tmp_path_factory, spans) -> None:
    from tierckpt import _copycrc

    path = tmp_path_factory.getbasetemp() / "spans.bin"
    if not path.exists():
        path.write_bytes(os.urandom((3 << 20) + 12345))
    data = path.read_bytes()
    spans = [(start, min(length, len(data) - start)) for start, length in spans]  # in the file; any order
    outs = [bytearray(length) for _, length in spans]
    fd = os.open(path, os.O_RDONLY)
    try:
        got = _copycrc.copy_spans(fd, np.array([s for s, _ in spans], dtype=np.int64),
                                  np.array([n for _, n in spans], dtype=np.int64), [memoryview(o) for o in outs], True)
        assert got == [crc32c.crc32c(data[s : s + n]) for s, n in spans]
        assert [bytes(o) for o in outs] == [data[s : s + n] for s, n in spans]
        assert _copycrc.copy_spans(fd, np.array([s for s, _ in spans], dtype=np.int64),
                                   np.array([n for _, n in spans], dtype=np.int64), outs, False) == []
    finally:
        os.close(fd)


@native
def test_a_group_of_small_units_is_read_through_one_mapping(warm_file, monkeypatch) -> None:
    """pread_segments copies single-run segments through one mapping (each below MIN_BYTES, together
    above it); a segment of several runs, or a span past the end, sends the group back to pread."""
    path, data = warm_file
    calls = []
    monkeypatch.setattr(mapped_read, "_copycrc", _Spy(mapped_read._copycrc.copy_runs, calls))
    starts = [0, 300_000, 2 << 20, 700_001, len(data) - (256 << 10) - 3]
    segments = [([s], 256 << 10, memoryview(bytearray(256 << 10))) for s in starts]
    got = run_reads.pread_segments(path, segments, crc32c.crc32c, mapped=True)
    assert calls == ["spans"]
    assert got == [[crc32c.crc32c(data[s : s + (256 << 10)])] for s in starts]
    assert [bytes(out) for _, _, out in segments] == [data[s : s + (256 << 10)] for s in starts]
    assert run_reads.pread_segments(path, segments, None, mapped=True) == [None] * len(starts)
    calls.clear()
    two_runs = segments[:4] + [([0, 4096], 1 << 20, memoryview(bytearray(2 << 20)))]
    got = run_reads.pread_segments(path, two_runs, crc32c.crc32c, mapped=True)
    assert "spans" not in calls and got[-1] == [crc32c.crc32c(data[: 1 << 20]), crc32c.crc32c(data[4096 : 4096 + (1 << 20)])]
    past_end = segments[:4] + [([len(data) - 100], 256 << 10, memoryview(bytearray(256 << 10)))]
    with pytest.raises(CorruptCheckpointError, match="ends before byte"):
        run_reads.pread_segments(path, past_end, crc32c.crc32c, mapped=True)


@native
def test_bad_span_arguments_are_refused(warm_file) -> None:
    from tierckpt import _copycrc

    fd = os.open(warm_file[0], os.O_RDONLY)
    one = np.array([0], dtype=np.int64)
    try:
        with pytest.raises(ValueError, match="of one length"):
            _copycrc.copy_spans(fd, np.array([0, 10], dtype=np.int64), one, [bytearray(1), bytearray(1)], True)
        with pytest.raises(ValueError, match="one output buffer per span"):
            _copycrc.copy_spans(fd, one, np.array([100], dtype=np.int64), [], True)
        with pytest.raises(ValueError, match="another length"):
            _copycrc.copy_spans(fd, one, np.array([100], dtype=np.int64), [bytearray(99)], True)
        with pytest.raises(ValueError, match="negative"):
            _copycrc.copy_spans(fd, np.array([-1], dtype=np.int64), np.array([100], dtype=np.int64), [bytearray(100)], True)
        with pytest.raises(ValueError, match="past 2\\^63"):
            _copycrc.copy_spans(fd, np.array([2**63 - 10], dtype=np.int64), np.array([100], dtype=np.int64), [bytearray(100)], True)
        with pytest.raises(BufferError):
            _copycrc.copy_spans(fd, one, np.array([100], dtype=np.int64), [b"x" * 100], True)  # read-only out
        with pytest.raises(OSError):
            _copycrc.copy_spans(-1, one, np.array([100], dtype=np.int64), [bytearray(100)], True)
    finally:
        os.close(fd)


@native
def test_a_default_load_of_small_tensors_through_one_mapping_catches_flipped_bits(tmp_path, monkeypatch) -> None:
    state = {f"t{i}": torch.arange(i, i + (64 << 10), dtype=torch.float32) for i in range(8)}  # 8 x 256 KiB
    root = tmp_path / "ckpt"
    tierckpt.save(str(root), state)
    calls = []
    monkeypatch.setattr(mapped_read, "_copycrc", _Spy(mapped_read._copycrc.copy_runs, calls))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    tierckpt.load(str(root), target)
    assert all(torch.equal(target[k], v) for k, v in state.items()) and "spans" in calls
    bits = piece_bits(root)
    for file, first, length, fqn in (bits[0], bits[len(bits) // 2], bits[-1]):
        for byte, bit in ((first, 0), (first + length - 1, 5)):
            flip(file, byte, bit)
            calls.clear()
            with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
                tierckpt.load(str(root), {k: torch.zeros_like(v) for k, v in state.items()})
            assert "spans" in calls  # the flipped copy came through the group's mapping, and its CRC caught it
            flip(file, byte, bit)


@native
def test_a_strided_read_of_many_short_runs_takes_the_mapping(warm_file, monkeypatch) -> None:
    """A column window of each row (what each rank of a row -> column resharded load reads): 64 runs of
    2 KiB, 128 KiB in all, below MIN_BYTES but not below MIN_RUNS, go through one mapping, not a pread
    each; fewer runs than MIN_RUNS of as few bytes still take pread."""
    path, data = warm_file
    calls = []
    monkeypatch.setattr(mapped_read, "_copycrc", _Spy(mapped_read._copycrc.copy_runs, calls))
    offsets = list(range(100, 100 + 64 * 16384, 16384))
    expected, crcs = _runs(offsets, 2048, data)
    out = bytearray(len(expected))
    assert pread_runs(path, offsets, 2048, memoryview(out), crc32c.crc32c, mapped=True) == crcs
    assert bytes(out) == expected and calls == ["copied"]
    few = offsets[: mapped_read.MIN_RUNS - 1]
    expected, crcs = _runs(few, 2048, data)
    out = bytearray(len(expected))
    assert pread_runs(path, few, 2048, memoryview(out), crc32c.crc32c, mapped=True) == crcs
    assert bytes(out) == expected and calls == ["copied"]
