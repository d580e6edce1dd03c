"""The CRC-32C a memory-tier file was written with, found again by any process of the node.

A file's writer knows its size and CRC-32C (computed on the way, or stated by the save's stream);
sealing a generation (:meth:`~.memory.MemoryTier.seal`) runs later, often in another object or another
process — the node's replication leader seals every rank's files. :func:`remember` stores the entry as
an extended attribute of the file (``user.tierckpt.crc32c``: tmpfs has user attributes since Linux 6.6),
so it travels with the inode and is gone with it; where the file system refuses, in a table of this
process. :func:`recall` returns the entry only while the file is the same inode with the same size and
modification time it was stamped with (a rewrite changes them), else ``None``: then the caller reads the
file for its CRC-32C.
"""

from __future__ import annotations

import os
import struct
import threading

from tierckpt.node.memory.manifest import FileEntry

_XATTR = "user.tierckpt.crc32c"
_FORMAT = struct.Struct("<QIQq")
"""size, CRC-32C, inode, modification time (ns)."""
_LOCK = threading.Lock()
_TABLE: dict[str, bytes] = {}
"""Path -> packed stamp, for files whose file system keeps no user attributes."""


def remember(path: str, entry: FileEntry) -> None:
    """Stamp ``path`` (just written, complete) with ``entry``: its size and CRC-32C."""
    st = os.stat(path)
    stamp = _FORMAT.pack(entry.size, entry.crc32c, st.st_ino, st.st_mtime_ns)
    try:
        os.setxattr(path, _XATTR, stamp)
    except OSError:
        with _LOCK:
            _TABLE[path] = stamp


def recall(path: str) -> FileEntry | None:
    """The entry ``path`` was stamped with, if the file is unchanged since; else ``None``."""
    st = os.stat(path)
    fields = _stamp_of(path)
    if fields is None:
        return None
    size, crc, inode, mtime_ns = fields
    if (inode, mtime_ns, size) != (st.st_ino, st.st_mtime_ns, st.st_size):
        return None
    return FileEntry(size, crc)


def _stamp_of(path: str) -> tuple[int, int, int, int] | None:
    """``(size, crc, inode, mtime_ns)`` of ``path``'s stamp (its extended attribute, else this process's
    table), or ``None`` when it has none."""
    try:
        stamp = os.getxattr(path, _XATTR)
    except OSError:
        with _LOCK:
            stamp = _TABLE.get(path, b"")
    if len(stamp) != _FORMAT.size:
        return None
    return _FORMAT.unpack(stamp)


def written(path: str) -> FileEntry | None:
    """The entry ``path``'s writer stamped it with, while it is the same inode — even if its size or
    modification time changed since: the file was then changed in place after it was written (a pooled
    file reused for new bytes drops its stamp first, :func:`forget`), and the stamp still says what its
    writer wrote, which a check of the file (a seal, a write-down) must compare against. ``None``: never
    stamped, or another inode under the name."""
    st = os.stat(path)
    fields = _stamp_of(path)
    if fields is None:
        return None
    size, crc, inode, _ = fields
    return FileEntry(size, crc) if inode == st.st_ino else None


def forget(path: str) -> None:
    """Remove ``path``'s stamp: its inode is about to be written over (a pooled file claimed for reuse:
    same inode, maybe the same size, and a rewrite within one clock tick keeps the modification time)."""
    try:
        os.removexattr(path, _XATTR)
    except OSError:
        pass  # none, or a file system without user attributes (the table below)
    with _LOCK:
        _TABLE.pop(path, None)


def forget_under(directory: str) -> None:
    """Drop this process's stamps of files under ``directory`` (removed; attributes go with their files)."""
    prefix = directory.rstrip(os.sep) + os.sep
    with _LOCK:
        for path in [p for p in _TABLE if p.startswith(prefix)]:
            del _TABLE[path]
