"""The file operations under the local backend: names of hidden files, atomic publication, whole-file and
range reads (many runs at once: :mod:`.run_reads`), write-back hints and the errors a file system's refusals become.

Plain functions of paths and descriptors, run in worker threads by their callers. Shared by the
local backend, the node cache's files and the memory tier, so every one of them writes, reads and
reports errors the same way: a failed write is reported by :func:`write_error` (what the file
system refused and where, never "not found"); :func:`check_range`, :func:`range_past_end`,
:func:`temp_name` and :func:`is_temp_name` are shared with every backend.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
import stat
import sys
import uuid
from collections.abc import Callable
from urllib.parse import unquote, urlparse

from tierckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
    StoragePermissionError,
    UnsupportedURIError,
)
from tierckpt.backends.bounded import MAX_RECORD_BYTES, read_fd_capped
from tierckpt.native.keys import validate_key
from tierckpt.backends import mapped_read
from tierckpt.backends.file_open import not_regular, open_regular
from tierckpt.backends.base import UNCONDITIONAL, Unconditional

_TEMP_SUFFIX = ".partial"
_LOCK_SUFFIX = ".lock"


# -- helpers shared by every backend ---------------------------------------------------------------
def check_range(uri: str, start: int, end: int) -> None:
    """Reject negative or inverted byte ranges before any I/O."""
    if start < 0 or end < start:
        raise CorruptCheckpointError(
            f"invalid byte range [{start}, {end}) for {uri}: ranges need 0 <= start <= end"
        )


def range_past_end(uri: str, start: int, end: int, size: int) -> CorruptCheckpointError:
    """The error for a read that would run past the end of an object (never a short read)."""
    return CorruptCheckpointError(
        f"byte range [{start}, {end}) of {uri} runs past the end of the object ({size} bytes); "
        "the checkpoint metadata and the stored data disagree"
    )


def temp_name(name: str) -> str:
    """Name of the hidden temporary object a write of ``name`` goes through."""
    return f".{name}.{uuid.uuid4().hex}{_TEMP_SUFFIX}"


def is_temp_name(name: str) -> bool:
    """Whether the last path part ``name`` is an in-flight (or orphaned) temporary object."""
    return name.startswith(".") and name.endswith(_TEMP_SUFFIX)


def lock_name(name: str) -> str:
    """Name of the hidden lock file that serializes commits of ``name`` (kept for good: a lock held on
    a deleted file would exclude nobody who opens the name afresh)."""
    return f".{name}{_LOCK_SUFFIX}"


def is_lock_name(name: str) -> bool:
    """Whether the last path part ``name`` is a commit lock file."""
    return name.startswith(".") and name.endswith(_LOCK_SUFFIX)


def check_prefix(prefix: str) -> str:
    """Validate a listing prefix: ``""`` or a key-like string, optionally ending in ``/``."""
    if prefix:
        validate_key(prefix.removesuffix("/"))
    return prefix


# -- local file helpers (run in worker threads) ----------------------------------------------------
def os_error(exc: OSError, what: str) -> CheckpointError:
    """Translate an ``OSError`` raised while doing ``what`` into the tierckpt hierarchy."""
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return CheckpointNotFoundError(f"{what}: no such object ({exc.strerror})")
    if isinstance(exc, PermissionError):
        return StoragePermissionError(f"{what}: permission denied ({exc.strerror})")
    return StorageError(f"{what}: {type(exc).__name__}: {exc.strerror or exc}")


_REFUSED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
_WRITE_HINTS = {
    errno.EACCES: "choose a directory you may write to, or fix its permissions",
    errno.EPERM: "choose a directory you may write to, or fix its permissions",
    errno.EROFS: "the file system is mounted read-only: choose a directory on a writable one",
    errno.ENOENT: "a directory on the path cannot be created there (a virtual file system such as /proc, or a "
    "directory removed meanwhile): choose a directory on a writable file system",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another path",
    errno.EISDIR: "a directory stands where the file goes: remove it or choose another path",
    errno.ENOSPC: "the device is full: free space or choose another directory",
    errno.EDQUOT: "the disk quota is exhausted: free space or choose another directory",
    errno.ENAMETOOLONG: "the path is too long for the file system: choose a shorter one",
}


def write_error(exc: OSError, what: str) -> CheckpointError:
    """Translate an ``OSError`` raised while writing: what the file system refused, where, and the fix.

    Never "not found": a write that fails with ``ENOENT`` or ``ENOTDIR`` names a directory that cannot
    be created, not a missing object. Refusals (permissions, read-only mounts) are
    :class:`StoragePermissionError`, the rest :class:`StorageError`.
    """
    reason = exc.strerror or str(exc)
    if exc.filename is not None:
        reason += f": {exc.filename}"
    hint = _WRITE_HINTS.get(exc.errno)
    cls = StoragePermissionError if exc.errno in _REFUSED else StorageError
    return cls(f"{what}: {reason}" + (f"; {hint}" if hint else ""))


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


DIRECT_ALIGN = 4096
"""What ``O_DIRECT`` needs aligned: the buffer's address, the file offset and each write's length (the
largest logical block size in use)."""
DIRECT_CHUNK = 8 << 20
"""The bytes of one ``O_DIRECT`` write."""


def write_pages(fd: int, pages: memoryview) -> None:
    """Append ``pages`` — another file's bytes through a mapping from its start (page-aligned) — to ``fd``,
    whose offset is a multiple of :data:`DIRECT_ALIGN`, with ``O_DIRECT``: the device takes the bytes from
    the source's pages, so none is copied into the page cache of ``fd``'s file, nor freed from it when
    that file is deleted (a written-down copy is not read while the memory tier holds the bytes): under
    half the CPU of a kernel copy and its later unlink (``docs/benchmarks.md``). The unaligned tail,
    and everything on a file system that refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some FUSE mounts),
    is written through the page cache."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    aligned = len(pages) - len(pages) % DIRECT_ALIGN
    done = 0
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        aligned = 0
    try:
        while done < aligned:
            try:
                done += os.write(fd, pages[done: min(aligned, done + DIRECT_CHUNK)])
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                break  # the file system took the flag but refuses this write: the rest through the page cache
    finally:
        if aligned:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    write_all(fd, pages[done:])


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or ``None`` where there is none."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of ``fd`` to the device, without waiting.

    A streamed file is then written out while the next chunks are still being produced, and the
    ``fsync`` that makes it durable only waits for the tail — instead of the whole file, which the
    kernel would otherwise keep dirty in memory until the ``fsync``. A no-op where unsupported.
    """
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # advisory: an error only loses the overlap


WRITEBACK_BATCH_BYTES = 8 << 20
"""A streamed file's writeback is started each time this many more bytes have been written."""
WRITEBACK_PAGE_BYTES = 4096
"""Writeback starts at page boundaries, so a page still being filled is not written early."""


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_temp(path: str) -> tuple[int, str]:
    """A new temp file beside ``path`` (its directories made when missing), open for writing, and its path."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, temp_name(name))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(tmp, flags, 0o666), tmp
    except FileNotFoundError:  # the directory first (asked only when missing: most writes go where others went)
        os.makedirs(directory, exist_ok=True)
        return os.open(tmp, flags, 0o666), tmp


def publish(fd: int, tmp: str, path: str, durable: bool = True) -> None:
    """Close ``fd`` and rename ``tmp`` over ``path``; ``durable``: fsync the file first and the directory after
    (a file system that keeps nothing past a restart, the node memory tier's tmpfs, has nothing to sync)."""
    try:
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        fsync_dir(os.path.dirname(path))


def unlink(path: str) -> None:
    """Remove a file; a missing one is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_tree(path: str) -> None:
    """Remove the directory ``path`` and everything in it (links are removed, never followed); one that is not
    there, or is not a directory, is fine. Any other refusal raises."""
    def refused(_function: object, _path: str, exc: BaseException) -> None:
        if not isinstance(exc, (FileNotFoundError, NotADirectoryError)):
            raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=refused)
    else:  # ``onerror`` (deprecated from 3.12) is given the exception's (type, value, traceback)
        shutil.rmtree(path, onerror=lambda function, where, info: refused(function, where, info[1]))


def discard(fd: int, tmp: str) -> None:
    try:
        os.close(fd)
    finally:
        unlink(tmp)


def write_atomic(path: str, data: bytes | memoryview, durable: bool = True) -> None:
    """Write a whole file: a temp file beside it, renamed over it (see :func:`publish` for ``durable``)."""
    fd, tmp = open_temp(path)
    try:
        write_all(fd, data)
    except BaseException:
        discard(fd, tmp)
        raise
    try:
        publish(fd, tmp, path, durable)
    except BaseException:
        unlink(tmp)
        raise


def pread_into(path: str, start: int, out: memoryview, *, mapped: bool = False, shared: bool = False) -> None:
    """Fill ``out`` with the bytes from ``start`` (``mapped``: from the page cache through a mapping when
    resident, :mod:`.mapped_read`; ``shared``: under the file's shared lock, :func:`.file_open.hold_shared`)."""
    fd = open_regular(path, shared)
    try:
        end = start + len(out)
        size = os.fstat(fd).st_size
        if end > size:
            raise range_past_end(path, start, end, size)
        if mapped and mapped_read.read_runs(fd, [start], len(out), out, None)[0]:
            return
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], start + done)
            if n == 0:  # the file shrank under us
                raise range_past_end(path, start, end, start + done)
            done += n
    finally:
        os.close(fd)


