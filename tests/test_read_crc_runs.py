"""The strided-read checksum path piece by piece: run CRCs taken as runs are read, partial blocks,
several ranks' partials combined, and a flipped bit in every position of every run caught.

A saved piece is laid out as rows of ``ROW`` bytes; each of 3 "ranks" reads a column range of every
row (runs of ``ROW // 3``-ish bytes, one per row), as a reshard from row to column sharding does.
Small blocks (``BLOCK`` bytes, not a multiple of ``ROW``) make runs cross block edges, and the piece
ends in a short last block. The checker is driven as the loader drives it: :meth:`ReadChecker.check`
per rank (with the run CRCs a read computes, and without), :meth:`ReadChecker.partials` gathered,
:meth:`ReadChecker.settle` on the lot.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable

import crc32c
import numpy as np
import pytest

from tierckpt.backends.local import LocalBackend
from tierckpt.backends.memory import MemoryBackend, MemoryRegistry
from tierckpt.errors import CorruptCheckpointError
from tierckpt.io.crc import block_crcs, raw_crc
from tierckpt.io.readcheck import ReadChecker
from tierckpt.native.metadata import PieceMeta
from tierckpt.native.regions import Box

BLOCK = 4096
ROW = 1000
ROWS = 30  # 30,000 bytes: 7 whole blocks and a short last one of 1,328 bytes
COLUMNS = [(0, 300), (300, 700), (700, 1000)]  # what each of 3 ranks reads of every row
OFFSET = 512  # the piece's offset in its data file


def _piece(data: bytes) -> PieceMeta:
    return PieceMeta(
        fqn="w", region=Box((0, 0), (ROWS, ROW)), file="d0", byte_offset=OFFSET, byte_length=len(data),
        crc32c=crc32c.crc32c(data), block_bytes=BLOCK, block_crc32c=tuple(block_crcs(data, BLOCK)),
    )


def _runs(data: bytes, cols: tuple[int, int], rows: range) -> tuple[np.ndarray, int, bytes]:
    """A rank's strided read of ``rows``: run offsets in the file, run length, the packed bytes."""
    a, b = cols
    offsets = np.array([OFFSET + r * ROW + a for r in rows], dtype=np.int64)
    return offsets, b - a, b"".join(data[r * ROW + a : r * ROW + b] for r in rows)


def _load(data: bytes, stored: bytes, with_run_crcs: bool, rows: range = range(ROWS)) -> list:
    """Every rank's check of what it read from ``data`` (saved as ``stored``); the group's settle."""
    checker = ReadChecker("g", {"w": [_piece(stored)]})
    gathered = []
    for cols in COLUMNS:
        rank = ReadChecker("g", {"w": [_piece(stored)]})
        offsets, run_bytes, packed = _runs(data, cols, rows)
        view = memoryview(packed)
        crcs = [crc32c.crc32c(view[i * run_bytes : (i + 1) * run_bytes]) for i in range(len(offsets))] if with_run_crcs else None
        half = len(offsets) // 2  # two read units per rank, as a load's row slabs make
        for lo, hi in ((0, half), (half, len(offsets))):
            unit = view[lo * run_bytes : hi * run_bytes]
            rank.add(rank.check("w", "d0", offsets[lo:hi], run_bytes, unit, None if crcs is None else crcs[lo:hi]))
        gathered.append(rank.partials())
    return checker.settle(gathered)


@pytest.fixture(scope="module")
def stored() -> bytes:
    return random.Random(7).randbytes(ROWS * ROW)


@pytest.mark.parametrize("with_run_crcs", [True, False], ids=["run-crcs-from-the-read", "crcs-in-the-check"])
def test_three_ranks_partials_complete_every_block(stored, with_run_crcs) -> None:
    assert _load(stored, stored, with_run_crcs) == []


