"""Size caps on the files tierckpt reads whole, checked before a byte is read.

Everything read from a checkpoint or a node tier is untrusted input: a ``COMMIT`` that is a 3 GiB
sparse file, or a tier's ``URI`` file grown by accident, must not be read into memory. Each such file
has a cap derived from what it can legitimately hold (a ``COMMIT`` is under 2 KiB), and its size is
checked (``fstat``, or the store's ``size``) before it is read; the read itself asks for at most
``cap + 1`` bytes, so a file that grows in between is refused too. A file over its cap raises
:class:`~tierckpt.errors.OversizedFileError` naming the file, its size and the cap.
"""

from __future__ import annotations

import os

from tierckpt.errors import OversizedFileError

MAX_RECORD_BYTES = 1 << 20
"""A checkpoint's ``COMMIT`` or a manager's ``LATEST`` record (under 2 KiB in practice)."""
MAX_URI_FILE_BYTES = 64 << 10
"""A memory tier directory's ``URI`` file: one URI."""
MAX_TIER_RECORD_BYTES = 64 << 20
"""A memory tier manifest (one line per file a node holds of a generation), write-down log (a few events
per file) or replica level record."""


def oversized(what: str, size: int, cap: int) -> OversizedFileError:
    """The error for ``what`` (a path or URI) holding ``size`` bytes, over ``cap``."""
    return OversizedFileError(
        f"{what} holds {size} bytes, more than such a file can ({cap}): the checkpoint is corrupt or this is "
        "not a tierckpt checkpoint (or tier directory); it is not read"
    )


def read_fd_capped(fd: int, cap: int, what: str) -> bytes:
    """The whole file open as ``fd`` (from its start), refused unread when larger than ``cap``."""
    size = os.fstat(fd).st_size
    if size > cap:
        raise oversized(what, size, cap)
    chunks, got = [], 0
    while got <= cap:
        chunk = os.pread(fd, cap + 1 - got, got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if got > cap:
        raise oversized(what, got, cap)  # it grew while being read
    return b"".join(chunks)


def read_capped(path: str, cap: int) -> bytes:
    """The whole file at ``path``, refused unread when larger than ``cap`` (:func:`read_fd_capped`)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return read_fd_capped(fd, cap, path)
    finally:
        os.close(fd)
