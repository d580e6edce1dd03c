"""Positional reads of many runs of one local file: the strided and segmented reads of a load.

Each run is read with ``pread`` (the kernel told about the spans ahead, :func:`read_ahead_spans`) or
copied through a mapping when its pages are resident (:mod:`.mapped_read`), its CRC-32C taken in the
same pass. Plain functions of paths and descriptors, run in worker threads by the local backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from tierckpt.errors import CorruptCheckpointError
from tierckpt.backends import mapped_read
from tierckpt.backends.base import Segment
from tierckpt.backends.file_open import open_regular


READ_THROUGH_GAP_BYTES = 128 << 10
"""Runs separated by at most this many bytes are read ahead as one span (the default Linux
read-ahead window): reading through such a gap costs a device about what skipping it costs."""


def read_ahead_spans(offsets: Sequence[int], run_bytes: int, max_gap: int = READ_THROUGH_GAP_BYTES) -> list[tuple[int, int]]:
    """``(start, length)`` of each cluster of two or more ascending runs whose gaps are at most ``max_gap``.

    Strided runs (a column window of a row-major shard) are announced to the kernel span by span,
    so it reads them in large requests instead of one small synchronous read per run; lone runs
    are left to the ``pread`` itself.
    """
    spans: list[tuple[int, int]] = []
    start = previous = None
    count = 0
    for offset in offsets:
        if previous is not None and offset >= previous + run_bytes and offset - previous - run_bytes <= max_gap:
            count += 1
        else:
            if count > 1:
                spans.append((start, previous + run_bytes - start))
            start, count = offset, 1
        previous = offset
    if count > 1:
        spans.append((start, previous + run_bytes - start))
    return spans


def _back_to_back(offsets: list[int], run_bytes: int) -> bool:
    """Whether the runs are one contiguous ascending range."""
    return bool(offsets) and offsets == list(range(offsets[0], offsets[0] + len(offsets) * run_bytes, run_bytes))


def pread_runs(
    path: str, offsets: list[int], run_bytes: int, out: memoryview, digest: Callable[[memoryview], int] | None = None,
    *, mapped: bool = False, shared: bool = False,
) -> list[int] | None:
    """Read runs packed into ``out``; with ``digest``, also ``digest(run)`` of each run right after
    its read, while its bytes are in the CPU cache (one pass over them, no second thread).

    ``mapped``: runs in the page cache are copied through a mapping instead, their CRC-32C taken in the
    copying pass (:mod:`.mapped_read`; the same bytes and digests, sooner).

    Runs separated by gaps are announced to the kernel span by span (:func:`read_ahead_spans`); runs
    back to back (a contiguous range read block by block) only mark the file sequential, so the
    kernel's own read-ahead runs ahead of them: asking for a range already in the page cache costs
    about 2.6 ms per 32 MiB on the 2-core test VM, more than checksumming it."""
    fd = open_regular(path, shared)
    try:
        return _read_runs(fd, path, offsets, run_bytes, out, digest, mapped)
    finally:
        os.close(fd)


def pread_segments(
    path: str, segments: Sequence[Segment], digest: Callable[[memoryview], int] | None = None,
    *, mapped: bool = False, shared: bool = False,
) -> list[list[int] | None]:
    """:func:`pread_runs` of each segment, all with one open of the file (and one hold of its shared lock):
    a load's many small units of one file cost one call, not one thread hop each. Returns each segment's
    digests. ``mapped``: segments that are one run each (contiguous units) are copied through one mapping
    of their extent, each run's CRC-32C in the copying pass, when their pages are resident
    (:func:`.mapped_read.read_spans`)."""
    fd = open_regular(path, shared)
    try:
        if mapped and all(len(offsets) == 1 and out.nbytes == run_bytes for offsets, run_bytes, out in segments):
            done, got = mapped_read.read_spans(fd, [offsets[0] for offsets, _, _ in segments],
                                               [out for _, _, out in segments], digest)
            if done:
                return [[crc] for crc in got] if got is not None else [None] * len(segments)
        return [_read_runs(fd, path, offsets, run_bytes, out, digest, mapped) for offsets, run_bytes, out in segments]
    finally:
        os.close(fd)


def _read_runs(
    fd: int, path: str, offsets: Sequence[int], run_bytes: int, out: memoryview,
    digest: Callable[[memoryview], int] | None, mapped: bool,
) -> list[int] | None:
    """:func:`pread_runs` on the open file ``fd``."""
    if mapped:
        done, got = mapped_read.read_runs(fd, offsets, run_bytes, out, digest)
        if done:
            return got
    digests: list[int] | None = [] if digest is not None else None
    if hasattr(os, "posix_fadvise"):  # Linux and most Unixes; elsewhere each pread reads alone
        if _back_to_back(offsets, run_bytes):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        else:
            for start, length in read_ahead_spans(offsets, run_bytes):
                os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)
    for i, offset in enumerate(offsets):
        view = out[i * run_bytes : (i + 1) * run_bytes]
        got = os.preadv(fd, [view], offset)
        if got != run_bytes:
            raise CorruptCheckpointError(
                f"{path} ends before byte {offset + run_bytes} (read {got} of {run_bytes} bytes at {offset})"
            )
        if digests is not None:
            digests.append(digest(view))  # type: ignore[misc]
    return digests