@pytest.mark.slow
@pytest.mark.parametrize("with_run_crcs", [True, False], ids=["run-crcs-from-the-read", "crcs-in-the-check"])
def test_a_flip_in_every_position_of_every_run_of_a_row_is_caught(stored, with_run_crcs) -> None:
    """Every byte of rows 4 (crosses the block edge at 4096) and 29 (the short last block), each with a
    different bit, plus the first and last byte of every run of every row."""
    positions = [r * ROW + c for r in (4, 29) for c in range(ROW)]
    positions += [r * ROW + c for r in range(ROWS) for a, b in COLUMNS for c in (a, b - 1)]
    missed = _flips_missed(stored, positions, lambda flipped: _load(flipped, stored, with_run_crcs))
    assert not missed, f"{len(missed)} flips loaded without an error, e.g. at bytes {missed[:5]}"


def _flips_missed(stored: bytes, positions: list[int], load: Callable[[bytes], object]) -> list[int]:
    """Flip one bit at each position (a different bit each time) and ``load``; the positions whose flip
    loaded without an error (each caught one must name the block it lies in)."""
    missed = []
    for n, pos in enumerate(sorted(set(positions))):
        flipped = bytearray(stored)
        flipped[pos] ^= 1 << (n % 8)
        try:
            load(bytes(flipped))
        except CorruptCheckpointError as exc:
            block = pos // BLOCK
            assert f"at bytes {OFFSET + block * BLOCK}..{OFFSET + min((block + 1) * BLOCK, len(stored))}" in str(exc)
        else:
            missed.append(pos)
    return missed


def test_blocks_the_group_reads_in_part_are_returned_not_passed(stored) -> None:
    """Rows 5..17 only: blocks 1 and 4 (cut by the first and last row read) are incomplete, 2 and 3 checked."""
    incomplete = _load(stored, stored, True, rows=range(5, 18))
    assert [b for _, b in incomplete] == [1, 4]
    flipped = bytearray(stored)
    flipped[2 * BLOCK + 10] ^= 4
    with pytest.raises(CorruptCheckpointError, match=f"at bytes {OFFSET + 2 * BLOCK}.."):
        _load(bytes(flipped), stored, True, rows=range(5, 18))


def test_a_missing_rank_leaves_blocks_incomplete_not_passed(stored) -> None:
    """Two ranks' partials alone never complete a block: each is reported, none is taken as checked."""
    checker = ReadChecker("g", {"w": [_piece(stored)]})
    gathered = []
    for cols in COLUMNS[:2]:
        offsets, run_bytes, packed = _runs(stored, cols, range(ROWS))
        rank = ReadChecker("g", {"w": [_piece(stored)]})
        view = memoryview(packed)
        rank.add(rank.check("w", "d0", offsets, run_bytes, view, [crc32c.crc32c(view[i * run_bytes : (i + 1) * run_bytes]) for i in range(ROWS)]))
        gathered.append(rank.partials())
    assert [b for _, b in checker.settle(gathered)] == list(range(8))


def test_whole_runs_with_known_crcs_check_whole_blocks() -> None:
    """Runs of a whole block each (one row per block): checked from the run CRCs alone, the last short."""
    data = random.Random(3).randbytes(3 * BLOCK + 100)
    piece = PieceMeta(
        fqn="w", region=Box((0,), (len(data),)), file="d0", byte_offset=0, byte_length=len(data),
        crc32c=crc32c.crc32c(data), block_bytes=BLOCK, block_crc32c=tuple(block_crcs(data, BLOCK)),
    )
    checker = ReadChecker("g", {"w": [piece]})
    offsets = np.array([0, BLOCK, 2 * BLOCK], dtype=np.int64)
    view = memoryview(data[: 3 * BLOCK])
    crcs = [crc32c.crc32c(view[i * BLOCK : (i + 1) * BLOCK]) for i in range(3)]
    assert checker.check("w", "d0", offsets, BLOCK, view, crcs) == {}
    tail = memoryview(data[3 * BLOCK :])
    assert checker.check("w", "d0", np.array([3 * BLOCK]), 100, tail, [crc32c.crc32c(tail)]) == {}
    crcs[1] ^= 1 << 20  # what a read computes of a block with a flipped bit
    with pytest.raises(CorruptCheckpointError, match=f"at bytes {BLOCK}..{2 * BLOCK}"):
        checker.check("w", "d0", offsets, BLOCK, view, crcs)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_read_runs_returns_the_digest_of_each_run(tmp_path, kind) -> None:
    """Local files (one thread of positional reads) and the default (a ranged read per run)."""
    data = os.urandom(50_000)
    backend = LocalBackend(str(tmp_path)) if kind == "local" else MemoryBackend("memory://runs/root", registry=MemoryRegistry())
    offsets = [7, 1000, 20_001, 49_000]

    async def run() -> tuple[list[int] | None, list[int] | None, bytes]:
        await backend.put("f", data)
        out = bytearray(len(offsets) * 900)
        got = await backend.read_runs("f", offsets, 900, memoryview(out), raw_crc)
        plain = await backend.read_runs("f", offsets, 900, memoryview(bytearray(len(out))))
        return got, plain, bytes(out)

    got, plain, out = asyncio.run(run())
    assert out == b"".join(data[o : o + 900] for o in offsets)
    assert got == [raw_crc(data[o : o + 900]) for o in offsets]
    assert plain is None


