"""Checksums checked in the read path of every load: each byte a load reads is checked once.

Each saved piece carries the CRC-32C of each of its blocks (:mod:`tierckpt.io.crc`). When a rank
has read a unit (a contiguous range, or a box's strided runs), :meth:`ReadChecker.check` splits its
runs at block boundaries:

* a block the unit covers whole is checked at once, before any of its bytes is delivered;
* a block covered in part yields a *partial*: the raw CRC of each covered part, shifted to the end of
  its block, XORed per block, with the count of bytes covered. A strided read takes the CRC-32C of
  each short run as it reads it (:data:`DIGEST_RUN_BYTES`), while the run is in the CPU cache; the
  check computes only the parts of runs that cross a block edge.

A contiguous unit read from a local file is read in runs cut at its piece's block edges
(:meth:`ReadChecker.block_runs`), each run's CRC-32C taken right after its read, while its bytes are
in the CPU cache: one pass over memory instead of a read and a second pass to check it.

After the last round, :meth:`ReadChecker.settle` combines every rank's partials (gathered with the
read step's agreement, no collective of its own): a
block whose parts add up to all its bytes is checked against its CRC — no byte is read twice, so read
amplification stays 1.00. A block the group read only in part (a load that needs part of a tensor) is
read whole once more by one rank and checked, so no byte a load delivers goes unchecked. Pieces of
checkpoints written before block checksums are one block: the piece and its CRC.

Ranks of one node that read the same bytes directly (a replicated tensor read from a local file by
every rank) read them from the same page cache: :func:`checking_ranks` has one of them check each such
unit, sharing the bytes evenly, so the node computes each CRC once instead of once per rank (a failed check fails the
load on every rank). Ranks of different nodes each check what they read.
"""

from __future__ import annotations

import bisect
import functools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import crc32c
import numpy as np

from tierckpt.native import layout
from tierckpt.backends import Backend
from tierckpt.errors import ChecksumMismatchError
from tierckpt.native.metadata import PieceMeta
from tierckpt.io.crc import RAW_INIT, shift, zeros_crc
from tierckpt.io.scheduler import get_scheduler

try:
    from tierckpt._copycrc import fold_runs
except ImportError:  # the optional native extension was not built: numpy does the same
    fold_runs = None

