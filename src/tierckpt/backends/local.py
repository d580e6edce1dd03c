"""Local file system backend, for plain paths and ``file://`` URIs.

Keys map to files under the root directory, so this backend reports ``local_path`` and exposes
:meth:`LocalBackend.path_of` for callers that want to mmap or ``pread`` a file themselves.

Writes never expose a torn file: data goes to ``.<name>.<uuid>.partial`` next to the target, is
fsynced, then renamed over the target with ``os.replace`` and the directory is fsynced, so a crash
leaves either the old file or the new one (plus, at worst, a stray ``.partial`` that :meth:`list`
ignores). ``commit`` is a compare-and-swap: under an exclusive ``flock`` of the hidden lock file
``.<name>.lock`` next to the target (released by the kernel when the holder dies, and never deleted,
so every writer locks the same file), it reads the target, compares it with ``expected`` and
publishes the new object the same way. Reads use positional I/O (``os.pread``/``os.preadv``); :meth:`LocalBackend.read_into`
fills the caller's buffer directly, without an intermediate ``bytes`` object.

Every blocking call runs in a worker thread (``asyncio.to_thread``), except on a backend whose file
system never waits on a device (:attr:`LocalBackend.inline_calls`: the node memory tier's tmpfs), where
calls that move at most :data:`INLINE_BYTES` run in the event loop's own thread. Cancelling the awaiting
task does not stop a call already running in its thread: a ``put`` cancelled mid-flight may still
publish its whole object (never a partial one).

The file operations themselves live in :mod:`tierckpt.backends.files`, shared with the node cache
and the memory tier.
"""

from __future__ import annotations

import asyncio
import functools
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from tierckpt.errors import CorruptCheckpointError
from tierckpt.native.keys import validate_key
from tierckpt.backends.base import UNCONDITIONAL, Backend, Capabilities, ObjectWriter, ReadsInto, Segment, Unconditional
from tierckpt.backends.commit_check import commit_refused
from tierckpt.backends.run_reads import pread_runs, pread_segments
from tierckpt.backends.files import (
    WRITEBACK_BATCH_BYTES,
    WRITEBACK_PAGE_BYTES,
    commit_if,
    DIRECT_ALIGN,
    copy_range,
    discard,
    list_files,
    open_temp,
    os_error,
    publish,
    pread_into,
    pread_range,
    read_whole,
    read_whole_capped,
    remove_tree,
    file_size,
    unlink,
    write_all,
    write_pages,
    write_atomic,
    check_prefix,
    check_range,
    local_root,
    start_writeback,
    write_error,
)

_T = TypeVar("_T")

INLINE_BYTES = 1 << 20
"""The most bytes a call moves in the event loop's own thread where a backend's calls run there
(:attr:`LocalBackend.inline_calls`): a 1 MiB copy in memory takes about as long as a hop to a worker."""


class _LocalWriter(ObjectWriter):
    """Streams into a hidden temp file; ``close`` renames it into place."""

    def __init__(self, backend: LocalBackend, key: str, fd: int, tmp: str) -> None:
        self._backend = backend
        self._uri = backend.uri_of(key)
        self._path = backend.path_of(key)
        self._durable = backend.durable_writes
        self._fd = fd
        self._tmp = tmp
        self._offset = 0
        self._flushed = 0

    async def write(self, data: bytes | memoryview) -> None:
        self._check_open()
        try:
            await self._backend.blocking(self._write_through, data, nbytes=memoryview(data).nbytes)
        except OSError as exc:
            raise write_error(exc, f"writing {self._tmp}") from exc

    def _write_through(self, data: bytes | memoryview) -> None:
        """Append ``data``; every ``WRITEBACK_BATCH_BYTES`` start writing the whole pages written so far
        to the device, so ``close`` (fsync) waits only for the tail. Whole pages only, and in batches:
        a page that the next write dirties again would be written twice."""
        write_all(self._fd, data)
        self._offset += memoryview(data).nbytes
        if self._offset - self._flushed >= WRITEBACK_BATCH_BYTES:
            end = self._offset - self._offset % WRITEBACK_PAGE_BYTES
            start_writeback(self._fd, self._flushed, end - self._flushed)
            self._flushed = end

    async def write_file(self, fd: int, offset: int, length: int, pages: memoryview | None = None) -> None:
        """Append ``length`` bytes of the local file open as ``fd`` (a :class:`~tierckpt.node.copy.FileSink`:
        the write-back engine's copies land so): from ``pages``, their mapping, with ``O_DIRECT``
        (:func:`~tierckpt.backends.files.write_pages`: this copy below the memory tier is not read back
        while the tier holds the bytes, so it does not take page cache), else kernel-side."""
        self._check_open()
        try:
            await self._backend.blocking(self._copy_through, fd, offset, length, pages, nbytes=length)
        except OSError as exc:
            raise write_error(exc, f"writing {self._tmp}") from exc

    def _copy_through(self, fd: int, offset: int, length: int, pages: memoryview | None) -> None:
        if pages is not None and self._offset % DIRECT_ALIGN == 0:
            write_pages(self._fd, pages[:length])
        else:
            copy_range(fd, self._fd, offset, length)
        self._offset += length

    async def close(self) -> None:
        self._check_open()
        self._done = True
        try:
            await self._backend.blocking(publish, self._fd, self._tmp, self._path, self._durable)
        except OSError as exc:
            await asyncio.to_thread(unlink, self._tmp)
            raise write_error(exc, f"publishing {self._path}") from exc

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        await asyncio.to_thread(discard, self._fd, self._tmp)  # maybe a large temp file's pages to free


