"""CRC-32C arithmetic for block checksums: computed while saving, combined while loading.

Every saved piece carries the CRC-32C of each ``BLOCK_BYTES`` block of its bytes (block *i* covers
piece bytes ``[i * BLOCK_BYTES, (i + 1) * BLOCK_BYTES)``; the last block may be shorter). A load
checks every block its reads cover whole directly. A block that a load reads in parts — by several
ranks (strided direct reads: each rank reads half of every row) or in several read units — is
checked by combining the parts: CRC-32C without its initial value and final inversion (the *raw*
CRC, here ``raw``) is linear over GF(2), so the raw CRC of a block is the XOR of the raw CRCs of its
parts, each shifted by the zero bytes that follow it in the block (:func:`shift`). Shifting is a
multiplication by ``x^(8n)`` modulo the CRC polynomial, vectorized over numpy arrays: no per-part
Python loop and no byte is read twice. The conventional CRC of ``n`` bytes is their raw CRC XOR the
CRC of ``n`` zero bytes (:func:`zeros_crc`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c
import numpy as np

BLOCK_BYTES = 1 << 20
"""Bytes per checksummed block of a piece (recorded per piece in the pieces table)."""

_POLY = 0x82F63B78
"""The CRC-32C polynomial, bit-reflected."""
_MASK = 0xFFFFFFFF
RAW_INIT = _MASK
"""``crc32c.crc32c(data, RAW_INIT) ^ RAW_INIT`` is the raw CRC (see :func:`raw_crc`)."""
_ONE = 1 << 31
"""The polynomial ``1`` (``x^0``) in the reflected representation."""


def _mulmod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a * b mod P`` elementwise, for reflected 32-bit polynomials in uint64 arrays."""
    product = np.zeros(np.broadcast(a, b).shape, dtype=np.uint64)
    b = np.broadcast_to(b, product.shape).astype(np.uint64)
    for bit in range(31, -1, -1):
        product ^= np.where((a >> np.uint64(bit)) & np.uint64(1), b, np.uint64(0))
        b = (b >> np.uint64(1)) ^ (np.uint64(_POLY) * (b & np.uint64(1)))
    return product


def _mulmod_int(a: int, b: int) -> int:
    """``a * b mod P`` for two reflected 32-bit polynomials as Python ints (:func:`_mulmod` for one pair,
    without numpy's per-call overhead: the table below is built at import, in every fresh process)."""
    product = 0
    for bit in range(31, -1, -1):
        if (a >> bit) & 1:
            product ^= b
        b = (b >> 1) ^ (_POLY if b & 1 else 0)
    return product


def _powers() -> list[int]:
    """``x^(2^k) mod P`` for k = 0..63."""
    table = [1 << 30]  # x^1
    for _ in range(63):
        table.append(_mulmod_int(table[-1], table[-1]))
    return table


_X2N = _powers()


def _x8n(nbytes: np.ndarray) -> np.ndarray:
    """``x^(8 * nbytes) mod P`` elementwise."""
    n = np.asarray(nbytes, dtype=np.uint64).copy()
    out = np.full(n.shape, _ONE, dtype=np.uint64)
    k = 3  # 8 * n = n << 3
    while n.any():
        odd = (n & np.uint64(1)).astype(bool)
        if odd.any():
            out[odd] = _mulmod(np.uint64(_X2N[k]), out[odd])
        n >>= np.uint64(1)
        k += 1
    return out


_BYTE_BASIS = np.arange(256, dtype=np.uint64)[None, :] << (np.uint64(8) * np.arange(4, dtype=np.uint64))[:, None]
"""Every value of each of the 4 bytes of a 32-bit CRC, in place: shape (4, 256)."""
_MAX_SHIFT_TABLES = 4096
"""At most this many shifts' tables are kept (4 KiB each); past that the cache starts afresh."""


