"""Opening a checkpoint's files for reading: regular files only (a FIFO would block a reader forever), and,
for the node memory tier's files, under a shared ``flock`` held while the file is read.

The memory tier reuses a retired file's pages (:mod:`tierckpt.node.memory.pagepool`) only when no reader holds
that lock, so every reader of the tier's files opens them with :func:`open_shared` (or holds the lock with
:func:`hold_shared`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from tierckpt.errors import CorruptCheckpointError


def not_regular(path: str, mode: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path} is not a regular file (mode {stat.filemode(mode)}); a checkpoint holds only regular files, "
        "so this one was tampered with"
    )


_REOPENS = 100
"""How often a shared open retries when its path was renamed over meanwhile (``COMMIT`` replaced)."""


def hold_shared(fd: int, path: str) -> bool:
    """Take a shared ``flock`` on ``fd`` (opened from ``path``); whether ``path`` still names its file.

    The node memory tier reuses a retired file's pages (:mod:`tierckpt.node.memory.pagepool`) only after renaming
    it away from its path and then taking its exclusive lock without waiting: a reader holding the shared
    lock on a file its path still named reads bytes nobody overwrites until it closes the descriptor (or
    the last ``mmap`` made from it). ``False``: the file left its path before the lock was taken (the
    caller opens the path again). A path that names nothing raises :class:`FileNotFoundError`, as if the
    file had been unlinked before the open."""
    fcntl.flock(fd, fcntl.LOCK_SH)
    held = os.fstat(fd)
    try:
        named = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "left its path while it was being opened", path) from None
    return (named.st_ino, named.st_dev) == (held.st_ino, held.st_dev)


def open_shared(path: str) -> int:
    """A descriptor of the file ``path`` names, for reading, holding its shared lock (:func:`hold_shared`)."""
    return open_regular(path, shared=True)


def open_regular(path: str, shared: bool = False) -> int:
    """Open ``path`` for reading, refusing anything but a regular file (a FIFO would block forever);
    ``shared``: holding its shared lock (:func:`hold_shared`), opening again while the path was renamed
    over between the open and the lock."""
    for _ in range(_REOPENS):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise not_regular(path, mode)
            if not shared or hold_shared(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise FileNotFoundError(errno.ENOENT, f"renamed over {_REOPENS} times while being opened", path)