class LocalBackend(ReadsInto, Backend):
    """Objects are files under a local directory (``/data/ckpt`` or ``file:///data/ckpt``)."""

    capabilities = Capabilities(local_path=True)
    mapped_reads = True
    """Whether reads of resident page cache go through a mapping (:mod:`.mapped_read`)."""
    links_checked = True
    """Whether :meth:`path_of` looks for symbolic links below the root (a checkpoint tree may come from
    anyone); a private tree of this user's own (the node memory tier) skips the ``lstat`` per component."""
    durable_writes = True
    """Whether a published file and its directory are fsynced (:func:`.files.publish`): the node memory tier's
    tmpfs keeps nothing past a restart, so its syncs would be system calls that do nothing."""
    shared_reads = False
    """Whether reads hold each file's shared lock while they read it (:func:`.file_open.hold_shared`): the
    node memory tier sets it, as it may reuse a retired file's pages."""
    inline_calls = False
    """Whether calls that move at most :data:`INLINE_BYTES` run in the event loop's own thread (:meth:`blocking`;
    never deletions, which may free a large file's pages):
    for a file system that never waits on a device (the node memory tier's tmpfs, and only with ``durable_writes``
    off: an fsync waits). There a hop to a worker thread costs ten times the call it carries (a 4 KiB
    ``write_atomic``: about 150 µs of CPU through ``asyncio.to_thread`` against 12 µs in place, on a 2-core VM),
    CPU that the training loop sharing the cores pays, with a GIL hand-off each way."""

    def __init__(self, root_uri: str) -> None:
        super().__init__(root_uri)
        self.root = local_root(root_uri)
        self.hub_blobs = hub_blobs_of(self.root) if self.links_checked else None
        """The ``blobs`` folder that the links of a Hugging Face hub-cache snapshot root may lead into (only
        looked for where links are: a private tree of this user's own holds none)."""

    async def blocking(self, fn: Callable[..., _T], *args: Any, nbytes: int = 0) -> _T:
        """``fn(*args)``, a blocking file operation that moves ``nbytes``: in a worker thread, or in place where
        the backend's calls run there (:attr:`inline_calls`) and it moves at most :data:`INLINE_BYTES`."""
        if self.inline_calls and nbytes <= INLINE_BYTES:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def path_of(self, key: str) -> str:
        """Absolute path of the file that holds ``key``; refuses paths that symlinks lead out of the root,
        except, when the root is a Hugging Face hub-cache snapshot (:func:`hub_blobs_of`), into its own
        repository's ``blobs`` folder, where the hub cache keeps every snapshot's files.

        Only a symbolic link below the root can lead out of it (keys hold no ``..``), so the components
        below the root are looked at (one ``lstat`` each, a few per key: this runs for every read) and the
        whole path is resolved only when one of them is a link."""
        parts = validate_key(key).split("/")
        path = os.path.join(self.root, *parts)
        if not self.links_checked or not _link_below(self.root, parts):
            return path
        real_root = os.path.realpath(self.root)
        real = os.path.realpath(path)
        if self.hub_blobs is not None and real.startswith(self.hub_blobs + os.sep):
            return path
        if real != path and not real.startswith(real_root + os.sep):
            raise CorruptCheckpointError(
                f"{path} leads outside the checkpoint root {self.root} (to {real}) through a symbolic link; "
                "checkpoints never contain such links, so this one was tampered with"
            )
        return path

    def uri_of(self, key: str) -> str:
        """The key as a path, for messages."""
        return self.path_of(key)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        path = self.path_of(key)
        try:
            await self.blocking(write_atomic, path, data, self.durable_writes, nbytes=memoryview(data).nbytes)
        except OSError as exc:
            raise write_error(exc, f"writing {path}") from exc

    async def open_writer(self, key: str) -> ObjectWriter:
        path = self.path_of(key)
        try:
            fd, tmp = await self.blocking(open_temp, path)
        except OSError as exc:
            raise write_error(exc, f"opening {path} for writing") from exc
        return _LocalWriter(self, key, fd, tmp)

    async def get(self, key: str) -> bytes:
        path = self.path_of(key)
        try:
            return await asyncio.to_thread(read_whole, path, self.shared_reads)
        except OSError as exc:
            raise os_error(exc, f"reading {path}") from exc

    async def get_capped(self, key: str, cap: int) -> bytes:
        path = self.path_of(key)
        try:
            return await self.blocking(read_whole_capped, path, cap, self.shared_reads, nbytes=cap)
        except OSError as exc:
            raise os_error(exc, f"reading {path}") from exc

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        path = self.path_of(key)
        check_range(path, start, end)
        try:
            return await asyncio.to_thread(pread_range, path, start, end, self.shared_reads)
        except OSError as exc:
            raise os_error(exc, f"reading [{start}, {end}) of {path}") from exc

    async def _read_range(self, key: str, start: int, end: int, out: memoryview) -> None:
        path = self.path_of(key)
        check_range(path, start, end)
        try:
            await asyncio.to_thread(
                functools.partial(pread_into, path, start, out, mapped=self.mapped_reads, shared=self.shared_reads))
        except OSError as exc:
            raise os_error(exc, f"reading [{start}, {end}) of {path}") from exc

    async def exists(self, key: str) -> bool:
        return await self.blocking(os.path.isfile, self.path_of(key))

    def size_at_once(self, key: str) -> int:
        path = self.path_of(key)
        try:
            return file_size(path)
        except OSError as exc:
            raise os_error(exc, f"size of {path}") from exc

    async def size(self, key: str) -> int:
        path = self.path_of(key)
        try:
            return await self.blocking(file_size, path)
        except OSError as exc:
            raise os_error(exc, f"size of {path}") from exc

    async def list(self, prefix: str = "") -> list[str]:
        try:
            return await asyncio.to_thread(list_files, self.root, check_prefix(prefix))
        except OSError as exc:
            raise os_error(exc, f"listing {self.root} with prefix {prefix!r}") from exc

    async def delete(self, key: str) -> None:
        path = self.path_of(key)
        try:
            await asyncio.to_thread(unlink, path)  # a large file's pages are freed here
        except OSError as exc:
            raise os_error(exc, f"deleting {path}") from exc

    async def read_runs(
        self, key: str, offsets: Sequence[int], run_bytes: int, out: memoryview,
        digest: Callable[[memoryview], int] | None = None,
    ) -> list[int] | None:
        """Positional reads of every run in one worker thread: thousands of short runs cost microseconds each."""
        path = self.path_of(key)
        try:
            return await asyncio.to_thread(functools.partial(
                pread_runs, path, list(offsets), run_bytes, out, digest, mapped=self.mapped_reads, shared=self.shared_reads))
        except OSError as exc:
            raise os_error(exc, f"reading {len(offsets)} runs of {path}") from exc

    async def read_segments(
        self, key: str, segments: Sequence[Segment], digest: Callable[[memoryview], int] | None = None,
    ) -> list[list[int] | None]:
        """All segments in one worker thread, with one open of the file (:func:`.run_reads.pread_segments`)."""
        path = self.path_of(key)
        try:
            return await asyncio.to_thread(functools.partial(
                pread_segments, path, [(list(o), n, out) for o, n, out in segments], digest,
                mapped=self.mapped_reads, shared=self.shared_reads))
        except OSError as exc:
            raise os_error(exc, f"reading {len(segments)} ranges of {path}") from exc

    async def delete_prefix(self, prefix: str) -> None:
        """Delete everything under ``prefix``; a prefix naming a directory is removed whole, in one worker call
        (a sweep removes a generation per save)."""
        if not prefix.endswith("/"):
            await super().delete_prefix(prefix)
            return
        directory = self.path_of(prefix.rstrip("/"))
        try:
            await asyncio.to_thread(remove_tree, directory)
        except OSError as exc:
            raise os_error(exc, f"deleting {directory}") from exc

    async def commit(
        self, key: str, data: bytes, *, expected: bytes | None | Unconditional = UNCONDITIONAL,
        after: Mapping[str, int | None] | None = None,
    ) -> None:
        path = self.path_of(key)
        try:
            # A worker thread even where calls run in place: the commit lock may be held by another process.
            done, found = await asyncio.to_thread(commit_if, path, bytes(data), expected, self.durable_writes)
        except OSError as exc:
            raise os_error(exc, f"committing {path}") from exc
        if not done:
            raise commit_refused(path, expected, found)  # type: ignore[arg-type]


HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")
"""How the folders of a Hugging Face hub cache's repositories are named (``models--org--name``)."""


def hub_blobs_of(root: str) -> str | None:
    """The real path of the ``blobs`` folder of the hub-cache repository whose snapshot ``root`` is
    (``<hub cache>/models--org--name/snapshots/<revision>``, resolved), else ``None``. A snapshot's files are
    symbolic links to ``../../blobs/<hash>``: reading them in place follows those links, and only into that
    folder (not into another repository, nor anywhere else a crafted link points)."""
    real = os.path.realpath(root)
    snapshots = os.path.dirname(real)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) != "snapshots" or not os.path.basename(repo).startswith(HUB_REPO_PREFIXES):
        return None
    return os.path.join(repo, "blobs")


def _link_below(root: str, parts: Sequence[str]) -> bool:
    """Whether a component of ``root/parts...`` below ``root`` is a symbolic link (or could not be looked at)."""
    at = root
    for part in parts:
        at = os.path.join(at, part)
        try:
            if stat.S_ISLNK(os.lstat(at).st_mode):
                return True
        except FileNotFoundError:
            return False  # nothing exists below here: no link leads anywhere
        except OSError:
            return True  # let the whole path's resolution decide
    return False