class _ShiftTables:
    """Shift by n bytes as 4 byte tables (multiplication by ``x^(8n)`` is linear: XOR of the bytes' images),
    memoized in one growing array, since a load's shifts repeat. Thread-safe: the load's checks run in
    worker threads; rows once written never change, and a full cache starts a new array."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[int, int] = {}
        self._table = np.zeros((64, 1024), dtype=np.uint32)

    def rows(self, zero_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The table array, shape (rows, 1024) (byte k's image of value v at ``k * 256 + v``), and the
        row of each of ``zero_bytes`` (distinct) in it."""
        wanted = zero_bytes.tolist()
        with self._lock:
            missing = [n for n in wanted if n not in self._rows]
            if missing:
                if len(self._rows) + len(missing) > _MAX_SHIFT_TABLES:
                    self._rows, self._table = {}, np.zeros((64, 1024), dtype=np.uint32)
                    missing = wanted  # distinct (the caller passes unique shifts), and none is cached any more
                powers = _x8n(np.array(missing, dtype=np.uint64))
                tables = _mulmod(powers[:, None, None], _BYTE_BASIS[None, :, :]).astype(np.uint32).reshape(len(missing), 1024)
                used = len(self._rows)
                if used + len(missing) > len(self._table):
                    grown = np.zeros((max(2 * len(self._table), used + len(missing)), 1024), dtype=np.uint32)
                    grown[:used] = self._table[:used]
                    self._table = grown  # a new array: readers of the old one keep valid rows
                self._table[used : used + len(missing)] = tables
                self._rows.update(zip(missing, range(used, used + len(missing))))
            return self._table, np.array([self._rows[n] for n in wanted], dtype=np.intp)


_SHIFT_TABLES = _ShiftTables()


def shift(raw_crcs: np.ndarray, zero_bytes: np.ndarray) -> np.ndarray:
    """Raw CRCs of ``data + zero_bytes * b"\\0"`` given the raw CRCs of ``data`` (elementwise, uint64)."""
    raw = np.asarray(raw_crcs, dtype=np.uint64)
    zero_bytes = np.asarray(zero_bytes, dtype=np.uint64)
    if raw.size == 0:
        return raw.copy()
    unique, inverse = np.unique(zero_bytes, return_inverse=True)  # few distinct shifts in a strided read
    table, rows = _SHIFT_TABLES.rows(unique)
    flat = table.reshape(-1)  # (row, byte k, value) -> flat index row * 1024 + k * 256 + value
    base = rows[inverse.reshape(-1)] * 1024
    octets = raw.reshape(-1).astype("<u4").view(np.uint8).reshape(-1, 4).astype(np.intp)  # low byte first
    out = flat.take(base + octets[:, 0])
    for k in range(1, 4):
        out ^= flat.take(base + (256 * k) + octets[:, k])
    return out.astype(np.uint64).reshape(raw.shape)


def raw_crc(data: memoryview | bytes) -> int:
    """CRC-32C of ``data`` with initial register 0 and no final inversion (linear in ``data``)."""
    return crc32c.crc32c(data, RAW_INIT) ^ RAW_INIT


def zeros_crc(nbytes: np.ndarray) -> np.ndarray:
    """The CRC-32C of ``nbytes`` zero bytes, elementwise (what turns a raw CRC into a conventional one)."""
    return shift(np.full(np.shape(nbytes), _MASK, dtype=np.uint64), nbytes) ^ np.uint64(_MASK)