def test_block_runs_cut_a_range_at_the_block_edges() -> None:
    """Head up to the first edge, whole blocks, tail; a range inside one block is one run; an aligned one has no head."""
    data = bytes(3 * BLOCK + 100)
    piece = PieceMeta(
        fqn="w", region=Box((0,), (len(data),)), file="d0", byte_offset=OFFSET, byte_length=len(data),
        crc32c=crc32c.crc32c(data), block_bytes=BLOCK, block_crc32c=tuple(block_crcs(data, BLOCK)),
    )
    checker = ReadChecker("g", {"w": [piece]})
    assert checker.block_runs("w", "d0", OFFSET + 10, 3 * BLOCK) == [
        (OFFSET + 10, BLOCK - 10, 1), (OFFSET + BLOCK, BLOCK, 2), (OFFSET + 3 * BLOCK, 10, 1),
    ]
    assert checker.block_runs("w", "d0", OFFSET, len(data)) == [(OFFSET, BLOCK, 3), (OFFSET + 3 * BLOCK, 100, 1)]
    assert checker.block_runs("w", "d0", OFFSET + 5, 20) == [(OFFSET + 5, 20, 1)]
    assert checker.block_runs("w", "d0", OFFSET + BLOCK, BLOCK) == [(OFFSET + BLOCK, BLOCK, 1)]