def read_whole(path: str, shared: bool = False) -> bytes:
    with open(open_regular(path, shared), "rb") as f:
        return f.read()


def read_whole_capped(path: str, cap: int, shared: bool = False) -> bytes:
    """:func:`read_whole`, refused unread when the file is larger than ``cap`` (see :mod:`tierckpt.backends.bounded`)."""
    fd = open_regular(path, shared)
    try:
        return read_fd_capped(fd, cap, path)
    finally:
        os.close(fd)


def pread_range(path: str, start: int, end: int, shared: bool = False) -> bytes:
    """Bytes ``[start, end)``, allocated only once the file is known to hold them."""
    fd = open_regular(path, shared)
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if end > size:
        raise range_past_end(path, start, end, size)
    buf = bytearray(end - start)
    pread_into(path, start, memoryview(buf), shared=shared)
    return bytes(buf)


def _read_if_exists(path: str) -> bytes | None:
    """The commit record at ``path``, if any (capped: it is compared, never more)."""
    try:
        return read_whole_capped(path, MAX_RECORD_BYTES)
    except FileNotFoundError:
        return None


def commit_if(path: str, data: bytes, expected: bytes | None | Unconditional,
              durable: bool = True) -> tuple[bool, bytes | None]:
    """Publish ``data`` at ``path`` if it holds ``expected``, under the commit lock; ``(done, found)``
    (``durable``: see :func:`publish`)."""
    directory, name = os.path.split(path)
    lock = os.path.join(directory, lock_name(name))
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    try:
        fd = os.open(lock, flags, 0o666)
    except FileNotFoundError:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(lock, flags, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if expected is not UNCONDITIONAL:
            current = _read_if_exists(path)
            if current != expected:
                return False, current
        write_atomic(path, data, durable)
        return True, None
    finally:
        os.close(fd)  # releases the lock


def list_files(root: str, prefix: str) -> list[str]:
    base = os.path.join(root, *prefix.split("/")[:-1])
    keys = []
    for directory, dirs, files in os.walk(base):
        dirs.sort()
        rel_dir = os.path.relpath(directory, root).replace(os.sep, "/")
        for name in files:
            if is_temp_name(name) or is_lock_name(name):
                continue
            key = name if rel_dir == "." else f"{rel_dir}/{name}"
            if key.startswith(prefix):
                keys.append(key)
    return sorted(keys)


def file_size(path: str) -> int:
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(21, "a directory", path)
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, st.st_mode)
    return st.st_size