PieceKey = tuple[str, int]
"""A piece, named the same on every rank: ``(file, byte_offset)``."""
Partials = dict[PieceKey, tuple[np.ndarray, np.ndarray, np.ndarray]]
"""Per piece: block indices, the XOR of their parts' shifted raw CRCs, and the bytes covered."""
RankPartials = tuple[list[PieceKey], np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""One rank's partial blocks as the load's agreement carries them: its pieces, then per block the piece's
position in that list, the block index, the XOR of its parts' shifted raw CRCs and the bytes covered. Four
arrays whatever the count of pieces: a rank of a resharded load holds parts of every piece it touches
(64 at 8 ranks, 64 MiB), and three arrays per piece cost the group's unpickling 1,536 arrays per load."""

DIGEST_RUN_BYTES = 64 << 10
"""Runs of a strided read up to this long have their CRC taken as each lands, in the read's own
loop (``Backend.read_runs(digest=RUN_DIGEST)``): the per-run cost is then one native call on bytes in
the CPU cache. Longer runs are few per block and checked after the read, with the GIL released."""
RUN_DIGEST = crc32c.crc32c
"""What a read computes of each run it reads: the plain CRC-32C, the native function itself (no Python
frame per run); :meth:`ReadChecker.check` turns all of a unit's run CRCs into raw CRCs with one XOR,
since its runs have one length."""


def checking_ranks(units: Sequence[Any], nodes: Sequence[str]) -> list[int]:
    """The rank that checks the checksums of each unit (``units``: a load plan's read units).

    A unit's reader checks it, unless ranks of the same node read exactly the same runs of the same
    file: those units are checked by one of their readers, the one with the fewest bytes to check so
    far (ties to the lower rank), so the work is shared. Pure: every rank computes the same list.
    """
    readers: dict[tuple, set[int]] = defaultdict(set)
    keys = []
    for u in units:
        key = (u.file, u.run_bytes, np.asarray(u.run_offsets).tobytes(), nodes[u.reader])
        keys.append(key)
        readers[key].add(u.reader)
    load: dict[int, int] = defaultdict(int)
    chosen: dict[tuple, int] = {}
    out = []
    for u, key in zip(units, keys):
        if len(readers[key]) == 1:
            out.append(u.reader)
            continue
        if key not in chosen:
            chosen[key] = min(sorted(readers[key]), key=lambda r: load[r])
            load[chosen[key]] += u.nbytes
        out.append(chosen[key])
    return out


class ReadChecker:
    """Checks the block checksums of what one rank reads in a load, and keeps the partial blocks."""

    def __init__(self, generation: str, pieces: Mapping[str, Sequence[PieceMeta]]) -> None:
        self.generation = generation
        self._pieces: dict[PieceKey, PieceMeta] = {}
        index: dict[tuple[str, str], list[PieceMeta]] = defaultdict(list)
        for fqn, plist in pieces.items():
            for p in plist:
                self._pieces[(p.file, p.byte_offset)] = p
                index[(fqn, p.file)].append(p)
        self._index = {k: (sorted(p.byte_offset for p in v), sorted(v, key=lambda p: p.byte_offset)) for k, v in index.items()}
        self._parts: dict[PieceKey, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = defaultdict(list)
        self._arrays: dict[PieceKey, np.ndarray] = {}

    def check(
        self, fqn: str, file: str, run_offsets: np.ndarray, run_bytes: int, data: memoryview,
        run_crcs: Sequence[int] | None = None,
    ) -> Partials:
        """Check the whole blocks among runs read into ``data`` (packed back to back); return the partial blocks.

        ``run_crcs``: the CRC-32C (:data:`RUN_DIGEST`) of each run, computed as it was read
        (:data:`DIGEST_RUN_BYTES`, :meth:`block_runs`); a run that lies within one block is not read
        again here, so a read costs one native CRC call per run on bytes still in the CPU cache. With
        every run inside one block, in order, the native ``fold_runs`` folds the runs' CRCs per block
        (one multiplication per run; numpy's shift tables cost about six times as much per strided
        unit); otherwise runs that cross a block edge are cut there and their parts computed from ``data``.
        Thread-safe (its only state is a cache of each piece's block CRCs as an array): the caller hands
        the result to :meth:`add`.
        """
        if run_bytes == 0 or len(run_offsets) == 0:
            return {}
        piece = self._piece_at(fqn, file, int(run_offsets[0]))
        block = piece.blocks()[0]
        if run_crcs is not None and self._whole_blocks_match(piece, run_offsets, run_bytes, run_crcs):
            return {}
        rel = np.asarray(run_offsets, dtype=np.int64) - piece.byte_offset
        folded = None
        if run_crcs is not None and fold_runs is not None:
            folded = fold_runs(rel, run_bytes, run_crcs, block, piece.byte_length)
        if folded is not None:  # one entry per block
            blocks, raw, covered = (np.frombuffer(a, dtype=t) for a, t in zip(folded, (np.int64, np.uint64, np.int64)))
        else:  # one entry per (run, block) segment
            blocks, raw, covered = self._segments(piece, rel, run_bytes, data, run_crcs)
        lengths = np.minimum(blocks * block + block, piece.byte_length) - blocks * block
        full = covered == lengths
        whole = np.flatnonzero(full)
        # Blocks have one or two lengths (the last block may be shorter): their zeros' CRCs are memoized.
        zeros = np.array([_zeros_crc_of(n) for n in lengths[whole].tolist()], dtype=np.uint64)
        expected = self._block_crcs(piece)[blocks[whole]]
        if (bad := np.flatnonzero(raw[whole] ^ zeros != expected)).size:
            raise self._mismatch(piece, int(blocks[whole[bad[0]]]))
        part = np.flatnonzero(~full)
        if not part.size:
            return {}
        return {(piece.file, piece.byte_offset): (blocks[part], raw[part], covered[part])}

    def _whole_blocks_match(self, piece: PieceMeta, run_offsets: Any, run_bytes: int, run_crcs: Sequence[int]) -> bool:
        """Whether every run is one whole block of ``piece`` (a contiguous read cut at block edges, a small
        tensor's piece read whole): then each run's CRC-32C is its block's, compared as is, without the
        arrays of the general path (a load of many small tensors checks one block per unit). Raises on a
        mismatch; ``False`` when a run is not a whole block."""
        block, expected = piece.blocks()
        if run_bytes != block and run_bytes != piece.byte_length % block:  # e.g. the short runs of a strided read
            return False
        rel = [int(o) - piece.byte_offset for o in run_offsets]
        if any(r % block or run_bytes != min(block, piece.byte_length - r) for r in rel):
            return False
        for r, crc in zip(rel, run_crcs):
            if crc != expected[r // block]:
                raise self._mismatch(piece, r // block)
        return True

    @staticmethod
    def _segments(
        piece: PieceMeta, rel: np.ndarray, run_bytes: int, data: memoryview, run_crcs: Sequence[int] | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Runs cut at block edges: per segment its block, its raw CRC shifted to the block's end (the
        raw CRC of the block with every byte outside the segment zero) and its bytes."""
        block = piece.blocks()[0]
        first = rel // block
        count = (rel + run_bytes - 1) // block - first + 1
        if bool((count == 1).all()):  # each run lies in one block (short strided runs, block runs)
            run, blocks = np.arange(len(rel)), first
        else:  # cut runs at block edges: one segment per (run, block) pair
            run = np.repeat(np.arange(len(rel)), count)
            blocks = np.repeat(first, count) + (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count))
        block_start = blocks * block
        block_end = np.minimum(block_start + block, piece.byte_length)
        lo = np.maximum(rel[run], block_start)
        hi = np.minimum(rel[run] + run_bytes, block_end)
        at = run * run_bytes + (lo - rel[run])
        raw = np.zeros(len(run), dtype=np.uint64)
        known = np.zeros(len(run), dtype=bool)
        if run_crcs is not None:  # a segment that is its whole run has its raw CRC from the run's CRC-32C
            known = count[run] == 1
            raw[known] = (np.asarray(run_crcs, dtype=np.uint64) ^ np.uint64(_zeros_crc_of(run_bytes)))[run[known]]
        if (todo := np.flatnonzero(~known)).size:
            view = memoryview(data).cast("B")
            pairs = zip(at[todo].tolist(), (at + hi - lo)[todo].tolist())
            raw[todo] = np.array([crc32c.crc32c(view[a:b], RAW_INIT) for a, b in pairs], dtype=np.uint64) ^ np.uint64(RAW_INIT)
        return blocks, shift(raw, block_end - hi), hi - lo

    def _block_crcs(self, piece: PieceMeta) -> np.ndarray:
        """The piece's block CRCs as an array (made once per piece; :meth:`check` indexes it per unit)."""
        key = (piece.file, piece.byte_offset)
        if (got := self._arrays.get(key)) is None:
            got = self._arrays[key] = np.array(piece.blocks()[1], dtype=np.uint64)
        return got

    def block_runs(self, fqn: str, file: str, start: int, nbytes: int) -> list[tuple[int, int, int]]:
        """A contiguous range of a piece cut at the piece's block edges, as groups of equal runs
        ``(file offset of the first run, run bytes, runs)``: the head up to the first block edge, the
        whole blocks, the tail after the last edge (each group only where it has bytes).

        A read of these runs that takes each run's CRC right after reading it (``Backend.read_runs``
        with :data:`RUN_DIGEST`) checks every block while its bytes are in the CPU cache.
        """
        piece = self._piece_at(fqn, file, start)
        block = piece.blocks()[0]
        rel, end = start - piece.byte_offset, start - piece.byte_offset + nbytes
        head_end = min(-(-rel // block) * block, end)
        body_end = max(head_end, end // block * block)
        groups = [(rel, head_end - rel, 1), (head_end, block, (body_end - head_end) // block), (body_end, end - body_end, 1)]
        return [(piece.byte_offset + at, size, n) for at, size, n in groups if size and n]

    def _piece_at(self, fqn: str, file: str, offset: int) -> PieceMeta:
        offsets, pieces = self._index[(fqn, file)]
        return pieces[bisect.bisect_right(offsets, offset) - 1]

    def add(self, partials: Partials) -> None:
        """Keep partial blocks returned by :meth:`check` until :meth:`partials`."""
        for key, parts in partials.items():
            self._parts[key].append(parts)

    def partials(self) -> RankPartials:
        """This rank's partial blocks, reduced per block (what :func:`settle` gathers from every rank)."""
        keys = list(self._parts)
        parts = [(i, part) for i, key in enumerate(keys) for part in self._parts[key]]
        if not parts:
            return keys, *(np.zeros(0, dtype=t) for t in (np.int64, np.int64, np.uint64, np.int64))
        owner = np.concatenate([np.full(len(part[0]), i, dtype=np.int64) for i, part in parts])
        raw, covered, pair = _reduce_by((owner << 32) | np.concatenate([part[0] for _, part in parts]),
                                        np.concatenate([part[1] for _, part in parts]),
                                        np.concatenate([part[2] for _, part in parts]))
        return keys, pair >> 32, pair & 0xFFFFFFFF, raw, covered

    def settle(self, gathered: Sequence[RankPartials]) -> list[tuple[PieceMeta, int]]:
        """Check every block the group's parts complete; return the blocks the group read only in part.

        Pure given ``gathered`` (every rank's :meth:`partials`): every rank computes the same outcome,
        raising the same error on a mismatch, so no collective is needed to agree on it.
        """
        keys = sorted({key for rank_keys, *_ in gathered for key in rank_keys})
        if not keys:
            return []
        index = {key: i for i, key in enumerate(keys)}
        # Each rank's pieces renumbered in the group's order: (piece, block) pairs keyed as one int64.
        owner = np.concatenate([np.array([index[k] for k in rank_keys], dtype=np.int64)[rank_owner]
                                for rank_keys, rank_owner, *_ in gathered if len(rank_keys)])
        key_of = (owner << 32) | np.concatenate([p[2] for p in gathered if len(p[0])])
        raw, covered, pair = _reduce_by(key_of, np.concatenate([p[3] for p in gathered if len(p[0])]),
                                        np.concatenate([p[4] for p in gathered if len(p[0])]))
        which, blocks = pair >> 32, pair & 0xFFFFFFFF
        pieces = [self._pieces[k] for k in keys]
        block = np.array([p.blocks()[0] for p in pieces], dtype=np.int64)[which]
        length = np.array([p.byte_length for p in pieces], dtype=np.int64)[which]
        lengths = np.minimum(blocks * block + block, length) - blocks * block
        complete = covered == lengths
        crc = raw[complete] ^ zeros_crc(lengths[complete].astype(np.uint64))
        offsets = np.cumsum([0] + [len(p.blocks()[1]) for p in pieces])
        stored = np.fromiter((c for p in pieces for c in p.blocks()[1]), dtype=np.uint64, count=int(offsets[-1]))
        if (bad := np.flatnonzero(crc != stored[offsets[which[complete]] + blocks[complete]])).size:
            first = int(np.flatnonzero(complete)[bad[0]])
            raise self._mismatch(pieces[int(which[first])], int(blocks[first]))
        return [(pieces[int(w)], int(b)) for w, b in zip(which[~complete], blocks[~complete])]

    def check_whole(self, incomplete: Sequence[tuple[PieceMeta, int]], backend: Backend, rank: int, world_size: int) -> None:
        """Read this rank's share (round robin) of the blocks read only in part, whole, and check them."""
        sched = get_scheduler()
        for piece, b in incomplete[rank::world_size]:
            block, crcs = piece.blocks()
            start = piece.byte_offset + b * block
            end = min(start + block, piece.byte_offset + piece.byte_length)
            data = sched.run(backend.get_range(layout.in_generation(self.generation, piece.file), start, end))
            if crc32c.crc32c(data) != crcs[b]:
                raise self._mismatch(piece, b)

    def _mismatch(self, piece: PieceMeta, b: int) -> ChecksumMismatchError:
        block, _ = piece.blocks()
        start = piece.byte_offset + b * block
        end = min(start + block, piece.byte_offset + piece.byte_length)
        key = layout.in_generation(self.generation, piece.file)
        return ChecksumMismatchError(
            f"checksum mismatch in data file {key!r} at bytes {start}..{end} (tensor {piece.fqn!r}, region "
            f"{piece.region}): the checkpoint is corrupt; load an earlier checkpoint or restore this one from "
            "another copy", key, start, end,
        )


@functools.lru_cache(maxsize=64)
def _zeros_crc_of(nbytes: int) -> int:
    """The CRC-32C of ``nbytes`` zero bytes: what turns the CRC-32C of ``nbytes`` bytes into their raw CRC."""
    return int(zeros_crc(np.array(nbytes, dtype=np.uint64)))


def _reduce_by(keys: np.ndarray, raw: np.ndarray, covered: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct key (ascending): the XOR of the raw CRCs, the sum of the bytes covered, the key."""
    order = np.argsort(keys, kind="stable")
    keys, raw, covered = keys[order], raw[order].astype(np.uint64), covered[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return np.bitwise_xor.reduceat(raw, starts), np.add.reduceat(covered, starts), keys[starts]