@pytest.mark.slow
def test_shift_tables_stay_right_across_threads_and_a_full_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shifts from 4 threads at once, more distinct ones than the cache keeps (cut to 256 tables here, so
    it fills and starts afresh many times): each equals the raw CRC of the bytes followed by that many
    zeros (small shifts), and shifting twice equals shifting by the sum."""
    from concurrent.futures import ThreadPoolExecutor

    from tierckpt.io import crc
    from tierckpt.io.crc import shift

    monkeypatch.setattr(crc, "_MAX_SHIFT_TABLES", 256)
    monkeypatch.setattr(crc, "_SHIFT_TABLES", crc._ShiftTables())

    data = random.Random(5).randbytes(64)
    raw = np.full(8, raw_crc(data), dtype=np.uint64)

    def one(seed: int) -> bool:
        rng = np.random.default_rng(seed)
        a = rng.integers(0, 1 << 30, size=crc._MAX_SHIFT_TABLES // 2 + 1).astype(np.uint64)
        small = np.arange(8, dtype=np.uint64) + np.uint64(seed)
        ok = all(int(v) == raw_crc(data + bytes(int(n))) for v, n in zip(shift(raw, small), small))
        twice = shift(shift(raw[:1].repeat(len(a)), a), a)
        return ok and bool((twice == shift(raw[:1].repeat(len(a)), 2 * a)).all())

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(one, range(8)))


ALIGNED_ROW = 1024  # rows that never cross a block edge: every run lies inside one block
ALIGNED_COLUMNS = [(0, 300), (300, 700), (700, 1024)]


def _aligned_load(data: bytes, stored: bytes) -> tuple[list, list]:
    """3 ranks' strided reads of 30 rows of ``ALIGNED_ROW`` bytes (7.5 blocks), two units each, run CRCs
    from the read: the group's settle and every rank's reduced partials."""
    rows = len(stored) // ALIGNED_ROW
    piece = PieceMeta(
        fqn="w", region=Box((0, 0), (rows, ALIGNED_ROW)), file="d0", byte_offset=OFFSET, byte_length=len(stored),
        crc32c=crc32c.crc32c(stored), block_bytes=BLOCK, block_crc32c=tuple(block_crcs(stored, BLOCK)),
    )
    gathered = []
    for a, b in ALIGNED_COLUMNS:
        rank = ReadChecker("g", {"w": [piece]})
        offsets = np.array([OFFSET + r * ALIGNED_ROW + a for r in range(rows)], dtype=np.int64)
        view = memoryview(b"".join(data[r * ALIGNED_ROW + a : r * ALIGNED_ROW + b] for r in range(rows)))
        run = b - a
        crcs = [crc32c.crc32c(view[i * run : (i + 1) * run]) for i in range(rows)]
        for lo, hi in ((0, 13), (13, rows)):  # the first unit ends inside block 3
            rank.add(rank.check("w", "d0", offsets[lo:hi], run, view[lo * run : hi * run], crcs[lo:hi]))
        gathered.append(rank.partials())
    incomplete = ReadChecker("g", {"w": [piece]}).settle(gathered)
    return incomplete, [(keys, *(a.tolist() for a in arrays)) for keys, *arrays in gathered]


@pytest.mark.slow
def test_native_fold_agrees_with_numpy_and_catches_every_flip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs inside blocks take the native per-block fold (``fold_runs``): the same reduced partials as the
    numpy path, every block completed, and a flipped bit at every position of two rows (one in the short
    last block) and at both ends of every run caught, naming its block — on both paths."""
    from tierckpt.io import readcheck

    if readcheck.fold_runs is None:
        pytest.skip("the native extension is not built (tests/test_mapped_read.py says why)")
    stored = random.Random(11).randbytes(30 * ALIGNED_ROW)
    folds = []
    native = readcheck.fold_runs
    monkeypatch.setattr(readcheck, "fold_runs", lambda *a: folds.append(native(*a)) or folds[-1])
    incomplete, folded = _aligned_load(stored, stored)
    assert incomplete == [] and folds and all(f is not None for f in folds)
    positions = [r * ALIGNED_ROW + c for r in (5, 29) for c in range(ALIGNED_ROW)]
    positions += [r * ALIGNED_ROW + c for r in range(30) for a, b in ALIGNED_COLUMNS for c in (a, b - 1)]
    for path in ("native", "numpy"):
        if path == "numpy":
            monkeypatch.setattr(readcheck, "fold_runs", None)
            assert _aligned_load(stored, stored) == ([], folded)
        missed = _flips_missed(stored, positions, lambda flipped: _aligned_load(flipped, stored))
        assert not missed, f"{path}: {len(missed)} flips loaded without an error, e.g. at bytes {missed[:5]}"


def test_fold_runs_takes_any_integers_and_refuses_runs_out_of_order() -> None:
    """The native fold reads run CRCs given as Python ints or numpy integers alike, and returns ``None``
    (the caller's numpy path) for runs out of order, overlapping or crossing a block edge."""
    from tierckpt.io import readcheck

    if readcheck.fold_runs is None:
        pytest.skip("the native extension is not built (tests/test_mapped_read.py says why)")
    data = random.Random(2).randbytes(4 * BLOCK)
    offsets = np.arange(8, dtype=np.int64) * 1024  # four runs in each of two blocks
    crcs = [crc32c.crc32c(data[o : o + 300]) for o in offsets.tolist()]
    folded = readcheck.fold_runs(offsets, 300, crcs, BLOCK, len(data))
    assert folded is not None
    assert readcheck.fold_runs(offsets, 300, np.array(crcs, dtype=np.uint32), BLOCK, len(data)) == folded
    assert readcheck.fold_runs(offsets[::-1].copy(), 300, crcs[::-1], BLOCK, len(data)) is None
    assert readcheck.fold_runs(np.array([0, 100], dtype=np.int64), 300, crcs[:2], BLOCK, len(data)) is None
    assert readcheck.fold_runs(np.array([BLOCK - 10], dtype=np.int64), 300, crcs[:1], BLOCK, len(data)) is None