def local_root(root_uri: str) -> str:
    """The absolute directory a plain path or ``file://`` URI names."""
    if root_uri.startswith("file:"):
        parsed = urlparse(root_uri)
        if parsed.netloc not in ("", "localhost"):
            raise UnsupportedURIError(
                f"file URI {root_uri!r} names host {parsed.netloc!r}; only local files are "
                "supported: use file:///absolute/path"
            )
        return os.path.abspath(unquote(parsed.path))
    return os.path.abspath(os.path.expanduser(root_uri))


def copy_range(src: int, dst: int, offset: int, length: int) -> None:
    """Append ``length`` bytes of ``src`` from ``offset`` to ``dst`` kernel-side, with no copy through user
    space: ``copy_file_range``, or ``sendfile`` between file systems that refuse it."""
    end = offset + length
    try:
        while offset < end:
            offset += _advanced(os.copy_file_range(src, dst, end - offset, offset), offset, end)
        return
    except OSError as exc:
        if exc.errno not in _NO_KERNEL_COPY:
            raise
    while offset < end:
        offset += _advanced(os.sendfile(dst, src, offset, end - offset), offset, end)


def _advanced(n: int, offset: int, end: int) -> int:
    if n == 0:
        raise OSError(errno.EIO, f"the source file ended at byte {offset} of the {end} being copied")
    return n


_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF}
"""``copy_file_range`` refused between these two files (another file system, an old kernel): ``sendfile``."""