def concat_crc(parts: Sequence[tuple[int, int]]) -> int:
    """The CRC-32C of consecutive byte strings, given each one's ``(CRC-32C, length)``, in order.

    ``crc(A + B) = shift(crc(A), len(B)) ^ crc(B)`` (conventional CRCs: the initial value's and the final
    inversion's terms cancel), folded from the first part to the last. Each shift is four lookups in the
    byte tables of its length (:class:`_ShiftTables`, memoized): a file's parts are its pieces and the
    padding between them, whose lengths repeat within a save and across saves of the same state, so the
    fold costs about a microsecond per part — against a pass over every byte to checksum them again.
    """
    lengths = np.unique(np.array([n for _, n in parts], dtype=np.uint64))
    table, rows = _SHIFT_TABLES.rows(lengths)
    flat = table.reshape(-1)
    base = dict(zip(lengths.tolist(), (rows * 1024).tolist()))
    crc = 0
    for part_crc, nbytes in parts:
        b = base[nbytes]
        crc = (
            flat.item(b + (crc & 0xFF)) ^ flat.item(b + 256 + ((crc >> 8) & 0xFF))
            ^ flat.item(b + 512 + ((crc >> 16) & 0xFF)) ^ flat.item(b + 768 + (crc >> 24))
        ) ^ part_crc
    return crc


def block_crcs(data: memoryview | bytes, block_bytes: int = BLOCK_BYTES) -> list[int]:
    """The CRC-32C of each ``block_bytes`` block of ``data``."""
    view = memoryview(data).cast("B")
    return [crc32c.crc32c(view[i : i + block_bytes]) for i in range(0, len(view), block_bytes)]


def combine_blocks(crcs: list[list[int]], sizes: list[int], block_bytes: int = BLOCK_BYTES) -> list[int]:
    """The CRC-32C of each of several byte strings (``sizes[i]`` bytes whose blocks have CRCs ``crcs[i]``).

    Vectorized over every block of every string: one call combines all the pieces of a file. A string of one
    block (or none) is its block: a file of small pieces combines nothing.
    """
    if all(len(c) <= 1 for c in crcs):
        return [c[0] if c else 0 for c in crcs]
    counts = np.array([len(c) for c in crcs], dtype=np.int64)
    if not counts.any():
        return [0] * len(crcs)
    sizes_arr = np.asarray(sizes, dtype=np.uint64)
    owner = np.repeat(np.arange(len(crcs)), counts)
    index = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = index.astype(np.uint64) * np.uint64(block_bytes)
    ends = np.minimum(starts + np.uint64(block_bytes), sizes_arr[owner])
    flat = np.fromiter((c for blocks in crcs for c in blocks), dtype=np.uint64, count=int(counts.sum()))
    shifted = shift(flat ^ zeros_crc(ends - starts), sizes_arr[owner] - ends)
    raw = np.zeros(len(crcs), dtype=np.uint64)
    np.bitwise_xor.at(raw, owner, shifted)
    whole = raw ^ zeros_crc(sizes_arr)
    return [int(w) if n else 0 for w, n in zip(whole, counts)]


@dataclass(frozen=True, slots=True)
class PieceChecksums:
    """A piece's CRC-32C and the CRC-32C of each of its blocks."""

    crc32c: int
    block_bytes: int
    block_crc32c: tuple[int, ...]


class BlockAccumulator:
    """CRC-32C of each block of one piece, fed its bytes in order in segments of any size."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self.crcs: list[int] = []
        self.nbytes = 0

    def update(self, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        start = 0
        while start < len(view):
            within = self.nbytes % self.block_bytes
            take = min(self.block_bytes - within, len(view) - start)
            part = view[start : start + take]
            if within == 0:
                self.crcs.append(crc32c.crc32c(part))
            else:
                self.crcs[-1] = crc32c.crc32c(part, self.crcs[-1])
            self.nbytes += take
            start += take



def finish_pieces(pieces: list[BlockAccumulator]) -> list[PieceChecksums]:
    """The checksums of pieces fed to :class:`BlockAccumulator` objects of one block size."""
    block = pieces[0].block_bytes if pieces else BLOCK_BYTES
    whole = combine_blocks([p.crcs for p in pieces], [p.nbytes for p in pieces], block)
    return [PieceChecksums(crc32c=c, block_bytes=block, block_crc32c=tuple(p.crcs)) for c, p in zip(whole, pieces)]
