"""Reads of a local file's resident page cache through a mapping, each run's CRC-32C in the same pass.

A load reads a local file either from disk (cold) or from the page cache (warm: a restart on the node
that saved, an eval job reading the node cache). Warm, ``pread`` is a kernel copy and the read path's
checksum a second pass over the copied bytes. The native :mod:`tierckpt._copycrc` maps the file
instead and, when every page of the runs' span is resident, copies each run with its CRC-32C computed
from the same loads; a file system that keeps large folios in the page cache (XFS; ext4 on recent
kernels) maps them with 2 MiB page-table entries, so the mapping itself is nearly free. Measured on the
2-core test VM (512 MiB, warm, ext4 on Linux 6.18, one core): ``pread`` 64 ms, ``pread`` + CRC 84 ms,
the fused copy + CRC 57 ms (two ranks at once: the CRC hides entirely); a cold file read through a mapping took 220 ms against ``pread`` + CRC's
190 ms, hence the residency check (``mincore``) and the fallback.

A load's many small units of one file (a model's hundreds of small tensors) are read as a group
(:func:`read_spans`): each below :data:`MIN_BYTES`, one mapping for the group's extent serves them all,
each into its own buffer with its CRC-32C.

:func:`read_runs` says whether it read; when it did not (no extension, a CPU without SSE4.2, fewer than
:data:`MIN_BYTES` in fewer than :data:`MIN_RUNS` runs, a page not resident, the file shorter than the runs), the caller reads with ``pread``
as before — the result is the same bytes and the same CRC-32Cs either way. ``TIERCKPT_MAPPED_READS=off``
turns it off (to compare, or where mapping files is unwelcome).

A mapped read shares one hazard with every reader of a mapping: a file truncated *while* it is being
copied raises ``SIGBUS``, which ends the process (loudly, never with wrong bytes). Checkpoint files are
never truncated in place (they are written under temporary names and renamed), and the memory tier
cuts a file's size only when it reuses its pages (:mod:`tierckpt.node.memory.pagepool`), which it never does
while a reader holds the file's shared lock — as every read of the tier does, mapped or not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import crc32c
import numpy as np

try:
    from tierckpt import _copycrc
except ImportError:  # built without a C compiler: every read takes pread
    _copycrc = None

ENV = "TIERCKPT_MAPPED_READS"
MIN_BYTES = 1 << 20
"""Smaller reads of few runs take ``pread``: mapping, ``mincore`` and unmapping cost more than they save."""
MIN_RUNS = 16
"""Reads of at least this many runs take the mapping whatever their bytes: a strided read (a column window
of each row of a saved piece, which every rank of a resharded load does) costs ``pread`` a system call and
a Python iteration per run (about 4 us on the 2-core test VM: 122 ms for 16,384 runs of 2 KiB), the
mapping one native loop (16 ms for the same runs, span 256 MiB, mapped once)."""


def available() -> bool:
    """Whether mapped reads can run here (extension built, CPU with SSE4.2) and are not turned off."""
    return _copycrc is not None and bool(_copycrc.AVAILABLE) and os.environ.get(ENV, "on").lower() != "off"


def read_runs(
    fd: int, offsets: Sequence[int], run_bytes: int, out: memoryview, digest: Callable[[memoryview], int] | None,
) -> tuple[bool, list[int] | None]:
    """Copy the runs ``[offset, offset + run_bytes)`` of ``fd`` back to back into ``out`` from the page
    cache; ``(True, CRC-32C of each run or None)`` when done, ``(False, None)`` when the caller must read.

    ``digest`` is what the caller wants of each run: ``None``, or ``crc32c.crc32c`` (computed here in the
    copying pass); any other function takes the caller's path."""
    if digest not in (None, crc32c.crc32c) or not available():
        return False, None
    if run_bytes * len(offsets) < MIN_BYTES and len(offsets) < MIN_RUNS:
        return False, None
    got = _copycrc.copy_runs(fd, np.asarray(offsets, dtype=np.int64), run_bytes, out, digest is not None)
    if got is None:
        return False, None
    return True, (got if digest is not None else None)


def read_spans(
    fd: int, starts: Sequence[int], outs: Sequence[memoryview], digest: Callable[[memoryview], int] | None,
) -> tuple[bool, list[int] | None]:
    """:func:`read_runs` for a group of single-run units of one file, each into its own buffer: copy
    ``[starts[i], starts[i] + len(outs[i]))`` into ``outs[i]`` through one mapping of the group's extent
    (small units together reach :data:`MIN_BYTES`; one mapping each would cost more than it saves).
    ``(True, CRC-32C of each span or None)`` when done, ``(False, None)`` when the caller must read."""
    lengths = [out.nbytes for out in outs]
    if digest not in (None, crc32c.crc32c) or sum(lengths) < MIN_BYTES or not available():
        return False, None
    got = _copycrc.copy_spans(fd, np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64),
                              outs, digest is not None)
    if got is None:
        return False, None
    return True, (got if digest is not None else None)
