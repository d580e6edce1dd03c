"""Coalesced reads: one request for a rank's back-to-back ranges of one object.

An object store charges every GET a round trip; a load that reads many small tensors (a model's
biases and norms, an optimizer's step counters) would pay one per tensor. The load planner puts one
reader's units of a file back to back where it can (:mod:`tierckpt.planner.load_planner`); this
module groups ranges that are back to back, or separated only by bytes no rank reads (the padding
that aligns saved pieces: under 64 bytes by default), into one ranged read of at most ``max_bytes``,
and scatters the bytes into each range's buffer. No byte another read of the plan covers is read
through, so each byte is still read once per group.

A local file's ranges are grouped too, gaps and all (:data:`GAPS_UNREAD`), not to save requests but
thread hops: the group is read in one call, each range straight into its buffer
(``Backend.read_segments``), the gaps never read.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from tierckpt.backends import Backend
from tierckpt.io.scheduler import IOScheduler, ReadRequest


class Taken:
    """The bytes of each key that some read of a plan covers, on any rank: a gap between two ranges
    may be read through only where it holds none of them (else a byte would be read twice)."""

    def __init__(self, runs: Iterable[tuple[str, np.ndarray, int]]) -> None:
        """``runs``: ``(key, run start offsets, run length)`` of every read in the plan."""
        starts: dict[str, list[np.ndarray]] = defaultdict(list)
        ends: dict[str, list[np.ndarray]] = defaultdict(list)
        for key, offsets, nbytes in runs:
            offsets = np.asarray(offsets, dtype=np.int64)
            starts[key].append(offsets)
            ends[key].append(offsets + nbytes)
        self._merged: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for key in starts:
            s, e = np.concatenate(starts[key]), np.concatenate(ends[key])
            order = np.argsort(s, kind="stable")
            s, e = s[order], np.maximum.accumulate(e[order])
            first = np.r_[True, s[1:] > e[:-1]]  # a run that starts past every earlier end opens an interval
            last = np.r_[first[1:], True]
            self._merged[key] = (s[first], e[last])

    def free(self, key: str, start: int, end: int) -> bool:
        """Whether no read of the plan covers any byte of ``[start, end)`` of ``key``."""
        if start >= end or key not in self._merged:
            return True
        starts, ends = self._merged[key]
        i = int(np.searchsorted(starts, end, side="left")) - 1
        return i < 0 or int(ends[i]) <= start


class _GapsUnread:
    """A ``taken`` for groups whose gaps are never read (local files: each range lands apart, in place),
    so any gap may lie inside a group."""

    @staticmethod
    def free(key: str, start: int, end: int) -> bool:
        return True


GAPS_UNREAD = _GapsUnread()


def coalesce(
    ranges: Sequence[tuple[str, int, int] | None], max_bytes: int, max_gap: int = 0,
    taken: Taken | _GapsUnread | None = None,
) -> list[list[int]]:
    """Group ``ranges`` (``(key, start, nbytes)``, or ``None`` for a read that is never merged) into
    runs of ranges of one key, each spanning at most ``max_bytes`` (a longer range stays alone).

    Neighbours join when they are back to back, or at most ``max_gap`` bytes apart where ``taken``
    says no read of the plan covers the gap (padding between saved pieces, bytes nobody loads).
    Returns the indices of each group, every index once, groups in key and offset order.
    """
    alone = [[i] for i, r in enumerate(ranges) if r is None]
    order = sorted((r[0], r[1], r[2], i) for i, r in enumerate(ranges) if r is not None)
    groups: list[list[int]] = []
    key, first, end = None, 0, -1
    for k, start, nbytes, i in order:
        gap = start - end
        near = gap == 0 or (0 < gap <= max_gap and taken is not None and taken.free(k, end, start))
        if groups and k == key and near and start + nbytes - first <= max_bytes:
            groups[-1].append(i)
        else:
            groups.append([i])
            key, first = k, start
        end = start + nbytes
    return groups + alone



async def read_group(sched: IOScheduler, backend: Backend, requests: Sequence[ReadRequest]) -> None:
    """Fill every request's ``out`` with one ranged read; the requests are of one key, sorted, and do
    not overlap (a group from :func:`coalesce`). One request alone is read as the scheduler reads any."""
    if len(requests) == 1:
        await sched.read(backend, requests)
        return
    key, start = requests[0].key, requests[0].start
    end = requests[-1].start + len(memoryview(requests[-1].out).cast("B"))
    data = memoryview(await backend.get_range(key, start, end))
    for req in requests:
        out = memoryview(req.out).cast("B")
        at = req.start - start
        out[:] = data[at : at + len(out)]
